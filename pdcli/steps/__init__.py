"""The steps profile -> plan -> compile -> train: the only code that reuses a run directory's
artifact when the hashes of its inputs match, else makes it (with the profiler, planner and
compiler, which know no run directory) and records it. Each module ensures one artifact;
`train` ensures the three that `pdcli.runtime.job` trains on."""

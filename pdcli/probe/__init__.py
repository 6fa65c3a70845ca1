"""Measure a config: its model's layers (through `pdcli.profiler`) and what the runtime pays
beyond them: real stages through the runtime's executor (`runtime`), a short real pipeline
(`pipeline`), the transport's ping-pong and the all-reduce (`pingpong`, `allreduce`: the host's,
kept in `hostfile`), and the host's profiles (`profile_cache`). It stands above the profiler, the compiler, the runtime and the planner's cost
formats, which it combines; `profile.profile_config` is what `pd profile` measures."""

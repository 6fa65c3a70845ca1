"""Measure a config: its model's layers (through `pdcli.profiler`) and what the runtime pays
beyond them, by running real stages through the runtime's executor and a short real pipeline
(`runtime`). It stands above the profiler, the compiler, the runtime and the planner's cost
formats, which it combines; `profile.profile_config` is what `pd profile` measures."""

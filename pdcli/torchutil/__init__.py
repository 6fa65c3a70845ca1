"""Torch helpers the profiler and the runtime share: a stage's optimizer and its out-of-place
step (`optim`), and the deferred weight gradients of a split backward (`wgrad`); the profiler
measures with the same code the runtime trains with, so its costs are those of the runtime."""

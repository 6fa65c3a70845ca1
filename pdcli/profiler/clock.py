"""Timing of profiled work: CUDA events on a GPU, a monotonic clock on the CPU, medians of repeats."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

NS_PER_MS = 1_000_000


class Clock:
    """Times one region of work at a time: `start()`, run the work, `stop() -> ms`.

    On a CUDA device the region is bracketed by CUDA events, so it measures the GPU time
    of the kernels launched inside it, not the launch overhead; `stop()` waits for the
    end event (a CPU-GPU sync point, outside the timed region). On the CPU it is
    `time.perf_counter_ns` around the call.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.uses_cuda_events = device.type == "cuda" and torch.cuda.is_available()
        self._start_ns = 0
        self._start_event: torch.cuda.Event | None = None
        self._end_event: torch.cuda.Event | None = None
        if self.uses_cuda_events:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._end_event = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self._start_event is not None:
            self._start_event.record()
        else:
            self._start_ns = time.perf_counter_ns()

    def stop(self) -> float:
        """Milliseconds since `start()`."""
        if self._start_event is not None and self._end_event is not None:
            self._end_event.record()
            self._end_event.synchronize()
            return float(self._start_event.elapsed_time(self._end_event))
        return (time.perf_counter_ns() - self._start_ns) / NS_PER_MS

    def sync(self) -> None:
        """Wait for queued device work (so one measurement does not leak into the next)."""
        if self.uses_cuda_events:
            torch.cuda.synchronize(self.device)


def median_ms(
    clock: Clock,
    work: Callable[[], object],
    warmup: int,
    repeats: int,
    setup: Callable[[], object] | None = None,
) -> float:
    """Median time of `work()` over `repeats` timed calls after `warmup` untimed ones.

    `setup()` runs before every call, outside the timed region (e.g. zeroing gradients).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        if setup is not None:
            setup()
        work()
    clock.sync()
    samples_ms: list[float] = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        clock.sync()
        clock.start()
        work()
        samples_ms.append(clock.stop())
    return float(statistics.median(samples_ms))


def device_name(device: torch.device) -> str:
    """Human name of the device: the CUDA device name, or the CPU model."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return cpu_model_name()


def cpu_model_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else `platform.processor()`, else the machine type."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"

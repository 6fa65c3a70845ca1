"""The gradient all-reduce of a replicated stage on this host, measured.

A replicated stage's AllReduceGrads (`pdcli.runtime.executor`) flattens the stage's gradients
into one tensor, all-reduces it over gloo and copies the sums back. On one host gloo runs
over loopback TCP with its own threads, so the time is far from bytes / bandwidth: a fixed
cost per collective (rendezvous of the ring's steps, waking the peers) and a per-byte cost
that includes the reduction on the CPU. `measure_allreduce` times the same three steps
between this process and a spawned one at a few sizes and fits a line in the bytes. Both
processes compute before each collective, as replicas compute their microbatches before
AllReduceGrads: gloo's threads have gone to sleep and the peers arrive apart, which
collectives run back to back never pay.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from pdcli.host import HOST_SPEED_SHAPE
from pdcli.planner.runtime_costs import Affine, RuntimeCosts, fit_affine, steady_mean
from pdcli.probe.hostfile import HostFile

ALLREDUCE_BYTES = (64 << 10, 1 << 20, 8 << 20)
"""Flat gradients measured (bytes): a small stage's to a large one's."""
ALLREDUCE_REPEATS = 24
"""Collectives per size; the first half warms up (`steady_mean`)."""
ALLREDUCE_GAP_MATMULS = 20
"""Reference matmuls (`pdcli.host.HOST_SPEED_SHAPE`, a millisecond or two each on one core)
each process computes before every collective; 0: collectives back to back."""
ALLREDUCE_TIMEOUT_S = 60.0
PIECES = 8
"""Gradient tensors the flat one is made of (the runtime concatenates a stage's)."""


def _grads(num_bytes: int) -> list[torch.Tensor]:
    numel = max(num_bytes // 4, PIECES)
    return list(torch.ones(numel, dtype=torch.float32).chunk(PIECES))


def all_reduce_grads(group: dist.ProcessGroup, grads: Sequence[torch.Tensor]) -> None:
    """What AllReduceGrads does with a stage's gradients: one flat collective, the sums copied back."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    group.allreduce([flat]).wait()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _compute(n: int) -> None:
    """The work between two collectives: `n` reference matmuls."""
    rows, inner, cols = HOST_SPEED_SHAPE
    a, b = torch.ones(rows, inner), torch.ones(inner, cols)
    for _ in range(n):
        torch.mm(a, b)


def _peer(port: int, sizes: Sequence[int], repeats: int, threads: int, gap_matmuls: int) -> None:
    torch.set_num_threads(threads)
    timeout = timedelta(seconds=ALLREDUCE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
    group = dist.ProcessGroupGloo(store, 1, 2, timeout)
    for size in sizes:
        grads = _grads(size)
        for _ in range(repeats):
            _compute(gap_matmuls)
            all_reduce_grads(group, grads)


def measure_allreduce(threads: int = 1, sizes: Sequence[int] = ALLREDUCE_BYTES, repeats: int = ALLREDUCE_REPEATS,
                      gap_matmuls: int = ALLREDUCE_GAP_MATMULS) -> tuple[Affine, list[list[float]]] | None:
    """(ms of one all-reduce of that many gradient bytes between two processes of this host,
    each computing `gap_matmuls` reference matmuls before it, (bytes, ms) measured); None where
    it cannot run (no gloo, or the peer failed)."""
    if not dist.is_available() or not dist.is_gloo_available():
        return None
    timeout = timedelta(seconds=ALLREDUCE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timeout, wait_for_workers=False)
    child = multiprocessing.get_context("spawn").Process(target=_peer, args=(store.port, tuple(sizes), repeats, threads, gap_matmuls),
                                                         daemon=True)
    child.start()
    points: list[list[float]] = []
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        group = dist.ProcessGroupGloo(store, 0, 2, timeout)
        for size in sizes:
            grads, samples = _grads(size), []
            for _ in range(repeats):
                _compute(gap_matmuls)
                start = time.perf_counter()
                all_reduce_grads(group, grads)
                samples.append((time.perf_counter() - start) * 1e3)
            points.append([float(size), steady_mean(samples)])
    except RuntimeError:  # the peer died or timed out
        return None
    finally:
        torch.set_num_threads(previous)
        child.join(timeout=ALLREDUCE_TIMEOUT_S)
        if child.is_alive():
            child.kill()
    return fit_affine([p[0] for p in points], [p[1] for p in points], single="fixed"), points


def with_allreduce(runtime: RuntimeCosts, threads: int, host: HostFile | None = None) -> RuntimeCosts:
    """`runtime` with this host's all-reduce (`RuntimeCosts.allreduce`) from `host` (the host
    calibration file), measured where it has none; `sources["allreduce"]` holds the points, or
    why nothing was measured."""
    measured = host.allreduce(threads, measure_allreduce) if host is not None else measure_allreduce(threads)
    if measured is None:
        return dataclasses.replace(runtime, sources={**runtime.sources, "allreduce": "skipped: gloo did not run"})
    line, points = measured
    return dataclasses.replace(runtime, allreduce=line, sources={**runtime.sources, "allreduce": points})

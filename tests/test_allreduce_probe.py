"""`pd profile` measures the gradient all-reduce of replicated stages on this host (gloo, two processes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def test_the_measured_step_is_the_runtimes() -> None:
    """The probe's step flattens, all-reduces and copies back like AllReduceGrads: a group of
    one leaves the gradients as they were, in their own shapes."""
    from datetime import timedelta

    from pdcli.probe.allreduce import all_reduce_grads

    store = dist.HashStore()
    group = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=10))
    grads = [torch.arange(6, dtype=torch.float32).view(2, 3), torch.ones(4)]
    before = [g.clone() for g in grads]
    all_reduce_grads(group, grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, before))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_all_reduce_is_measured_between_two_processes() -> None:
    from pdcli.probe.allreduce import measure_allreduce

    measured = measure_allreduce(threads=1, sizes=(64 << 10, 1 << 20), repeats=4, gap_matmuls=1)
    assert measured is not None
    line, points = measured
    assert [p[0] for p in points] == [64 << 10, 1 << 20] and all(p[1] > 0 for p in points)
    assert line.scale >= 0 and line.fixed_ms >= 0 and line(1 << 20) > 0

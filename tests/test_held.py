"""What the profile says a stage holds for its backward equals what the runtime counts.

For every 2-stage split of small models, each stage's compiled module is run as a worker
runs it, under the runtime's own accounting (`pdcli.runtime.memory.MemoryTracker`: inputs
plus saved tensors, each storage once), and set beside the planner's figure
(`SplitSpace.activations`, from `pdcli.profiler.held`), in fp32 and under bf16 autocast.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from pdcli.compiler.split import split_graph
from pdcli.planner.memory import MemorySettings, StageBytes, stage_memory
from pdcli.planner.space import SplitSpace
from pdcli.profiler.chain import HELD_META
from pdcli.profiler.measure import profile_model
from pdcli.profiler.trace import chain_order, trace_model
from pdcli.runtime.memory import MemoryTracker
from pdcli.torchutil.wgrad import DeferredWeightGrads


class Batch:
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.inputs, self.target = (x,), y


def mlp() -> tuple[nn.Module, Batch]:
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Dropout(0.1), nn.Linear(64, 10))
    return model, Batch(torch.randn(16, 3, 4, 4), torch.randint(0, 10, (16,)))


def cnn() -> tuple[nn.Module, Batch]:
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 4 * 4, 10))
    return model, Batch(torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)))


def measured_stage_bytes(part, inputs: dict[str, torch.Tensor], target: torch.Tensor, last: bool,
                         half: bool) -> tuple[int, dict[str, torch.Tensor], int]:
    """(bytes the runtime counts for one microbatch of this stage, its outputs, bytes a split
    backward keeps for its WeightGrads)."""
    tracker = MemoryTracker(0)
    weights = [*part.module.parameters(), *part.module.buffers()]  # as the executor excludes them
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if half else contextlib.nullcontext()
    deferred = DeferredWeightGrads(part.module).install()
    try:
        with tracker.saving(0, inputs.values(), weights), autocast:
            out = part.module(*inputs.values())
            if last:
                loss = nn.functional.cross_entropy(out[0], target)
        held = tracker.activations_bytes
        roots = [loss] if last else [t for t in out if t.requires_grad]
        if roots:
            with deferred.collecting(0):
                torch.autograd.backward(roots, None if last else [torch.ones_like(t) for t in roots])
        tracker.released(0)
        tracker.hold(0, deferred.held(0), weights)
        waiting = tracker.activations_bytes
    finally:
        deferred.uninstall()
    # the next stage receives them as the compiled wire carries them (the model's dtype)
    sent = {o.wire.name: t.detach().to(o.wire.dtype) for o, t in zip(part.outputs, out)}
    return held, {n: t.requires_grad_(t.is_floating_point()) for n, t in sent.items()}, waiting


@pytest.mark.parametrize("build", [mlp, cnn])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_stage_holds_what_the_profile_says_for_every_split(build, precision: str) -> None:
    torch.manual_seed(0)
    model, batch = build()
    chain = profile_model(model, batch, nn.functional.cross_entropy, "cpu", 0, 1, False)
    assert "half" in chain.meta[HELD_META]
    space = SplitSpace.from_chain(chain)
    acts = space.activations(precision, 1.0)
    gm = trace_model(model, batch.inputs)
    n = len(chain_order(gm))
    half = precision != "fp32"
    for cut in range(1, n):
        parts = split_graph(gm, [(0, cut), (cut, n)], batch.inputs)
        first, out, first_waiting = measured_stage_bytes(parts[0], {"x": batch.inputs[0]}, batch.target, False, half)
        if half and not all(t.requires_grad for t in parts[0].module(*batch.inputs)):
            # a cut before any weight: the runtime makes every received float input require
            # a gradient, so the next Linear keeps its weight's copy, which the profile (whose
            # model input needs none) does not count
            continue
        second, _, second_waiting = measured_stage_bytes(parts[1], out, batch.target, True, half)
        for (start, end), got, waiting in (((0, cut), first, first_waiting), ((cut, n), second, second_waiting)):
            predicted = acts.held[start, end] + (acts.copies[start, end] if acts.copies is not None else 0)
            assert got == pytest.approx(predicted), (precision, cut, start, end)
            assert waiting == pytest.approx(acts.waiting[start, end]), (precision, cut, start, end)


def test_measured_copies_replace_the_factor_rule_and_grads_peak_with_the_timeline() -> None:
    """The bf16 rule of thumb (A / 2 + P / 2 per microbatch) is what stage_memory falls back
    to; given measured copies it uses them; a flush schedule's total is its timeline peak."""
    p, a, m = 4e6, 8e6, 4
    where, sizes = dict(replicas=1, devices_from=2, stages_from=2), StageBytes(parameters=p, activations=a)
    bf16 = MemorySettings(schedule="pipedream", num_microbatches=m, precision="bf16")
    rule = stage_memory(bf16, sizes, **where)
    assert rule.activations_bytes == pytest.approx(2 * (0.5 * a / m + 0.5 * p))
    measured = stage_memory(bf16, StageBytes(parameters=p, activations=a, copies=0.0), **where)
    assert measured.activations_bytes == pytest.approx(2 * a / m)
    # gpipe holds all M microbatches before its first Backward, and no gradients yet
    gpipe = stage_memory(MemorySettings(schedule="gpipe", num_microbatches=m), sizes, **where, num_stages=2)
    assert gpipe.activations_bytes == pytest.approx(a)
    assert gpipe.total_bytes == pytest.approx(p + max(a, p + a))  # the first Backward's point holds both
    split = stage_memory(MemorySettings(schedule="gpipe", num_microbatches=m, split_backward=True),
                         StageBytes(parameters=p, activations=a, waiting=0.0), **where, num_stages=2)
    assert split.activations_bytes == pytest.approx(a)
    assert split.total_bytes < gpipe.total_bytes  # weight gradients come once Backwards released microbatches

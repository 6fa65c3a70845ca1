"""Measure the optimizer step per chain position: its time and the state it keeps.

The runtime builds one optimizer per stage (`pdcli.torchutil.optim.build_optimizer`) over the
stage's parameters and steps it once per update. Here each position's parameters get an
optimizer of their own, built the same way, stepped on copies of the parameters with
constant gradients (the step's cost does not depend on the values). A step also has a
fixed cost (Python, parameter grouping) that a stage pays once however many positions it
holds: it is measured on the runtime's parameter-free stand-in (one empty parameter) and
recorded as `meta.optimizer.step_overhead_ms`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from pdcli.profiler.clock import Clock, median_ms

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
"""Builds the configured optimizer over a module's parameters (as the runtime does)."""
STEP_STATE_KEY = "step"
"""Adam's step counter: a scalar per parameter, not counted as state bytes."""
GRAD_VALUE = 1e-3


@dataclass(frozen=True)
class OptimizerCost:
    """One optimizer step on a set of parameters."""

    step_ms: float
    state_bytes: int


def _holder(params: Sequence[torch.Tensor]) -> nn.Module:
    """A module owning fresh copies of `params` (the model's weights are left untouched)."""
    holder = nn.Module()
    holder.params = nn.ParameterList([nn.Parameter(p.detach().clone()) for p in params])
    for p in holder.parameters():
        p.grad = torch.full_like(p, GRAD_VALUE)
    return holder


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the per-parameter state tensors (momentum buffers, exp_avg, exp_avg_sq)."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and key != STEP_STATE_KEY
    )


def measure_optimizer(params: Sequence[torch.Tensor], factory: OptimizerFactory, clock: Clock,
                      warmup: int, repeats: int) -> OptimizerCost:
    """Median time of one `factory` optimizer step over `params`, and the state it keeps.

    No parameters: time 0 and no state (the fixed cost is `step_overhead_ms`)."""
    if not params:
        return OptimizerCost(0.0, 0)
    holder = _holder(params)
    optimizer = factory(holder)
    optimizer.step()  # creates the state (momentum buffers, Adam's moments)
    step_ms = median_ms(clock, optimizer.step, warmup, repeats)
    return OptimizerCost(step_ms, state_bytes(optimizer))


def step_overhead_ms(factory: OptimizerFactory, clock: Clock, warmup: int, repeats: int) -> float:
    """Time of a step over one empty parameter: what every stage pays once per update."""
    holder = nn.Module()
    holder.empty = nn.Parameter(torch.zeros(0))
    holder.empty.grad = torch.zeros(0)
    optimizer = factory(holder)
    optimizer.step()
    return median_ms(clock, optimizer.step, warmup, repeats)

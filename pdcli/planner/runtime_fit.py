"""The points the runtime's per-action lines are fitted through: a stage's profiled time beside
what its actions took (pure). `pd profile`'s probe fits lines through them, `pd plan
--calibrate` rescales lines to them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from pdcli.planner.runtime_costs import steady_mean
from pdcli.planner.search import covered_or_zeros, optimizer_step_matrix
from pdcli.planner.space import SplitSpace

KINDS = ("forward", "backward", "wgrad", "update")
"""ModeCosts' fields, in order."""
UPDATE_ACTIONS = ("OptimizerStep", "StashWeights", "FreeWeights")
"""What an update costs: the step and its weight-version bookkeeping."""


@dataclass
class StagePoints:
    """(profiled ms, measured ms) per action kind, one point per stage added."""

    space: SplitSpace
    per_microbatch: float
    """Profiled batch -> one microbatch (the profiled times are per profiled batch)."""
    loss_fwd_ms: float
    loss_bwd_ms: float
    points: dict[str, tuple[list[float], list[float]]] = field(default_factory=lambda: {k: ([], []) for k in KINDS})

    def __post_init__(self) -> None:
        self._optimizer = optimizer_step_matrix(self.space)

    def add(self, start: int, end: int, durations: Mapping[str, Sequence[float]], last: bool,
            update: bool = True) -> None:
        """Stage [start, end)'s actions (name -> durations, ms); `last`: it computes the loss,
        which is taken out (the loss is priced on its own). Backward is the whole backward:
        a split one's WeightGrads are added back. `update`: its updates too (`add_update`
        otherwise)."""
        space, m = self.space, self.per_microbatch
        w_ms = steady_mean(durations.get("WeightGrads", []))
        self._add("forward", space.range_total(space.covered_fwd_ms, start, end) * m,
                  steady_mean(durations.get("Forward", [])) - (self.loss_fwd_ms if last else 0.0))
        self._add("backward", space.range_total(space.covered_bwd_ms, start, end) * m,
                  steady_mean(durations.get("Backward", [])) + w_ms - (self.loss_bwd_ms if last else 0.0))
        wgrad = space.range_total(covered_or_zeros(space, space.covered_wgrad_ms), start, end) * m
        if wgrad > 0 and "WeightGrads" in durations:
            self._add("wgrad", wgrad, w_ms)
        if update:
            self.add_update([(start, end)], durations)

    def add_update(self, ranges: Sequence[tuple[int, int]], durations: Mapping[str, Sequence[float]]) -> None:
        """The updates of a process that steps the stages `ranges` at once (the chunks of one
        rank): one point per range, the measured time shared in proportion to the profiled,
        so that the points' sums are the process's."""
        profiled = [float(self._optimizer[start, end]) for start, end in ranges]
        measured = sum(steady_mean(durations.get(a, [])) for a in UPDATE_ACTIONS)
        total = sum(profiled)
        for x in profiled:
            self._add("update", x, measured * x / total if total > 0 else measured / len(profiled))

    def _add(self, kind: str, profiled_ms: float, measured_ms: float) -> None:
        self.points[kind][0].append(profiled_ms)
        self.points[kind][1].append(measured_ms)

"""Predictions for one partition: per-stage time and memory under either cost model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pdcli.planner.costs import MS_PER_S, bubble_factor, compute_calibration, pd_stage_terms
from pdcli.planner.memory import StageMemory, stage_memory
from pdcli.planner.options import PlanOptions
from pdcli.planner.pipedream import ALLREDUCE_FACTOR, TRANSFER_FACTOR, PdStage
from pdcli.planner.search import backward_split, covered_or_zeros, optimizer_step_matrix
from pdcli.planner.space import SplitSpace
from pdcli.planner.topology import Topology

TERM_NAMES = ("fwd_ms", "bwd_ms", "compute_ms", "optimizer_ms", "sync_ms", "comm_in_ms", "comm_out_ms",
              "stage_time_ms")


@dataclass(frozen=True)
class StageEval:
    start: int
    end: int
    ranks: tuple[int, ...]
    terms: dict[str, float]
    """TERM_NAMES -> ms per minibatch (fwd/bwd: the whole minibatch on one replica); the `pd`
    model adds `wgrad_ms`, the part of bwd_ms a split backward defers."""
    memory: StageMemory

    @property
    def replicas(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class PlanEval:
    stages: tuple[StageEval, ...]
    time_per_minibatch_ms: float


def batch_scale(meta: dict, options: PlanOptions) -> float:
    """Factor from the profiled batch (`meta["batch_size"]`) to the planned minibatch."""
    profiled = meta.get("batch_size") if isinstance(meta, dict) else None
    return float(options.batch_size) / float(profiled) if profiled else 1.0


def _memory(space: SplitSpace, options: PlanOptions, scale: float, start: int, end: int,
            replicas: int, devices_from: int, stages_from: int, num_stages: int,
            split_backward: bool = False) -> StageMemory:
    mem = stage_memory(
        options.schedule,
        space.range_total(space.covered_parameter_bytes, start, end),
        space.range_total(space.covered_activation_bytes, start, end) * scale,
        replicas, devices_from, stages_from, options.num_microbatches,
        space.range_total(covered_or_zeros(space, space.covered_optimizer_state_bytes), start, end),
        options.precision, options.recompute,
        space.cut_bytes[start - 1] * scale if start > 0 else 0.0,
        split_backward, num_stages,
    )
    return StageMemory(*(float(x) for x in (mem.weights_bytes, mem.stashed_weights_bytes,
                                            mem.activations_bytes, mem.total_bytes,
                                            mem.optimizer_state_bytes)))


def evaluate_pd(space: SplitSpace, topology: Topology, options: PlanOptions, scale: float,
                partition: Sequence[tuple[int, int, int]]) -> PlanEval:
    """`pd` model for stages (start, end, replicas) on contiguous ranks from 0 (fwd_ms, bwd_ms
    and wgrad_ms calibrated, see `pdcli.planner.costs`)."""
    n, bw = space.num_positions, topology.span_bandwidth_matrix()
    used, num_stages = sum(r for _, _, r in partition), len(partition)
    stages, first = [], 0
    optimizer = optimizer_step_matrix(space)
    compute_scale = scale * compute_calibration(space.calibration_ratio)
    covered_wgrad = covered_or_zeros(space, space.covered_wgrad_ms)
    for index, (start, end, r) in enumerate(partition):
        last = first + r - 1
        terms = pd_stage_terms(
            space.range_total(space.covered_fwd_ms, start, end) * compute_scale,
            space.range_total(space.covered_bwd_ms, start, end) * compute_scale,
            space.range_total(space.covered_parameter_bytes, start, end),
            space.cut_bytes[start - 1] * scale if start > 0 else 0.0,
            space.cut_bytes[end - 1] * scale if end < n else 0.0,
            r, bw[first, last], bw[first - 1, first] if first > 0 else np.inf,
            bw[last, last + 1] if last + 1 < bw.shape[0] else np.inf,
            options.schedule, options.num_microbatches, float(optimizer[start, end]),
        )
        values = {name: float(getattr(terms, name)) for name in TERM_NAMES}
        values["wgrad_ms"] = space.range_total(covered_wgrad, start, end) * compute_scale
        memory = _memory(space, options, scale, start, end, r, used - first, num_stages - index, num_stages,
                         options.split_backward)
        stages.append(StageEval(start, end, tuple(range(first, first + r)), values, memory))
        first += r
    bottleneck = max(s.terms["stage_time_ms"] for s in stages)
    factor = float(bubble_factor(options.schedule, options.num_microbatches, num_stages,
                                 backward_split(space, options)))
    return PlanEval(tuple(stages), factor * bottleneck)


def evaluate_pipedream(space: SplitSpace, topology: Topology, options: PlanOptions, scale: float,
                       stages: Sequence[PdStage]) -> PlanEval:
    """PipeDream's terms per stage (its model has no optimizer term: optimizer_ms = 0).
    Exact for one level; for several levels the outer all-reduce of a stage is charged to each of its inner stages (an attribution)."""
    n, levels = space.num_positions, topology.levels
    out, total_devices = [], sum(len(s.ranks) for s in stages)
    devices_after = total_devices
    for index, st in enumerate(stages):
        replicas = int(np.prod([p[3] for p in st.path]))
        fwd = space.range_total(space.covered_fwd_ms, st.start, st.end) * scale
        bwd = space.range_total(space.covered_bwd_ms, st.start, st.end) * scale
        sync, comm_in, comm_out = 0.0, 0.0, 0.0
        found_in = found_out = False
        for depth in range(len(st.path) - 1, -1, -1):  # innermost level first
            lv, s, e, nm, first = st.path[depth]
            outer = float(np.prod([p[3] for p in st.path[:depth]]))
            bw = levels[lv].bandwidth_bytes_per_s
            params = space.range_total(space.covered_parameter_bytes, s, e)
            within = levels[lv - 1].devices if (lv > 0 and first) else 1
            sync += ALLREDUCE_FACTOR * (nm - 1) * params / (bw * nm) / within * MS_PER_S / (nm * outer)
            if not first and s == st.start and not found_in:
                comm_in = TRANSFER_FACTOR * space.cut_bytes[s - 1] * scale / (bw * nm) * MS_PER_S / outer
                found_in = True
            if not first and e == st.end and e < n and not found_out:
                comm_out = TRANSFER_FACTOR * space.cut_bytes[e - 1] * scale / (bw * nm) * MS_PER_S / outer
                found_out = True
        compute = (fwd + bwd) / replicas
        terms = {"fwd_ms": fwd, "bwd_ms": bwd, "compute_ms": compute, "optimizer_ms": 0.0, "sync_ms": sync,
                 "comm_in_ms": comm_in, "comm_out_ms": comm_out,
                 "stage_time_ms": max(compute + sync, comm_in, comm_out)}
        memory = _memory(space, options, scale, st.start, st.end, replicas, devices_after,
                         len(stages) - index, len(stages))  # PipeDream's model has no split backward
        devices_after -= len(st.ranks)
        out.append(StageEval(st.start, st.end, st.ranks, terms, memory))
    return PlanEval(tuple(out), max(s.terms["stage_time_ms"] for s in out))

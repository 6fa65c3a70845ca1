"""Predictions for one partition: per-stage time and memory under either cost model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from pdcli.planner.costs import (
    MS_PER_S, ActionCosts, backward_work, bubble_factor, pd_stage_terms, replica_allreduce_ms, runtime_action_costs,
    runtime_stage_terms,
)
from pdcli.planner.memory import MemorySettings, StageBytes, StageMemory, VerticalSync, stage_memory
from pdcli.planner.options import PlanOptions
from pdcli.planner.pipedream import ALLREDUCE_FACTOR, TRANSFER_FACTOR, PdStage
from pdcli.planner.runtime_costs import RuntimeCosts
from pdcli.planner.search import (
    backward_split, compute_scale_of, covered_or_zeros, optimizer_step_matrix, oversubscription_of, runtime_of,
)
from pdcli.planner.space import SplitSpace
from pdcli.planner.topology import Topology
from pdcli.profiler.chain import Chain
from pdcli.schedule import ScheduleSpec
from pdcli.schedule.simulator import Simulation, StageCost, simulate
from pdcli.schedule.spec import FLUSH_SCHEDULES, stand_in

TERM_NAMES = ("fwd_ms", "bwd_ms", "compute_ms", "optimizer_ms", "sync_ms", "comm_in_ms", "comm_out_ms",
              "stage_time_ms")
RUNTIME_TERM_NAMES = ("messages_ms", "load_ms")
"""Terms a plan has only when the profile measured the runtime's costs."""
ACTIONS_KEY = "actions_ms"
"""A plan stage's per-action costs (runtime costs only): StageCost field -> ms."""
REFINE_SHIFTS = (-2, -1, 1, 2)
"""Positions a boundary (a stage's or a chunk's) of the search's plan is moved by when the replay
refines it (`pdcli.planner.make.refine_by_replay`, `pdcli.planner.virtual.refine_by_replay`)."""
REFINE_MIN_GAIN = 1e-6
"""A moved boundary is taken when its replay is faster by more than this fraction (not by rounding)."""
REPLAY_MIN_MINIBATCHES = 16
"""A plan's replay runs max(this, 2 x stages + 2) minibatches; its steady time is measured
over the second half of the completions before the drain (`pdcli.schedule.simulator.steady_window`)."""


Priced = TypeVar("Priced")
Partition = list[tuple[int, int, int]]


def climb(space: SplitSpace, partition: Partition, price: Callable[[Partition], Priced | None],
          time_ms: Callable[[Priced], float], best: Priced) -> Priced:
    """From `partition` (priced `best`), moves one boundary by REFINE_SHIFTS (replicas kept) to
    the fastest `price` (None: not a candidate, e.g. over memory), again from there while that is
    faster: a partition no such move improves. Each partition is priced once (a later pass
    revisits the moves of the one before)."""
    valid = space.valid_stages()
    priced: dict[tuple[tuple[int, int, int], ...], Priced | None] = {tuple(partition): best}
    for _ in range(space.num_positions):  # each pass moves to a faster partition, or ends
        start, moved_to = best, partition
        for k in range(1, len(partition)):
            (a, cut, before), (_, b, after) = partition[k - 1], partition[k]
            for shift in REFINE_SHIFTS:
                moved_cut = cut + shift
                if not a < moved_cut < b or not (valid[a, moved_cut] and valid[moved_cut, b]):
                    continue
                moved = [*partition[: k - 1], (a, moved_cut, before), (moved_cut, b, after), *partition[k + 1:]]
                key = tuple(moved)
                if key not in priced:
                    priced[key] = price(moved)
                candidate = priced[key]
                if candidate is not None and time_ms(candidate) < time_ms(best) * (1 - REFINE_MIN_GAIN):
                    best, moved_to = candidate, moved
        if best is start:
            break
        partition = moved_to
    return best


@dataclass(frozen=True)
class StageEval:
    start: int
    end: int
    ranks: tuple[int, ...]
    terms: dict[str, float]
    """TERM_NAMES -> ms per minibatch (fwd/bwd: the whole minibatch on one replica); the `pd`
    model adds `wgrad_ms`, the part of bwd_ms a split backward defers."""
    memory: StageMemory
    actions_ms: dict[str, float] | None = None
    """Per-action costs of one replica (`pdcli.schedule.simulator.StageCost` fields), when
    the runtime's costs were measured."""

    @property
    def replicas(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class StageLinks:
    """Bandwidths between a partition's stages where they are not the topology's contiguous
    ranks: a chunked schedule's chunks, each on the device its placement gives
    (`pdcli.planner.virtual.chunk_links`)."""

    bandwidth: np.ndarray
    """[i, j]: bytes/s between the devices of stage i and stage j (one replica each)."""
    cluster: Topology
    """The cluster the runtime costs are priced for (`runtime_of`)."""


@dataclass(frozen=True)
class PlanEval:
    stages: tuple[StageEval, ...]
    time_per_minibatch_ms: float
    replay: dict[str, Any] | None = None
    """How the time was replayed (runtime costs only): cores, minibatches."""


def stage_predicted(st: StageEval) -> dict[str, Any]:
    """A plan stage's `predicted`: its terms, its memory and (runtime costs) its per-action costs."""
    predicted: dict[str, Any] = dict(st.terms)
    predicted.update(dataclasses.asdict(st.memory))
    if st.actions_ms is not None:
        predicted[ACTIONS_KEY] = dict(st.actions_ms)
    return predicted


def pipeline_summary(batch_size: int, time_ms: float, data_parallel_ms: float, num_devices: int,
                     devices_used: int, stages: Sequence[StageEval]) -> dict[str, Any]:
    """A plan's `pipeline` keys every plan has (`pdcli.planner.plan.PIPELINE_KEYS`)."""
    times = [st.terms["stage_time_ms"] for st in stages]
    return {
        "time_per_minibatch_ms": time_ms,
        "throughput_samples_per_s": batch_size * MS_PER_S / time_ms if time_ms > 0 else 0.0,
        "data_parallel_time_per_minibatch_ms": data_parallel_ms,
        "speedup_over_data_parallel": data_parallel_ms / time_ms if time_ms > 0 else 1.0,
        "num_devices": num_devices,
        "num_devices_used": devices_used,
        "bottleneck_stage": times.index(max(times)),
    }


def batch_scale(meta: dict, options: PlanOptions) -> float:
    """Factor from the profiled batch (`meta["batch_size"]`) to the planned minibatch."""
    profiled = meta.get("batch_size") if isinstance(meta, dict) else None
    return float(options.batch_size) / float(profiled) if profiled else 1.0


def _memory(space: SplitSpace, options: PlanOptions, scale: float, start: int, end: int,
            replicas: int, devices_from: int, stages_from: int, num_stages: int,
            split_backward: bool = False, first_replicas: int = 1, devices: int = 1) -> StageMemory:
    """One stage's memory; `first_replicas` (stage 0's) and `devices` (the plan's) matter
    under vertical sync."""
    acts = space.activations(options.precision, scale)
    sync = VerticalSync(devices, (first_replicas,)) if options.vertical_sync else None
    settings = MemorySettings(schedule=options.schedule, num_microbatches=options.num_microbatches,
                              precision=options.precision, recompute=options.recompute, split_backward=split_backward,
                              eager_sends=space.eager_sends, vertical_sync=sync,
                              merge_weight_grads=options.merges_weight_grads)
    sizes = StageBytes(
        parameters=space.range_total(space.covered_parameter_bytes, start, end),
        activations=acts.held[start, end],
        optimizer_state=space.range_total(covered_or_zeros(space, space.covered_optimizer_state_bytes), start, end),
        inputs=acts.inputs[start, end],
        copies=None if acts.copies is None else acts.copies[start, end],
        waiting=None if acts.waiting is None else acts.waiting[start, end],
    )
    mem = stage_memory(settings, sizes, replicas=replicas, devices_from=devices_from, stages_from=stages_from,
                       num_stages=num_stages)
    return StageMemory(*(float(x) for x in (mem.weights_bytes, mem.stashed_weights_bytes,
                                            mem.activations_bytes, mem.total_bytes,
                                            mem.optimizer_state_bytes)))


def replay_stage_costs(actions_ms: Sequence[dict[str, float]], num_microbatches: int) -> list[StageCost]:
    """The simulator's StageCosts from plan stages' `actions_ms`: a LoadMicrobatch per
    microbatch, the runtime making the whole minibatch at the first of them (spread evenly)."""
    return [StageCost(**{**a, "load_ms": a.get("load_ms", 0.0) / num_microbatches}) for a in actions_ms]


def _actions_ms(a: ActionCosts, split: bool, allreduce_ms: float) -> dict[str, float]:
    """One replica's StageCost fields: Backward is split from WeightGrads when the schedule splits."""
    return {
        "fwd_ms": float(a.forward_ms), "bwd_ms": float(a.backward_ms),
        "wgrad_ms": float(a.wgrad_ms) if split else 0.0, "optimizer_ms": float(a.update_ms),
        "allreduce_ms": allreduce_ms, "comm_ms": float(a.link_out_ms),
        "wire_ms": float(a.wire_out_ms),
        "send_acts_ms": float(a.send_acts_ms), "recv_grads_ms": float(a.recv_grads_ms),
        "recv_acts_ms": float(a.recv_acts_ms), "send_grads_ms": float(a.send_grads_ms),
        "load_ms": float(a.load_ms), "gap_ms": float(a.gap_ms),
    }


def replay(stages: Sequence[StageEval], options: PlanOptions, cores: int | None) -> Simulation | None:
    """The plan's action lists replayed with its stages' `actions_ms`; None when the runtime
    has no lists for it (microbatches that do not spread evenly over a stage's replicas). A
    hand-written schedule replays its written orders (`options.orders`) when it has one per
    stage, else its stand-in's lists (`ScheduleRules.stand_in`: a plan the run would refuse)."""
    num_stages = len(stages)
    if any(options.num_microbatches % st.replicas for st in stages):
        return None
    steps = max(REPLAY_MIN_MINIBATCHES, 2 * num_stages + 2)
    split = options.split_backward and options.schedule in FLUSH_SCHEDULES
    written = len(options.orders) == num_stages and all(st.replicas == 1 for st in stages)
    spec = ScheduleSpec.make(options.schedule if written else stand_in(options.schedule), num_stages,
                             options.num_microbatches, steps, [s.replicas for s in stages], split_backward=split,
                             orders=options.orders if written else (),
                             merge_weight_grads=split and options.merges_weight_grads)
    costs = replay_stage_costs([st.actions_ms or {} for st in stages], options.num_microbatches)
    return simulate(spec, costs, cores=cores)


def replay_shown(cores: int | None, slowdown: float, sim: Simulation | None, cpu_scale: float) -> dict[str, Any]:
    """How a plan's time was replayed (`plan.json`'s `pipeline.replay`): its minibatches, the
    cores, `shared_slowdown` where the replay's time was multiplied by one, and
    `shared_cpu_scale` where the workers' compute costs that much more CPU time for sharing the
    cores (`RuntimeCosts`; the report's compute per stage)."""
    return {**({"minibatches": len(sim.done_ms)} if sim is not None else {}), "cores": cores,
            **({"shared_slowdown": slowdown} if slowdown != 1.0 else {}),
            **({"shared_cpu_scale": cpu_scale} if cpu_scale != 1.0 else {})}


def replay_ms(stages: Sequence[StageEval], options: PlanOptions, runtime: RuntimeCosts) -> tuple[float, dict[str, Any]]:
    """Time per minibatch of the plan's action lists replayed with its stages' `actions_ms` on
    `runtime.cores`, times `runtime.slowdown` of its workers."""
    cores, workers = runtime.cores, sum(st.replicas for st in stages)
    slowdown = runtime.slowdown(workers)
    sim = replay(stages, options, cores)
    shown = replay_shown(cores, slowdown, sim, runtime.cpu_sharing(workers))
    if sim is None:  # the runtime refuses it: priced by its slowest stage
        bottleneck = max(st.terms["stage_time_ms"] for st in stages)
        return bottleneck * oversubscription_of(cores, workers, slowdown), shown
    return sim.time_per_minibatch_ms * slowdown, shown


def evaluate_pd(space: SplitSpace, topology: Topology, options: PlanOptions, scale: float,
                partition: Sequence[tuple[int, int, int]], replay: bool = True,
                links: StageLinks | None = None) -> PlanEval:
    """`pd` model for stages (start, end, replicas) on contiguous ranks from 0 (fwd_ms, bwd_ms
    and wgrad_ms calibrated, see `pdcli.planner.costs`). With the runtime's measured costs the
    time per minibatch is the replay of the plan's action lists (`replay_ms`); `replay=False`
    (a caller that replays other lists with these stages' costs) gives the bottleneck stage's
    time instead. `links`: the bandwidths between stages when they are not `topology`'s ranks."""
    n = space.num_positions
    bw = topology.span_bandwidth_matrix() if links is None else links.bandwidth
    used, num_stages = sum(r for _, _, r in partition), len(partition)
    stages, first = [], 0
    optimizer = optimizer_step_matrix(space)
    compute_scale = compute_scale_of(space, scale)
    covered_wgrad = covered_or_zeros(space, space.covered_wgrad_ms)
    runtime = runtime_of(space, topology if links is None else links.cluster)
    split = options.split_backward and options.schedule in FLUSH_SCHEDULES
    for index, (start, end, r) in enumerate(partition):
        last = first + r - 1
        fwd = space.range_total(space.covered_fwd_ms, start, end) * compute_scale
        bwd = backward_work(fwd, space.range_total(space.covered_bwd_ms, start, end) * compute_scale,
                            options.recompute)
        wgrad = space.range_total(covered_wgrad, start, end) * compute_scale
        params = space.range_total(space.covered_parameter_bytes, start, end)
        cut_in = space.cut_bytes[start - 1] * scale if start > 0 else 0.0
        cut_out = space.cut_bytes[end - 1] * scale if end < n else 0.0
        sync_bw = bw[first, last]
        in_bw = bw[first - 1, first] if first > 0 else np.inf
        out_bw = bw[last, last + 1] if last + 1 < bw.shape[0] else np.inf
        actions_ms = None
        if runtime is not None:
            actions = runtime_action_costs(runtime, options.schedule, options.num_microbatches, fwd, bwd, wgrad,
                                           float(optimizer[start, end]), cut_in, cut_out, start == 0, end == n,
                                           in_bw, out_bw, space.position_factor(start, end))
            terms = runtime_stage_terms(actions, params, r, sync_bw, options.schedule, options.num_microbatches)
            actions_ms = _actions_ms(actions, split, float(replica_allreduce_ms(params, r, sync_bw, actions.allreduce)))
        else:
            terms = pd_stage_terms(fwd, bwd, params, cut_in, cut_out, r, sync_bw, in_bw, out_bw,
                                   options.schedule, options.num_microbatches, float(optimizer[start, end]))
        values = {name: float(getattr(terms, name)) for name in TERM_NAMES}
        if runtime is not None:
            values.update({name: float(getattr(terms, name)) for name in RUNTIME_TERM_NAMES})
        values["wgrad_ms"] = wgrad
        memory = _memory(space, options, scale, start, end, r, used - first, num_stages - index, num_stages,
                         options.split_backward, partition[0][2], used)
        stages.append(StageEval(start, end, tuple(range(first, first + r)), values, memory, actions_ms))
        first += r
    bottleneck = max(s.terms["stage_time_ms"] for s in stages)
    if runtime is not None and replay:
        time_ms, replayed = replay_ms(stages, options, runtime)
        return PlanEval(tuple(stages), time_ms, replayed)
    if runtime is not None:
        return PlanEval(tuple(stages), bottleneck)
    factor = float(bubble_factor(options.schedule, options.num_microbatches, num_stages,
                                 backward_split(space, options)))
    return PlanEval(tuple(stages), factor * bottleneck)


DATA_PARALLEL_SCHEDULE = "1f1b"
"""The schedule data parallelism is priced as: with one stage, a flush schedule is torch DDP's
step (every device's forward and backward, one all-reduce, one optimizer step)."""


def data_parallel_eval(space: SplitSpace, topology: Topology, options: PlanOptions, scale: float) -> PlanEval:
    """Data parallelism as `torch.nn.parallel.DistributedDataParallel` runs it, the baseline a
    plan's `speedup_over_data_parallel` is against: the whole model on every device of the
    cluster, each device one 1/N share of the minibatch (one microbatch each), then one
    all-reduce of every gradient over the slowest level spanned and one optimizer step per
    minibatch, whatever the plan's own schedule (a schedule that steps per microbatch would
    all-reduce M times per minibatch, which no data-parallel user runs). Priced by the same
    model as the plan: `evaluate_pd` of one stage with N replicas under DATA_PARALLEL_SCHEDULE."""
    devices = topology.num_devices
    ddp = dataclasses.replace(options, schedule=DATA_PARALLEL_SCHEDULE, num_microbatches=devices,
                              split_backward=False, merge_weight_grads=None, vertical_sync=False, orders=(),
                              num_stages=None, straight=False, boundaries=None, split_points=(), replicas=None,
                              virtual_stages=1)
    return evaluate_pd(space, topology, ddp, scale, [(0, space.num_positions, devices)])


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
        memory = _memory(space, options, scale, st.start, st.end, replicas, devices_after,  # no split backward
                         len(stages) - index, len(stages), False, len(stages[0].ranks), total_devices)
        devices_after -= len(st.ranks)
        out.append(StageEval(st.start, st.end, st.ranks, terms, memory))
    return PlanEval(tuple(out), max(s.terms["stage_time_ms"] for s in out))


def plan_options_of(plan: dict[str, Any]) -> PlanOptions:
    """The options a plan.json was made with (what its `inputs` record)."""
    inputs = plan["inputs"]
    return PlanOptions(
        schedule=inputs["schedule"], num_microbatches=int(inputs["num_microbatches"]),
        batch_size=int(inputs["batch_size"]), precision=inputs.get("precision", "fp32"),
        recompute=bool(inputs.get("recompute", False)), split_backward=bool(inputs.get("split_backward", False)),
        vertical_sync=bool(inputs.get("vertical_sync", False)),
        merge_weight_grads=bool(inputs.get("merge_weight_grads", False)))


def evaluate_plan(chain: Chain, plan: dict[str, Any]) -> PlanEval:
    """A plan.json's stages priced by `chain` (its runtime costs when it has them): the same
    stages, ranks and options, another profile or cost model."""
    options = plan_options_of(plan)
    partition = [(int(s["start"]), int(s["end"]), int(s["replicas"])) for s in plan["stages"]]
    topology = Topology.from_levels(plan["inputs"]["topology"]["levels"])
    return evaluate_pd(SplitSpace.from_chain(chain), topology, options, batch_scale(chain.meta, options), partition)

"""What the plan predicted, per minibatch, and the simulated timeline of the same action lists.

The plan gives per-stage terms per minibatch (`data.batch_size` samples); the simulator
(`pdcli.schedule.simulator`) replays the schedule's action lists with per-microbatch costs
derived from them and gives the idle time (pipeline bubble) of every rank. The plan's
`optimizer_ms` (per minibatch: the steps one replica takes) is split into its steps, so
predicted compute = forward + backward + optimizer steps, as the runtime measures compute.
Plans made before the optimizer was modelled have no `optimizer_ms`: it counts 0. Data
loading and weight stashing are not modelled: they cost 0 here.

A plan made for a split backward (`inputs.split_backward`; absent in older plans: unsplit)
is replayed with its WeightGrads actions: a Backward costs the plan's `bwd_ms` less its
`wgrad_ms` (0 when the plan has none), a WeightGrads the `wgrad_ms`, and both count as
compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from pdcli.planner.costs import updates_per_minibatch
from pdcli.planner.evaluate import ACTIONS_KEY, replay_stage_costs
from pdcli.report.measured import pipeline_bubble
from pdcli.runtime.metrics import CATEGORIES, COMM, COMPUTE, IDLE, action_category
from pdcli.schedule import Backward, Forward, OptimizerStep, ScheduleSpec, WeightGrads
from pdcli.schedule.simulator import Simulation, StageCost, shares_cores, simulate
from pdcli.schedule.orders import Order
from pdcli.schedule.spec import FLUSH_SCHEDULES, rules, stand_in, takes_merged_weight_grads

MAX_SIMULATED_STEPS = 200
"""Longer runs are simulated over this many minibatches (per-minibatch values barely change)."""
WAYS_PER_CUT = 2  # a cut's comm term is activations forward + gradients back


@dataclass(frozen=True)
class PredictedStage:
    """One stage, ms per minibatch on one replica."""

    stage_id: int
    replicas: int
    fwd_ms: float
    bwd_ms: float
    compute_ms: float
    """Forward + backward + optimizer steps, per minibatch, the replicas sharing the work."""
    comm_ms: float
    """comm_in + comm_out + sync (transfers and the gradient all-reduce)."""
    idle_ms: float
    """Simulated time waiting for a peer (the bubble), per minibatch."""
    stage_time_ms: float
    wall_ms: float
    """Simulated makespan per minibatch."""
    optimizer_ms: float = 0.0
    """Optimizer steps per minibatch (part of compute_ms)."""
    wgrad_ms: float = 0.0
    """Of bwd_ms, the weight gradients a split backward defers to WeightGrads (0: none, or an
    older plan)."""
    compute_cpu_ms: float | None = None
    """The compute actions' own cost (CPU time), per minibatch: compute_ms without the time a
    replay on shared cores queued the rank for a core, times the plan's `shared_cpu_scale` (None:
    not a runtime-costed plan)."""
    comm_cpu_ms: float | None = None
    """The comm actions' own cost, per minibatch: comm_ms without the time a replay on shared
    cores queued the rank for a core (None: not a runtime-costed plan)."""

    @property
    def bubble_fraction(self) -> float:
        return self.idle_ms / self.wall_ms if self.wall_ms > 0 else 0.0


@dataclass(frozen=True)
class Predicted:
    """The plan's pipeline prediction plus the simulation of the run's schedule."""

    stages: tuple[PredictedStage, ...]
    time_per_minibatch_ms: float
    throughput_samples_per_s: float
    simulated_time_per_minibatch_ms: float
    """The replay's steady time per minibatch."""
    num_simulated_steps: int
    split_backward: bool = False
    """The plan (and so the simulation) splits the backward."""
    merge_weight_grads: bool = False
    """... and runs the weight gradients merged per chunk (`plan_merges_weight_grads`)."""
    whole_loop_per_minibatch_ms: float = 0.0
    """The run's whole loop (fill and drain included) per minibatch: the replay's makespan, its
    steps beyond MAX_SIMULATED_STEPS at the steady time."""
    shared_cores: bool = False
    """The replay ran the ranks on fewer cores than ranks (a CPU host's workers sharing cores)."""

    @property
    def bubble_fraction(self) -> float:
        """Simulated share of all ranks' wall time waiting for a peer (`pipeline_bubble`)."""
        return pipeline_bubble(self.stages)


def runtime_costed(plan: dict[str, Any]) -> bool:
    """The plan priced every action with the runtime's measured costs (`actions_ms`)."""
    return bool(plan["stages"]) and all(ACTIONS_KEY in s["predicted"] for s in plan["stages"])


def stage_costs(plan: dict[str, Any], schedule: str, num_microbatches: int) -> list[StageCost]:
    """Per-microbatch costs of one replica of each stage: the plan's per-action costs, or
    derived from its per-minibatch terms."""
    if runtime_costed(plan):
        return replay_stage_costs([s["predicted"][ACTIONS_KEY] for s in plan["stages"]], num_microbatches)
    costs = []
    for stage in plan["stages"]:
        p, r = stage["predicted"], int(stage["replicas"])
        # comm_out_ms = 2 transfers of the whole minibatch's cut, shared by r replicas
        comm_ms = float(p["comm_out_ms"]) * r / (WAYS_PER_CUT * num_microbatches)
        # sync_ms, optimizer_ms: one all-reduce and one step per minibatch, pipedream: one
        # per round of r microbatches
        rounds = float(updates_per_minibatch(schedule, num_microbatches, r))
        bwd_ms = float(p["bwd_ms"]) / num_microbatches
        costs.append(StageCost(
            fwd_ms=float(p["fwd_ms"]) / num_microbatches, bwd_ms=bwd_ms,
            comm_ms=comm_ms, optimizer_ms=float(p.get("optimizer_ms", 0.0)) / rounds,
            allreduce_ms=float(p["sync_ms"]) / rounds,
            wgrad_ms=min(float(p.get("wgrad_ms", 0.0)) / num_microbatches, bwd_ms),
        ))
    return costs


DEVICE_SUMMED_KEYS = ("fwd_ms", "bwd_ms", "compute_ms", "optimizer_ms", "wgrad_ms", "comm_in_ms", "comm_out_ms",
                      "sync_ms", "stage_time_ms")


def device_stages(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """A virtual-stage plan's chunks summed per device (its rank), as one stage each: what a run,
    which measures devices, is held against (a device's comm terms add its chunks' links, those
    to its own other chunks included)."""
    devices = sorted({int(r) for s in plan["stages"] for r in s["ranks"]})
    out = []
    for d in devices:
        chunks = [s["predicted"] for s in plan["stages"] if [int(r) for r in s["ranks"]] == [d]]
        out.append({"stage_id": d, "replicas": 1, "ranks": [d],
                    "predicted": {k: sum(float(c.get(k, 0.0)) for c in chunks) for k in DEVICE_SUMMED_KEYS}})
    return out


def plan_splits_backward(plan: dict[str, Any], schedule: str) -> bool:
    """Whether the run of `plan` with `schedule` split its backward (`inputs.split_backward`)."""
    return bool(plan.get("inputs", {}).get("split_backward", False)) and schedule in FLUSH_SCHEDULES


def plan_merges_weight_grads(plan: dict[str, Any], schedule: str) -> bool:
    """Whether the run of `plan` with `schedule` ran its WeightGrads merged per chunk
    (`inputs.merge_weight_grads`, where `schedule` takes it)."""
    merge = bool(plan.get("inputs", {}).get("merge_weight_grads", False))
    return merge and takes_merged_weight_grads(schedule, plan_splits_backward(plan, schedule))


def predict(plan: dict[str, Any], schedule: str, num_microbatches: int, num_steps: int,
            vertical_sync: bool = False, orders: Sequence[Order] = ()) -> Predicted:
    """The plan's numbers for a run of `num_steps` minibatches of `schedule` (a hand-written
    one: its written `orders`, else its stand-in's, see `ScheduleRules.stand_in`)."""
    run_steps = max(1, num_steps)
    steps = min(run_steps, MAX_SIMULATED_STEPS)
    split = plan_splits_backward(plan, schedule)
    plan_stages = device_stages(plan) if rules(schedule).chunked else plan["stages"]
    replicas = [int(s["replicas"]) for s in plan_stages]
    merged = plan_merges_weight_grads(plan, schedule)
    spec = ScheduleSpec.make(schedule if orders or rules(schedule).chunked else stand_in(schedule), len(replicas),
                             num_microbatches, steps, replicas, vertical_sync, split_backward=split, orders=orders,
                             virtual_stages=int(plan.get("inputs", {}).get("virtual_stages", 1)),
                             merge_weight_grads=merged)
    runtime = runtime_costed(plan)
    replayed = plan["pipeline"].get("replay") or {}
    cores = replayed.get("cores") if runtime else None
    costs = stage_costs(plan, schedule, num_microbatches)
    sim = simulate(spec, costs, cores=cores)
    shared = shares_cores(spec.num_ranks, cores)
    own = simulate(spec, costs) if shared else sim  # the same lists, nobody queued for a core
    cpu_scale = float(replayed.get("shared_cpu_scale", 1.0))  # `RuntimeCosts.shared_cpu_scale`
    stages = []
    for stage_id, stage in enumerate(plan_stages):
        if runtime:
            stages.append(_replayed_stage(stage, stage_id, spec, sim, own, replicas[stage_id], steps, cpu_scale))
            continue
        p = stage["predicted"]
        optimizer_ms = float(p.get("optimizer_ms", 0.0))
        busy_ms = [
            sum(t.end_ms - t.start_ms for t in sim.timeline[spec.rank_of(stage_id, replica)]
                if isinstance(t.action, (Forward, Backward, WeightGrads, OptimizerStep)))
            for replica in range(replicas[stage_id])
        ]
        idle_ms = sim.makespan_ms - sum(busy_ms) / len(busy_ms)
        stages.append(PredictedStage(
            stage_id=stage_id, replicas=replicas[stage_id], fwd_ms=float(p["fwd_ms"]), bwd_ms=float(p["bwd_ms"]),
            compute_ms=float(p["compute_ms"]) + optimizer_ms, optimizer_ms=optimizer_ms,
            wgrad_ms=float(p.get("wgrad_ms", 0.0)),
            comm_ms=float(p["comm_in_ms"]) + float(p["comm_out_ms"]) + float(p["sync_ms"]),
            idle_ms=idle_ms / steps, stage_time_ms=float(p["stage_time_ms"]), wall_ms=sim.makespan_ms / steps,
        ))
    pipeline = plan["pipeline"]
    slowdown = float(replayed.get("shared_slowdown", 1.0))  # `RuntimeCosts.shared_slowdown`
    return Predicted(
        stages=tuple(stages), time_per_minibatch_ms=float(pipeline["time_per_minibatch_ms"]),
        throughput_samples_per_s=float(pipeline["throughput_samples_per_s"]),
        simulated_time_per_minibatch_ms=sim.time_per_minibatch_ms,
        whole_loop_per_minibatch_ms=(sim.makespan_ms + (run_steps - steps) * sim.time_per_minibatch_ms) / run_steps
        * slowdown,
        num_simulated_steps=steps, split_backward=split, merge_weight_grads=merged, shared_cores=shared,
    )


def _category_ms(sim: Simulation, spec: ScheduleSpec, stage_id: int, replicas: int, steps: int) -> dict[str, float]:
    """Replayed ms per minibatch of each category on one replica of the stage (replicas averaged)."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for replica in range(replicas):
        for t in sim.timeline[spec.rank_of(stage_id, replica)]:
            totals[action_category(t.action)] += (t.end_ms - t.start_ms) / (replicas * steps)
    return totals


def _replayed_stage(stage: dict[str, Any], stage_id: int, spec: ScheduleSpec, sim: Simulation, own: Simulation,
                    replicas: int, steps: int, cpu_scale: float) -> PredictedStage:
    """A stage of a runtime-costed plan, per minibatch, in the runtime's own categories:
    compute (every action but messages), comm (sends, all-reduce), idle (receives: waiting and
    unpacking), from the replay `sim` of its action lists; its compute's own cost (CPU time)
    from `own`, the replay with no rank queued for a core, times `cpu_scale`, what compute
    costs more where the workers share the cores; its comm's own cost from `own`."""
    p = stage["predicted"]
    totals = _category_ms(sim, spec, stage_id, replicas, steps)
    alone = _category_ms(own, spec, stage_id, replicas, steps)
    return PredictedStage(
        stage_id=stage_id, replicas=replicas, fwd_ms=float(p["fwd_ms"]), bwd_ms=float(p["bwd_ms"]),
        compute_ms=totals[COMPUTE], optimizer_ms=float(p.get("optimizer_ms", 0.0)),
        wgrad_ms=float(p.get("wgrad_ms", 0.0)), comm_ms=totals[COMM], idle_ms=totals[IDLE],
        stage_time_ms=totals[COMPUTE] + totals[COMM], wall_ms=sim.makespan_ms / steps,
        compute_cpu_ms=alone[COMPUTE] * cpu_scale, comm_cpu_ms=alone[COMM],
    )

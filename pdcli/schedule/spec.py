"""The rules of each schedule: `RULES` (what the planner, the config and the runtime ask) and
`ScheduleSpec`, everything that fixes a run's action lists (`pdcli.schedule.lower` builds
them, `pdcli.schedule.actions` defines their actions).

A process is one replica of one stage. Its list fixes the order of everything it does,
so the numerics of a run never depend on timing.

Words: a *minibatch* is one batch of the data loader (`num_microbatches` microbatches).
Microbatch `k` of minibatch `t` has the global id `t * num_microbatches + k`.
`pipedream` treats every microbatch as a minibatch of its own (one update per
microbatch, per round of `r` microbatches on a stage with `r` replicas); the other
schedules take one optimizer step per minibatch.

Weight versions: version `v` of a stage = its live weights after `v` optimizer steps.
The rule each schedule follows is `ScheduleSpec.weight_version`; the reference trainer
(`pdcli.testing.reference`) applies the same rule without action lists, and the checker
proves that the lists implement it.

Drain points (checkpoints): `ScheduleSpec.drain_after` lists minibatch counts after which
the pipeline drains. gpipe and 1f1b drain before every step anyway; pipedream and 2bw have
no flush, so with checkpoints every N minibatches (`train.checkpoint_every`) pipedream
drains at each checkpoint: the run is cut into segments of N minibatches (the last one
may be shorter) and each segment is a complete pipedream/2bw run (warm-up, steady state,
drain) that starts from the weights and optimizer state the previous segment left. Inside
a segment the weight-version rules apply as if the run began at the segment's first
microbatch (pipedream: no staleness for its first microbatches; 2bw: its first minibatch
runs on the segment's starting version). Weight version numbers count on across
segments. Everything before a drain point is finished on every process, so a checkpoint
there is a consistent cut and a resumed run (`build_for(..., start_minibatch=t)`) is the
suffix of the same lists.

Evaluation (`ScheduleSpec.eval_after`): after the first t minibatches (t = 0: before any
training) every process runs an evaluation block: forward-only passes of the held-out
microbatches through the pipeline on the live weights (`EvalForward`: no stashing, no
gradients), then `EndEval(t)`. The block follows the optimizer step that completes
minibatch t, at a point where nothing is in flight (pipedream and 2bw drain there, as at
checkpoints), so every stage evaluates the same weights. Held-out microbatch e of the k-th
evaluation travels under the id `eval_microbatch_id(k, e)`, past every training id.

Virtual stages (`interleaved`, `loopedbfs`, `zbv`; `ScheduleSpec.virtual_stages` = V): the
model is cut into num_stages x V chunks and a stage (process) is a device that runs several of
them (`chunks_of`, `stage_of_chunk`; `pdcli.schedule.virtual`). They are flush schedules: one
optimizer step per minibatch for all of a device's chunks, after every gradient.

Gradients: a Backward adds the gradient of its microbatch's (unscaled) loss to the
live parameters' `.grad`, whatever version it ran on (with `split_backward`, gpipe and
1f1b only: all but the deferred weight gradients, which a later WeightGrads adds);
AllReduceGrads sums `.grad`
over the stage's replicas; OptimizerStep divides by the number of microbatches the
update covers (a mean, so `lr` means what it means without a pipeline), steps, zeroes.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol, Sequence

from pdcli.errors import UserError
from pdcli.schedule.actions import Backward, Forward, WeightGrads
from pdcli.schedule.orders import Order, read_orders
from pdcli.schedule.virtual import (
    LOOP, V_SHAPE, ChunkAction, chunks_on, device_of, interleaved, looped_bfs, zbv,
)


GPIPE, ONE_F_ONE_B, PIPEDREAM, TWO_BW, FILE = "gpipe", "1f1b", "pipedream", "2bw", "file"
INTERLEAVED, LOOPED_BFS, ZBV = "interleaved", "loopedbfs", "zbv"
SCHEDULES = (PIPEDREAM, ONE_F_ONE_B, GPIPE, TWO_BW, FILE, INTERLEAVED, LOOPED_BFS, ZBV)


@dataclass(frozen=True)
class ScheduleRules:
    """What a schedule is, as the packages around its action lists ask it (the planner's
    vectorized costs and memory, config validation, the runtime's update and tie rules)."""

    flush: bool
    """Drains the pipeline before every optimizer step: a fill/drain bubble, no stale weights,
    and a split backward can fill the bubble."""
    step_per_microbatch: bool
    """Each stage steps once per microbatch (per round of r on r replicas), at its own time;
    otherwise every stage steps once per minibatch, in the same rounds."""
    weight_buffers: int | None
    """Weight versions a stage holds: a fixed number, or None for one per microbatch in flight."""
    in_flight: str
    """How many microbatches one replica of a stage holds at its peak (split backward aside):
    `all` (its share of the minibatch), `devices` (the devices from it to the end over its
    replicas, as PipeDream's 1F1B warm-up), `devices_upto_all` (that, at most its share)."""
    stand_in: str | None = None
    """Set for a schedule whose order the user writes (`file`, `ScheduleSpec.orders`): the
    schedule whose lists stand in for it where only the name is known. The planner's search
    prices `file` as `1f1b` (its bubble and memory); `pd plan`'s replay of the chosen plan and
    the run use the written order."""
    replicable: bool = True
    """Stages may run replicated (data parallel); a written order has one device per stage."""
    placement: str = ""
    """Virtual stages (`ScheduleSpec.virtual_stages`): how the chunks sit on the devices, `loop` or
    `v` (`pdcli.schedule.virtual`); "" for one chunk per device."""
    virtual_stages: tuple[int, int | None] = (1, 1)
    """The chunks per device the schedule takes: (at least, at most; None: no bound)."""
    split_backward: bool | None = None
    """True: the schedule's order needs a split backward (zbv's B and W); None: either."""
    microbatches_per_device: bool = False
    """num_microbatches must be a multiple of the devices (Megatron's interleaved order)."""
    merges_weight_grads: bool = False
    """A split backward's WeightGrads run merged per chunk unless `schedule.merge_weight_grads`
    says otherwise (`merges_weight_grads`): loopedbfs, whose device backwards all of a chunk's
    microbatches back to back and holds all of them anyway. Its per-microbatch W's would sit
    between those Backwards and hold back the gradients the previous device waits for."""

    @property
    def chunked(self) -> bool:
        """Its lists name the chunk of every microbatch action (a device may hold several)."""
        return bool(self.placement)

    @property
    def hand_written(self) -> bool:
        """The order is the user's (`ScheduleSpec.orders`), not fixed by the name."""
        return self.stand_in is not None

    @property
    def stashes_weights(self) -> bool:
        """Forwards run on stashed weight versions (copies the optimizer step leaves behind)."""
        return self.weight_buffers != 1


RULES: dict[str, ScheduleRules] = {
    PIPEDREAM: ScheduleRules(flush=False, step_per_microbatch=True, weight_buffers=None, in_flight="devices"),
    ONE_F_ONE_B: ScheduleRules(flush=True, step_per_microbatch=False, weight_buffers=1, in_flight="devices_upto_all"),
    GPIPE: ScheduleRules(flush=True, step_per_microbatch=False, weight_buffers=1, in_flight="all"),
    TWO_BW: ScheduleRules(flush=False, step_per_microbatch=False, weight_buffers=2, in_flight="devices"),
    FILE: ScheduleRules(flush=True, step_per_microbatch=False, weight_buffers=1, in_flight="devices_upto_all",
                        stand_in=ONE_F_ONE_B, replicable=False),
    INTERLEAVED: ScheduleRules(flush=True, step_per_microbatch=False, weight_buffers=1, in_flight="devices_upto_all",
                               replicable=False, placement=LOOP, virtual_stages=(1, None),
                               microbatches_per_device=True),
    LOOPED_BFS: ScheduleRules(flush=True, step_per_microbatch=False, weight_buffers=1, in_flight="all",
                              replicable=False, placement=LOOP, virtual_stages=(1, None),
                              merges_weight_grads=True),
    ZBV: ScheduleRules(flush=True, step_per_microbatch=False, weight_buffers=1, in_flight="devices_upto_all",
                       replicable=False, placement=V_SHAPE, virtual_stages=(2, 2), split_backward=True),
}
"""Every schedule's rules; `ScheduleSpec` holds the rest of its definition (weight versions,
stash depths) and `pdcli.schedule.lower` its compute order."""
FLUSH_SCHEDULES = tuple(name for name in SCHEDULES if RULES[name].flush)
"""Schedules that drain the pipeline before every optimizer step (and so pay a fill/drain bubble)."""


def rules(name: str) -> ScheduleRules:
    """The rules of schedule `name`; UserError for a name that is not a schedule."""
    if name not in RULES:
        raise UserError(f"schedule {name!r} is not one of {', '.join(SCHEDULES)}")
    return RULES[name]


def stand_in(name: str) -> str:
    """The schedule whose lists price `name` where its own are not at hand (`ScheduleRules.stand_in`)."""
    return rules(name).stand_in or name


def switch_problems(name: str, vertical_sync: bool = False, split_backward: bool = False,
                    merge_weight_grads: bool = False) -> dict[str, str]:
    """The switches schedule `name` does not take: {switch: why} (empty when all fit). Config
    validation, the planner's options and `ScheduleSpec` all ask this one rule."""
    problems = {}
    if vertical_sync and name != PIPEDREAM:
        problems["vertical_sync"] = f"vertical_sync only applies to {PIPEDREAM}, not {name!r}"
    if split_backward and name not in FLUSH_SCHEDULES:
        problems["split_backward"] = (f"split_backward only applies to {', '.join(FLUSH_SCHEDULES)}, not {name!r} "
                                      f"(it fills the flush's bubble; {name} has none)")
    if merge_weight_grads:
        placed = ", ".join(n for n in FLUSH_SCHEDULES if not RULES[n].split_backward)
        if name in FLUSH_SCHEDULES and RULES[name].split_backward:
            problems["merge_weight_grads"] = (f"{name}'s own order places its WeightGrads; merge_weight_grads "
                                              f"is for the schedules whose W's pd places ({placed})")
        elif name not in FLUSH_SCHEDULES or not split_backward:
            problems["merge_weight_grads"] = (f"merge_weight_grads merges the WeightGrads of a split backward at "
                                              f"the flush: {placed} with schedule.split_backward on, not {name!r}"
                                              f"{'' if name not in FLUSH_SCHEDULES else ' with it off'}")
    return problems


def takes_merged_weight_grads(name: str, split_backward: bool) -> bool:
    """Whether schedule `name` with `split_backward` takes `merge_weight_grads` (`switch_problems`)."""
    return not switch_problems(name, False, split_backward, True)


def merges_weight_grads(name: str, split_backward: bool, setting: bool | None) -> bool:
    """Whether a run of schedule `name` merges its weight gradients: `setting`
    (`schedule.merge_weight_grads`), or where that is null, the schedule's default
    (`ScheduleRules.merges_weight_grads`) where it takes them (a split backward pd places)."""
    if setting is not None:
        return setting
    return rules(name).merges_weight_grads and takes_merged_weight_grads(name, split_backward)


def written_merge_problem(orders: Sequence[Order], source: str) -> str | None:
    """Why `merge_weight_grads` does not go with these written orders: every line places its own
    WeightGrads, so pd places none to merge (None when some line leaves them to pd)."""
    if orders and all(any(isinstance(a, WeightGrads) for a in order) for order in orders):
        return (f"the lines of {source} place every WeightGrads themselves; leave the W's out of them (pd then "
                f"places them at the flush) or set schedule.merge_weight_grads=false")
    return None


def virtual_problems(name: str, virtual_stages: int, split_backward: bool, num_microbatches: int,
                     num_devices: int | None = None) -> dict[str, str]:
    """What schedule `name` does not take of virtual stages, split backward and (with the
    devices known) microbatches: {config key: why}. Config validation and `ScheduleSpec` ask it."""
    r = rules(name)
    low, high = r.virtual_stages
    problems = {}
    if not r.chunked and virtual_stages != 1:
        chunked = ", ".join(n for n in SCHEDULES if RULES[n].chunked)
        problems["schedule.virtual_stages"] = (f"{virtual_stages} chunks per device, but {name} runs one; virtual "
                                               f"stages are for {chunked} (set schedule.virtual_stages=1)")
    elif not low <= virtual_stages <= (high or virtual_stages):
        want = f"exactly {low}" if low == high else f"at least {low}"
        problems["schedule.virtual_stages"] = f"{name} takes {want} chunks per device, got {virtual_stages}"
    if r.split_backward and not split_backward:
        problems["schedule.split_backward"] = (f"{name} runs the input and the weight gradients as separate "
                                               f"actions (B and W); set schedule.split_backward=null or true")
    if r.microbatches_per_device and num_devices is not None and num_microbatches % num_devices:
        problems["schedule.num_microbatches"] = (
            f"{num_microbatches} microbatches, but {name} (Megatron's interleaved 1F1B) cycles them through the "
            f"chunks in groups of one per device: use a multiple of the {num_devices} devices")
    return problems


# ---- the parameters of a schedule and its rules -------------------------------------------


def drain_points(num_steps: int, every: int, extra: Sequence[int] = ()) -> tuple[int, ...]:
    """Minibatch counts after which the pipeline drains: every `every` minibatches (0 = never)
    plus `extra` (e.g. the checkpoint a run resumes from), strictly inside (0, num_steps)."""
    points = set(range(every, num_steps, every)) if every > 0 else set()
    points |= {t for t in extra if 0 < t < num_steps}
    return tuple(sorted(points))


def eval_points(num_steps: int, every: int, at_start: bool) -> tuple[int, ...]:
    """Minibatch counts after which the held-out split is evaluated: every `every` minibatches
    (0 = never in between), at 0 when `at_start`, and always at the end (`num_steps`)."""
    return tuple(sorted({*drain_points(num_steps, every), *((0,) if at_start else ()), num_steps}))


def replica_for(microbatch_id: int, replicas_of_stage: int) -> int:
    """The replica (of a stage with `replicas_of_stage` replicas) that runs `microbatch_id`: round-robin."""
    return microbatch_id % replicas_of_stage


@dataclass(frozen=True)
class StashDepth:
    """What one process of a stage holds at once, at most."""

    weight_versions: int
    """Distinct weight versions: the live weights plus stashed copies."""
    activation_sets: int
    """Microbatches forwarded and not yet backwarded (their saved activations)."""


class ScheduleSettings(Protocol):
    """The config's `schedule` section (`pdcli.config.schema.ScheduleConfig`), as the spec reads it."""

    name: str
    num_microbatches: int
    vertical_sync: bool
    path: str | None
    orders: list[str] | None
    virtual_stages: int

    @property
    def split_backward_on(self) -> bool: ...
    @property
    def merge_weight_grads_on(self) -> bool: ...


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything that fixes the action lists of a run; rejects what no schedule can run."""

    name: str
    """`gpipe`, `1f1b`, `pipedream`, `2bw` or `file` (a written order: `orders`)."""
    num_stages: int
    """Pipeline stages S."""
    num_microbatches: int
    """Microbatches per minibatch M."""
    num_steps: int
    """Minibatches the run consumes (gpipe/1f1b/2bw: one optimizer step each)."""
    replicas: tuple[int, ...]
    """Replicas (data-parallel copies) of each stage."""
    vertical_sync: bool = False
    """pipedream only: every stage uses the weight version stage 0 used for a microbatch."""
    drain_after: tuple[int, ...] = ()
    """Minibatch counts after which the pipeline drains (checkpoint points), increasing,
    inside (0, num_steps); see `drain_points`. No effect on gpipe/1f1b (they always drain)."""
    split_backward: bool = False
    """Flush schedules only: each Backward leaves the weight gradients of its Linear layers
    to a WeightGrads action placed where the stage would wait (see `_add_weight_grads`)."""
    eval_after: tuple[int, ...] = ()
    """Minibatch counts after which the held-out split is evaluated (see `eval_points`),
    increasing, inside [0, num_steps]; pipedream/2bw: those inside (0, num_steps) are drain points."""
    num_eval_microbatches: int = 0
    """Held-out microbatches per evaluation (a multiple of num_microbatches)."""
    orders: tuple[Order, ...] = ()
    """`file` only: each stage's compute order for one minibatch (Forward, Backward and
    WeightGrads of microbatches 0 .. M-1 on version 0, see `pdcli.schedule.orders`), which the
    lowering repeats for every minibatch, each followed by its optimizer step."""
    virtual_stages: int = 1
    """Chunks per device V (`interleaved`, `loopedbfs`, `zbv`): the model is cut into
    num_stages x V chunks, placed as the schedule's `ScheduleRules.placement` says; a process
    (stage) is then a device, and its lists name each action's chunk."""
    merge_weight_grads: bool = False
    """split_backward, W's the lowering places: every WeightGrads of a minibatch waits for the
    flush, where a chunk's run of them computes one matmul per Linear layer over all the
    minibatch's rows (`pdcli.torchutil.wgrad`); every microbatch's Linear inputs and output
    gradients are held until then (`weight_grad_lag`)."""

    @classmethod
    def make(cls, name: str, num_stages: int, num_microbatches: int, num_steps: int,
             replicas: Sequence[int] | None = None, vertical_sync: bool = False,
             drain_after: Sequence[int] = (), split_backward: bool = False,
             eval_after: Sequence[int] = (), num_eval_microbatches: int = 0,
             orders: Sequence[Order] = (), virtual_stages: int = 1, merge_weight_grads: bool = False) -> ScheduleSpec:
        """A spec with `replicas=None` meaning one replica per stage."""
        reps = tuple(replicas) if replicas is not None else (1,) * num_stages
        evals = tuple(eval_after) if num_eval_microbatches else ()
        return cls(name, num_stages, num_microbatches, num_steps, reps, vertical_sync, tuple(drain_after),
                   split_backward, evals, num_eval_microbatches if evals else 0, tuple(orders), virtual_stages,
                   merge_weight_grads)

    @classmethod
    def from_config(cls, schedule: ScheduleSettings, replicas: Sequence[int], num_steps: int,
                    drain_after: Sequence[int] = (), eval_after: Sequence[int] = (),
                    num_eval_microbatches: int = 0) -> ScheduleSpec:
        """The spec of a run of the config's `schedule` section on stages with `replicas`."""
        orders = read_orders(schedule.orders or [], schedule.num_microbatches, schedule.split_backward_on,
                             schedule.path or "schedule.orders") if schedule.orders else ()
        if orders and len(orders) != len(replicas):
            raise UserError(f"{schedule.path or 'schedule.orders'}: {len(orders)} device lines, but the plan has "
                            f"{len(replicas)} stages", hint="write one line per stage, or plan that many stages "
                            f"(plan.num_stages={len(orders)})")
        return cls.make(schedule.name, len(replicas), schedule.num_microbatches, num_steps, replicas,
                        schedule.vertical_sync, drain_after, schedule.split_backward_on, eval_after,
                        num_eval_microbatches, orders, schedule.virtual_stages, schedule.merge_weight_grads_on)

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.name not in SCHEDULES:
            problems.append(f"schedule {self.name!r} is not one of {', '.join(SCHEDULES)}")
        for key in ("num_stages", "num_microbatches", "num_steps"):
            if getattr(self, key) < 1:
                problems.append(f"{key} must be >= 1, got {getattr(self, key)}")
        if len(self.replicas) != self.num_stages:
            problems.append(f"replicas has {len(self.replicas)} entries for {self.num_stages} stages")
        problems += switch_problems(self.name, self.vertical_sync, self.split_backward,
                                    self.merge_weight_grads).values()
        if list(self.drain_after) != sorted(set(self.drain_after)) or any(
                not 0 < t < self.num_steps for t in self.drain_after):
            problems.append(f"drain_after {list(self.drain_after)} must increase strictly inside "
                            f"(0, num_steps={self.num_steps})")
        if list(self.eval_after) != sorted(set(self.eval_after)) or any(
                not 0 <= t <= self.num_steps for t in self.eval_after):
            problems.append(f"eval_after {list(self.eval_after)} must increase strictly inside [0, {self.num_steps}]")
        if not self.is_flush and any(0 < t < self.num_steps and t not in self.drain_after for t in self.eval_after):
            problems.append(f"{self.name}: evaluations {list(self.eval_after)} must be at drain points "
                            f"{list(self.drain_after)} (nothing in flight)")
        if self.num_eval_microbatches % self.num_microbatches:
            problems.append(f"num_eval_microbatches={self.num_eval_microbatches} is not whole minibatches "
                            f"of {self.num_microbatches}")
        if not problems:
            problems += self._order_problems()
        if not problems:
            problems += [f"{key}: {why}" for key, why in virtual_problems(
                self.name, self.virtual_stages, self.split_backward, self.num_microbatches, self.num_stages).items()]
        if not problems and self.chunked and max(self.replicas) > 1:
            problems.append(f"plan.replicas: {self.name} runs one device per pipeline position (its chunks talk "
                            f"to both neighbours), got replicas {list(self.replicas)}; leave plan.replicas unset")
        if problems:
            raise UserError("; ".join(problems))
        for stage_id, r in enumerate(self.replicas):
            if r < 1 or self.num_microbatches % r:
                problems.append(
                    f"stage {stage_id} has {r} replicas: num_microbatches={self.num_microbatches} "
                    f"must be a multiple of it (microbatches are spread evenly over replicas)")
            elif self.name == TWO_BW and self.num_in_flight(stage_id) > self.num_microbatches // r + 1:
                problems.append(
                    f"2bw: stage {stage_id} keeps {self.num_in_flight(stage_id)} microbatches in "
                    f"flight per replica, more than num_microbatches/replicas + 1 = "
                    f"{self.num_microbatches // r + 1}, so two weight buffers cannot hold them")
        if problems:
            raise UserError("; ".join(problems), hint="use more microbatches per minibatch")

    def _order_problems(self) -> list[str]:
        """What is wrong with `orders` for this schedule (the lines themselves are checked by
        `pdcli.schedule.orders` and `pdcli.schedule.handwritten`)."""
        if not rules(self.name).hand_written:
            return [f"{self.name}: orders are only for {FILE}"] if self.orders else []
        if len(self.orders) != self.num_stages:
            return [f"{self.name}: {len(self.orders)} orders for {self.num_stages} stages (one per stage)"]
        if not rules(self.name).replicable and max(self.replicas) > 1:
            return [f"{self.name}: one replica per stage (a written order per device), got replicas "
                    f"{list(self.replicas)}; leave plan.replicas unset"]
        if not self.split_backward and any(isinstance(a, WeightGrads) for order in self.orders for a in order):
            return [f"{self.name}: WeightGrads in the orders need split_backward"]
        merge_problem = written_merge_problem(self.orders, "the written orders") if self.merge_weight_grads else None
        if merge_problem:
            return [f"{self.name}: merge_weight_grads, but {merge_problem}"]
        return []

    def places_weight_grads(self, stage_id: int) -> bool:
        """Whether the lowering places `stage_id`'s WeightGrads (split backward, unless the stage's
        written order or the schedule's own order (zbv) has them)."""
        own = self.orders[stage_id] if self.orders else ()
        return self.split_backward and not rules(self.name).split_backward and not any(
            isinstance(a, WeightGrads) for a in own)

    def merges_weight_grads(self, stage_id: int) -> bool:
        """Whether `stage_id`'s WeightGrads run merged per chunk: `merge_weight_grads`
        where the lowering places them (a written order's own W's run where they are written)."""
        return self.merge_weight_grads and self.places_weight_grads(stage_id)

    # -- chunks (virtual stages) --
    @property
    def chunked(self) -> bool:
        """The lists name each microbatch action's chunk (`interleaved`, `loopedbfs`, `zbv`)."""
        return rules(self.name).chunked

    @property
    def num_chunks(self) -> int:
        """Pieces of the model: num_stages x virtual_stages (num_stages without virtual stages)."""
        return self.num_stages * self.virtual_stages

    def chunks_of(self, stage_id: int) -> tuple[int, ...]:
        """The chunks stage (device) `stage_id` runs: (stage_id,) without virtual stages."""
        if not self.chunked:
            return (stage_id,)
        return chunks_on(rules(self.name).placement, self.num_stages, self.virtual_stages, stage_id)

    def stage_of_chunk(self, chunk: int) -> int:
        """The stage (device) that runs `chunk`."""
        if not self.chunked:
            return chunk
        return device_of(rules(self.name).placement, self.num_stages, chunk)

    # -- processes --
    @property
    def num_ranks(self) -> int:
        """Processes in the run: the sum of the replicas of every stage."""
        return sum(self.replicas)

    def rank_of(self, stage_id: int, replica_id: int) -> int:
        """Ranks are stage-major: stage 0's replicas, then stage 1's, ..."""
        return sum(self.replicas[:stage_id]) + replica_id

    def stage_replica_of(self, rank: int) -> tuple[int, int]:
        """(stage_id, replica_id) of `rank`; the inverse of `rank_of`."""
        for stage_id, r in enumerate(self.replicas):
            if rank < r:
                return stage_id, rank
            rank -= r
        raise ValueError(f"rank out of range (num_ranks={self.num_ranks})")

    # -- microbatches and steps --
    @property
    def is_flush(self) -> bool:
        """True for the schedules that drain the pipeline before each optimizer step."""
        return self.name in FLUSH_SCHEDULES

    @property
    def total_microbatches(self) -> int:
        """Microbatches in the run, ids 0 .. total - 1."""
        return self.num_steps * self.num_microbatches

    def segment_start(self, minibatch: int) -> int:
        """First minibatch of the segment (between drain points) that holds `minibatch`."""
        i = bisect.bisect_right(self.drain_after, minibatch)
        return self.drain_after[i - 1] if i else 0

    @property
    def segments(self) -> list[range]:
        """The minibatches of each segment, in order (one segment without drain points)."""
        bounds = [0, *self.drain_after, self.num_steps]
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]

    def steps_through(self, stage_id: int, num_minibatches: int) -> int:
        """Optimizer steps `stage_id` has taken once the first `num_minibatches` are done."""
        if self.name == PIPEDREAM:
            return num_minibatches * self.num_microbatches // self.replicas[stage_id]
        return num_minibatches

    def num_in_flight(self, stage_id: int) -> int:
        """Forwards one replica of `stage_id` runs before its first backward (1F1B warm-up
        + 1): the devices from this stage to the end over this stage's replicas, rounded
        up (S - s on a straight pipeline, as in PipeDream)."""
        return math.ceil(sum(self.replicas[stage_id:]) / self.replicas[stage_id])

    def microbatches_of(self, stage_id: int, replica_id: int) -> range:
        """The microbatches `replica_id` of `stage_id` runs, in increasing order."""
        return range(replica_id, self.total_microbatches, self.replicas[stage_id])

    def step_of(self, stage_id: int, microbatch_id: int) -> int:
        """The optimizer step of `stage_id` whose gradient includes `microbatch_id`: its
        minibatch, or for pipedream its round of r microbatches (r = replicas)."""
        if self.name == PIPEDREAM:
            return microbatch_id // self.replicas[stage_id]
        return microbatch_id // self.num_microbatches

    def microbatches_of_step(self, stage_id: int, step: int) -> range:
        """The microbatches (over all replicas) whose mean gradient optimizer step `step` applies."""
        size = self.replicas[stage_id] if self.name == PIPEDREAM else self.num_microbatches
        return range(step * size, (step + 1) * size)

    def num_optimizer_steps(self, stage_id: int) -> int:
        """Optimizer steps `stage_id` takes in the run."""
        if self.name == PIPEDREAM:
            return self.total_microbatches // self.replicas[stage_id]
        return self.num_steps

    # -- weight versions --
    def weight_version(self, stage_id: int, microbatch_id: int) -> int:
        """The version of `stage_id` (number of its updates it holds) that both the forward
        and the backward of `microbatch_id` use.

        gpipe, 1f1b: the minibatch index t (all updates before it).
        2bw: t - 1 (clamped at the segment's first minibatch t0, 0 without drain points):
        W(t+1) = W(t) - lr * grad on W(t - 1).
        pipedream: the live version when the microbatch reaches this stage in 1F1B order:
        round k = mb // r of a replica runs after k - n + 1 updates (n = num_in_flight),
        i.e. on a straight pipeline the updates of microbatches 0 .. mb - (S - s); with
        drain points, rounds count from the segment's first microbatch and the versions
        start from the steps taken before the segment.
        With vertical sync: the newest version of this stage whose updates all come from
        microbatches that stage 0's version for `microbatch_id` includes.
        """
        minibatch = microbatch_id // self.num_microbatches
        if self.is_flush:
            return minibatch
        if self.name == TWO_BW:
            return max(self.segment_start(minibatch), minibatch - 1)
        if self.vertical_sync:
            first_stage = self._pipedream_version(0, microbatch_id)
            return first_stage * self.replicas[0] // self.replicas[stage_id]
        return self._pipedream_version(stage_id, microbatch_id)

    def update_delay(self, stage_id: int) -> int:
        """Staleness: how many of its own optimizer steps the weights a microbatch of
        `stage_id` runs on lack, in steady state (the last microbatch of the spec: give it
        enough steps). 0 for gpipe/1f1b, 1 for 2bw, S - s - 1 for pipedream on a straight
        pipeline."""
        microbatch_id = self.total_microbatches - 1
        return self.step_of(stage_id, microbatch_id) - self.weight_version(stage_id, microbatch_id)

    def _pipedream_version(self, stage_id: int, microbatch_id: int) -> int:
        r = self.replicas[stage_id]
        first = self.segment_start(microbatch_id // self.num_microbatches) * self.num_microbatches
        round_index = (microbatch_id - first) // r  # first is a multiple of r (M % r == 0)
        return first // r + max(0, round_index - self.num_in_flight(stage_id) + 1)

    def eval_microbatch_id(self, evaluation: int, eval_microbatch: int) -> int:
        """The message id of held-out microbatch `eval_microbatch` of the `evaluation`-th
        evaluation: past every training id (a multiple of M, so replicas take them round-robin
        as `eval_microbatch % r`)."""
        return self.total_microbatches + evaluation * self.num_eval_microbatches + eval_microbatch

    @property
    def weight_grad_lag(self) -> int:
        """split_backward: WeightGrads trail their Backward by up to this many microbatches
        (plus one taken early before each RecvGrads). S, the number of stages, came out
        best or equal best of per-stage lags 0..S+1 in the simulator for S = 2..4, M = 4..16
        and W = 1/3 or 1/4 of a microbatch's work; it bounds the extra memory to S
        microbatches' Linear inputs and output gradients. `merge_weight_grads`: all of a
        minibatch's (they wait for the flush)."""
        return self.num_microbatches * self.virtual_stages if self.merge_weight_grads else self.num_stages

    def stash_depth(self, stage_id: int) -> StashDepth:
        """Weight versions and activation sets one replica of `stage_id` holds at most."""
        per_replica = self.num_microbatches // self.replicas[stage_id]
        if self.orders:
            return StashDepth(1, self._written_depth(stage_id))
        if self.chunked:
            return StashDepth(1, self._chunked_depth(stage_id))
        in_flight = self.num_in_flight(stage_id)
        if self.name == GPIPE:
            return StashDepth(1, per_replica)
        if self.name == ONE_F_ONE_B:  # split: a microbatch is held until its WeightGrads
            return StashDepth(1, min(in_flight + (self.weight_grad_lag if self.split_backward else 0), per_replica))
        if self.name == TWO_BW:
            return StashDepth(2, in_flight)
        if not self.vertical_sync:  # one version per microbatch in flight
            return StashDepth(in_flight, in_flight)
        return StashDepth(self._vertical_sync_versions(stage_id), in_flight)

    def _written_depth(self, stage_id: int) -> int:
        """Activation sets `stage_id`'s written order holds at most: forwarded and not yet
        backwarded (nor, with its own WeightGrads, weight-graded); with WeightGrads the lowering
        places, at most `weight_grad_lag` more, and never more than the minibatch."""
        held, peak = 0, 0
        releases = WeightGrads if any(isinstance(a, WeightGrads) for a in self.orders[stage_id]) else Backward
        for action in self.orders[stage_id]:
            held += 1 if isinstance(action, Forward) else -1 if isinstance(action, releases) else 0
            peak = max(peak, held)
        if self.places_weight_grads(stage_id):
            peak = min(peak + self.weight_grad_lag, self.num_microbatches)
        return peak

    def _chunked_depth(self, stage_id: int) -> int:
        """Activation sets (microbatch, chunk) the device holds at most: forwarded and not yet
        backwarded (nor, with a split backward, weight-graded: zbv's order places its W's, the
        lowering those of the others, at most `weight_grad_lag` later and never past the minibatch)."""
        order = chunk_order(self, stage_id)
        own_w = any(isinstance(a, WeightGrads) for a in order)
        releases = WeightGrads if own_w else Backward
        held, peak = 0, 0
        for action in order:
            held += 1 if isinstance(action, Forward) else -1 if isinstance(action, releases) else 0
            peak = max(peak, held)
        if self.split_backward and not own_w:
            peak = min(peak + self.weight_grad_lag, self.num_microbatches * self.virtual_stages)
        return peak

    def _vertical_sync_versions(self, stage_id: int) -> int:
        # After its k-th forward a replica is at version k - n + 1 and still needs every
        # version from the one of its oldest microbatch in flight (round k - n + 1) up.
        if self.drain_after:  # a drain only shortens the stash: count without drain points
            return dataclasses.replace(self, drain_after=())._vertical_sync_versions(stage_id)
        r, n = self.replicas[stage_id], self.num_in_flight(stage_id)
        horizon = 4 * (n + self.num_in_flight(0)) * self.replicas[0] * r
        return max(max(0, k - n + 1) - self.weight_version(stage_id, max(0, k - n + 1) * r) + 1
                   for k in range(horizon))


def chunk_order(spec: ScheduleSpec, stage_id: int) -> list[ChunkAction]:
    """A chunked schedule's compute order of one minibatch on `stage_id` (`pdcli.schedule.virtual`)."""
    s, v, m = spec.num_stages, spec.virtual_stages, spec.num_microbatches
    if spec.name == INTERLEAVED:
        return interleaved(s, v, m, stage_id)
    if spec.name == LOOPED_BFS:
        return looped_bfs(s, v, m, stage_id)
    if spec.name == ZBV:
        return zbv(s, m, stage_id)
    raise ValueError(f"{spec.name} names no chunks")


@lru_cache(maxsize=4096)
def vertical_sync_versions(devices: int, first_replicas: int, devices_from: int, replicas: int) -> int:
    """Weight versions one replica of a pipedream stage holds under vertical sync
    (`ScheduleSpec.stash_depth`), from what they depend on: the run's `devices`, stage 0's
    `first_replicas`, and this stage's `replicas` of the `devices_from` devices from it to the
    end (devices_from == devices: the stage is stage 0). The spec is built with one device
    per stage wherever the count does not matter."""
    if devices_from == devices:
        shape: tuple[int, ...] = (replicas, *(1,) * (devices - replicas))
        stage_id = 0
    else:
        between = devices - first_replicas - devices_from
        if between < 0 or replicas > devices_from:
            raise ValueError(f"no pipeline of {devices} devices has stage 0 on {first_replicas} and a stage "
                             f"with {replicas} replicas {devices_from} devices from the end")
        shape = (first_replicas, *(1,) * between, replicas, *(1,) * (devices_from - replicas))
        stage_id = 1 + between
    spec = ScheduleSpec.make(PIPEDREAM, len(shape), math.lcm(*shape), 1, shape, vertical_sync=True)
    return spec.stash_depth(stage_id).weight_versions

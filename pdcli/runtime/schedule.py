"""Pipeline schedules as data: typed actions and the ordered action list of every process.

A process is one replica of one stage. Its list fixes the order of everything it does,
so the numerics of a run never depend on timing. The executor interprets a list with
a table `{ActionType: handler}` (see `dispatch`); the checker and the simulator replay
the same lists.

Words: a *minibatch* is one batch of the data loader (`num_microbatches` microbatches).
Microbatch `k` of minibatch `t` has the global id `t * num_microbatches + k`.
`pipedream` treats every microbatch as a minibatch of its own (one update per
microbatch, per round of `r` microbatches on a stage with `r` replicas); the other
schedules take one optimizer step per minibatch.

Weight versions: version `v` of a stage = its live weights after `v` optimizer steps.
The rule each schedule follows is `ScheduleSpec.weight_version`; the reference trainer
(`pdcli.runtime.reference`) applies the same rule without action lists, and the checker
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
from typing import Callable, Mapping, Sequence, TypeVar, Union

from pdcli.errors import UserError

__all__ = [
    "Action", "ACTION_TYPES", "AllReduceGrads", "Backward", "Forward", "FreeWeights",
    "LoadMicrobatch", "OptimizerStep", "RecvActivations", "RecvGrads", "ScheduleSpec",
    "SCHEDULES", "SendActivations", "SendGrads", "StashDepth", "StashWeights", "sends_first",
    "UnknownActionError", "WeightGrads", "build_all", "build_for", "build_schedule", "dispatch",
    "drain_points", "one_f_one_b", "replica_for", "stash_depth", "EvalForward", "EndEval", "eval_points",
]

GPIPE, ONE_F_ONE_B, PIPEDREAM, TWO_BW = "gpipe", "1f1b", "pipedream", "2bw"
SCHEDULES = (PIPEDREAM, ONE_F_ONE_B, GPIPE, TWO_BW)
FLUSH_SCHEDULES = (GPIPE, ONE_F_ONE_B)


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


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything that fixes the action lists of a run; rejects what no schedule can run."""

    name: str
    """`gpipe`, `1f1b`, `pipedream` or `2bw`."""
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
    """gpipe and 1f1b only: each Backward leaves the weight gradients of its Linear layers
    to a WeightGrads action placed where the stage would wait (see `_add_weight_grads`)."""
    eval_after: tuple[int, ...] = ()
    """Minibatch counts after which the held-out split is evaluated (see `eval_points`),
    increasing, inside [0, num_steps]; pipedream/2bw: those inside (0, num_steps) are drain points."""
    num_eval_microbatches: int = 0
    """Held-out microbatches per evaluation (a multiple of num_microbatches)."""

    @classmethod
    def make(cls, name: str, num_stages: int, num_microbatches: int, num_steps: int,
             replicas: Sequence[int] | None = None, vertical_sync: bool = False,
             drain_after: Sequence[int] = (), split_backward: bool = False,
             eval_after: Sequence[int] = (), num_eval_microbatches: int = 0) -> ScheduleSpec:
        """A spec with `replicas=None` meaning one replica per stage."""
        reps = tuple(replicas) if replicas is not None else (1,) * num_stages
        evals = tuple(eval_after) if num_eval_microbatches else ()
        return cls(name, num_stages, num_microbatches, num_steps, reps, vertical_sync, tuple(drain_after),
                   split_backward, evals, num_eval_microbatches if evals else 0)

    def __post_init__(self) -> None:
        problems = []
        if self.name not in SCHEDULES:
            problems.append(f"schedule {self.name!r} is not one of {', '.join(SCHEDULES)}")
        for key in ("num_stages", "num_microbatches", "num_steps"):
            if getattr(self, key) < 1:
                problems.append(f"{key} must be >= 1, got {getattr(self, key)}")
        if len(self.replicas) != self.num_stages:
            problems.append(f"replicas has {len(self.replicas)} entries for {self.num_stages} stages")
        if self.vertical_sync and self.name != PIPEDREAM:
            problems.append(f"vertical_sync only applies to pipedream, not {self.name!r}")
        if self.split_backward and self.name not in FLUSH_SCHEDULES:
            problems.append(f"split_backward only applies to {' and '.join(FLUSH_SCHEDULES)}, not {self.name!r} "
                            f"(it fills the flush's bubble; {self.name} has none)")
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
        microbatches' Linear inputs and output gradients."""
        return self.num_stages

    def stash_depth(self, stage_id: int) -> StashDepth:
        """Weight versions and activation sets one replica of `stage_id` holds at most."""
        per_replica = self.num_microbatches // self.replicas[stage_id]
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

    def _vertical_sync_versions(self, stage_id: int) -> int:
        # After its k-th forward a replica is at version k - n + 1 and still needs every
        # version from the one of its oldest microbatch in flight (round k - n + 1) up.
        if self.drain_after:  # a drain only shortens the stash: count without drain points
            return dataclasses.replace(self, drain_after=())._vertical_sync_versions(stage_id)
        r, n = self.replicas[stage_id], self.num_in_flight(stage_id)
        horizon = 4 * (n + self.num_in_flight(0)) * self.replicas[0] * r
        return max(max(0, k - n + 1) - self.weight_version(stage_id, max(0, k - n + 1) * r) + 1
                   for k in range(horizon))


# ---- actions -------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadMicrobatch:
    """inputs (first stage) / target (last stage) = data[microbatch_id]."""

    microbatch_id: int


@dataclass(frozen=True)
class RecvActivations:
    """acts_in[mb] = recv from (stage - 1, peer_replica); pairs with its SendActivations."""

    microbatch_id: int
    peer_replica: int


@dataclass(frozen=True)
class Forward:
    """acts_out[mb] = stage(acts_in[mb]; weights[weight_version]); last stage: loss[mb]."""

    microbatch_id: int
    weight_version: int


@dataclass(frozen=True)
class SendActivations:
    """send acts_out[mb] to (stage + 1, peer_replica); pairs with its RecvActivations."""

    microbatch_id: int
    peer_replica: int


@dataclass(frozen=True)
class RecvGrads:
    """grads_out[mb] = recv from (stage + 1, peer_replica); pairs with its SendGrads."""

    microbatch_id: int
    peer_replica: int


@dataclass(frozen=True)
class Backward:
    """live.grad += d loss[mb] / d weights[weight_version]; grads_in[mb]; free acts of mb."""

    microbatch_id: int
    weight_version: int


@dataclass(frozen=True)
class SendGrads:
    """send grads_in[mb] to (stage - 1, peer_replica); pairs with its RecvGrads."""

    microbatch_id: int
    peer_replica: int


@dataclass(frozen=True)
class WeightGrads:
    """live.grad += the weight gradients Backward(mb) deferred (split_backward); free them."""

    microbatch_id: int


@dataclass(frozen=True)
class StashWeights:
    """stash[version] = copy(live weights); the live weights are at `version` right now."""

    version: int


@dataclass(frozen=True)
class FreeWeights:
    """del stash[version] (its last Forward/Backward is done)."""

    version: int


@dataclass(frozen=True)
class AllReduceGrads:
    """live.grad = sum of live.grad over this stage's replicas (collective, all replicas)."""

    step: int


@dataclass(frozen=True)
class OptimizerStep:
    """live.grad /= num_microbatches; optimizer.step(); zero grads; version = step + 1."""

    step: int
    num_microbatches: int


@dataclass(frozen=True)
class EvalForward:
    """acts_out[mb] = stage(acts_in[mb] or held-out data[eval_microbatch]; live weights), no grad; last: eval sums += loss."""

    microbatch_id: int
    eval_microbatch: int


@dataclass(frozen=True)
class EndEval:
    """last stage: report the eval sums (summed over its replicas) as the evaluation after `after_minibatches`; reset."""

    after_minibatches: int


Action = Union[
    LoadMicrobatch, RecvActivations, Forward, SendActivations, RecvGrads, Backward,
    SendGrads, WeightGrads, StashWeights, FreeWeights, AllReduceGrads, OptimizerStep,
    EvalForward, EndEval,
]
ACTION_TYPES: tuple[type, ...] = (
    LoadMicrobatch, RecvActivations, Forward, SendActivations, RecvGrads, Backward,
    SendGrads, WeightGrads, StashWeights, FreeWeights, AllReduceGrads, OptimizerStep,
    EvalForward, EndEval,
)


class UnknownActionError(TypeError):
    """An action whose type the interpreter's handler table does not know (a bug)."""


R = TypeVar("R")


def dispatch(handlers: Mapping[type, Callable[[Action], R]], action: Action) -> R:
    """Run the handler of `type(action)`; an action type without a handler is an error."""
    handler = handlers.get(type(action))
    if handler is None:
        known = ", ".join(sorted(t.__name__ for t in handlers))
        raise UnknownActionError(f"no handler for {action!r} (handlers: {known})")
    return handler(action)


# ---- the order of compute ---------------------------------------------------------------


def one_f_one_b(microbatch_ids: Sequence[int], num_in_flight: int) -> list[Forward | Backward]:
    """The 1F1B order over `microbatch_ids`, weight versions left at 0.

    Warm-up: forward the first `num_in_flight` microbatches. Steady state: backward the
    oldest microbatch in flight, then forward the next one. Cool-down: backward the
    rest. `num_in_flight = len(microbatch_ids)` gives GPipe's all-forwards-then-all-
    backwards.
    """
    ids = list(microbatch_ids)
    warmup = min(num_in_flight, len(ids))
    order: list[Forward | Backward] = [Forward(mb, 0) for mb in ids[:warmup]]
    for position, mb in enumerate(ids):
        order.append(Backward(mb, 0))
        if position + warmup < len(ids):
            order.append(Forward(ids[position + warmup], 0))
    return order


@lru_cache(maxsize=256)
def _compute_order(spec: ScheduleSpec, stage_id: int, replica_id: int) -> tuple[Action, ...]:
    """Forward/Backward/AllReduceGrads/OptimizerStep of one process, versions filled in."""
    own = spec.microbatches_of(stage_id, replica_id)
    if spec.is_flush:  # a flush per minibatch: the pipeline drains before each step
        per_replica = spec.num_microbatches // spec.replicas[stage_id]
        per_minibatch = [own[t * per_replica:(t + 1) * per_replica] for t in range(spec.num_steps)]
        gpipe = spec.name == GPIPE
        order = [a for chunk in per_minibatch
                 for a in one_f_one_b(chunk, len(chunk) if gpipe else spec.num_in_flight(stage_id))]
    else:  # no flush: one 1F1B sequence per segment (the whole run without drain points)
        m, r = spec.num_microbatches, spec.replicas[stage_id]
        order = [a for seg in spec.segments  # seg.start * m is a multiple of r (M % r == 0)
                 for a in one_f_one_b(range(seg.start * m + replica_id, seg.stop * m, r),
                                      spec.num_in_flight(stage_id))]
    last_of_step = {spec.step_of(stage_id, mb): mb for mb in own}  # own is increasing
    replicated = spec.replicas[stage_id] > 1
    actions: list[Action] = []
    for action in order:
        mb = action.microbatch_id
        version = spec.weight_version(stage_id, mb)
        actions.append(type(action)(mb, version))
        step = spec.step_of(stage_id, mb)
        if isinstance(action, Backward) and last_of_step[step] == mb:
            if replicated:
                actions.append(AllReduceGrads(step))
            covered = len(spec.microbatches_of_step(stage_id, step))
            actions.append(OptimizerStep(step, covered))
    return tuple(actions)


# ---- communication and weight stashing ------------------------------------------------


def _receive_first(spec: ScheduleSpec, stage_id: int, sent: int, needed: int,
                   positions: dict[int, dict[tuple[type, int], int]]) -> bool:
    """Whether a process that just forwarded `sent` and next backwards `needed` should
    receive the gradient of `needed` before sending the activations of `sent`: yes when
    one replica of the next stage does both and backwards `needed` before it forwards
    `sent` (steady 1F1B), so blocking sends meet their receives in the same order on
    both sides; otherwise send first (the gradient may depend on these activations)."""
    next_r = spec.replicas[stage_id + 1]
    replica_id = replica_for(sent, next_r)
    if replica_for(needed, next_r) != replica_id:
        return False
    if replica_id not in positions:  # looked up once per peer: hashing a spec costs O(drain points)
        positions[replica_id] = _positions(spec, stage_id + 1, replica_id)
    position = positions[replica_id]
    return position[Backward, needed] < position[Forward, sent]


@lru_cache(maxsize=256)
def _positions(spec: ScheduleSpec, stage_id: int, replica_id: int) -> dict[tuple[type, int], int]:
    """(Forward or Backward, microbatch_id) -> index in the process's compute order."""
    return {(type(a), a.microbatch_id): i for i, a in enumerate(_compute_order(spec, stage_id, replica_id))
            if isinstance(a, (Forward, Backward))}


def _neighbours(spec: ScheduleSpec, stage_id: int) -> tuple[bool, bool, int, int]:
    """(first stage, last stage, replicas of the previous stage, of the next; 1 where there is none)."""
    first, last = stage_id == 0, stage_id == spec.num_stages - 1
    return first, last, spec.replicas[stage_id - 1] if not first else 1, spec.replicas[stage_id + 1] if not last else 1


def _add_communication(spec: ScheduleSpec, stage_id: int, compute: Sequence[Action]) -> list[Action]:
    """Wrap each Forward/Backward in the data loads, receives and sends it needs (see
    `_receive_first` for the one place where a receive may overtake a send)."""
    first, last, prev_r, next_r = _neighbours(spec, stage_id)
    out: list[Action] = []
    positions: dict[int, dict[tuple[type, int], int]] = {}
    for action in compute:
        if isinstance(action, Forward):
            mb = action.microbatch_id
            if not first:
                out.append(RecvActivations(mb, replica_for(mb, prev_r)))
            if first or last:
                out.append(LoadMicrobatch(mb))
            out.append(action)
            if not last:
                out.append(SendActivations(mb, replica_for(mb, next_r)))
        elif isinstance(action, Backward):
            mb = action.microbatch_id
            if not last:
                recv = RecvGrads(mb, replica_for(mb, next_r))
                previous = out[-1]
                if isinstance(previous, SendActivations) and _receive_first(
                        spec, stage_id, previous.microbatch_id, mb, positions):
                    out.insert(len(out) - 1, recv)
                else:
                    out.append(recv)
            out.append(action)
            if not first:
                out.append(SendGrads(mb, replica_for(mb, prev_r)))
        else:
            out.append(action)
    return out


def _add_weight_stashing(actions: list[Action]) -> list[Action]:
    """Stash the live weights before a step when a later Forward/Backward still needs
    their version, and free each stashed version right after its last use."""
    last_use: dict[int, int] = {}
    for index, action in enumerate(actions):
        if isinstance(action, (Forward, Backward)):
            last_use[action.weight_version] = index
    out: list[Action] = []
    version = 0
    stashed: set[int] = set()
    for index, action in enumerate(actions):
        if isinstance(action, OptimizerStep):
            if last_use.get(version, -1) > index:
                out.append(StashWeights(version))
                stashed.add(version)
            version += 1
        out.append(action)
        if isinstance(action, (Forward, Backward)):
            v = action.weight_version
            if v in stashed and last_use[v] == index:
                out.append(FreeWeights(v))
                stashed.discard(v)
    return out


def _add_weight_grads(spec: ScheduleSpec, actions: Sequence[Action]) -> list[Action]:
    """split_backward: a WeightGrads for every Backward, in microbatch order, where it fills time.

    Each Backward's W waits in a queue; the oldest leaves the queue (1) right before a
    RecvGrads, where the stage would otherwise wait for the next stage's gradient (the
    pipeline's drain), and (2) when more than `weight_grad_lag` are queued; the rest run
    before the optimizer step (and its all-reduce), which needs them all. The last stage
    receives no gradients: its W's trail by the lag and fill the time the other stages
    spend draining. A stage that never backwards a Linear layer runs empty W's (free).
    Not before a RecvGrads that a send follows (stream-ordered lists, see `sends_first`):
    there the W would hold back the next stage's activations.
    """
    out: list[Action] = []
    queued: list[int] = []
    for index, action in enumerate(actions):
        if isinstance(action, (OptimizerStep, AllReduceGrads)):
            out += [WeightGrads(mb) for mb in queued]
            queued = []
        elif isinstance(action, RecvGrads) and queued and not (
                index + 1 < len(actions) and isinstance(actions[index + 1], (SendActivations, SendGrads))):
            out.append(WeightGrads(queued.pop(0)))
        out.append(action)
        if isinstance(action, Backward):
            queued.append(action.microbatch_id)
            while len(queued) > spec.weight_grad_lag:
                out.append(WeightGrads(queued.pop(0)))
    return out


def _evaluation(spec: ScheduleSpec, stage_id: int, replica_id: int, evaluation: int) -> list[Action]:
    """One evaluation block of a process: its share of the held-out microbatches, forward only."""
    first, last, prev_r, next_r = _neighbours(spec, stage_id)
    out: list[Action] = []
    for e in range(replica_id, spec.num_eval_microbatches, spec.replicas[stage_id]):
        mb = spec.eval_microbatch_id(evaluation, e)
        if not first:
            out.append(RecvActivations(mb, replica_for(mb, prev_r)))
        out.append(EvalForward(mb, e))
        if not last:
            out.append(SendActivations(mb, replica_for(mb, next_r)))
    return [*out, EndEval(spec.eval_after[evaluation])]


def _add_evaluations(spec: ScheduleSpec, stage_id: int, replica_id: int, actions: list[Action]) -> list[Action]:
    """Each evaluation block right after the optimizer step that completes its minibatch count
    (at the start for 0)."""
    blocks = {spec.steps_through(stage_id, t) - 1: _evaluation(spec, stage_id, replica_id, k)
              for k, t in enumerate(spec.eval_after)}
    out = list(blocks.pop(-1, []))
    for action in actions:
        out.append(action)
        if isinstance(action, OptimizerStep) and action.step in blocks:
            out += blocks.pop(action.step)
    return out


def sends_first(actions: Sequence[Action]) -> list[Action]:
    """The same list with every send moved ahead of the receives (and WeightGrads) just before it.

    `_receive_first` puts RecvGrads(b) before SendActivations(b + 1) so that a transport
    that completes messages in posting order on one stream (NCCL) sees both ends in the
    same order. A transport whose sends never wait for the peer (the socket transport,
    gloo: receives are posted ahead, sends are buffered) pays for that order in idle
    time: the next stage cannot start forward b + 1 until this stage has received the
    gradient of b. Measured on the 2-stage runtime benchmark: 6-10 ms idle per minibatch
    on each stage. A send depends only on compute before it, so the numerics are the same.
    A WeightGrads produces nothing a send carries, so a send moves ahead of it too.
    """
    out: list[Action] = []
    for action in actions:
        if isinstance(action, (SendActivations, SendGrads)):
            at = len(out)
            while at > 0 and isinstance(out[at - 1], (RecvActivations, RecvGrads, WeightGrads)):
                at -= 1
            out.insert(at, action)
        else:
            out.append(action)
    return out


# ---- public entry points ------------------------------------------------------------------


def build_for(spec: ScheduleSpec, stage_id: int, replica_id: int = 0, start_minibatch: int = 0,
              eager_sends: bool = False) -> list[Action]:
    """The ordered action list of one process (stage `stage_id`, replica `replica_id`);
    with `start_minibatch` = t > 0 (a drain point: a checkpoint to resume from), only the
    actions after the first t minibatches, whose weights and optimizer state it continues.
    `eager_sends`: for a transport whose sends never wait for the peer (see `sends_first`)."""
    if not 0 <= stage_id < spec.num_stages:
        raise ValueError(f"stage_id {stage_id} out of range (num_stages={spec.num_stages})")
    if not 0 <= replica_id < spec.replicas[stage_id]:
        raise ValueError(
            f"replica_id {replica_id} out of range (stage {stage_id} has "
            f"{spec.replicas[stage_id]} replicas)")
    compute = _compute_order(spec, stage_id, replica_id)
    actions = _add_communication(spec, stage_id, compute)
    if eager_sends:
        actions = sends_first(actions)
    if spec.split_backward:
        actions = _add_weight_grads(spec, actions)
    actions = _add_weight_stashing(actions)
    if spec.eval_after:
        actions = _add_evaluations(spec, stage_id, replica_id, actions)
    return actions if start_minibatch == 0 else _resume_suffix(spec, stage_id, actions, start_minibatch)


def _resume_suffix(spec: ScheduleSpec, stage_id: int, actions: list[Action], start_minibatch: int) -> list[Action]:
    """The actions after the optimizer step that completes the first `start_minibatch` minibatches."""
    if not (spec.is_flush or start_minibatch in spec.drain_after) or not 0 < start_minibatch < spec.num_steps:
        raise ValueError(f"cannot resume {spec.name} at minibatch {start_minibatch}: not a drain point "
                         f"{list(spec.drain_after)} inside (0, {spec.num_steps})")
    last_step = spec.steps_through(stage_id, start_minibatch) - 1
    cut = next(i for i, a in enumerate(actions) if isinstance(a, OptimizerStep) and a.step == last_step) + 1
    first_mb = start_minibatch * spec.num_microbatches
    early = [a for a in actions[cut:] if isinstance(a, (Forward, Backward)) and a.microbatch_id < first_mb]
    late = [a for a in actions[:cut] if isinstance(a, (Forward, Backward)) and a.microbatch_id >= first_mb]
    stashed = sum(isinstance(a, StashWeights) for a in actions[:cut]) - sum(isinstance(a, FreeWeights) for a in actions[:cut])
    if early or late or stashed:
        raise AssertionError(f"stage {stage_id}: minibatch {start_minibatch} is not a clean cut ({early[:2]}, {late[:2]})")
    return actions[cut:]


def build_all(spec: ScheduleSpec, eager_sends: bool = False) -> list[list[Action]]:
    """The action lists of all processes, indexed by rank (`spec.rank_of`)."""
    return [build_for(spec, *spec.stage_replica_of(rank), eager_sends=eager_sends) for rank in range(spec.num_ranks)]


def build_schedule(
    name: str,
    num_stages: int,
    stage_id: int,
    num_microbatches: int,
    num_steps: int,
    replicas: Sequence[int] | None = None,
    replica_id: int = 0,
    vertical_sync: bool = False,
    drain_after: Sequence[int] = (),
    start_minibatch: int = 0,
    split_backward: bool = False,
    eager_sends: bool = False,
    eval_after: Sequence[int] = (),
    num_eval_microbatches: int = 0,
) -> list[Action]:
    """The action list of one process for a run of `num_steps` minibatches.

    `replicas[s]` is the replication factor of stage s (None: all 1); `drain_after` the
    drain (checkpoint) points (see `drain_points`); `start_minibatch` a drain point to
    resume from; `split_backward` (gpipe, 1f1b) adds WeightGrads; `eval_after` the
    evaluation points (see `eval_points`) of `num_eval_microbatches` each. Raises UserError
    on parameters no schedule can run (see `ScheduleSpec`).
    """
    spec = ScheduleSpec.make(name, num_stages, num_microbatches, num_steps, replicas, vertical_sync, drain_after,
                             split_backward, eval_after, num_eval_microbatches)
    return build_for(spec, stage_id, replica_id, start_minibatch, eager_sends)


def stash_depth(
    name: str,
    num_stages: int,
    stage_id: int,
    num_microbatches: int,
    replicas: Sequence[int] | None = None,
    vertical_sync: bool = False,
) -> StashDepth:
    """Weight versions and activation sets one process of `stage_id` holds at most."""
    spec = ScheduleSpec.make(name, num_stages, num_microbatches, 1, replicas, vertical_sync)
    return spec.stash_depth(stage_id)

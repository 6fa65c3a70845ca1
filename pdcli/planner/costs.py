"""The `pd` cost model: time of one stage and of the whole pipeline, per minibatch.

For a stage with forward/backward time F, B (ms, one minibatch on one device), parameters
P bytes, one optimizer step O (ms, the stage's parameters), r replicas on ranks
[a, a + r), and M microbatches per minibatch:

    compute_ms  = (F + B) / r
    optimizer_ms = O * M / r           pipedream: one update per microbatch (each is a
                                        minibatch of its own); a replica steps its full
                                        copy for each of its M / r microbatches
                 = O                   gpipe, 1f1b, 2bw: one update per minibatch; the
                                        replicas step at the same time
    allreduce   = 2 (r - 1) / r * P / bw(a .. a+r-1)           ring all-reduce, slowest level spanned
    sync_ms     = allreduce            gpipe, 1f1b, 2bw: replicas split a minibatch's
                                        microbatches and all-reduce once per minibatch
                = allreduce * M / r    pipedream: each microbatch is a minibatch of its own,
                                        replicas take them round-robin and all-reduce once
                                        per round of r
    comm_in_ms  = 2 * cut_in  / bw(a-1, a)     / r     activations in + gradients out
    comm_out_ms = 2 * cut_out / bw(a+r-1, a+r) / r     activations out + gradients in
    stage_ms    = max(compute_ms + optimizer_ms + sync_ms, comm_in_ms, comm_out_ms)

O is measured by `pd profile` (`pdcli.profiler.optim_cost`): each position's step on its
own parameters less the fixed cost of a step, plus that fixed cost once per stage; it does
not scale with the batch. Profiles without it (older ones, PipeDream graphs) give O = 0.

F and B are calibrated: multiplied by c = max(1, ratio), ratio = the profile's
`meta.calibration.ratio` (the whole model's fwd+bwd step timed as one piece / the sum of
its positions timed alone; `compute_calibration`). A ratio above 1 is what a long piece of
work loses on the host (other processes, caches) that the medians of short per-layer
timings hide; below 1 (per-call overhead the fused step saves) it is not applied, because
the runtime's per-action overhead, which this model does not count, more than eats that
saving. The ratio records the load while profiling, so it predicts well only when training
meets the same load. The pipedream cost model never applies it.

What the per-layer model leaves out (the runtime costs below count it): the runtime's
per-action overhead (a small stage's actions cost more than its module alone, and the
OptimizerStep action more than the optimizer's own step), several ranks sharing few CPU
cores, and data loading.

Transfers run off the compute thread, so a link only limits a stage when it is slower than
the compute. With S stages and max stage_ms = T:

    time per minibatch = T                      pipedream, 2bw (no flush: steady 1F1B)
                       = (M + S - 1) / M * T    gpipe, 1f1b (fill and drain every minibatch)
                       = k(S) * T               gpipe, 1f1b with a split backward

A split backward (`schedule.split_backward`, `pdcli.torchutil.wgrad`) leaves the weight
gradients W of the `nn.Linear` layers to WeightGrads actions that the schedule places where
a stage would wait for the fill or the drain; it changes no stage's work (W is part of B,
so compute_ms is as above), only the bubble. k(S) has no closed form: it is the factor of
a replay (`pdcli.schedule.simulator`) of the schedule on S equal stages, each microbatch
costing the whole chain's shares of forward, backward less W, and W (calibrated totals,
`profile.json`'s `wgrad_ms`), no communication: k(S) = simulated time per minibatch /
(M x (forward + backward)). Replays are cached per (schedule, M, S, shares rounded to
SHARE_DIGITS). With no W (no Linear layers, PipeDream graphs) k(S) = (M + S - 1) / M. The
`pipedream` cost model has no split: it ignores the option.

The bubble factor stretches the all-reduce too, which slightly over-estimates flush
schedules with replicated stages. Every function works on numpy arrays and on floats.

With the runtime's measured costs (`profile.json` `meta.runtime`, see
`pdcli.planner.runtime_costs`) the stage terms are what the runtime's actions cost instead
(`runtime_stage_terms`): per microbatch Forward = forward(F/M) (+ the loss on the last
stage), Backward = backward(B/M) (+ the loss's), per update update(O), data loading per
minibatch on the first and last stage, and the CPU time of packing and unpacking each
message (`messages_ms`); the links carry each message with the measured latency and
bandwidth of the transport on one host. The profile's calibration ratio is not applied then
(the probe measured the runtime itself). The time per minibatch of the plan is then the
replay of its action lists with these costs (`pdcli.planner.evaluate`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcli.planner.runtime_costs import Affine, RuntimeCosts
from pdcli.schedule import ScheduleSpec
from pdcli.schedule.simulator import StageCost, simulate
from pdcli.schedule.spec import FLUSH_SCHEDULES, rules, stand_in

MS_PER_S = 1000.0
SHARE_DIGITS = 6
"""Decimals the work shares of a split backward are rounded to: the replay cache's key, free
of the last bits of float sums (the factor moves by about 1e-6 at most)."""
REPLAYED_MINIBATCHES = 2
"""Minibatches a split-backward replay runs: the flush schedules repeat from the second
minibatch on (12-minibatch replays give the same period to 1e-13 for S <= 6, M <= 12)."""


@dataclass(frozen=True)
class StageTerms:
    fwd_ms: Any
    bwd_ms: Any
    compute_ms: Any
    sync_ms: Any
    optimizer_ms: Any
    comm_in_ms: Any
    comm_out_ms: Any
    stage_time_ms: Any
    messages_ms: Any = 0.0
    """CPU time packing and unpacking messages (runtime costs only)."""
    load_ms: Any = 0.0
    """Data loading (runtime costs only)."""


def ring_allreduce_ms(parameter_bytes: Any, replicas: Any, bandwidth_bytes_per_s: Any) -> Any:
    r = np.asarray(replicas, dtype=float)
    return 2.0 * (r - 1.0) / r * np.asarray(parameter_bytes, dtype=float) / bandwidth_bytes_per_s * MS_PER_S


def replica_allreduce_ms(parameter_bytes: Any, replicas: Any, bandwidth_bytes_per_s: Any, measured: Any = None) -> Any:
    """One all-reduce of a stage's gradients over its replicas (0 for one replica): the ring
    over the slowest level spanned; with `measured` (this host's all-reduce between two
    processes, ms in bytes: `RuntimeCosts.allreduce`) the slower of the ring and that line
    stretched to r replicas (r - 1 times its fixed cost, 2 (r - 1) / r times its bytes')."""
    r = np.asarray(replicas, dtype=float)
    ring = ring_allreduce_ms(parameter_bytes, r, bandwidth_bytes_per_s)
    if measured is not None:
        p = np.asarray(parameter_bytes, dtype=float)
        ring = np.maximum(ring, measured.fixed_ms * (r - 1.0) + measured.scale * p * (r - 1.0) / r * 2.0)
    return np.where(r > 1, ring, 0.0)


def transfer_ms(cut_bytes: Any, bandwidth_bytes_per_s: Any) -> Any:
    """Activations one way plus gradients back across one cut."""
    with np.errstate(invalid="ignore"):
        out = 2.0 * np.asarray(cut_bytes, dtype=float) / bandwidth_bytes_per_s * MS_PER_S
    return np.where(np.asarray(cut_bytes) == 0, 0.0, out)


def compute_calibration(ratio: float | None) -> float:
    """Factor on the profiled forward and backward times: max(1, ratio); 1 when unknown."""
    if ratio is None or not np.isfinite(ratio):
        return 1.0
    return max(1.0, float(ratio))


def updates_per_minibatch(schedule: str, num_microbatches: int, replicas: Any) -> Any:
    """Optimizer steps one replica takes per minibatch (also: all-reduces per minibatch)."""
    r = np.asarray(replicas, dtype=float)
    return num_microbatches / r if rules(schedule).step_per_microbatch else np.ones(np.shape(r))


def backward_work(fwd_ms: Any, bwd_ms: Any, recompute: bool) -> Any:
    """A stage's Backward in profiled ms: with `train.recompute` it runs the stage's forward
    again first (the runtime keeps only a held microbatch's inputs), priced on the backward's
    line as the run's Backward spans hold both."""
    return bwd_ms + fwd_ms if recompute else bwd_ms


def pd_stage_terms(fwd_ms: Any, bwd_ms: Any, parameter_bytes: Any, cut_in_bytes: Any,
                   cut_out_bytes: Any, replicas: Any, sync_bw: Any, in_bw: Any, out_bw: Any,
                   schedule: str, num_microbatches: int, optimizer_step_ms: Any = 0.0) -> StageTerms:
    """The terms above; `optimizer_step_ms` is O, one step of one replica."""
    r = np.asarray(replicas, dtype=float)
    compute = (np.asarray(fwd_ms) + np.asarray(bwd_ms)) / r
    updates = updates_per_minibatch(schedule, num_microbatches, r)
    allreduce = replica_allreduce_ms(parameter_bytes, r, sync_bw)
    sync = allreduce * updates
    optimizer = np.asarray(optimizer_step_ms, dtype=float) * updates
    comm_in = transfer_ms(cut_in_bytes, in_bw) / r
    comm_out = transfer_ms(cut_out_bytes, out_bw) / r
    stage = np.maximum(np.maximum(compute + optimizer + sync, comm_in), comm_out)
    return StageTerms(fwd_ms, bwd_ms, compute, sync, optimizer, comm_in, comm_out, stage)


@dataclass(frozen=True)
class SplitShares:
    """A chain's work per microbatch under a split backward, as shares of forward + backward."""

    fwd: float
    """Forward / (forward + backward)."""
    wgrad: float
    """Weight gradients (what WeightGrads runs) / (forward + backward); > 0."""
    merged: bool = False
    """The WeightGrads run merged per chunk (`schedule.merge_weight_grads`)."""


def split_shares(fwd_ms: float, bwd_ms: float, wgrad_ms: float, merged: bool = False) -> SplitShares | None:
    """The shares of a chain's totals rounded to SHARE_DIGITS; None when no W is left to defer
    (then the flush factor is the closed form)."""
    total_ms = fwd_ms + bwd_ms
    if not total_ms > 0:
        return None
    wgrad = round(min(max(wgrad_ms, 0.0), bwd_ms) / total_ms, SHARE_DIGITS)
    if wgrad <= 0:
        return None
    return SplitShares(round(fwd_ms / total_ms, SHARE_DIGITS), wgrad, merged)


@functools.lru_cache(maxsize=None)
def replayed_bubble_factor(schedule: str, num_microbatches: int, num_stages: int, fwd_share: float,
                           wgrad_share: float, merged: bool = False) -> float:
    """k(S) of a split backward: the schedule replayed on `num_stages` equal stages whose
    microbatch costs fwd_share + (1 - fwd_share) (of which wgrad_share is W); at least 1 (each
    stage runs all its work), which the search's pruning relies on."""
    wgrad_share = min(wgrad_share, 1.0 - fwd_share)  # rounding must not make B - W negative
    spec = ScheduleSpec.make(stand_in(schedule), num_stages, num_microbatches, REPLAYED_MINIBATCHES,
                             split_backward=True, merge_weight_grads=merged)
    cost = StageCost(fwd_ms=fwd_share, bwd_ms=1.0 - fwd_share, wgrad_ms=wgrad_share)
    replay = simulate(spec, [cost] * num_stages)
    return max(1.0, replay.time_per_minibatch_ms / num_microbatches)


def bubble_factor(schedule: str, num_microbatches: int, num_stages: Any, split: SplitShares | None = None) -> Any:
    """Time per minibatch / bottleneck stage time; `split`: the shares of a split backward
    (flush schedules only; None = unsplit, or nothing to defer)."""
    if schedule not in FLUSH_SCHEDULES:
        return np.ones(np.shape(num_stages))
    if split is None:
        return (num_microbatches + np.asarray(num_stages, dtype=float) - 1.0) / num_microbatches
    replay = np.vectorize(lambda s: replayed_bubble_factor(schedule, num_microbatches, int(s), split.fwd, split.wgrad,
                                                           split.merged),
                          otypes=[float])
    return replay(num_stages)


def bubble_factor_floor(schedule: str, num_microbatches: int, num_stages: int, split: SplitShares | None) -> float:
    """At most `bubble_factor` for this stage count, and nondecreasing in it (the search drops the
    stage counts whose floor times the smallest bottleneck already loses). Unsplit: the factor
    itself. Split: a minibatch's critical path on S equal stages over its work M (F + B), in
    shares: stage 0's M forwards, the last microbatch's forward down and its Backward less W back
    up the other S - 1 stages, then its Backward and W on stage 0; a flush starts the next
    minibatch after it, so k(S) >= (M f + (S - 1)(1 - w) + 1 - f) / M, and k(S) >= 1."""
    if split is None or schedule not in FLUSH_SCHEDULES:
        return float(bubble_factor(schedule, num_microbatches, num_stages))
    m, f, w = float(num_microbatches), split.fwd, min(split.wgrad, 1.0 - split.fwd)
    return max(1.0, (m * f + (num_stages - 1) * (1.0 - w) + 1.0 - f) / m)


@dataclass(frozen=True)
class ActionCosts:
    """What one replica of a stage spends per action under the runtime's measured costs:
    per microbatch (Forward, Backward, WeightGrads, each message), per update, per minibatch
    (loading). Arrays or floats."""

    forward_ms: Any
    backward_ms: Any
    """The whole backward (a split one: Backward + WeightGrads)."""
    wgrad_ms: Any
    update_ms: Any
    send_acts_ms: Any
    recv_grads_ms: Any
    recv_acts_ms: Any
    send_grads_ms: Any
    load_ms: Any
    link_in_ms: Any
    """One message in flight over the link from the previous stage."""
    link_out_ms: Any
    wire_out_ms: Any = 0.0
    """Of link_out_ms, what a message holds the link for (`RuntimeCosts.link_wire_ms`; 0: the
    link carries messages side by side)."""
    latency_ms: Any = 0.0
    """Of each link_*_ms, the measured latency: time in flight that does not hold the link
    (messages overlap in it), unlike the bytes' time on the wire."""
    gap_ms: Any = 0.0
    """The interpreter's time per action."""
    actions_per_microbatch: Any = 0.0
    """Actions the stage's list holds per microbatch (for the interpreter's time)."""
    actions_per_update: Any = 0.0
    allreduce: Any = None
    """This host's measured all-reduce (`RuntimeCosts.allreduce`), None: not measured."""


def _per_message(affine: Any, message_bytes: Any) -> Any:
    b = np.asarray(message_bytes, dtype=float)
    return np.where(b > 0, affine(b), 0.0)


def runtime_action_costs(runtime: RuntimeCosts, schedule: str, num_microbatches: int, fwd_ms: Any, bwd_ms: Any,
                         wgrad_ms: Any, optimizer_step_ms: Any, cut_in_bytes: Any, cut_out_bytes: Any,
                         first: Any, last: Any, in_bw: Any, out_bw: Any, position_factor: Any = 1.0) -> ActionCosts:
    """Per-action costs of a stage whose positions' profiled totals per minibatch are
    fwd_ms, bwd_ms, wgrad_ms (and one optimizer step optimizer_step_ms); cut bytes per
    minibatch; `first`/`last`: the stage holds the model's inputs / the loss;
    `position_factor`: the stage's (`SplitSpace.position_factor`), on its compute actions'
    fixed costs as the profiled times carry it already."""
    m = float(num_microbatches)
    mode = runtime.mode(schedule)
    factor = np.asarray(position_factor, dtype=float)

    def compute(line: Affine, profiled_ms: Any) -> Any:
        return line.scale * (np.asarray(profiled_ms) / m) + line.fixed_ms * factor
    first_f, last_f = np.asarray(first, dtype=float), np.asarray(last, dtype=float)
    in_bytes, out_bytes = np.asarray(cut_in_bytes, dtype=float) / m, np.asarray(cut_out_bytes, dtype=float) / m

    def link(b: Any, bw: Any) -> Any:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(b > 0, runtime.link_ms(b, bw), 0.0)

    has_in, has_out = (in_bytes > 0).astype(float), (out_bytes > 0).astype(float)
    split = (np.asarray(wgrad_ms) > 0) & (schedule in FLUSH_SCHEDULES)
    return ActionCosts(
        gap_ms=runtime.gap_ms,
        # Forward, Backward, LoadMicrobatch on the first and last stage, Recv+Send each way, WeightGrads
        actions_per_microbatch=2.0 + np.maximum(first_f, last_f) + 2.0 * (has_in + has_out) + split,
        # OptimizerStep, and StashWeights + FreeWeights where forwards run on stashed versions
        actions_per_update=3.0 if schedule not in FLUSH_SCHEDULES else 1.0,
        forward_ms=compute(mode.forward, fwd_ms) + last_f * runtime.loss_fwd_ms,
        backward_ms=compute(mode.backward, bwd_ms) + last_f * runtime.loss_bwd_ms,
        wgrad_ms=np.where(np.asarray(wgrad_ms) > 0, compute(mode.wgrad, wgrad_ms), 0.0),
        update_ms=mode.update(np.asarray(optimizer_step_ms, dtype=float)),
        send_acts_ms=_per_message(runtime.send, out_bytes), recv_grads_ms=_per_message(runtime.recv, out_bytes),
        recv_acts_ms=_per_message(runtime.recv, in_bytes), send_grads_ms=_per_message(runtime.send, in_bytes),
        load_ms=first_f * runtime.load_inputs_ms + np.maximum(last_f - first_f, 0.0) * runtime.load_target_ms,
        link_in_ms=link(in_bytes, in_bw), link_out_ms=link(out_bytes, out_bw),
        wire_out_ms=np.where(out_bytes > 0, runtime.link_wire_ms(out_bytes, out_bw), 0.0),
        latency_ms=runtime.latency_ms if runtime.latency_ms is not None and runtime.bandwidth_bytes_per_s else 0.0,
        allreduce=runtime.allreduce,
    )


def runtime_stage_terms(actions: ActionCosts, parameter_bytes: Any, replicas: Any, sync_bw: Any, schedule: str,
                        num_microbatches: int) -> StageTerms:
    """A stage's time per minibatch (one replica) from its per-action costs: the busy time of
    its actions, or a link that carries its messages' bytes slower (their latency overlaps:
    the replay of the action lists prices it). A link is full duplex: activations go one way
    while gradients come back the other, each way carrying one message per microbatch."""
    r = np.asarray(replicas, dtype=float)
    per_replica = num_microbatches / r
    a = actions
    updates = updates_per_minibatch(schedule, num_microbatches, r)
    allreduce = replica_allreduce_ms(parameter_bytes, r, sync_bw, a.allreduce)
    sync = allreduce * updates
    fwd, bwd = a.forward_ms * num_microbatches, a.backward_ms * num_microbatches
    compute = (fwd + bwd) / r + a.load_ms
    optimizer = a.update_ms * updates
    messages = per_replica * (a.send_acts_ms + a.recv_grads_ms + a.recv_acts_ms + a.send_grads_ms)
    messages = messages + a.gap_ms * (per_replica * a.actions_per_microbatch + updates * a.actions_per_update)
    comm_in = per_replica * np.maximum(a.link_in_ms - a.latency_ms, 0.0)  # the wire's time, back to back
    comm_out = per_replica * np.maximum(a.link_out_ms - a.latency_ms, 0.0)
    stage = np.maximum(np.maximum(compute + optimizer + sync + messages, comm_in), comm_out)
    return StageTerms(fwd, bwd, compute, sync, optimizer, comm_in, comm_out, stage, messages, a.load_ms)

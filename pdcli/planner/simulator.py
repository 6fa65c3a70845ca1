"""Predict a pipeline's timeline by replaying its action lists with per-stage costs.

Pure (no torch): the same lists the runtime executes (`pdcli.runtime.schedule`) are
run by the checker's lockstep engine, and each completed event is given a start and
an end. With eager sends (the default) a send does not hold its process: the data
arrives `comm_ms` after the send starts, and the receive waits for it. With rendezvous
sends both sides are busy for `comm_ms` from when both are ready. An all-reduce starts
when every replica reaches it. Eager sends replay the lists built for a transport whose
sends never wait (`sends_first`, what the CPU runtime runs). With `split_backward` a
Backward costs `bwd_ms - wgrad_ms` and its WeightGrads `wgrad_ms`.

Beside the time in flight (`comm_ms`), a message costs its two processes CPU time: the
sender packs it (`send_*_ms`, the Send action) and the receiver unpacks it once it has
arrived (`recv_*_ms`, the end of the Recv action). LoadMicrobatch costs `load_ms`; weight
stashing is part of `optimizer_ms`. With `cores`, ranks that share fewer cores than they
are cannot together be busy for more than `cores` ms per ms: the steady time per
minibatch is at least their busy time per minibatch / cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pdcli.runtime.checker import SendMode, Slot, lockstep
from pdcli.runtime.schedule import (
    Action, AllReduceGrads, Backward, Forward, LoadMicrobatch, OptimizerStep, RecvActivations, RecvGrads,
    ScheduleSpec, SendActivations, SendGrads, WeightGrads, build_all,
)


@dataclass(frozen=True)
class StageCost:
    """What one replica of a stage spends per action."""

    fwd_ms: float
    """Forward of one microbatch."""
    bwd_ms: float
    """Backward of one microbatch."""
    comm_ms: float = 0.0
    """One transfer between this stage and the next (activations forward or gradients back)."""
    optimizer_ms: float = 0.0
    """One optimizer step."""
    allreduce_ms: float = 0.0
    """One all-reduce of the stage's gradients over its replicas."""
    wgrad_ms: float = 0.0
    """The part of `bwd_ms` a split backward defers to WeightGrads (Linear weight gradients)."""
    send_acts_ms: float = 0.0
    """CPU time of SendActivations (packing the message to the next stage)."""
    recv_grads_ms: float = 0.0
    """CPU time of RecvGrads once the message is there (unpacking)."""
    recv_acts_ms: float = 0.0
    """CPU time of RecvActivations once the message is there."""
    send_grads_ms: float = 0.0
    """CPU time of SendGrads."""
    load_ms: float = 0.0
    """One LoadMicrobatch."""
    gap_ms: float = 0.0
    """The interpreter's time before each action (outside every action)."""


@dataclass(frozen=True)
class TimedAction:
    """An action and when it ran (ms from the start of the run)."""

    action: Action
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class Simulation:
    """A predicted run."""

    timeline: tuple[tuple[TimedAction, ...], ...]
    """Per rank (`ScheduleSpec.rank_of`), its actions in order with their times."""
    makespan_ms: float
    """End of the last action."""
    time_per_minibatch_ms: float
    """Steady state: time between the completions of consecutive minibatches (of
    num_microbatches microbatches each, whatever the schedule), measured over the
    second half of the run; the makespan when the run has one minibatch."""
    bubble_fraction: float
    """Share of the ranks' time not spent in forward or backward (or WeightGrads)."""


def _cpu_ms(stage_id: int, action: Action, costs: Sequence[StageCost]) -> float:
    """What a message action costs its own process (packing or unpacking)."""
    cost = costs[stage_id]
    if isinstance(action, SendActivations):
        return cost.send_acts_ms
    if isinstance(action, RecvGrads):
        return cost.recv_grads_ms
    if isinstance(action, RecvActivations):
        return cost.recv_acts_ms
    if isinstance(action, SendGrads):
        return cost.send_grads_ms
    return 0.0


def _duration_ms(spec: ScheduleSpec, stage_id: int, action: Action,
                 costs: Sequence[StageCost]) -> float:
    cost = costs[stage_id]
    if isinstance(action, LoadMicrobatch):
        return cost.load_ms
    if isinstance(action, Forward):
        return cost.fwd_ms
    if isinstance(action, Backward):
        return cost.bwd_ms - cost.wgrad_ms if spec.split_backward else cost.bwd_ms
    if isinstance(action, WeightGrads):
        return cost.wgrad_ms
    if isinstance(action, OptimizerStep):
        return cost.optimizer_ms
    if isinstance(action, AllReduceGrads):
        return cost.allreduce_ms
    if isinstance(action, (SendActivations, RecvGrads)):  # the link to the next stage
        return cost.comm_ms
    if isinstance(action, (RecvActivations, SendGrads)):  # the link to the previous stage
        return costs[stage_id - 1].comm_ms
    return 0.0


def simulate(spec: ScheduleSpec, costs: Sequence[StageCost],
             send_mode: SendMode = SendMode.EAGER,
             lists_by_rank: Sequence[Sequence[Action]] | None = None,
             cores: int | None = None) -> Simulation:
    """Time the action lists of `spec` (built here unless given) with `costs[stage_id]`;
    `cores`: the CPU cores the ranks share (None: each rank has its own device)."""
    if len(costs) != spec.num_stages:
        raise ValueError(f"{len(costs)} stage costs for {spec.num_stages} stages")
    lists = lists_by_rank if lists_by_rank is not None else build_all(spec, eager_sends=send_mode is SendMode.EAGER)
    stages = [spec.stage_replica_of(rank)[0] for rank in range(spec.num_ranks)]
    clock_ms = [0.0] * spec.num_ranks
    arrival_ms: dict[Slot, float] = {}
    timed: list[list[TimedAction]] = [[] for _ in range(spec.num_ranks)]
    for event in lockstep(lists, spec, send_mode):
        ranks = [rank for rank, _ in event.members]
        actions = [lists[rank][index] for rank, index in event.members]
        duration = max(_duration_ms(spec, stages[r], a, costs) for r, a in zip(ranks, actions))
        cpu_ms = max(_cpu_ms(stages[r], a, costs) for r, a in zip(ranks, actions))
        start = max(clock_ms[r] + costs[stages[r]].gap_ms for r in ranks)
        end = start + cpu_ms + duration
        if send_mode is SendMode.EAGER and isinstance(actions[0], (SendActivations, SendGrads)):
            arrival_ms[event.members[0]] = end  # the sender goes on once it has packed
            end = end_of_rank = start + cpu_ms
        elif event.waited_for:  # an eager receive: unpacked once the data has arrived
            end = max(start, arrival_ms.pop(event.waited_for[0])) + cpu_ms
            end_of_rank = end
        else:
            end_of_rank = end
        for r, a in zip(ranks, actions):
            timed[r].append(TimedAction(a, start, end))
            clock_ms[r] = end_of_rank
    return _summarize(spec, timed, costs, cores)


def _busy_ms(stage_id: int, t: TimedAction, costs: Sequence[StageCost]) -> float:
    """The CPU time an action took of its process in the replay, the interpreter's gap before
    it included (a receive: its unpacking only, not the wait)."""
    busy = _cpu_ms(stage_id, t.action, costs) if isinstance(t.action, (RecvActivations, RecvGrads)) else t.end_ms - t.start_ms
    return busy + costs[stage_id].gap_ms


def _summarize(spec: ScheduleSpec, timed: list[list[TimedAction]], costs: Sequence[StageCost],
               cores: int | None) -> Simulation:
    makespan_ms = max((t.end_ms for rank in timed for t in rank), default=0.0)
    done_ms = [0.0] * spec.num_steps  # when the last backward (or W) of each minibatch ends
    busy_ms = 0.0
    for rank in timed:
        for t in rank:
            if isinstance(t.action, (Forward, Backward, WeightGrads)):
                busy_ms += t.end_ms - t.start_ms
            if isinstance(t.action, (Backward, WeightGrads)):
                minibatch = t.action.microbatch_id // spec.num_microbatches
                done_ms[minibatch] = max(done_ms[minibatch], t.end_ms)
    if spec.num_steps == 1:
        per_minibatch_ms = makespan_ms
    else:
        first = (spec.num_steps - 1) // 2
        per_minibatch_ms = (done_ms[-1] - done_ms[first]) / (spec.num_steps - 1 - first)
    if cores is not None and spec.num_ranks > cores:
        stages = [spec.stage_replica_of(r)[0] for r in range(spec.num_ranks)]
        cpu_ms = sum(_busy_ms(stages[r], t, costs) for r, rank in enumerate(timed) for t in rank)
        per_minibatch_ms = max(per_minibatch_ms, cpu_ms / spec.num_steps / cores)
    bubble = 1.0 - busy_ms / (spec.num_ranks * makespan_ms) if makespan_ms > 0 else 0.0
    return Simulation(tuple(tuple(rank) for rank in timed), makespan_ms, per_minibatch_ms, bubble)

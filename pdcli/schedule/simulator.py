"""Predict a pipeline's timeline by replaying its action lists with per-stage costs.

Pure (no torch): the same lists the runtime executes (`pdcli.schedule`) are
run by the checker's lockstep engine, and each completed event is given a start and
an end. With eager sends (the default) a send does not hold its process: the data
arrives `comm_ms` after the send starts, and the receive waits for it. With rendezvous
sends both sides are busy for `comm_ms` from when both are ready. An all-reduce starts
when every replica reaches it. Eager sends replay the lists built for a transport whose
sends never wait (`sends_first`, what the CPU runtime runs). With `split_backward` a
Backward costs `bwd_ms - wgrad_ms` and its WeightGrads `wgrad_ms`.

Beside the time in flight (`comm_ms`), a message costs its two processes CPU time: the
sender packs it (`send_*_ms`, the Send action) and the receiver unpacks it once it has
arrived (`recv_*_ms`, the end of the Recv action). A process's first LoadMicrobatch of a
minibatch costs `load_ms` x M (it makes the whole minibatch, as the runtime does), the others
nothing; weight stashing is part of `optimizer_ms`.
Of a message's time in flight, `wire_ms` holds its link (the bytes on the wire; the rest is
latency): a process's messages in one direction leave one after another, each starting once
the one before it is off the wire (what a link slower than the compute does). 0: the link
carries any number at once.
With `cores` fewer than the ranks (workers sharing a CPU host), the costs are CPU time and
the replay schedules the ranks on the cores as the kernel does (`_shared`): a rank with CPU
work to do (an action, packing or unpacking a message, the interpreter's gap) runs on a free
core or queues for one, and gives its core up when it waits for a message or its time slice
ends while others queue. Time spent queued lands in the action the rank is in, as it does
in a traced run: a preempted action's span stretches, a receive's span covers the wait for
a core after its message arrived.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from dataclasses import dataclass
from typing import Iterable, Sequence

from pdcli.schedule.actions import (
    Action, AllReduceGrads, Backward, Forward, LoadMicrobatch, OptimizerStep, RecvActivations, RecvGrads,
    SendActivations, SendGrads, WeightGrads,
)
from pdcli.schedule.checker import SendMode, Slot, lockstep
from pdcli.schedule.lower import build_all
from pdcli.schedule.spec import ScheduleSpec


TIME_SLICE_MS = 3.0
"""How long a rank computes before a rank waiting for a core takes it (the kernel scheduler's
slice, a few ms; EEVDF's base slice is 0.75 ms x (1 + log2 cores))."""


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
    wire_ms: float = 0.0
    """Of `comm_ms`, the part a transfer holds its link (its bytes at the link's bandwidth):
    the next transfer the same way over it waits for it."""
    send_acts_ms: float = 0.0
    """CPU time of SendActivations (packing the message to the next stage)."""
    recv_grads_ms: float = 0.0
    """CPU time of RecvGrads once the message is there (unpacking)."""
    recv_acts_ms: float = 0.0
    """CPU time of RecvActivations once the message is there."""
    send_grads_ms: float = 0.0
    """CPU time of SendGrads."""
    load_ms: float = 0.0
    """A minibatch's data over its M microbatches: the first LoadMicrobatch of a minibatch on a
    process costs M x this, the others nothing."""
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
    completions of `steady_window`; the makespan when the run has one minibatch."""
    bubble_fraction: float
    """Share of the ranks' time not spent in forward or backward (or WeightGrads)."""
    done_ms: tuple[float, ...] = ()
    """When each minibatch completed: the end of its last Backward (or WeightGrads)."""


def _chunk(stage_id: int, action: Action) -> int:
    """The chunk whose costs `action` pays: the one it names, else the stage's."""
    chunk = getattr(action, "chunk", None)
    return stage_id if chunk is None else int(chunk)


def _local(spec: ScheduleSpec, stage_id: int, action: Action) -> bool:
    """A message between two chunks of one device: handed over in the process, nothing in flight."""
    chunk = getattr(action, "chunk", None)
    if chunk is None:
        return False
    peer = chunk + 1 if isinstance(action, (SendActivations, RecvGrads)) else chunk - 1
    return spec.stage_of_chunk(peer) == stage_id


def _cpu_ms(stage_id: int, action: Action, costs: Sequence[StageCost]) -> float:
    """What a message action costs its own process (packing or unpacking)."""
    cost = costs[_chunk(stage_id, action)]
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
    chunk = _chunk(stage_id, action)
    cost = costs[chunk]
    if isinstance(action, LoadMicrobatch):  # a process makes a whole minibatch at its first load of it
        replicas = 1 if spec.chunked else spec.replicas[stage_id]
        m = spec.num_microbatches
        return cost.load_ms * m if action.microbatch_id % m < replicas else 0.0
    if isinstance(action, Forward):
        return cost.fwd_ms
    if isinstance(action, Backward):
        return cost.bwd_ms - cost.wgrad_ms if spec.split_backward else cost.bwd_ms
    if isinstance(action, WeightGrads):
        return cost.wgrad_ms
    if isinstance(action, OptimizerStep):  # one step for every chunk of the device
        return sum(costs[c].optimizer_ms for c in spec.chunks_of(stage_id))
    if isinstance(action, AllReduceGrads):
        return cost.allreduce_ms
    if isinstance(action, (SendActivations, SendGrads, RecvActivations, RecvGrads)) and _local(spec, stage_id, action):
        return 0.0
    if isinstance(action, (SendActivations, RecvGrads)):  # the link to the next stage (chunk)
        return cost.comm_ms
    if isinstance(action, (RecvActivations, SendGrads)):  # the link to the previous stage (chunk)
        return costs[chunk - 1].comm_ms
    return 0.0


def _wire_ms(spec: ScheduleSpec, stage_id: int, action: Action, costs: Sequence[StageCost]) -> float:
    """The part of a send's time in flight that holds its link (`StageCost.wire_ms`)."""
    if _local(spec, stage_id, action):
        return 0.0
    chunk = _chunk(stage_id, action)
    return costs[chunk].wire_ms if isinstance(action, SendActivations) else costs[chunk - 1].wire_ms


class _Links:
    """When each process's link in each direction is free again: a send's bytes go on the
    wire once it has packed them and the sends before it are off."""

    def __init__(self) -> None:
        self.free_ms: dict[tuple[int, bool], float] = {}

    def arrival_ms(self, spec: ScheduleSpec, rank: int, stage_id: int, action: Action, costs: Sequence[StageCost],
                   packed_ms: float) -> float:
        """When the message of `action` (a send by `rank`, packed at `packed_ms`) arrives."""
        key = (rank, isinstance(action, SendActivations))
        start = max(packed_ms, self.free_ms.get(key, 0.0))
        self.free_ms[key] = start + _wire_ms(spec, stage_id, action, costs)
        return start + _duration_ms(spec, stage_id, action, costs)


def simulate(spec: ScheduleSpec, costs: Sequence[StageCost],
             send_mode: SendMode = SendMode.EAGER,
             lists_by_rank: Sequence[Sequence[Action]] | None = None,
             cores: int | None = None, time_slice_ms: float = TIME_SLICE_MS) -> Simulation:
    """Time the action lists of `spec` (built here unless given) with `costs[stage_id]`
    (with virtual stages `costs[chunk]`: a chunked action pays its chunk's costs, a message
    between two chunks of one device nothing in flight); `cores`: the CPU cores the ranks share
    (None: each rank has its own device)."""
    if len(costs) != spec.num_chunks:
        raise ValueError(f"{len(costs)} stage costs for {spec.num_chunks} stages (chunks)")
    lists = lists_by_rank if lists_by_rank is not None else build_all(spec, eager_sends=send_mode is SendMode.EAGER)
    stages = [spec.stage_replica_of(rank)[0] for rank in range(spec.num_ranks)]
    if cores is not None and shares_cores(spec.num_ranks, cores):
        if send_mode is not SendMode.EAGER:
            raise ValueError("a replay on shared cores needs eager sends (the CPU runtime's)")
        return _summarize(spec, _shared(spec, lists, stages, costs, cores, time_slice_ms))
    clock_ms = [0.0] * spec.num_ranks
    arrival_ms: dict[Slot, float] = {}
    timed: list[list[TimedAction]] = [[] for _ in range(spec.num_ranks)]
    links = _Links()
    for event in lockstep(lists, spec, send_mode):
        ranks = [rank for rank, _ in event.members]
        actions = [lists[rank][index] for rank, index in event.members]
        duration = max(_duration_ms(spec, stages[r], a, costs) for r, a in zip(ranks, actions))
        cpu_ms = max(_cpu_ms(stages[r], a, costs) for r, a in zip(ranks, actions))
        start = max(clock_ms[r] + costs[stages[r]].gap_ms for r in ranks)
        end = start + cpu_ms + duration
        if send_mode is SendMode.EAGER and isinstance(actions[0], (SendActivations, SendGrads)):
            end = end_of_rank = start + cpu_ms  # the sender goes on once it has packed
            arrival_ms[event.members[0]] = links.arrival_ms(spec, ranks[0], stages[ranks[0]], actions[0], costs, end)
        elif event.waited_for:  # an eager receive: unpacked once the data has arrived
            end = max(start, arrival_ms.pop(event.waited_for[0])) + cpu_ms
            end_of_rank = end
        else:
            end_of_rank = end
        for r, a in zip(ranks, actions):
            timed[r].append(TimedAction(a, start, end))
            clock_ms[r] = end_of_rank
    return _summarize(spec, timed)


def _summarize(spec: ScheduleSpec, timed: list[list[TimedAction]]) -> Simulation:
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
        first_stage = range(spec.replicas[0])  # ranks are stage-major; chunk 0 is on stage 0
        drain_ms = drain_start_ms([t.start_ms for t in timed[r] if isinstance(t.action, Forward)] for r in first_stage)
        first, last = steady_window(done_ms, drain_ms)
        per_minibatch_ms = (done_ms[last] - done_ms[first]) / (last - first)
    bubble = 1.0 - busy_ms / (spec.num_ranks * makespan_ms) if makespan_ms > 0 else 0.0
    return Simulation(tuple(tuple(rank) for rank in timed), makespan_ms, per_minibatch_ms, bubble, tuple(done_ms))


_EPS_MS = 1e-9
MIN_STEADY_COMPLETIONS = 3
"""`steady_window` cuts the drain off only where this many completions come before it."""


def drain_start_ms(forward_starts: Iterable[Sequence[float]]) -> float | None:
    """When the pipeline starts to drain: the earliest, over the first stage's replicas (each
    one's forwards' start times), of a replica's last forward; None: no forward."""
    return min((max(starts) for starts in forward_starts if starts), default=None)


def shares_cores(workers: int, cores: int | None) -> bool:
    """`workers` outnumber the `cores` they run on (None: each worker has a device of its own):
    the replay then queues them for a core."""
    return cores is not None and workers > cores


def steady_window(done_ms: Sequence[float], drain_ms: float | None = None) -> tuple[int, int]:
    """(first, last): the completions (indices into the increasing `done_ms`) between which a
    run's time per minibatch is its steady state, the second half of those completed by
    `drain_ms`, when the first stage starts its last forward. From then on the pipeline
    drains: the stages run out of work one by one, and the first stage completes the
    minibatches still in flight faster than the pipeline sustains (it no longer interleaves
    forwards, and on shared cores it gets the cores the finished stages give up), so a run
    of few minibatches would look faster than a long one. All completions count where
    fewer than MIN_STEADY_COMPLETIONS come before `drain_ms`, or it is None. One rule for
    the replay (`simulate`) and the traced run (`pdcli.report.measured`)."""
    last = len(done_ms) - 1
    if drain_ms is not None:
        before = bisect_right(done_ms, drain_ms + _EPS_MS)
        if before >= MIN_STEADY_COMPLETIONS:
            last = before - 1
    return last // 2, last


@dataclass
class _Rank:
    """One rank's place in a shared-core replay."""

    index: int = 0
    """Its current action."""
    phase: str = "gap"
    """"gap" (the interpreter's time before the action), "work" (its CPU time), "wait" (for a
    message in flight or the all-reduce's peers), "held" (its part of an all-reduce done, the
    peers' not), "done"."""
    left_ms: float = 0.0
    """CPU work left in the phase."""
    start_ms: float = 0.0
    """When the current action started (after its gap)."""
    slice_ms: float = 0.0
    """Left of its time slice while it holds a core."""

    @property
    def runnable(self) -> bool:
        return self.phase in ("gap", "work")


def _shared(spec: ScheduleSpec, lists: Sequence[Sequence[Action]], stages: Sequence[int],
            costs: Sequence[StageCost], cores: int, time_slice_ms: float = TIME_SLICE_MS) -> list[list[TimedAction]]:
    """Eager replay of `lists` on `cores` cores shared by every rank, scheduled as the kernel
    does: a rank with CPU work runs on a free core or queues for one (first come, first
    served); it keeps its core until it waits for a message or, with others queued, until its
    time slice ends. Time queued is part of whatever action the rank is in: the action it was
    preempted in, or the receive it woke up from, as a traced span shows it."""
    return _SharedReplay(spec, lists, stages, costs, cores, time_slice_ms).run()


class _SharedReplay:
    """The state of one `_shared` replay: the ranks' places, the messages in flight, the cores."""

    def __init__(self, spec: ScheduleSpec, lists: Sequence[Sequence[Action]], stages: Sequence[int],
                 costs: Sequence[StageCost], cores: int, time_slice_ms: float) -> None:
        self.spec, self.lists, self.stages, self.costs = spec, lists, stages, costs
        self.cores, self.time_slice_ms = cores, time_slice_ms
        self.sender_of: dict[Slot, Slot] = {}  # receive -> its send
        self.groups: dict[Slot, tuple[Slot, ...]] = {}  # all-reduce -> every member
        for event in lockstep(lists, spec, SendMode.EAGER):  # also proves the lists deadlock-free
            if event.waited_for:
                self.sender_of[event.members[0]] = event.waited_for[0]
            if len(event.members) > 1:
                for member in event.members:
                    self.groups[member] = event.members
        self.arrival_ms: dict[Slot, float] = {}  # send -> when its message is at the receiver
        self.arrivals: list[float] = []  # heap of the arrival times still ahead
        self.ready: set[Slot] = set()  # all-reduce members that reached it
        self.finished: set[Slot] = set()  # all-reduce members whose part is done
        self.ranks = [_Rank(left_ms=costs[stages[r]].gap_ms) if lists[r] else _Rank(phase="done")
                      for r in range(spec.num_ranks)]
        self.timed: list[list[TimedAction]] = [[] for _ in range(spec.num_ranks)]
        self.running: list[int] = []  # ranks on a core
        self.queue: list[int] = []  # ranks waiting for one, first come first
        self.now = 0.0
        self.links = _Links()

    def work_ms(self, r: int, action: Action) -> float:
        if isinstance(action, (SendActivations, SendGrads, RecvActivations, RecvGrads)):
            return _cpu_ms(self.stages[r], action, self.costs)
        return _duration_ms(self.spec, self.stages[r], action, self.costs)

    def next_action(self, r: int) -> None:
        state = self.ranks[r]
        state.index += 1
        if state.index >= len(self.lists[r]):
            state.phase, state.left_ms = "done", 0.0
        else:
            state.phase, state.left_ms = "gap", self.costs[self.stages[r]].gap_ms

    def settle(self, r: int) -> bool:
        """Take rank r past every phase that ends now; whether it moved."""
        state, moved, now = self.ranks[r], False, self.now
        while state.phase != "done":
            slot = (r, state.index)
            action = self.lists[r][state.index]
            if state.phase == "gap" and state.left_ms <= _EPS_MS:
                state.start_ms = now
                if slot in self.groups:
                    self.ready.add(slot)
                state.phase = "wait" if slot in self.sender_of or slot in self.groups else "work"
                state.left_ms = 0.0 if state.phase == "wait" else self.work_ms(r, action)
            elif state.phase == "wait":
                if slot in self.sender_of:
                    arrived = self.arrival_ms.get(self.sender_of[slot])
                    if arrived is None or arrived > now + _EPS_MS:
                        return moved
                elif not all(member in self.ready for member in self.groups[slot]):
                    return moved
                state.phase, state.left_ms = "work", self.work_ms(r, action)
            elif state.phase == "work" and state.left_ms <= _EPS_MS:
                if slot in self.groups:  # an all-reduce ends when every member's part is done
                    self.finished.add(slot)
                    if not all(member in self.finished for member in self.groups[slot]):
                        state.phase = "held"
                        return True
                    for member_rank, _ in self.groups[slot]:
                        self.timed[member_rank].append(TimedAction(action, self.ranks[member_rank].start_ms, now))
                        self.next_action(member_rank)
                else:
                    if isinstance(action, (SendActivations, SendGrads)):
                        self.arrival_ms[slot] = self.links.arrival_ms(self.spec, r, self.stages[r], action,
                                                                      self.costs, now)
                        heapq.heappush(self.arrivals, self.arrival_ms[slot])
                    self.timed[r].append(TimedAction(action, state.start_ms, now))
                    self.next_action(r)
            else:
                return moved
            moved = True
        return moved

    def schedule(self) -> None:
        """Free the cores of ranks that wait or ended, preempt those whose slice ended while
        others queue, queue the runnable ones, and give free cores to the queue's first."""
        for r in list(self.running):
            state = self.ranks[r]
            if not state.runnable:  # waits for a message, or finished: the core is free
                self.running.remove(r)
            elif state.slice_ms <= _EPS_MS:
                if self.queue:  # preempted: to the back of the queue
                    self.running.remove(r)
                    self.queue.append(r)
                else:
                    state.slice_ms = self.time_slice_ms
        for r in range(self.spec.num_ranks):
            if self.ranks[r].runnable and r not in self.running and r not in self.queue:
                self.queue.append(r)
        while self.queue and len(self.running) < self.cores:
            r = self.queue.pop(0)
            self.ranks[r].slice_ms = self.time_slice_ms
            self.running.append(r)

    def advance(self) -> None:
        """Run the ranks on cores to the next event: a phase or a slice ending, a message arriving.
        Nothing changes between events, so with no rank queued no slice can end in a
        preemption: the step runs to the next event and each slice renews as it would have."""
        queued = bool(self.queue)
        step = min((min(self.ranks[r].left_ms, self.ranks[r].slice_ms) if queued else self.ranks[r].left_ms
                    for r in self.running), default=float("inf"))
        while self.arrivals and self.arrivals[0] <= self.now + _EPS_MS:
            heapq.heappop(self.arrivals)
        if self.arrivals:
            step = min(step, self.arrivals[0] - self.now)
        if step == float("inf"):  # lockstep proved the lists deadlock-free
            raise RuntimeError("the shared-core replay stalled")
        slice_ms = self.time_slice_ms
        for r in self.running:
            state = self.ranks[r]
            state.left_ms = max(state.left_ms - step, 0.0)
            if queued:
                state.slice_ms = max(state.slice_ms - step, 0.0)
            else:
                state.slice_ms = slice_ms - (slice_ms - state.slice_ms + step) % slice_ms
        self.now += step

    def run(self) -> list[list[TimedAction]]:
        while True:
            moved = True
            while moved:  # every rank settles, again while any moved
                moved = False
                for r in range(self.spec.num_ranks):
                    moved = self.settle(r) or moved
            if all(state.phase == "done" for state in self.ranks):
                return self.timed
            self.schedule()
            self.advance()

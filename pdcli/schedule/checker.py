"""Prove a set of action lists runs: every send meets its receive, no deadlock, and the
weight versions, optimizer steps and stash depths are the ones the schedule declares.

`lockstep` runs all processes together, without time: a process advances while its next
action can complete. With `SendMode.RENDEZVOUS` (the strict default) a send completes
only together with its receive, as a blocking send; with `SendMode.EAGER` a send
completes at once and its receive completes once the send is posted. An all-reduce
completes when every replica of the stage reaches it. The simulator
(`pdcli.schedule.simulator`) times the same events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, Iterator, Sequence

from pdcli.schedule.actions import (
    Action, ACTION_TYPES, AllReduceGrads, Backward, EndEval, EvalForward, Forward, FreeWeights, LoadMicrobatch,
    Message, OptimizerStep, RecvActivations, RecvGrads, SendActivations, SendGrads, StashWeights, WeightGrads,
)
from pdcli.schedule.spec import PIPEDREAM, replica_for, ScheduleSpec, StashDepth

Slot = tuple[int, int]  # (rank, index of the action in that rank's list)
SENDS = (SendActivations, SendGrads)
RECVS = (RecvActivations, RecvGrads)


class ScheduleError(AssertionError):
    """The action lists are wrong (a bug in a schedule); the message lists every problem."""


class Deadlock(ScheduleError):
    """No process can advance: `stuck` holds the (rank, index) of each unfinished process's next action."""

    def __init__(self, message: str, stuck: tuple[Slot, ...], send_mode: SendMode) -> None:
        super().__init__(message)
        self.stuck = stuck
        self.send_mode = send_mode


class SendMode(Enum):
    """How a send completes."""

    RENDEZVOUS = "rendezvous"
    """Together with its matching receive (a blocking send)."""
    EAGER = "eager"
    """At once; the receive waits for it (a buffered / posted send)."""


@dataclass(frozen=True)
class Event:
    """Actions that complete together, and earlier actions on other ranks they waited for."""

    members: tuple[Slot, ...]
    waited_for: tuple[Slot, ...] = ()


def _peer_chunk(spec: ScheduleSpec, rank: int, action: Message) -> int | None:
    """The chunk at the other end of a chunked message (None: the lists name no chunks)."""
    if action.chunk is None:
        return None
    toward_next = isinstance(action, (SendActivations, RecvGrads))
    peer = action.chunk + 1 if toward_next else action.chunk - 1
    if not 0 <= peer < spec.num_chunks:
        raise ScheduleError(f"rank {rank}: {action!r} has no peer chunk")
    return peer


def _peer(spec: ScheduleSpec, rank: int, action: Message) -> tuple[int, type]:
    """The rank a send/recv talks to and the action type that pairs with it there."""
    stage_id, _ = spec.stage_replica_of(rank)
    toward_next = isinstance(action, (SendActivations, RecvGrads))
    peer_chunk = _peer_chunk(spec, rank, action)
    if peer_chunk is not None:
        peer_stage = spec.stage_of_chunk(peer_chunk)
    else:
        peer_stage = stage_id + 1 if toward_next else stage_id - 1
    if not 0 <= peer_stage < spec.num_stages:
        raise ScheduleError(f"rank {rank} (stage {stage_id}): {action!r} has no peer stage")
    peer_r = spec.replicas[peer_stage]
    if action.peer_replica != replica_for(action.microbatch_id, peer_r):
        raise ScheduleError(
            f"rank {rank} (stage {stage_id}): {action!r} names replica {action.peer_replica} "
            f"of stage {peer_stage}, but microbatch {action.microbatch_id} runs on replica "
            f"{replica_for(action.microbatch_id, peer_r)}")
    pair = {SendActivations: RecvActivations, RecvActivations: SendActivations,
            SendGrads: RecvGrads, RecvGrads: SendGrads}[type(action)]
    return spec.rank_of(peer_stage, action.peer_replica), pair


def lockstep(lists_by_rank: Sequence[Sequence[Action]], spec: ScheduleSpec,
             send_mode: SendMode = SendMode.RENDEZVOUS) -> Iterator[Event]:
    """Yield the events of a run in an order they can happen; ScheduleError on deadlock."""
    if len(lists_by_rank) != spec.num_ranks:
        raise ScheduleError(f"{len(lists_by_rank)} action lists for {spec.num_ranks} ranks")
    heads = [0] * spec.num_ranks
    posted: dict[tuple[type, int, int, int, int | None], Slot] = {}  # eager: (type, mb, from, to, chunk) -> send

    def head(rank: int) -> Action | None:
        return lists_by_rank[rank][heads[rank]] if heads[rank] < len(lists_by_rank[rank]) else None

    def try_advance(rank: int) -> Event | None:
        action = head(rank)
        here: Slot = (rank, heads[rank])
        if not isinstance(action, ACTION_TYPES):
            raise ScheduleError(f"rank {rank}: unknown action {action!r} at #{heads[rank]}")
        if isinstance(action, AllReduceGrads):
            stage_id, _ = spec.stage_replica_of(rank)
            group = [spec.rank_of(stage_id, r) for r in range(spec.replicas[stage_id])]
            if all(head(g) == action for g in group):
                return Event(tuple((g, heads[g]) for g in group))
            return None
        if isinstance(action, SENDS):
            peer, pair = _peer(spec, rank, action)
            to_chunk = _peer_chunk(spec, rank, action)
            if send_mode is SendMode.EAGER or peer == rank:  # a hand-over inside a process never waits
                posted[(pair, action.microbatch_id, rank, peer, to_chunk)] = here
                return Event((here,))
            _, replica_id = spec.stage_replica_of(rank)
            if head(peer) == pair(action.microbatch_id, replica_id, to_chunk):
                return Event((here, (peer, heads[peer])))
            return None
        if isinstance(action, RECVS):
            peer, _ = _peer(spec, rank, action)
            send = posted.pop((type(action), action.microbatch_id, peer, rank, action.chunk), None)
            if (send_mode is SendMode.EAGER or peer == rank) and send is not None:
                return Event((here,), (send,))
            return None  # rendezvous: the sender's turn completes both
        return Event((here,))

    while True:
        progressed = False
        for rank in range(spec.num_ranks):
            while head(rank) is not None:
                event = try_advance(rank)
                if event is None:
                    break
                for r, _ in event.members:
                    heads[r] += 1
                progressed = True
                yield event
        if all(head(rank) is None for rank in range(spec.num_ranks)):
            break
        if not progressed:
            stuck = "; ".join(
                f"rank {rank} (stage, replica {spec.stage_replica_of(rank)}) at "
                f"#{heads[rank]} {head(rank)!r}"
                for rank in range(spec.num_ranks) if head(rank) is not None)
            raise Deadlock(f"deadlock ({send_mode.value} sends): {stuck}",
                           tuple((rank, heads[rank]) for rank in range(spec.num_ranks) if head(rank) is not None),
                           send_mode)
    if posted:
        raise ScheduleError(f"sends never received: {sorted(posted.values())}")


Key = tuple[int, int]
"""(microbatch, chunk): what a process forwards, backwards and holds; the chunk is the stage
itself on a process of one chunk (`_key`)."""


@dataclass
class _Process:
    """What the checker tracks of one process while it replays its list."""

    stage_id: int
    replica_id: int
    version: int = 0
    stash: set[int] = field(default_factory=set)
    loaded: set[Key] = field(default_factory=set)
    received: set[tuple[type, Key]] = field(default_factory=set)
    in_flight: dict[Key, int] = field(default_factory=dict)  # -> weight version
    deferred: set[Key] = field(default_factory=set)  # split_backward: backwarded, WeightGrads to come
    forwarded: set[Key] = field(default_factory=set)
    backwarded: set[Key] = field(default_factory=set)
    evaluated: set[Key] = field(default_factory=set)  # held-out microbatch ids (EvalForward)
    evaluations: list[int] = field(default_factory=list)  # EndEval points, in order
    grads: set[Key] = field(default_factory=set)  # in .grad since the last step
    reduced: frozenset[Key] | None = None  # after AllReduceGrads: microbatches of all replicas
    max_versions: int = 1
    max_activation_sets: int = 0
    declared: StashDepth = StashDepth(0, 0)  # set from the spec: what may be held


def _key(p: _Process, a: Action) -> Key:
    """(microbatch, chunk) of a microbatch action: its chunk, or the process's stage."""
    chunk = getattr(a, "chunk", None)
    return a.microbatch_id, p.stage_id if chunk is None else chunk  # type: ignore[union-attr]


def _show(p: _Process, keys: Iterable[Key]) -> list[str] | list[int]:
    """Keys as a message shows them: microbatch ids, with `:c<chunk>` where the chunk is named."""
    ordered = sorted(keys)
    if all(chunk == p.stage_id for _, chunk in ordered):
        return [mb for mb, _ in ordered]
    return [f"{mb}:c{chunk}" for mb, chunk in ordered]


@dataclass(frozen=True)
class CheckReport:
    """What a run of valid lists held: per rank, the most weight versions / activation sets."""

    max_depth_by_rank: tuple[StashDepth, ...]
    num_events: int


def check_schedules(lists_by_rank: Sequence[Sequence[Action]], spec: ScheduleSpec,
                    send_mode: SendMode = SendMode.RENDEZVOUS) -> CheckReport:
    """Replay all lists together; ScheduleError listing every problem found."""
    procs = [_Process(*spec.stage_replica_of(rank)) for rank in range(spec.num_ranks)]
    for proc in procs:
        proc.declared = spec.stash_depth(proc.stage_id)
    problems: list[str] = []
    num_events = 0
    for event in lockstep(lists_by_rank, spec, send_mode):
        num_events += 1
        ranks = [rank for rank, _ in event.members]
        first = lists_by_rank[ranks[0]][event.members[0][1]]
        if isinstance(first, AllReduceGrads):
            union = frozenset().union(*(procs[r].grads for r in ranks))
            for r in ranks:
                procs[r].reduced = union
        for rank, index in event.members:
            action = lists_by_rank[rank][index]
            problem = _apply(spec, procs[rank], action)
            if problem:
                problems.append(f"rank {rank} #{index} {action!r}: {problem}")
    for rank, proc in enumerate(procs):
        problems += [f"rank {rank}: {p}" for p in _final_problems(spec, proc)]
    if problems:
        raise ScheduleError(f"{len(problems)} problems:\n" + "\n".join(problems[:50]))
    return CheckReport(
        tuple(StashDepth(p.max_versions, p.max_activation_sets) for p in procs), num_events)


def _apply(spec: ScheduleSpec, p: _Process, action: Action) -> str | None:
    """Update `p` with one completed action; a description of what is wrong, if anything."""
    problem = _apply_unchecked_depth(spec, p, action)
    versions, activation_sets = len(p.stash | {p.version}), len(p.in_flight) + len(p.deferred)
    p.max_versions = max(p.max_versions, versions)
    p.max_activation_sets = max(p.max_activation_sets, activation_sets)
    if problem is None and versions > p.declared.weight_versions:
        problem = f"holds {versions} weight versions, declared {p.declared.weight_versions}"
    if problem is None and activation_sets > p.declared.activation_sets:
        problem = f"holds {activation_sets} activation sets, declared {p.declared.activation_sets}"
    return problem


def _apply_unchecked_depth(spec: ScheduleSpec, p: _Process, a: Action) -> str | None:
    if isinstance(a, (AllReduceGrads, OptimizerStep, StashWeights, FreeWeights, EndEval)):
        return _apply_process_action(spec, p, a)
    key = _key(p, a)
    mb, chunk = key
    first, last = chunk == 0, chunk == spec.num_chunks - 1
    if chunk not in spec.chunks_of(p.stage_id):
        return f"chunk {chunk} runs on stage {spec.stage_of_chunk(chunk)}"
    if isinstance(a, LoadMicrobatch):
        if not (first or last):
            return "only the first and the last stage load data"
        p.loaded.add(key)
    elif isinstance(a, RECVS):
        p.received.add((type(a), key))
    elif isinstance(a, SendActivations) and key not in p.forwarded | p.evaluated:
        return "sends activations before their forward"
    elif isinstance(a, EvalForward):
        if not first and (RecvActivations, key) not in p.received:
            return "evaluation forward before RecvActivations"
        if p.in_flight or p.deferred or p.grads:
            return (f"evaluates with training in flight (microbatches {_show(p, p.in_flight)}, "
                    f"weight gradients {_show(p, p.deferred | p.grads)} not yet applied)")
        p.evaluated.add(key)
    elif isinstance(a, SendGrads) and key not in p.backwarded:
        return "sends gradients before their backward"
    elif isinstance(a, Forward):
        if mb not in spec.microbatches_of(p.stage_id, p.replica_id):
            return "microbatch belongs to another replica or is out of range"
        if key in p.forwarded:
            return "second forward of the microbatch"
        if (first or last) and key not in p.loaded:
            return "forward before LoadMicrobatch"
        if not first and (RecvActivations, key) not in p.received:
            return "forward before RecvActivations"
        t = mb // spec.num_microbatches
        if t in spec.drain_after and p.in_flight and min(p.in_flight)[0] < t * spec.num_microbatches:
            return f"forward after drain point {t} with microbatches {_show(p, p.in_flight)} of the last segment in flight"
        p.forwarded.add(key)
        p.in_flight[key] = a.weight_version
        return _version_problem(spec, p, a, live_only=spec.name == PIPEDREAM and not spec.vertical_sync)
    elif isinstance(a, Backward):
        if key not in p.in_flight:
            return "backward without a forward in flight"
        if a.weight_version != p.in_flight.pop(key):
            return "backward on another weight version than its forward"
        if not last and (RecvGrads, key) not in p.received:
            return "backward before RecvGrads"
        p.backwarded.add(key)
        (p.deferred if spec.split_backward else p.grads).add(key)
        return _version_problem(spec, p, a, live_only=False)
    elif isinstance(a, WeightGrads):
        if key not in p.deferred:
            return "WeightGrads without a split Backward waiting for it"
        waiting = [k for k in p.deferred if k[1] == chunk]
        if key != min(waiting):
            return f"WeightGrads out of microbatch order (waiting: {_show(p, waiting)})"
        p.deferred.discard(key)
        p.grads.add(key)
    return None


def _apply_process_action(spec: ScheduleSpec, p: _Process,
                          a: AllReduceGrads | OptimizerStep | StashWeights | FreeWeights | EndEval) -> str | None:
    """The actions of the whole process (every chunk of it): weights, steps, the end of an evaluation."""
    if isinstance(a, EndEval):
        if p.version != spec.steps_through(p.stage_id, a.after_minibatches):
            return f"evaluates version {p.version}, not the one after minibatch {a.after_minibatches}"
        p.evaluations.append(a.after_minibatches)
    elif isinstance(a, StashWeights):
        if a.version != p.version or a.version in p.stash:
            return f"stashes version {a.version}, live is {p.version}, stash {sorted(p.stash)}"
        p.stash.add(a.version)
    elif isinstance(a, FreeWeights):
        if a.version not in p.stash:
            return f"frees version {a.version}, stash {sorted(p.stash)}"
        p.stash.discard(a.version)
    elif isinstance(a, AllReduceGrads):
        if spec.replicas[p.stage_id] == 1:
            return "all-reduce on a stage without replicas"
        if a.step != p.version:
            return f"all-reduce for step {a.step} while at version {p.version}"
        if p.deferred:
            return f"all-reduce before the WeightGrads of {_show(p, p.deferred)}"
    elif isinstance(a, OptimizerStep):
        return _step_problem(spec, p, a)
    return None


def _version_problem(spec: ScheduleSpec, p: _Process, a: Forward | Backward,
                     live_only: bool) -> str | None:
    expected = spec.weight_version(p.stage_id, a.microbatch_id)
    if a.weight_version != expected:
        return f"uses weight version {a.weight_version}, the schedule's rule says {expected}"
    if live_only and a.weight_version != p.version:
        return f"weight stashing forwards on the live version {p.version}"
    if a.weight_version != p.version and a.weight_version not in p.stash:
        return f"version {a.weight_version} is neither live ({p.version}) nor stashed {sorted(p.stash)}"
    return None


def _step_problem(spec: ScheduleSpec, p: _Process, a: OptimizerStep) -> str | None:
    if p.deferred:
        return f"optimizer step before the WeightGrads of {_show(p, p.deferred)}"
    replicated = spec.replicas[p.stage_id] > 1
    covered = p.reduced if replicated else frozenset(p.grads)
    expected = frozenset((mb, c) for mb in spec.microbatches_of_step(p.stage_id, a.step) for c in spec.chunks_of(p.stage_id))
    p.grads, p.reduced = set(), None
    p.version += 1
    if a.step != p.version - 1:
        return f"step {a.step} at version {p.version - 1}"
    if covered is None:
        return "optimizer step on a replicated stage without AllReduceGrads"
    if covered != expected:
        return f"gradient covers microbatches {_show(p, covered)}, expected {_show(p, expected)}"
    if a.num_microbatches != len(spec.microbatches_of_step(p.stage_id, a.step)):
        return f"divides by {a.num_microbatches}, the step covers {len(expected)} microbatches"
    if spec.is_flush and p.in_flight:
        return f"flush schedule steps with microbatches in flight {_show(p, p.in_flight)}"
    return None


def _final_problems(spec: ScheduleSpec, p: _Process) -> list[str]:
    own = {(mb, c) for mb in spec.microbatches_of(p.stage_id, p.replica_id) for c in spec.chunks_of(p.stage_id)}
    problems = []
    if p.forwarded != own or p.backwarded != own:
        problems.append(f"ran forwards {_show(p, p.forwarded)} / backwards {_show(p, p.backwarded)}, "
                        f"expected {_show(p, own)}")
    if p.version != spec.num_optimizer_steps(p.stage_id):
        problems.append(f"took {p.version} steps, expected {spec.num_optimizer_steps(p.stage_id)}")
    if p.evaluations != list(spec.eval_after):
        problems.append(f"evaluated after {p.evaluations}, expected {list(spec.eval_after)}")
    if len(p.evaluated) != len(spec.eval_after) * len(spec.chunks_of(p.stage_id)) * len(
            range(p.replica_id, spec.num_eval_microbatches, spec.replicas[p.stage_id])):
        problems.append(f"evaluated {len(p.evaluated)} held-out microbatches")
    if p.stash or p.grads or p.deferred:
        problems.append(f"ends with stash {sorted(p.stash)}, gradients of {_show(p, p.grads)} and "
                        f"deferred weight gradients of {_show(p, p.deferred)}")
    return problems

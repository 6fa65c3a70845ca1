"""Lowering: a schedule's compute order, then its messages, weight stashing, deferred
weight gradients and evaluations, into the full action list of every process.

`build_for(spec, stage, replica)` is the list one process runs; `build_all` every list;
`sends_first` reorders a list for a transport whose sends never wait.

Virtual stages (`ScheduleSpec.chunked`): a process is a device running several chunks; its
order (`pdcli.schedule.virtual`) names each action's chunk, messages go between neighbouring
chunks (`_add_chunk_communication`; between two chunks of one device they are handed over in
the process), and the lists for blocking sends hold each send back to its receive
(`_sends_at_their_receives`).
"""

from __future__ import annotations

import bisect
import dataclasses
from functools import lru_cache
from typing import Sequence

from pdcli.schedule.actions import (
    Action, AllReduceGrads, Backward, EndEval, EvalForward, Forward, FreeWeights, LoadMicrobatch, OptimizerStep,
    RecvActivations, RecvGrads, SendActivations, SendGrads, StashWeights, WeightGrads,
)
from pdcli.schedule.periodic import periodic_list
from pdcli.schedule.spec import (
    FLUSH_SCHEDULES, GPIPE, ONE_F_ONE_B, PIPEDREAM, TWO_BW, ScheduleSpec, StashDepth, chunk_order, replica_for,
)

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


def _written_order(spec: ScheduleSpec, stage_id: int) -> list[Action]:
    """A written order (`file`, `ScheduleSpec.orders`) for every minibatch, each followed by its
    optimizer step (one replica per stage: no all-reduce)."""
    m = spec.num_microbatches
    out: list[Action] = []
    for t in range(spec.num_steps):
        for action in spec.orders[stage_id]:
            mb = t * m + action.microbatch_id
            out.append(WeightGrads(mb) if isinstance(action, WeightGrads)
                       else type(action)(mb, spec.weight_version(stage_id, mb)))
        out.append(OptimizerStep(t, m))
    return out


def _chunked_order(spec: ScheduleSpec, stage_id: int) -> list[Action]:
    """A chunked schedule's order (`pdcli.schedule.virtual`) for every minibatch, each followed
    by its optimizer step (one step for all the device's chunks; one replica per stage)."""
    m = spec.num_microbatches
    order = chunk_order(spec, stage_id)
    out: list[Action] = []
    for t in range(spec.num_steps):
        for action in order:
            mb = t * m + action.microbatch_id
            out.append(dataclasses.replace(action, microbatch_id=mb) if isinstance(action, WeightGrads)
                       else dataclasses.replace(action, microbatch_id=mb, weight_version=spec.weight_version(stage_id, mb)))
        out.append(OptimizerStep(t, m))
    return out


@lru_cache(maxsize=256)
def _compute_order(spec: ScheduleSpec, stage_id: int, replica_id: int) -> tuple[Action, ...]:
    """Forward/Backward/AllReduceGrads/OptimizerStep of one process (and a written order's
    WeightGrads), versions filled in."""
    if spec.orders:
        return tuple(_written_order(spec, stage_id))
    if spec.chunked:
        return tuple(_chunked_order(spec, stage_id))
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


def _add_chunk_communication(spec: ScheduleSpec, compute: Sequence[Action]) -> list[Action]:
    """Wrap each Forward/Backward of a chunked schedule in the loads, receives and sends of its
    chunk: the first chunk loads the inputs and the last the target; messages go to the
    neighbouring chunks (one replica each), through the transport or, between two chunks of one
    device, handed over in the process (the same actions; `ScheduleSpec.stage_of_chunk` tells)."""
    last_chunk = spec.num_chunks - 1
    out: list[Action] = []
    for action in compute:
        if isinstance(action, Forward):
            mb, c = action.microbatch_id, action.chunk
            assert c is not None
            out += [RecvActivations(mb, 0, c)] if c > 0 else []
            out += [LoadMicrobatch(mb, c)] if c in (0, last_chunk) else []
            out.append(action)
            out += [SendActivations(mb, 0, c)] if c < last_chunk else []
        elif isinstance(action, Backward):
            mb, c = action.microbatch_id, action.chunk
            assert c is not None
            out += [RecvGrads(mb, 0, c)] if c < last_chunk else []
            out.append(action)
            out += [SendGrads(mb, 0, c)] if c > 0 else []
        else:
            out.append(action)
    return out


def _add_communication(spec: ScheduleSpec, stage_id: int, compute: Sequence[Action]) -> list[Action]:
    """Wrap each Forward/Backward in the data loads, receives and sends it needs (see
    `_receive_first` for the one place where a receive may overtake a send)."""
    if spec.chunked:
        return _add_chunk_communication(spec, compute)
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

    Each Backward's W waits in a queue; the oldest (the lowest microbatch: a written order may
    backward out of microbatch order) leaves the queue (1) right before a
    RecvGrads, where the stage would otherwise wait for the next stage's gradient (the
    pipeline's drain), and (2) when more than `weight_grad_lag` are queued, after the sends
    that follow the Backward (a W produces nothing a message carries, and ahead of a send it
    would hold back the peer); the rest run before the optimizer step (and its all-reduce),
    which needs them all. The last stage receives no gradients: its W's trail by the lag and
    fill the time the other stages spend draining. A stage that never backwards a Linear
    layer runs empty W's (free).
    Not before a RecvGrads that a send follows (stream-ordered lists, see `sends_first`):
    there the W would hold back the next stage's activations.
    `merge_weight_grads`: a chunk's W's run back to back, after its minibatch's last Backward
    (the runtime computes such a run as one matmul per layer): before the optimizer step,
    chunk by chunk, or earlier, right before a RecvGrads the rank's last send of the minibatch
    has passed. From there on no other rank waits for this one, so a run there fills the drain
    and delays nothing but the rank's own Backwards, which then end no later than with the run
    at the flush. (In the loop placement, device 0 has its chunk S's run there while it waits
    for chunk 0's gradients.)
    """
    out: list[Action] = []
    queued: list[tuple[int, int]] = []  # (microbatch, chunk or -1)
    merged = spec.merge_weight_grads

    def over_the_lag() -> None:
        while len(queued) > spec.weight_grad_lag:
            out.append(_weight_grads(*queued.pop(0)))

    done_sending = _past_last_send(actions) if merged else {}

    for index, action in enumerate(actions):
        if not isinstance(action, (SendActivations, SendGrads)):
            over_the_lag()
        if isinstance(action, (OptimizerStep, AllReduceGrads)):
            out += [_weight_grads(*key) for key in (sorted(queued, key=_by_chunk) if merged else queued)]
            queued = []
        elif isinstance(action, RecvGrads) and index in done_sending:
            backwarded = {chunk for _, chunk in queued} - done_sending[index]
            out += [_weight_grads(*key) for key in sorted(queued, key=_by_chunk) if key[1] in backwarded]
            queued = [key for key in queued if key[1] not in backwarded]
        elif isinstance(action, RecvGrads) and queued and not merged and not (
                index + 1 < len(actions) and isinstance(actions[index + 1], (SendActivations, SendGrads))):
            out.append(_weight_grads(*queued.pop(0)))
        out.append(action)
        if isinstance(action, Backward):
            bisect.insort(queued, (action.microbatch_id, -1 if action.chunk is None else action.chunk))
    over_the_lag()
    return out


def _prefetch_loads(spec: ScheduleSpec, stage_id: int, actions: Sequence[Action]) -> list[Action]:
    """Flush schedules, the device of the first stage (chunk 0): each minibatch's first input
    LoadMicrobatch moves to the previous minibatch's first RecvGrads, where the device waits
    for the pipeline's round trip.

    A load makes the whole minibatch (`Executor._microbatch`); left before the minibatch's first
    Forward it sits between the previous optimizer step and that Forward, on the path every
    later stage waits along at the flush. Not across a drain or evaluation point (a resumed run
    starts there, an evaluation reads its own data there).
    """
    if not (spec.is_flush and stage_id == spec.stage_of_chunk(0) and spec.num_stages > 1):
        return list(actions)
    m = spec.num_microbatches
    kept = set(spec.drain_after) | set(spec.eval_after)
    first_recv: dict[int, int] = {}  # minibatch -> index of its first RecvGrads
    first_load: dict[int, int] = {}  # minibatch -> index of its first load of chunk 0's inputs
    for index, action in enumerate(actions):
        if isinstance(action, RecvGrads):
            first_recv.setdefault(action.microbatch_id // m, index)
        elif isinstance(action, LoadMicrobatch) and not action.chunk:
            first_load.setdefault(action.microbatch_id // m, index)
    moved = {first_load[t + 1]: first_recv[t] for t in first_recv
             if t + 1 in first_load and t + 1 not in kept and first_recv[t] < first_load[t + 1]}
    if not moved:
        return list(actions)
    before: dict[int, Action] = {at: actions[index] for index, at in moved.items()}
    out: list[Action] = []
    for index, action in enumerate(actions):
        if index in before:
            out.append(before[index])
        if index not in moved:
            out.append(action)
    return out


def _past_last_send(actions: Sequence[Action]) -> dict[int, set[int]]:
    """The RecvGrads that come after the last send of their minibatch (the actions up to its
    optimizer step or all-reduce), each with the chunks (-1: none named) that still backward
    after it in that minibatch."""
    out: dict[int, set[int]] = {}
    sends_ahead, backwards_ahead = False, set[int]()
    for index in range(len(actions) - 1, -1, -1):
        action = actions[index]
        if isinstance(action, (OptimizerStep, AllReduceGrads)):
            sends_ahead, backwards_ahead = False, set()
        elif isinstance(action, (SendActivations, SendGrads)):
            sends_ahead = True
        elif isinstance(action, Backward):
            backwards_ahead.add(-1 if action.chunk is None else action.chunk)
        elif isinstance(action, RecvGrads) and not sends_ahead:
            out[index] = set(backwards_ahead)
    return out


def _by_chunk(key: tuple[int, int]) -> tuple[int, int]:
    """The order of a merged run of queued (microbatch, chunk) W's: by chunk, then microbatch."""
    return key[1], key[0]


def _weight_grads(microbatch_id: int, chunk: int) -> WeightGrads:
    """WeightGrads of a queued (microbatch, chunk; -1: none named)."""
    return WeightGrads(microbatch_id, None if chunk < 0 else chunk)


def _evaluation(spec: ScheduleSpec, stage_id: int, replica_id: int, evaluation: int) -> list[Action]:
    """One evaluation block of a process: its share of the held-out microbatches, forward only
    (chunked: every held-out microbatch through each of the device's chunks in turn)."""
    if spec.chunked:
        out: list[Action] = []
        for c in spec.chunks_of(stage_id):
            for e in range(spec.num_eval_microbatches):
                mb = spec.eval_microbatch_id(evaluation, e)
                out += [RecvActivations(mb, 0, c)] if c > 0 else []
                out.append(EvalForward(mb, e, c))
                out += [SendActivations(mb, 0, c)] if c < spec.num_chunks - 1 else []
        return [*out, EndEval(spec.eval_after[evaluation])]
    first, last, prev_r, next_r = _neighbours(spec, stage_id)
    out = []
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
    gradient of b. A send depends only on compute before it, so the numerics are the same.
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
              eager_sends: bool = False) -> Sequence[Action]:
    """The ordered action list of one process (stage `stage_id`, replica `replica_id`);
    with `start_minibatch` = t > 0 (a drain point: a checkpoint to resume from), only the
    actions after the first t minibatches, whose weights and optimizer state it continues.
    `eager_sends`: for a transport whose sends never wait for the peer (see `sends_first`).
    A long run's list is an `ActionList` (`pdcli.schedule.periodic`): the same actions,
    computed one by one from the lists of a few short runs; a short run's, a list."""
    if not 0 <= stage_id < spec.num_stages:
        raise ValueError(f"stage_id {stage_id} out of range (num_stages={spec.num_stages})")
    if not 0 <= replica_id < spec.replicas[stage_id]:
        raise ValueError(
            f"replica_id {replica_id} out of range (stage {stage_id} has "
            f"{spec.replicas[stage_id]} replicas)")

    def whole(run: ScheduleSpec) -> list[Action]:
        if run.chunked and not eager_sends:
            return list(_sends_at_their_receives(run)[stage_id])
        return _lowered(run, stage_id, replica_id, eager_sends)

    actions: Sequence[Action] | None = periodic_list(spec, whole)
    if actions is None:
        actions = whole(spec)
    return actions if start_minibatch == 0 else _resume_suffix(spec, stage_id, actions, start_minibatch)


def _lowered(spec: ScheduleSpec, stage_id: int, replica_id: int, eager_sends: bool) -> list[Action]:
    """The whole list of one process: compute order, messages, weight gradients, stashing, evaluations."""
    compute = _compute_order(spec, stage_id, replica_id)
    actions = _add_communication(spec, stage_id, compute)
    if eager_sends:
        actions = sends_first(actions)
    if spec.places_weight_grads(stage_id):
        actions = _add_weight_grads(spec, actions)
    actions = _prefetch_loads(spec, stage_id, actions)
    actions = _add_weight_stashing(actions)
    if spec.eval_after:
        actions = _add_evaluations(spec, stage_id, replica_id, actions)
    return actions


def _message_key(spec: ScheduleSpec, stage_id: int, action: Action) -> tuple[int, tuple[object, ...]] | None:
    """(peer stage, key both ends of a chunked message share), or None for another action."""
    if not isinstance(action, (SendActivations, SendGrads, RecvActivations, RecvGrads)) or action.chunk is None:
        return None
    forward = isinstance(action, (SendActivations, RecvActivations))
    toward_next = isinstance(action, (SendActivations, RecvGrads))
    peer_chunk = action.chunk + 1 if toward_next else action.chunk - 1
    producer = action.chunk if isinstance(action, (SendActivations, RecvGrads)) else peer_chunk
    return spec.stage_of_chunk(peer_chunk), (forward, action.microbatch_id, producer)


@lru_cache(maxsize=64)
def _sends_at_their_receives(spec: ScheduleSpec) -> tuple[tuple[Action, ...], ...]:
    """Chunked lists for sends that wait for their receive (NCCL): every rank's list as for
    eager sends, with each send to another rank moved later, to where its receiver takes it.

    The lists are run together with eager sends (a send posts, its receive takes it once
    posted), except that a rank does not pass its optimizer step or the end of an evaluation
    while a message it sent waits to be received (each rank receives a minibatch's messages
    before its own step, so that wait ends). The order the run takes is written down: a
    rank's actions as they complete, and each send together with its receive, so that the
    same order is a run with blocking sends, by construction. A send only moves later, past
    nothing it depends on; a message between two chunks of one rank stays where it was (it
    never waits). A rank whose W's run merged (`ScheduleSpec.merges_weight_grads`) does not
    start the flush's W's either while a send waits (every message of the minibatch is received before anyone's W's)."""
    lists = [_lowered(spec, stage, 0, eager_sends=False) for stage in range(spec.num_stages)]
    heads = [0] * spec.num_stages
    out: list[list[Action]] = [[] for _ in lists]
    posted: dict[tuple[int, int, tuple[object, ...]], Action] = {}  # (from, to, key) -> the send, held back
    waiting = [0] * spec.num_stages  # sends of each rank not yet received
    while True:
        progressed = False
        for rank, actions in enumerate(lists):
            while heads[rank] < len(actions):
                action = actions[heads[rank]]
                message = _message_key(spec, rank, action)
                if message is not None and message[0] != rank:
                    peer, key = message
                    if isinstance(action, (SendActivations, SendGrads)):
                        posted[rank, peer, key] = action
                        waiting[rank] += 1
                    else:
                        send = posted.pop((peer, rank, key), None)
                        if send is None:
                            break
                        out[peer].append(send)
                        waiting[peer] -= 1
                        out[rank].append(action)
                elif waiting[rank] and (isinstance(action, (OptimizerStep, EndEval)) or (
                        spec.merges_weight_grads(rank) and isinstance(action, WeightGrads))):
                    break  # a merged run of W's waits too: it would hold back the peer's last Backwards
                else:
                    out[rank].append(action)
                heads[rank] += 1
                progressed = True
        if all(h == len(a) for h, a in zip(heads, lists)) and not posted:
            return tuple(tuple(o) for o in out)
        if not progressed:
            raise AssertionError(f"{spec.name}: no order for blocking sends (heads {heads}, held sends {len(posted)})")


def _resume_suffix(spec: ScheduleSpec, stage_id: int, actions: Sequence[Action],
                   start_minibatch: int) -> Sequence[Action]:
    """The actions after the optimizer step that completes the first `start_minibatch` minibatches."""
    if not (spec.is_flush or start_minibatch in spec.drain_after) or not 0 < start_minibatch < spec.num_steps:
        raise ValueError(f"cannot resume {spec.name} at minibatch {start_minibatch}: not a drain point "
                         f"{list(spec.drain_after)} inside (0, {spec.num_steps})")
    last_step = spec.steps_through(stage_id, start_minibatch) - 1
    first_mb = start_minibatch * spec.num_microbatches
    cut, stashed, late = 0, 0, []
    for index, a in enumerate(actions):  # one pass: a long run's list is computed as it is read
        if isinstance(a, OptimizerStep) and a.step == last_step:
            cut = index + 1
            break
        stashed += isinstance(a, StashWeights) - isinstance(a, FreeWeights)
        if isinstance(a, (Forward, Backward)) and a.microbatch_id >= first_mb:
            late.append(a)
    early = [a for a in actions[cut:] if isinstance(a, (Forward, Backward)) and a.microbatch_id < first_mb]
    if early or late or stashed:
        raise AssertionError(f"stage {stage_id}: minibatch {start_minibatch} is not a clean cut ({early[:2]}, {late[:2]})")
    return actions[cut:]


def build_all(spec: ScheduleSpec, eager_sends: bool = False) -> list[list[Action]]:
    """The action lists of all processes, indexed by rank (`spec.rank_of`)."""
    return [list(build_for(spec, *spec.stage_replica_of(rank), eager_sends=eager_sends)) for rank in range(spec.num_ranks)]


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
) -> Sequence[Action]:
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

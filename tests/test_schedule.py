"""Schedules as plain lists: their order, the checker's proof over many shapes, the
checker catching broken lists, and the simulator's textbook timelines."""

from __future__ import annotations

import dataclasses

import pytest

from pdcli.errors import UserError
from pdcli.schedule.simulator import StageCost, simulate
from pdcli.schedule.checker import ScheduleError, SendMode, check_schedules
from pdcli.schedule.spec import rules
from pdcli.schedule import (
    ACTION_TYPES, SCHEDULES, AllReduceGrads, Backward, Forward, FreeWeights, LoadMicrobatch, OptimizerStep,
    RecvActivations, RecvGrads, ScheduleSpec, SendActivations, SendGrads, StashDepth, StashWeights,
    UnknownActionError, WeightGrads, build_all, build_schedule, dispatch, replica_for, sends_first, stash_depth,
)


def compute(actions) -> list[str]:
    """The compute skeleton of a list: F3, B3, W3, step0 ..."""
    names = {Forward: "F", Backward: "B", WeightGrads: "W"}
    out = []
    for a in actions:
        if isinstance(a, (Forward, Backward, WeightGrads)):
            out.append(f"{names[type(a)]}{a.microbatch_id}")
        elif isinstance(a, OptimizerStep):
            out.append(f"step{a.step}")
    return out


def replica_layouts(num_stages: int) -> list[tuple[int, ...] | None]:
    one_replicated = [tuple(2 if i == j else 1 for i in range(num_stages)) for j in range(num_stages)]
    return [None, *one_replicated, (2,) * num_stages, (4,) + (1,) * (num_stages - 1)]


def all_specs():
    for name in SCHEDULES:
        for vertical_sync in ([False, True] if name == "pipedream" else [False]):
            for num_stages in range(1, 6):
                for num_microbatches in range(1, 9):
                    for replicas in replica_layouts(num_stages):
                        for virtual in ((1, 2, 3) if rules(name).chunked else (1,)):
                            try:
                                yield ScheduleSpec.make(name, num_stages, num_microbatches, 3, replicas, vertical_sync,
                                                        split_backward=bool(rules(name).split_backward),
                                                        virtual_stages=virtual)
                            except UserError:
                                continue  # e.g. 3 microbatches over 2 replicas


# ---- orders a reviewer can read ----


def test_gpipe_runs_all_forwards_then_all_backwards_then_steps():
    actions = build_schedule("gpipe", 3, 1, 3, 2)
    assert compute(actions) == ["F0", "F1", "F2", "B0", "B1", "B2", "step0",
                                "F3", "F4", "F5", "B3", "B4", "B5", "step1"]


def test_1f1b_warms_up_then_alternates_and_flushes():
    # Stage 1 of 4: warm-up min(S - s - 1, M) = 2 forwards, then one forward one backward.
    actions = build_schedule("1f1b", 4, 1, 4, 1)
    assert compute(actions) == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3", "step0"]
    last = build_schedule("1f1b", 4, 3, 4, 1)
    assert compute(last) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "step0"]


def test_pipedream_steps_after_every_backward_with_stashed_versions():
    # Stage 0 of 3 keeps S - s = 3 minibatches in flight; no flush.
    actions = build_schedule("pipedream", 3, 0, 2, 3)
    assert compute(actions) == ["F0", "F1", "F2", "B0", "step0", "F3", "B1", "step1", "F4", "B2",
                                "step2", "F5", "B3", "step3", "B4", "step4", "B5", "step5"]
    versions = [a.weight_version for a in actions if isinstance(a, Forward)]
    assert versions == [0, 0, 0, 1, 2, 3]  # updates of 0 .. b - 3
    assert StashWeights(0) in actions and FreeWeights(0) in actions


def test_2bw_accumulates_a_minibatch_without_flush():
    actions = build_schedule("2bw", 2, 0, 2, 3)
    assert compute(actions) == ["F0", "F1", "B0", "F2", "B1", "step0", "F3", "B2", "F4", "B3",
                                "step1", "F5", "B4", "B5", "step2"]
    assert [a.weight_version for a in actions if isinstance(a, Forward)] == [0, 0, 0, 0, 1, 1]
    assert max(a.num_microbatches for a in actions if isinstance(a, OptimizerStep)) == 2


def test_replicas_get_round_robin_microbatches_and_name_their_peers():
    assert [replica_for(mb, 2) for mb in range(5)] == [0, 1, 0, 1, 0]
    actions = build_schedule("gpipe", 2, 1, 4, 1, replicas=(2, 1))
    recvs = [a for a in actions if isinstance(a, RecvActivations)]
    assert [(a.microbatch_id, a.peer_replica) for a in recvs] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    replica1 = build_schedule("gpipe", 2, 0, 4, 1, replicas=(2, 1), replica_id=1)
    assert compute(replica1) == ["F1", "F3", "B1", "B3", "step0"]
    assert AllReduceGrads(0) in replica1 and OptimizerStep(0, 4) in replica1


# ---- the checker proves every schedule ----


@pytest.mark.slow
@pytest.mark.parametrize("send_mode", list(SendMode))
def test_every_schedule_checks_for_1_to_5_stages_1_to_8_microbatches(send_mode):
    checked = 0
    for spec in all_specs():
        replicated_no_flush = max(spec.replicas) > 1 and not spec.is_flush
        if send_mode is SendMode.RENDEZVOUS and replicated_no_flush:
            continue  # needs non-blocking sends: see test_replicated_pipedream_needs_eager_sends
        check_schedules(build_all(spec), spec, send_mode)
        checked += 1
    assert checked > (300 if send_mode is SendMode.RENDEZVOUS else 500)


@pytest.mark.slow
def test_sends_first_keeps_compute_and_checks_with_eager_sends():
    checked = 0
    for spec in all_specs():
        lists = build_all(spec)
        moved = [sends_first(actions) for actions in lists]
        for before, after in zip(lists, moved):
            assert sorted(map(repr, before)) == sorted(map(repr, after))  # the same actions
            assert [a for a in before if not isinstance(a, (RecvActivations, RecvGrads, SendActivations, SendGrads))] == \
                [a for a in after if not isinstance(a, (RecvActivations, RecvGrads, SendActivations, SendGrads))]
        check_schedules(moved, spec, SendMode.EAGER)
        checked += 1
    assert checked > 500


def test_sends_first_sends_activations_before_waiting_for_a_gradient():
    # Steady 1F1B on stage 0 of 2: forward b + 1, then backward b. The stream-ordered list
    # receives the gradient of b first; sends_first hands the next stage its input first.
    actions = build_schedule("pipedream", 2, 0, 1, 4)
    at = actions.index(RecvGrads(0, 0))
    assert actions[at + 1] == SendActivations(1, 0)
    moved = sends_first(actions)
    assert moved.index(SendActivations(1, 0)) < moved.index(RecvGrads(0, 0))
    # a send never moves past compute: each still follows the Forward that made it
    forward_at = {a.microbatch_id: i for i, a in enumerate(moved) if isinstance(a, Forward)}
    assert all(forward_at[a.microbatch_id] < i for i, a in enumerate(moved) if isinstance(a, SendActivations))
    last = build_schedule("pipedream", 2, 1, 1, 4)
    assert [a for a in sends_first(last) if isinstance(a, SendGrads)] == [a for a in last if isinstance(a, SendGrads)]


# ---- split backward: WeightGrads ----


@pytest.mark.slow
def test_split_backward_checks_for_every_flush_shape_both_transports():
    checked = 0
    for spec in all_specs():
        if not spec.is_flush or spec.chunked:  # chunked: tests/test_virtual_stages.py
            continue
        split = dataclasses.replace(spec, split_backward=True)
        for eager in (False, True):
            lists = build_all(split, eager_sends=eager)
            plain = build_all(spec, eager_sends=eager)
            for with_w, without in zip(lists, plain):
                # the same actions in the same order, plus one W per B, in microbatch order
                assert [a for a in with_w if not isinstance(a, WeightGrads)] == without
                ws = [a.microbatch_id for a in with_w if isinstance(a, WeightGrads)]
                assert ws == [a.microbatch_id for a in without if isinstance(a, Backward)]
            for mode in ([SendMode.EAGER] if eager or max(spec.replicas) > 1 else list(SendMode)):
                check_schedules(lists, split, mode)
            checked += 1
    assert checked > 300


def assert_merged_weight_grads(actions) -> tuple[int, int]:
    """Every WeightGrads sits in a run of whole chunks (all of the chunk's Backwards of the
    minibatch done, one W each), ordered by chunk, then microbatch; a run stands right before
    its minibatch's OptimizerStep (or the AllReduceGrads before it), or right before a
    RecvGrads that no send of the minibatch follows. Returns (runs at the flush, runs before)."""
    at_flush, early = 0, 0
    run: list[tuple[int, int]] = []
    backwarded: dict[int, list[int]] = {}  # chunk -> microbatches backwarded this minibatch
    graded: set[int] = set()  # chunks whose run has passed
    for index, a in enumerate(actions):
        if isinstance(a, WeightGrads):
            run.append((-1 if a.chunk is None else a.chunk, a.microbatch_id))
            continue
        if run:
            assert run == sorted(run), run
            chunks = {c for c, _ in run}
            assert run == sorted((c, mb) for c in chunks for mb in backwarded.get(c, [])), run  # whole chunks
            graded |= chunks
            if isinstance(a, (OptimizerStep, AllReduceGrads)):
                at_flush += 1
            else:
                assert isinstance(a, RecvGrads), f"{a} after the W's"
                rest = actions[index:]
                end = next(i for i, b in enumerate(rest) if isinstance(b, (OptimizerStep, AllReduceGrads)))
                assert not any(isinstance(b, (SendActivations, SendGrads)) for b in rest[:end]), "a send after W's"
                assert not any(isinstance(b, Backward) and (-1 if b.chunk is None else b.chunk) in chunks
                               for b in rest[:end]), run
                early += 1
            run = []
        if isinstance(a, Backward):
            backwarded.setdefault(-1 if a.chunk is None else a.chunk, []).append(a.microbatch_id)
        if isinstance(a, OptimizerStep):
            assert not backwarded or set(backwarded) == graded, (backwarded, graded)
            backwarded, graded = {}, set()
    assert not run
    return at_flush, early


@pytest.mark.slow
def test_merged_weight_grads_wait_for_the_flush_on_every_flush_shape_both_transports():
    checked = 0
    for spec in all_specs():
        if not spec.is_flush or spec.chunked or rules(spec.name).hand_written:  # chunked: test_virtual_stages.py
            continue
        merged = dataclasses.replace(spec, split_backward=True, merge_weight_grads=True)
        lagged = dataclasses.replace(spec, split_backward=True)
        for eager in (False, True):
            lists = build_all(merged, eager_sends=eager)
            for with_merge, without in zip(lists, build_all(lagged, eager_sends=eager)):
                # the same actions, the W's moved to the flush
                assert [a for a in with_merge if not isinstance(a, WeightGrads)] == \
                    [a for a in without if not isinstance(a, WeightGrads)]
                assert sorted(map(str, with_merge)) == sorted(map(str, without))
                assert assert_merged_weight_grads(with_merge) == (spec.num_steps, 0)  # one chunk: at the flush
            for mode in ([SendMode.EAGER] if eager or max(spec.replicas) > 1 else list(SendMode)):
                report = check_schedules(lists, merged, mode)
                stages = [stage for stage, r in enumerate(spec.replicas) for _ in range(r)]
                for stage, held in zip(stages, report.max_depth_by_rank):
                    assert held.activation_sets <= merged.stash_depth(stage).activation_sets
            checked += 1
    assert checked > 300


def test_merged_weight_grads_hold_every_microbatch_until_the_flush():
    lagged = ScheduleSpec.make("1f1b", 4, 8, 1, split_backward=True)
    merged = dataclasses.replace(lagged, merge_weight_grads=True)
    assert [lagged.stash_depth(s).activation_sets for s in range(4)] == [8, 7, 6, 5]  # in flight + the lag of 4
    assert [merged.stash_depth(s).activation_sets for s in range(4)] == [8] * 4


def test_a_written_order_keeps_its_own_weight_grads_under_merge():
    from pdcli.schedule.orders import read_orders

    orders = read_orders(["F0 F1 B0 W0 B1 W1", "F0 B0 F1 B1"], 2, True, "mine.txt")
    spec = ScheduleSpec.make("file", 2, 2, 1, split_backward=True, orders=orders, merge_weight_grads=True)
    assert [spec.merges_weight_grads(s) for s in range(2)] == [False, True]
    assert compute(build_all(spec)[0]) == ["F0", "F1", "B0", "W0", "B1", "W1", "step0"]  # as written
    assert compute(build_all(spec)[1]) == ["F0", "B0", "F1", "B1", "W0", "W1", "step0"]  # at the flush
    every = read_orders(["F0 F1 B0 W0 B1 W1", "F0 B0 W0 F1 B1 W1"], 2, True, "mine.txt")
    with pytest.raises(UserError, match="place every WeightGrads themselves"):
        ScheduleSpec.make("file", 2, 2, 1, split_backward=True, orders=every, merge_weight_grads=True)


@pytest.mark.parametrize("name,split,why", [
    ("pipedream", True, "not 'pipedream'"), ("1f1b", False, "with it off"), ("zbv", True, "own order places"),
])
def test_merged_weight_grads_need_weight_grads_pd_places(name, split, why):
    with pytest.raises(UserError, match=why):
        ScheduleSpec.make(name, 2, 4, 1, split_backward=split, virtual_stages=2 if name == "zbv" else 1,
                          merge_weight_grads=True)


def test_split_backward_fills_the_drain_with_weight_gradients():
    # Stage 0 of 2, 4 microbatches: each W waits until the stage would wait for a
    # gradient; the last ones run before the step.
    actions = build_schedule("1f1b", 2, 0, 4, 1, split_backward=True, eager_sends=True)
    assert compute(actions) == ["F0", "F1", "B0", "F2", "W0", "B1", "F3", "W1", "B2", "W2", "B3", "W3", "step0"]
    at = actions.index(WeightGrads(1))
    assert actions[at + 1] == RecvGrads(2, 0)  # runs while the gradient of 2 is on its way
    # the last stage receives nothing: its W's trail by num_stages and fill stage 0's drain
    last = build_schedule("1f1b", 2, 1, 4, 1, split_backward=True)
    assert compute(last) == ["F0", "B0", "F1", "B1", "F2", "B2", "W0", "F3", "B3", "W1", "W2", "W3", "step0"]


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("eager", [True, False])
def test_the_first_stage_loads_the_next_minibatch_while_it_waits_for_a_gradient(name, eager):
    """Flush schedules: minibatch t + 1's data is made at minibatch t's first RecvGrads (the
    wait for the pipeline's round trip), not between t's optimizer step and t + 1's first
    Forward; never across a drain or evaluation point; other stages and schedules unchanged."""
    m = 4
    spec = ScheduleSpec.make(name, 2, m, 6, drain_after=[3], eval_after=[5], num_eval_microbatches=m)
    lists = build_all(spec, eager_sends=eager)
    first = lists[0]
    loads = [i for i, a in enumerate(first) if isinstance(a, LoadMicrobatch)]
    assert sorted(first[i].microbatch_id for i in loads) == list(range(6 * m))  # each once
    for t in range(5):
        load = first.index(LoadMicrobatch((t + 1) * m))
        recv = first.index(RecvGrads(t * m, 0))
        step = first.index(OptimizerStep(t, m))
        if t + 1 in (3, 5):  # a drain point, an evaluation: the load stays with its Forward
            assert first[load + 1] == Forward((t + 1) * m, t + 1) and load > step
        else:
            assert load + 1 == recv and load < step
    for a, b in zip(first, first[1:]):  # every other load right before its Forward
        if isinstance(a, LoadMicrobatch) and a.microbatch_id % m:
            assert b == Forward(a.microbatch_id, a.microbatch_id // m)
    check_schedules(lists, spec, SendMode.EAGER if eager else SendMode.RENDEZVOUS)
    last = lists[1]
    assert all(b == Forward(a.microbatch_id, a.microbatch_id // m)
               for a, b in zip(last, last[1:]) if isinstance(a, LoadMicrobatch))
    pipedream = build_all(ScheduleSpec.make("pipedream", 2, m, 3), eager_sends=True)[0]
    assert all(isinstance(b, Forward) and b.microbatch_id == a.microbatch_id
               for a, b in zip(pipedream, pipedream[1:]) if isinstance(a, LoadMicrobatch))


def loads_with_their_forwards(actions):
    """The list with every LoadMicrobatch back right before its Forward (no prefetch)."""
    loads = [a for a in actions if isinstance(a, LoadMicrobatch)]
    out = []
    for a in actions:
        if isinstance(a, Forward):
            out += [x for x in loads if x.microbatch_id == a.microbatch_id and x.chunk == a.chunk]
        if not isinstance(a, LoadMicrobatch):
            out.append(a)
    return out


@pytest.mark.parametrize("name, virtual", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_a_load_made_while_waiting_for_a_gradient_leaves_the_flush_path(name, virtual):
    """The replay charges a process's first load of a minibatch the whole minibatch's data
    (M x load_ms, as the runtime makes it), the other loads nothing; the first stage's, made at
    the previous minibatch's first RecvGrads, costs the pipeline nothing, put back before its
    Forward it lengthens each minibatch by the load."""
    m, load = 4, 0.8
    spec = ScheduleSpec.make(name, 2, m, 8, split_backward=True, virtual_stages=virtual)
    free = [StageCost(1.0, 2.0, comm_ms=0.05, wgrad_ms=1.0)] * spec.num_chunks
    costs = [dataclasses.replace(free[0], load_ms=load / m), *free[1:]]  # the inputs' data; targets free
    lists = build_all(spec, eager_sends=True)
    prefetched = simulate(spec, costs, lists_by_rank=lists)
    in_place = simulate(spec, costs, lists_by_rank=[loads_with_their_forwards(x) for x in lists])
    nothing = simulate(spec, free, lists_by_rank=lists).time_per_minibatch_ms
    assert in_place.time_per_minibatch_ms == pytest.approx(nothing + load, abs=1e-9)
    assert prefetched.time_per_minibatch_ms == pytest.approx(nothing, abs=1e-9)
    timed = [t for t in prefetched.timeline[0] if isinstance(t.action, LoadMicrobatch) and not t.action.chunk]
    assert sorted(round(t.end_ms - t.start_ms, 9) for t in timed) == [0.0] * (8 * (m - 1)) + [load] * 8


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("eager", [True, False])
def test_weight_gradients_never_hold_back_a_send(name, eager):
    """A W the lag forces out runs after the sends that follow its Backward: the last stage
    sends the gradient of B2 before it computes W0, so a slower last stage does not make the
    stage before it wait for W's."""
    for stages, m in ((2, 4), (3, 8), (4, 8)):
        for stage in range(stages):
            actions = build_schedule(name, stages, stage, m, 2, split_backward=True, eager_sends=eager)
            for a, b in zip(actions, actions[1:]):
                assert not (isinstance(a, WeightGrads) and isinstance(b, (SendActivations, SendGrads))), (stage, actions)
    last = build_schedule("1f1b", 2, 1, 4, 1, split_backward=True, eager_sends=True)
    assert last[last.index(SendGrads(2, 0)) + 1] == WeightGrads(0)
    slow_last = [StageCost(1.0, 2.0, wgrad_ms=0.9), StageCost(1.0, 2.3, wgrad_ms=0.9)]
    bound = 4 * (1.0 + 2.3)  # the last stage's work per minibatch
    split = simulate(ScheduleSpec.make("1f1b", 2, 4, 6, split_backward=True), slow_last).time_per_minibatch_ms
    assert bound <= split < bound + 0.5  # W's ahead of the sends: 14.4, stage 0 waiting for them


def test_split_backward_only_for_flush_schedules():
    for name in ("pipedream", "2bw"):
        with pytest.raises(UserError, match="split_backward only applies"):
            ScheduleSpec.make(name, 2, 4, 2, split_backward=True)


@pytest.mark.parametrize("num_stages, num_microbatches", [(2, 4), (2, 8), (3, 8), (4, 8), (4, 16)])
def test_split_backward_shrinks_the_simulated_bubble(num_stages, num_microbatches):
    """Forward, input gradient and weight gradient of equal cost: 1F1B's bubble of (S - 1)
    microbatch times shrinks towards Zero Bubble's (S - 1)(F + B - W)."""
    costs = [StageCost(1.0, 2.0, comm_ms=0.05, wgrad_ms=1.0)] * num_stages
    unsplit = simulate(ScheduleSpec.make("1f1b", num_stages, num_microbatches, 6), costs)
    split = simulate(ScheduleSpec.make("1f1b", num_stages, num_microbatches, 6, split_backward=True), costs)
    work_ms = 3.0 * num_microbatches
    assert unsplit.time_per_minibatch_ms >= work_ms + 3.0 * (num_stages - 1)
    assert split.time_per_minibatch_ms < unsplit.time_per_minibatch_ms - (num_stages - 1)
    assert split.time_per_minibatch_ms >= work_ms + (num_stages - 1)  # Zero Bubble H1's bound
    assert split.bubble_fraction < unsplit.bubble_fraction
    no_w = [StageCost(1.0, 2.0, comm_ms=0.05)] * num_stages  # nothing to defer: the same time
    assert simulate(ScheduleSpec.make("1f1b", num_stages, num_microbatches, 6, split_backward=True),
                    no_w).time_per_minibatch_ms == pytest.approx(unsplit.time_per_minibatch_ms, rel=0.02)


def test_checker_catches_a_step_before_weight_gradients():
    spec = ScheduleSpec.make("1f1b", 2, 4, 2, split_backward=True)
    lists = build_all(spec)
    w = next(i for i, a in enumerate(lists[1]) if a == WeightGrads(3))
    lists[1].insert(len(lists[1]), lists[1].pop(w))  # W of mb 3 after the last step
    with pytest.raises(ScheduleError, match="optimizer step before the WeightGrads of \\[3\\]"):
        check_schedules(lists, spec)


def test_replicated_pipedream_needs_eager_sends():
    spec = ScheduleSpec.make("pipedream", 2, 2, 3, replicas=(2, 1))
    check_schedules(build_all(spec), spec, SendMode.EAGER)
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedules(build_all(spec), spec, SendMode.RENDEZVOUS)


@pytest.mark.parametrize("name, vertical_sync, split", [(n, False, False) for n in SCHEDULES
                                                         if not rules(n).hand_written and not rules(n).chunked] + [
    ("pipedream", True, False), ("1f1b", False, True), ("gpipe", False, True)])
def test_declared_stash_depth_is_reached_on_straight_pipelines(name, vertical_sync, split):
    for num_stages in range(1, 6):
        for num_microbatches in (num_stages, 8):
            spec = ScheduleSpec.make(name, num_stages, num_microbatches, 6, vertical_sync=vertical_sync,
                                     split_backward=split)
            report = check_schedules(build_all(spec), spec)
            for rank, held in enumerate(report.max_depth_by_rank):
                assert held == spec.stash_depth(rank), (spec, rank)


def test_stash_depths_by_formula():
    assert stash_depth("pipedream", 4, 1, 4) == StashDepth(3, 3)
    assert stash_depth("pipedream", 4, 1, 4, vertical_sync=True) == StashDepth(4, 3)
    assert stash_depth("1f1b", 4, 0, 2) == StashDepth(1, 2)
    assert stash_depth("gpipe", 4, 0, 8, replicas=(2, 1, 1, 1)) == StashDepth(1, 4)
    assert stash_depth("2bw", 4, 0, 4) == StashDepth(2, 4)
    # split backward: a microbatch is held until its W, which trails by up to num_stages
    assert ScheduleSpec.make("1f1b", 2, 8, 1, split_backward=True).stash_depth(0) == StashDepth(1, 4)


# ---- the checker catches broken lists ----


def straight(name: str = "1f1b") -> tuple[ScheduleSpec, list[list]]:
    spec = ScheduleSpec.make(name, 3, 4, 2)
    return spec, build_all(spec)


def test_checker_catches_swapped_send_and_forward_as_an_error():
    spec, lists = straight()
    i = next(i for i, a in enumerate(lists[1]) if isinstance(a, SendActivations))
    lists[1][i - 1], lists[1][i] = lists[1][i], lists[1][i - 1]
    with pytest.raises(ScheduleError, match="sends activations before their forward"):
        check_schedules(lists, spec)


def test_checker_reports_the_stuck_actions_of_a_deadlock():
    spec, lists = straight()
    # The last stage backwards mb 0 before receiving mb 1's activations ... then asks for
    # mb 1 before mb 0: receive order swapped against the sender's send order.
    recvs = [i for i, a in enumerate(lists[2]) if isinstance(a, RecvActivations)]
    lists[2][recvs[0]], lists[2][recvs[1]] = lists[2][recvs[1]], lists[2][recvs[0]]
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 2 .* RecvActivations\(microbatch_id=1"):
        check_schedules(lists, spec)


def test_checker_catches_backward_before_forward():
    spec, lists = straight()
    f = next(i for i, a in enumerate(lists[2]) if isinstance(a, Forward))
    b = next(i for i, a in enumerate(lists[2]) if isinstance(a, Backward))
    lists[2][f], lists[2][b] = lists[2][b], lists[2][f]
    with pytest.raises(ScheduleError, match="backward without a forward"):
        check_schedules(lists, spec, SendMode.EAGER)


def test_checker_catches_a_misplaced_optimizer_step():
    spec, lists = straight("gpipe")
    step = next(i for i, a in enumerate(lists[0]) if isinstance(a, OptimizerStep))
    lists[0].insert(step - 3, lists[0].pop(step))
    with pytest.raises(ScheduleError, match="gradient covers microbatches"):
        check_schedules(lists, spec)


def test_checker_catches_a_wrong_weight_version_and_a_wrong_peer():
    spec, lists = straight("pipedream")
    i = next(i for i, a in enumerate(lists[0]) if isinstance(a, Forward) and a.weight_version > 0)
    lists[0][i] = dataclasses.replace(lists[0][i], weight_version=0)
    with pytest.raises(ScheduleError, match="rule says"):
        check_schedules(lists, spec)
    spec, lists = straight()
    i = next(i for i, a in enumerate(lists[0]) if isinstance(a, SendActivations))
    lists[0][i] = dataclasses.replace(lists[0][i], peer_replica=1)
    with pytest.raises(ScheduleError, match="names replica 1"):
        check_schedules(lists, spec)


def test_checker_catches_an_exceeded_stash_depth():
    spec, lists = straight("pipedream")
    free = next(i for i, a in enumerate(lists[0]) if isinstance(a, FreeWeights))
    lists[0].append(lists[0].pop(free))  # free the stash only at the very end
    with pytest.raises(ScheduleError, match="weight versions, declared"):
        check_schedules(lists, spec)


# ---- interpreter form and validation ----


def test_every_action_has_a_docstring_and_unknown_actions_are_errors():
    assert all(t.__doc__ and len(t.__doc__.splitlines()) == 1 for t in ACTION_TYPES)
    table = {Forward: lambda a: ("fwd", a.microbatch_id)}
    assert dispatch(table, Forward(3, 0)) == ("fwd", 3)
    with pytest.raises(UnknownActionError, match="Backward"):
        dispatch(table, Backward(3, 0))


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="zigzag"), "not one of"),
    (dict(num_microbatches=3, replicas=(2, 1)), "multiple"),
    (dict(name="2bw", num_stages=4, num_microbatches=2), "two weight buffers"),
    (dict(name="gpipe", vertical_sync=True), "vertical_sync"),
    (dict(replicas=(1,)), "entries"),
])
def test_bad_parameters_are_user_errors(kwargs, message):
    args = dict(name="1f1b", num_stages=2, num_microbatches=4, num_steps=2)
    args.update(kwargs)
    with pytest.raises(UserError, match=message):
        ScheduleSpec.make(**args)


# ---- simulator ----


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_stages, num_microbatches", [(1, 1), (2, 4), (4, 8), (5, 3)])
def test_flush_schedules_take_the_textbook_time(name, num_stages, num_microbatches):
    fwd_ms, bwd_ms = 1.0, 2.0
    spec = ScheduleSpec.make(name, num_stages, num_microbatches, 3)
    sim = simulate(spec, [StageCost(fwd_ms, bwd_ms)] * num_stages)
    textbook_ms = (num_microbatches + num_stages - 1) * (fwd_ms + bwd_ms)
    assert sim.time_per_minibatch_ms == pytest.approx(textbook_ms)
    assert sim.makespan_ms == pytest.approx(3 * textbook_ms)
    bubble = (num_stages - 1) / (num_microbatches + num_stages - 1)
    assert sim.bubble_fraction == pytest.approx(bubble)


def test_pipedream_steady_state_is_the_slowest_stage():
    costs = [StageCost(1.0, 2.0), StageCost(2.0, 3.0), StageCost(1.0, 1.0)]
    spec = ScheduleSpec.make("pipedream", 3, 4, 20)
    sim = simulate(spec, costs)
    assert sim.time_per_minibatch_ms == pytest.approx(4 * 5.0, rel=0.03)
    flush = simulate(ScheduleSpec.make("1f1b", 3, 4, 20), costs)
    assert flush.time_per_minibatch_ms > sim.time_per_minibatch_ms


def test_simulated_timeline_respects_each_rank_order_and_communication():
    spec = ScheduleSpec.make("1f1b", 3, 4, 2, replicas=(1, 2, 1))
    costs = [StageCost(1.0, 2.0, comm_ms=0.5, optimizer_ms=0.2, allreduce_ms=0.3)] * 3
    for mode in SendMode:
        sim = simulate(spec, costs, mode)
        for rank, timeline in enumerate(sim.timeline):  # eager sends: the lists a socket transport runs
            assert [t.action for t in timeline] == build_all(spec, eager_sends=mode is SendMode.EAGER)[rank]
            busy = [t for t in timeline if not isinstance(t.action, SendActivations)]
            for before, after in zip(busy, busy[1:]):
                assert after.start_ms >= before.start_ms
        comm_free = simulate(spec, [dataclasses.replace(c, comm_ms=0.0) for c in costs], mode)
        assert sim.makespan_ms > comm_free.makespan_ms


def test_checker_rejects_an_unknown_action_type():
    spec, lists = straight()
    lists[0].insert(0, "Forward(0)")
    with pytest.raises(ScheduleError, match="unknown action"):
        check_schedules(lists, spec)


@pytest.mark.parametrize("name,replicas", [("1f1b", (1, 1, 1)), ("gpipe", (2, 1)), ("pipedream", (1, 1)),
                                           ("pipedream", (1, 2)), ("2bw", (1, 1))])
def test_evaluation_blocks_run_after_their_minibatch_on_every_process(name: str, replicas: tuple[int, ...]) -> None:
    from pdcli.schedule import EndEval, EvalForward, build_for, drain_points, eval_points

    steps, m = 6, 4
    evals = eval_points(steps, 2, at_start=True)
    assert evals == (0, 2, 4, 6)
    drains = drain_points(steps, 0, extra=evals)
    spec = ScheduleSpec.make(name, len(replicas), m, steps, replicas, drain_after=drains, eval_after=evals,
                             num_eval_microbatches=2 * m)
    for eager in (False, True):
        if not eager and name == "pipedream" and max(replicas) > 1:
            continue  # replicated pipedream needs posted sends, evaluation or not
        lists = build_all(spec, eager_sends=eager)
        check_schedules(lists, spec, SendMode.EAGER if eager else SendMode.RENDEZVOUS)
    for rank, actions in enumerate(build_all(spec)):
        stage_id, replica_id = spec.stage_replica_of(rank)
        assert isinstance(actions[0], (EvalForward, RecvActivations))  # evaluation 0 precedes training
        assert [a.after_minibatches for a in actions if isinstance(a, EndEval)] == list(evals)
        held_out = [a.eval_microbatch for a in actions if isinstance(a, EvalForward)]
        assert held_out == list(range(replica_id, 2 * m, replicas[stage_id])) * len(evals)
        ids = {a.microbatch_id for a in actions if isinstance(a, EvalForward)}
        assert min(ids) >= spec.total_microbatches and len(ids) == len(held_out)
        resumed = build_for(spec, stage_id, replica_id, start_minibatch=4)
        assert [a.after_minibatches for a in resumed if isinstance(a, EndEval)] == [4, 6]  # 4 runs again


def test_pipedream_evaluation_between_drain_points_is_refused() -> None:
    with pytest.raises(UserError, match="must be at drain points"):
        ScheduleSpec.make("pipedream", 2, 2, 6, eval_after=(3, 6), num_eval_microbatches=2)


def test_action_lists_in_text_form() -> None:
    from pdcli.schedule import action_text, parse_action

    def text(spec: ScheduleSpec) -> list[str]:
        return [" ".join(action_text(a) for a in actions) for actions in build_all(spec)]

    # 1f1b, 2 stages, 2 microbatches: stage 0 runs both forwards before its first backward
    assert text(ScheduleSpec.make("1f1b", 2, 2, 1)) == [
        "L0 F0@v0 SA0->r0 L1 F1@v0 RG0<-r0 SA1->r0 B0@v0 RG1<-r0 B1@v0 U#0/2",
        "RA0<-r0 L0 F0@v0 B0@v0 SG0->r0 RA1<-r0 L1 F1@v0 B1@v0 SG1->r0 U#0/2",
    ]
    # pipedream: stage 0 stashes version 0 for microbatch 1's backward while microbatch 2 runs on version 1
    assert text(ScheduleSpec.make("pipedream", 2, 1, 3))[0] == (
        "L0 F0@v0 SA0->r0 L1 F1@v0 RG0<-r0 SA1->r0 B0@v0 SW@v0 U#0/1 L2 F2@v1 RG1<-r0 SA2->r0 B1@v0 FW@v0 SW@v1 "
        "U#1/1 RG2<-r0 B2@v1 FW@v1 U#2/1")
    for name in ("pipedream", "2bw", "1f1b", "gpipe"):
        spec = ScheduleSpec.make(name, 3, 4, 3, (2, 1, 1), split_backward=name in ("1f1b", "gpipe"),
                                 eval_after=(3,), num_eval_microbatches=4)
        for actions in build_all(spec):
            assert [parse_action(action_text(a)) for a in actions] == actions
    with pytest.raises(ValueError, match="'F3@1' is not an action"):
        parse_action("F3@1")


@pytest.mark.parametrize("name", ["pipedream", "2bw", "1f1b", "gpipe"])
def test_the_rules_table_says_what_the_spec_does(name: str) -> None:
    """`RULES` (what the planner, the config and the runtime ask) against the spec's own numbers."""
    from pdcli.schedule.spec import rules

    r = rules(name)
    for replicas, m in (((1, 1, 1, 1), 8), ((2, 1, 1), 4), ((1, 2), 2), ((1,), 4)):
        spec = ScheduleSpec.make(name, len(replicas), m, 6, replicas)
        for stage_id, reps in enumerate(replicas):
            depth = spec.stash_depth(stage_id)
            devices_from = sum(replicas[stage_id:])
            in_flight = {"all": m // reps, "devices_upto_all": min(-(-devices_from // reps), m // reps),
                         "devices": -(-devices_from // reps)}[r.in_flight]
            assert depth.activation_sets == in_flight, (replicas, stage_id)
            assert depth.weight_versions == (r.weight_buffers or in_flight), (replicas, stage_id)
            steps = spec.total_microbatches // reps if r.step_per_microbatch else spec.num_steps
            assert spec.num_optimizer_steps(stage_id) == steps
        assert spec.is_flush == r.flush
        if r.flush:  # no stale weights
            assert all(spec.update_delay(k) == 0 for k in range(len(replicas)))
    with pytest.raises(UserError, match="'zb' is not one of"):
        rules("zb")


def test_which_action_texts_wait_for_a_peer() -> None:
    from pdcli.schedule.actions import waits_for_peer

    assert [waits_for_peer(t) for t in ("RA3<-r0", "RG3<-r1", "AR#2", "F3@v1", "SA3->r0", "U#2/4", "connect")] == [
        True, True, True, False, False, False, False]

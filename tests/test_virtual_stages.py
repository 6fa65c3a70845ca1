"""Virtual stages (`schedule.virtual_stages`): interleaved, loopedbfs and zbv as action lists.

Pure: the orders a reviewer can read, the placement of chunks on devices, the checker's proof
of every list (each microbatch's F, B and W on every chunk once, no deadlock, one update after
all gradients), the simulator's bubble, and the refusals (exit 2 messages naming the key).
"""

from __future__ import annotations

import dataclasses

import pytest

from pdcli.errors import UserError
from pdcli.schedule import ScheduleSpec, action_text, build_all, build_for, parse_action
from pdcli.schedule.actions import (
    AllReduceGrads, Backward, Forward, LoadMicrobatch, OptimizerStep, RecvActivations, RecvGrads, SendActivations,
    SendGrads, WeightGrads,
)
from pdcli.schedule.checker import ScheduleError, SendMode, check_schedules
from pdcli.schedule.simulator import StageCost, simulate
from pdcli.schedule.spec import INTERLEAVED, LOOPED_BFS, ZBV, virtual_problems

CHUNKED = (INTERLEAVED, LOOPED_BFS, ZBV)


def spec_of(name: str, devices: int, microbatches: int, steps: int = 2, **kw) -> ScheduleSpec:
    return ScheduleSpec.make(name, devices, microbatches, steps, virtual_stages=2, split_backward=name == ZBV, **kw)


def compute(spec: ScheduleSpec, device: int) -> list[str]:
    return [action_text(a).split("@")[0] for a in build_for(spec, device) if isinstance(a, (Forward, Backward, WeightGrads))]


def test_chunk_text_forms_round_trip_and_plain_forms_are_unchanged():
    for action in (Forward(3, 1, 2), Backward(0, 0, 5), WeightGrads(2, 1), SendActivations(3, 0, 2),
                   RecvGrads(1, 0, 0), LoadMicrobatch(4, 7)):
        assert parse_action(action_text(action)) == action
    assert action_text(Forward(3, 1, 2)) == "F3:c2@v1"
    assert action_text(SendActivations(3, 0, 2)) == "SA3:c2->r0"
    assert action_text(Forward(3, 1)) == "F3@v1" and action_text(WeightGrads(3)) == "W3"


def test_placement_loop_and_v():
    loop = spec_of(INTERLEAVED, 4, 4)
    assert [loop.chunks_of(d) for d in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    v = spec_of(ZBV, 4, 4)
    assert [v.chunks_of(d) for d in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [v.stage_of_chunk(c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_interleaved_is_megatrons_order():
    spec = spec_of(INTERLEAVED, 2, 4, steps=1)
    # device 0: warm-up (2-0-1)*2 + (2-1)*2 = 4 forwards over both chunks, then 1F1B, the last chunk backwards first
    assert compute(spec, 0) == ["F0:c0", "F1:c0", "F0:c2", "F1:c2", "F2:c0", "B0:c2", "F3:c0", "B1:c2",
                                "F2:c2", "B0:c0", "F3:c2", "B1:c0", "B2:c2", "B3:c2", "B2:c0", "B3:c0"]
    assert compute(spec, 1)[:4] == ["F0:c1", "F1:c1", "F0:c3", "B0:c3"]


def test_loopedbfs_is_breadth_first():
    spec = spec_of(LOOPED_BFS, 2, 2, steps=1)
    assert compute(spec, 0) == ["F0:c0", "F1:c0", "F0:c2", "F1:c2", "B0:c2", "B1:c2", "B0:c0", "B1:c0"]


def test_zbv_splits_backward_and_the_v_hands_over_in_the_process():
    spec = spec_of(ZBV, 2, 4, steps=1)
    order = compute(spec, 1)
    for mb in range(4):
        for c in (1, 2):
            assert order.index(f"B{mb}:c{c}") < order.index(f"W{mb}:c{c}")
    lists = build_all(spec, eager_sends=True)
    # chunk 1 -> chunk 2 both live on device 1: its send and receive are in device 1's own list
    assert SendActivations(0, 0, 1) in lists[1] and RecvActivations(0, 0, 2) in lists[1]
    assert SendGrads(0, 0, 2) in lists[1] and RecvGrads(0, 0, 1) in lists[1]
    # device 0 holds the first and the last chunk: it loads the inputs and the target
    assert LoadMicrobatch(0, 0) in lists[0] and LoadMicrobatch(0, 3) in lists[0]


@pytest.mark.parametrize("name", CHUNKED)
@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("microbatches", [2, 4, 8])
def test_checker_accepts_every_chunked_schedule(name: str, devices: int, microbatches: int) -> None:
    if name == INTERLEAVED and microbatches % devices:
        with pytest.raises(UserError, match="schedule.num_microbatches"):
            spec_of(name, devices, microbatches)
        return
    spec = spec_of(name, devices, microbatches, steps=3, eval_after=(1, 3), num_eval_microbatches=microbatches)
    report = check_schedules(build_all(spec, eager_sends=True), spec, SendMode.EAGER)
    for device, held in enumerate(report.max_depth_by_rank):
        assert held.activation_sets <= spec.stash_depth(device).activation_sets
    check_schedules(build_all(spec), spec, SendMode.RENDEZVOUS)  # the lists for blocking sends (NCCL)
    check_schedules(build_all(spec), spec, SendMode.EAGER)


@pytest.mark.parametrize("name", [INTERLEAVED, LOOPED_BFS])
@pytest.mark.parametrize("devices", [2, 4])
def test_merged_weight_grads_run_chunk_by_chunk_where_no_peer_waits(name: str, devices: int) -> None:
    """Each chunk's W's run back to back after its last Backward: at the flush, except device
    0's chunk S, whose run fills the wait for chunk 0's gradients (device 0 sends nothing more
    in the minibatch, so no peer waits for it)."""
    from test_schedule import assert_merged_weight_grads

    spec = dataclasses.replace(spec_of(name, devices, 8, steps=3, eval_after=(1, 3), num_eval_microbatches=8),
                               split_backward=True, merge_weight_grads=True)
    early = [spec.num_steps] + [0] * (devices - 1)
    for eager in (True, False):  # False: blocking sends, each moved to where its receive takes it
        lists = build_all(spec, eager_sends=eager)
        assert [assert_merged_weight_grads(actions) for actions in lists] == [(spec.num_steps, e) for e in early]
        modes = [SendMode.EAGER] if eager else [SendMode.RENDEZVOUS, SendMode.EAGER]
        for mode in modes:
            report = check_schedules(lists, spec, mode)
            for device, held in enumerate(report.max_depth_by_rank):
                assert held.activation_sets <= spec.stash_depth(device).activation_sets == 8 * 2


def _weight_grads_at_the_flush(actions):
    """`actions` with every WeightGrads moved to its minibatch's flush (before the optimizer
    step, or the all-reduce before it), by chunk, then microbatch."""
    out, waiting = [], []
    for a in actions:
        if isinstance(a, WeightGrads):
            waiting.append(a)
            continue
        if isinstance(a, (OptimizerStep, AllReduceGrads)) and waiting:
            out += sorted(waiting, key=lambda w: (w.chunk, w.microbatch_id))
            waiting = []
        out.append(a)
    return out


@pytest.mark.parametrize("name", [INTERLEAVED, LOOPED_BFS])
@pytest.mark.parametrize("devices", [2, 4])
def test_merged_weight_grads_before_the_flush_never_take_longer(name: str, devices: int) -> None:
    """Replayed, the lists with device 0's early runs of W's take no longer than the same lists
    with every run at the flush, whatever the chunks cost; interleaved takes less (device 0's
    drain is filled)."""
    spec = dataclasses.replace(spec_of(name, devices, 8, steps=4), split_backward=True, merge_weight_grads=True)
    lists = build_all(spec, eager_sends=True)
    at_flush = [_weight_grads_at_the_flush(actions) for actions in lists]
    assert at_flush != lists
    gains = []
    for costs in ([StageCost(1.0, 2.0, comm_ms=0.05, wgrad_ms=1.0)] * (2 * devices),
                  [StageCost(1.0 + c % 3, 2.0 + c, comm_ms=0.1, wgrad_ms=0.5 + c / 2) for c in range(2 * devices)]):
        early = simulate(spec, costs, lists_by_rank=lists)
        late = simulate(spec, costs, lists_by_rank=at_flush)
        assert early.makespan_ms <= late.makespan_ms + 1e-9
        assert early.time_per_minibatch_ms <= late.time_per_minibatch_ms + 1e-9
        gains.append(late.time_per_minibatch_ms - early.time_per_minibatch_ms)
    if name == INTERLEAVED:
        assert max(gains) > 0


def test_checker_catches_a_missing_backward_on_one_chunk():
    spec = spec_of(INTERLEAVED, 2, 2, steps=1)
    lists = build_all(spec, eager_sends=True)
    lists[0] = [a for a in lists[0] if a != Backward(1, 0, 2) and a != RecvGrads(1, 0, 2)]
    with pytest.raises(ScheduleError):
        check_schedules(lists, spec, SendMode.EAGER)


def test_lists_for_blocking_sends_move_sends_to_their_receives():
    """With blocking sends, two neighbours that send each other a chunk's output at once would
    wait forever (the eager lists deadlock); the lists for such a transport hold each send back
    to where its receiver takes it: the same actions, the same order of everything else, and a
    run resumed at a minibatch boundary is the suffix of the same lists."""
    spec = spec_of(LOOPED_BFS, 2, 4)
    eager = build_all(spec, eager_sends=True)
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedules(eager, spec, SendMode.RENDEZVOUS)
    blocking = build_all(spec)
    check_schedules(blocking, spec, SendMode.RENDEZVOUS)
    sends = (SendActivations, SendGrads)
    for before, after in zip(eager, blocking):
        assert sorted(map(repr, before)) == sorted(map(repr, after))
        assert [a for a in before if not isinstance(a, sends)] == [a for a in after if not isinstance(a, sends)]
        for index, action in enumerate(after):  # a send still follows the compute that made it
            if isinstance(action, SendActivations):
                assert Forward(action.microbatch_id, action.microbatch_id // 4, action.chunk) in after[:index]
    for device in range(2):
        assert build_for(spec, device, start_minibatch=1) == blocking[device][
            next(i for i, a in enumerate(blocking[device]) if action_text(a) == "U#0/4") + 1:]


@pytest.mark.parametrize("devices,microbatches", [(2, 4), (4, 8), (4, 4)])
def test_interleaved_bubble_is_smaller_than_1f1b(devices: int, microbatches: int) -> None:
    """The same model and per-device work: one stage per device (1f1b) or two chunks of half each."""
    plain = simulate(ScheduleSpec.make("1f1b", devices, microbatches, 1), [StageCost(1.0, 2.0)] * devices)
    chunked = simulate(spec_of(INTERLEAVED, devices, microbatches, steps=1), [StageCost(0.5, 1.0)] * (2 * devices))
    assert chunked.bubble_fraction < plain.bubble_fraction
    assert chunked.makespan_ms < plain.makespan_ms
    zbv = simulate(spec_of(ZBV, devices, microbatches, steps=1), [StageCost(0.5, 1.0, wgrad_ms=0.5)] * (2 * devices))
    assert zbv.bubble_fraction < chunked.bubble_fraction


def test_a_hand_over_inside_a_device_costs_no_transfer():
    spec = spec_of(ZBV, 2, 2, steps=1)
    fast = simulate(spec, [StageCost(1.0, 2.0, comm_ms=0.0, wgrad_ms=1.0)] * 4)
    slow_link = [StageCost(1.0, 2.0, comm_ms=0.0, wgrad_ms=1.0)] * 4
    slow_link[1] = StageCost(1.0, 2.0, comm_ms=5.0, wgrad_ms=1.0)  # chunk 1 -> 2: the same device
    assert simulate(spec, slow_link).makespan_ms == fast.makespan_ms


def test_refusals_name_the_key():
    assert "schedule.virtual_stages" in virtual_problems("1f1b", 2, True, 4)
    assert "schedule.virtual_stages" in virtual_problems(ZBV, 3, True, 4)
    assert "schedule.split_backward" in virtual_problems(ZBV, 2, False, 4)
    assert "schedule.num_microbatches" in virtual_problems(INTERLEAVED, 2, True, 6, num_devices=4)
    assert virtual_problems(LOOPED_BFS, 3, False, 5, num_devices=4) == {}
    with pytest.raises(UserError, match="plan.replicas"):
        ScheduleSpec.make(INTERLEAVED, 2, 4, 1, replicas=(2, 1), virtual_stages=2)


def test_pd_refuses_bad_virtual_stage_settings_with_exit_2(tmp_path) -> None:
    """Before anything runs: the key, the reason, no traceback."""
    from pathlib import Path

    from typer.testing import CliRunner

    from pdcli.cli import app

    quickstart = str(Path(__file__).resolve().parents[1] / "recipes/quickstart.yaml")
    root = f"run.root={tmp_path}"
    for args, expect in [
        (["schedule.name=1f1b", "schedule.virtual_stages=2"], "schedule.virtual_stages: 2 chunks per device, but 1f1b"),
        (["schedule.name=zbv", "schedule.virtual_stages=3"], "zbv takes exactly 2 chunks per device"),
        (["schedule.name=zbv", "schedule.virtual_stages=2", "schedule.split_backward=false"], "schedule.split_backward"),
        (["schedule.name=interleaved", "schedule.virtual_stages=2", "plan.num_stages=4", "schedule.num_microbatches=2"],
         "use a multiple of the 4 devices"),
        (["schedule.name=loopedbfs", "schedule.virtual_stages=2", "plan.replicas=[2,1]"], "plan.replicas"),
    ]:
        result = CliRunner().invoke(app, ["train", quickstart, root, *args])
        assert result.exit_code == 2, (args, result.output)
        assert expect in result.output and "Traceback" not in result.output, (args, result.output)


# ---- pd plan: chunks placed on devices, the lists replayed ----


def uniform_chain(n: int = 16):
    from pdcli.profiler.chain import Chain, ChainNode

    nodes = tuple(ChainNode(name=f"n{i}", label=f"layer{i}", fwd_ms=1.0, bwd_ms=2.0, parameter_bytes=1000,
                            activation_bytes=4000, backward_memory_bytes=0, optimizer_ms=0.1)
                  for i in range(n))
    return Chain(nodes=nodes, cut_bytes=(100,) * (n - 1), meta={})


@pytest.mark.parametrize("name,ranks", [(INTERLEAVED, [0, 1, 0, 1]), (LOOPED_BFS, [0, 1, 0, 1]), (ZBV, [0, 1, 1, 0])])
def test_plan_places_chunks_and_predicts_the_replay(name: str, ranks: list[int]) -> None:
    from pdcli.planner import PlanOptions, Topology, plan_chain
    from pdcli.planner.plan import Plan as PlanFile
    from pdcli.runtime.placement import Placement

    options = PlanOptions(schedule=name, num_microbatches=4, batch_size=4, straight=True, virtual_stages=2,
                          split_backward=name == ZBV)
    plan = plan_chain(uniform_chain(), Topology.flat(2), options)
    assert len(plan.stages) == 4 and [s.ranks for s in plan.stages] == [(r,) for r in ranks]
    assert [s.end - s.start for s in plan.stages] == [4, 4, 4, 4]  # a uniform model: equal chunks
    devices = plan.pipeline["devices"]
    assert [row["chunks"] for row in devices] == [[k for k, r in enumerate(ranks) if r == d] for d in (0, 1)]
    # the predicted time is the replay of the schedule's lists with each chunk's costs
    spec = ScheduleSpec.make(name, 2, 4, 16, virtual_stages=2, split_backward=name == ZBV)
    per_mb = [StageCost(fwd_ms=s.predicted["fwd_ms"] / 4, bwd_ms=s.predicted["bwd_ms"] / 4,
                        wgrad_ms=s.predicted["wgrad_ms"] / 4, comm_ms=s.predicted["comm_out_ms"] / 8,
                        optimizer_ms=s.predicted["optimizer_ms"]) for s in plan.stages]
    assert plan.time_per_minibatch_ms == pytest.approx(simulate(spec, per_mb).time_per_minibatch_ms)
    # plan.json round-trips, and the runtime reads its placement
    obj = plan.to_json()
    assert PlanFile.from_json(obj).to_json() == obj and obj["inputs"]["virtual_stages"] == 2
    placement = Placement.from_plan(obj)
    assert placement.world_size == 2 and placement.virtual and placement.chunks_of(0) == tuple(
        k for k, r in enumerate(ranks) if r == 0)


def test_chunks_on_two_hosts_pay_the_slow_link_where_they_cross_it() -> None:
    """ZB-V on two hosts: chunks 0|1 and 2|3 cross between the hosts, 1|2 stays on device 1;
    the plan prices the crossings at the link's rate, so a slow link costs what it carries."""
    from pdcli.planner import PlanOptions, Topology, plan_chain
    from pdcli.planner.virtual import chunk_links

    spec = ScheduleSpec.make(ZBV, 2, 4, 16, virtual_stages=2, split_backward=True)
    slow = Topology.from_levels([{"devices": 1, "bandwidth_bytes_per_s": 1e10}, {"devices": 2, "bandwidth_bytes_per_s": 1e5}])
    links = chunk_links(slow, spec)
    assert links is not None and chunk_links(Topology.flat(2, 1e10), spec) is None
    assert links.bandwidth[0, 1] == links.bandwidth[2, 3] == 1e5 and links.bandwidth[1, 2] == 1e10
    options = PlanOptions(schedule=ZBV, num_microbatches=4, batch_size=4, straight=True, virtual_stages=2,
                          split_backward=True, refine=False)
    fast = plan_chain(uniform_chain(), Topology.flat(2, 1e10), options)
    over = plan_chain(uniform_chain(), slow, options)
    # 100 bytes per cut and minibatch at 1e5 bytes/s: 1 ms each way per crossing, one crossing the bottleneck
    assert over.time_per_minibatch_ms > fast.time_per_minibatch_ms + 1.0
    assert [s.predicted["comm_out_ms"] for s in over.stages][1] == pytest.approx(
        [s.predicted["comm_out_ms"] for s in fast.stages][1])  # 1|2 on one device: no slower


def test_plan_memory_is_the_sum_of_a_devices_chunks_and_refuses_past_the_limit() -> None:
    from pdcli.planner import PlanOptions, Topology, plan_chain

    options = PlanOptions(schedule=INTERLEAVED, num_microbatches=4, batch_size=4, straight=True, virtual_stages=2)
    plan = plan_chain(uniform_chain(), Topology.flat(2), options)
    for row in plan.pipeline["devices"]:
        fixed = sum(plan.stages[c].predicted["weights_bytes"] + plan.stages[c].predicted["optimizer_state_bytes"]
                    for c in row["chunks"])
        assert row["total_bytes"] == pytest.approx(fixed + row["activations_bytes"])
        assert row["activations_bytes"] > 0
    need = max(row["total_bytes"] for row in plan.pipeline["devices"])
    with pytest.raises(UserError, match="no plan fits"):
        plan_chain(uniform_chain(), Topology.flat(2), dataclasses.replace(options, memory_bytes_per_device=need * 0.9))


@pytest.mark.slow
@pytest.mark.parametrize("name", CHUNKED)
def test_plan_replay_refines_the_searched_chunks(name: str) -> None:
    """The plan is never slower (replayed) than the search's own chunks, whose cuts it may move."""
    import random

    from pdcli.planner import PlanOptions, Topology, plan_chain
    from pdcli.planner.search import pd_search
    from pdcli.planner.space import SplitSpace
    from pdcli.planner.virtual import STAND_INS
    from pdcli.profiler.chain import Chain, ChainNode

    rng = random.Random(7)
    for _ in range(3):
        nodes = tuple(ChainNode(name=f"n{i}", label=f"l{i}", fwd_ms=rng.uniform(0.5, 3), bwd_ms=rng.uniform(1, 6),
                                parameter_bytes=1000, activation_bytes=4000, backward_memory_bytes=0, optimizer_ms=0.1)
                      for i in range(14))
        chain = Chain(nodes=nodes, cut_bytes=tuple(rng.randrange(100, 10_000) for _ in range(13)), meta={})
        options = PlanOptions(schedule=name, num_microbatches=4, batch_size=4, straight=True, virtual_stages=2,
                              split_backward=name == ZBV)
        searched = pd_search(SplitSpace.from_chain(chain), Topology.flat(4), dataclasses.replace(
            options, schedule=STAND_INS[name], num_stages=4, virtual_stages=1), 1.0)
        assert searched is not None
        fixed = tuple(s.start for s in searched.stages[1:])
        plan = plan_chain(chain, Topology.flat(2), options)
        assert plan.time_per_minibatch_ms <= plan_chain(chain, Topology.flat(2), dataclasses.replace(
            options, boundaries=fixed)).time_per_minibatch_ms * (1 + 1e-9)


def test_a_weight_tied_between_chunks_is_refused_before_any_worker() -> None:
    from pdcli.runtime.tied import check_schedule

    manifest = {"tied_weights": [{"holders": {"0": "lm_head.weight", "3": "lm_head.weight"}, "names": []}]}
    for name in CHUNKED:
        with pytest.raises(UserError, match=f"{name} cannot train a weight tied between stages .*chunks"):
            check_schedule(manifest, name)


def test_loopedbfs_merges_its_weight_gradients_unless_told_otherwise() -> None:
    """`schedule.merge_weight_grads: null`: on for loopedbfs with a split backward, off for every
    other schedule; an explicit value wins. The config, the planner's options, the search's
    configurations and the chunks' stand-in pricing all resolve it the same way."""
    from pdcli.config.schema import ScheduleConfig
    from pdcli.planner import PlanOptions, Topology
    from pdcli.planner.pareto import Configuration, config_options
    from pdcli.planner.virtual import chunk_pricing
    from pdcli.schedule.spec import FLUSH_SCHEDULES, SCHEDULES

    merged = {name for name in SCHEDULES if ScheduleConfig(name=name, virtual_stages=2).merge_weight_grads_on}
    assert merged == {LOOPED_BFS}
    assert not ScheduleConfig(name=LOOPED_BFS, split_backward=False).merge_weight_grads_on
    assert not ScheduleConfig(name=LOOPED_BFS, merge_weight_grads=False).merge_weight_grads_on
    assert ScheduleConfig(name="1f1b", merge_weight_grads=True).merge_weight_grads_on
    spec = ScheduleSpec.from_config(ScheduleConfig(name=LOOPED_BFS, num_microbatches=4, virtual_stages=2), [1, 1], 2)
    assert spec.merge_weight_grads and all(spec.merges_weight_grads(stage) for stage in range(2))

    base = PlanOptions(batch_size=32, schedule=LOOPED_BFS, split_backward=True, virtual_stages=2)
    assert base.merges_weight_grads and not dataclasses.replace(base, split_backward=False).merges_weight_grads
    searched = {name: config_options(base, Configuration(name, 4, True)).merges_weight_grads
                for name in FLUSH_SCHEDULES if name != "file"}
    assert searched == {name: name == LOOPED_BFS for name in searched}
    told = dataclasses.replace(base, merge_weight_grads=False)
    assert not config_options(told, Configuration(LOOPED_BFS, 4, True)).merges_weight_grads
    _, stand_in = chunk_pricing(Topology.flat(2, 1e9), base, 4)  # priced as gpipe chunks, merged as loopedbfs runs
    assert stand_in.schedule == "gpipe" and stand_in.merges_weight_grads

"""The runtime-cost model: each measured term moves the prediction, the replay's message and core
terms, the probe's fit, and the plan refined by replay (pure, no processes)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pdcli.planner import PlanOptions, Topology, plan_chain
from pdcli.planner.evaluate import batch_scale, evaluate_pd
from pdcli.planner.runtime_costs import DIRECT, RUNTIME_META, STASHED, TERMS, Affine, ModeCosts, RuntimeCosts
from pdcli.planner.search import pd_search
from pdcli.planner.space import SplitSpace
from pdcli.schedule.simulator import StageCost, simulate, steady_window
from pdcli.profiler.chain import Chain, ChainNode
from pdcli.planner.runtime_costs import fit_affine
from pdcli.probe.runtime import probe_boundaries
from pdcli.schedule import ScheduleSpec

MODE = ModeCosts(forward=Affine(1.3, 0.05), backward=Affine(1.2, 0.04), wgrad=Affine(1.1, 0.01),
                 update=Affine(1.5, 0.03))
RUNTIME = RuntimeCosts(
    modes={STASHED: MODE, DIRECT: MODE}, loss_fwd_ms=0.02, loss_bwd_ms=0.03, load_inputs_ms=0.2,
    load_target_ms=0.1, send=Affine(1e-6, 0.02), recv=Affine(1e-6, 0.01), latency_ms=1.0,
    bandwidth_bytes_per_s=5e7, transport="socket", cores=1, gap_ms=0.01,
    position_scale=tuple(1.0 + 0.05 * i for i in range(8)),  # the default chain's 8 positions
    shared_slowdown=1.2,
)


def chain(runtime: RuntimeCosts | None = RUNTIME, n: int = 8) -> Chain:
    nodes = tuple(ChainNode(name=f"n{i}", label=f"layer{i}", fwd_ms=0.1 + 0.02 * i, bwd_ms=0.2 + 0.03 * i,
                            parameter_bytes=40_000, activation_bytes=8192, backward_memory_bytes=8192,
                            optimizer_ms=0.02, wgrad_ms=0.05) for i in range(n))
    meta = {"batch_size": 16, "optimizer": {"step_overhead_ms": 0.01}}
    if runtime is not None:
        meta[RUNTIME_META] = runtime.to_json()
    return Chain(nodes=nodes, cut_bytes=(8192,) * (n - 1), meta=meta)


def predicted_ms(c: Chain, schedule: str = "pipedream", boundaries: tuple[int, ...] | None = (4,)) -> float:
    options = PlanOptions(schedule=schedule, num_microbatches=4, batch_size=64, num_stages=2, boundaries=boundaries,
                          split_backward=schedule in ("1f1b", "gpipe"))
    return plan_chain(c, Topology.flat(2, 1e9), options).time_per_minibatch_ms


def test_runtime_costs_round_trip_through_json() -> None:
    assert RuntimeCosts.from_json(RUNTIME.to_json()) == RUNTIME
    assert RuntimeCosts.from_meta({}) is None


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b"])
@pytest.mark.parametrize("term", TERMS)
def test_each_runtime_term_moves_the_prediction(schedule: str, term: str) -> None:
    """Every term the probe measures counts: switched off, the plan predicts less time (the
    others with a core per worker: one core for two would hide the waits behind its bound)."""
    base = RUNTIME if term in ("cores", "sharing") else RUNTIME.without("cores")
    full = predicted_ms(chain(base), schedule)
    assert predicted_ms(chain(base.without(term)), schedule) < full * (1 - 1e-6)


def test_the_measured_all_reduce_prices_replicated_stages() -> None:
    """This host's all-reduce line (slower than the ring over the nominal bandwidth) prices a
    replicated stage's sync; switched off with the measured transport, the ring is back."""
    from pdcli.planner.costs import replica_allreduce_ms

    measured = dataclasses.replace(RUNTIME.without("cores"), allreduce=Affine(2e-6, 3.0))
    assert RuntimeCosts.from_json(measured.to_json()) == measured
    assert measured.without("transport").allreduce is None
    line = Affine(2e-6, 3.0)
    assert replica_allreduce_ms(1e6, 1, 1e9, line) == 0.0
    assert replica_allreduce_ms(1e6, 2, 1e9, line) == pytest.approx(3.0 + 2.0)  # slower than the ring's 1 ms
    assert replica_allreduce_ms(1e6, 4, 1e9, line) == pytest.approx(3 * 3.0 + 2e-6 * 1e6 * 1.5)
    assert replica_allreduce_ms(1e6, 2, 1e5, line) == pytest.approx(replica_allreduce_ms(1e6, 2, 1e5))  # a slow link
    options = PlanOptions(schedule="1f1b", num_microbatches=4, batch_size=64, replicas=(2,), num_stages=1)
    ring = plan_chain(chain(measured.without("transport")), Topology.flat(2, 1e9), options)
    host = plan_chain(chain(measured), Topology.flat(2, 1e9), options)
    assert host.stages[0].predicted["sync_ms"] > ring.stages[0].predicted["sync_ms"] + 2.0
    assert host.time_per_minibatch_ms > ring.time_per_minibatch_ms


def test_calibration_rescales_the_all_reduce_to_the_runs() -> None:
    from pdcli.report.calibrate import refit_allreduce

    line = Affine(1e-6, 1.0)
    assert refit_allreduce([], line) == line and refit_allreduce([(1e6, 2, 4.0)], None) is None
    refitted = refit_allreduce([(1e6, 2, 4.0), (3e6, 2, 8.0)], line)  # predicted 2 + 4 = 6 ms, measured 12
    assert refitted == Affine(2e-6, 2.0)


def test_calibration_refits_each_stages_positions_to_what_the_stage_took() -> None:
    """A run's stage that took more than the refitted line through all stages says gets that
    factor on its positions (times the factors it was priced with), fixed costs included; the
    factors of a profile of another length are ignored."""
    from pdcli.report.calibrate import refit_positions

    mode = ModeCosts(forward=Affine(2.0, 0.1), backward=Affine(1.0, 0.2), wgrad=Affine(1.0, 0.0),
                     update=Affine(1.0, 0.0))
    # [0, 3) on the line (2 x 1 + 1 x 2 + 0.3 = 4.3); [3, 5), priced with factor 2, 1.5x above
    # its line (2 x 2 + 1 x 4 + 0.3 x 2 = 8.6)
    points = {"forward": ([1.0, 2.0], [2.1, 6.45]), "backward": ([2.0, 4.0], [2.2, 6.45])}
    factors = refit_positions([(0, 3), (3, 5)], points, mode, [1.0, 1.0, 1.0, 2.0, 2.0], [1.0, 2.0])
    assert factors == pytest.approx([1.0, 1.0, 1.0, 3.0, 3.0])  # 1.5 x the 2.0 it was priced with
    # a line of mostly fixed cost: a stage 20% above it gets 1.2, not 20% / its layers' share
    fixed = ModeCosts(forward=Affine(0.1, 1.0), backward=Affine(0.1, 1.0), wgrad=Affine(1.0, 0.0),
                      update=Affine(1.0, 0.0))
    mostly_fixed = {"forward": ([1.0, 1.0], [1.32, 0.88]), "backward": ([1.0, 1.0], [1.32, 0.88])}
    assert refit_positions([(0, 1), (1, 2)], mostly_fixed, fixed, [1.0, 1.0], [1.0, 1.0]) == pytest.approx((1.2, 0.8))
    nothing = {"forward": ([1.0, 1.0], [2.0, 0.0]), "backward": ([1.0, 1.0], [2.0, 0.0])}  # no spans measured
    assert refit_positions([(0, 1), (1, 2)], nothing, fixed, [1.0, 1.0], [1.0, 1.0])[1] == 1.0
    assert RUNTIME.position_factors(8)[3] == pytest.approx(1.15) and RUNTIME.position_factors(5) == [1.0] * 5
    space = SplitSpace.from_chain(chain(RUNTIME))
    plain = SplitSpace.from_chain(chain(RUNTIME.without("positions")))
    assert np.diff(space.covered_fwd_ms, prepend=0.0) == pytest.approx(
        np.diff(plain.covered_fwd_ms, prepend=0.0) * np.asarray(RUNTIME.position_factors(8)))
    assert plain.position_factor(0, 8) == 1.0 and space.position_factor(3, 4) == pytest.approx(1.15)


def test_a_stages_fixed_costs_run_at_its_position_factor() -> None:
    """A calibrated plan of the run's split prices each stage's forward and backward at the
    stage's factor whole: the affine cost of its profiled times, fixed part included, times
    the factor; the search's matrices carry each stage's factor alike."""
    from pdcli.planner.evaluate import evaluate_plan

    factors = (1.0,) * 4 + (1.6,) * 4
    runtime = dataclasses.replace(RUNTIME.without("cores"), position_scale=factors)
    options = PlanOptions(schedule="pipedream", num_microbatches=4, batch_size=64, num_stages=2, boundaries=(4,))
    plans = {f: plan_chain(chain(dataclasses.replace(runtime, position_scale=f)), Topology.flat(2, 1e9), options)
             for f in (None, factors)}
    plain, scaled = (evaluate_plan(chain(dataclasses.replace(runtime, position_scale=f)), plans[f].to_json())
                     for f in (None, factors))
    for index, ratio in enumerate((1.0, 1.6)):
        before, after = plain.stages[index].actions_ms, scaled.stages[index].actions_ms
        assert before is not None and after is not None
        loss = (RUNTIME.loss_fwd_ms + RUNTIME.loss_bwd_ms) if index == 1 else 0.0
        assert after["fwd_ms"] + after["bwd_ms"] - loss == pytest.approx(
            ratio * (before["fwd_ms"] + before["bwd_ms"] - loss))
    assert plans[factors].time_per_minibatch_ms > plans[None].time_per_minibatch_ms
    from pdcli.planner.search import StageMatrices

    space = SplitSpace.from_chain(chain(runtime))
    matrix = StageMatrices.of(space, 1.0, False).position_factor
    for start, end in ((0, 4), (4, 8), (2, 6), (0, 8)):
        assert matrix[start, end] == pytest.approx(space.position_factor(start, end))
    assert space.position_factor(2, 6) == pytest.approx(1.0 + 0.6 * space.range_total(
        space.covered_unfactored_ms, 4, 6) / space.range_total(space.covered_unfactored_ms, 2, 6))


def test_without_rejects_an_unknown_term() -> None:
    with pytest.raises(ValueError, match="unknown runtime terms"):
        RUNTIME.without("bogus")


def test_plan_without_runtime_costs_is_the_profile_model() -> None:
    """A profile without `meta.runtime` plans as before: no per-action costs in the plan."""
    c = chain(None)
    options = PlanOptions(schedule="pipedream", num_microbatches=4, batch_size=64, num_stages=2)
    plan = plan_chain(c, Topology.flat(2, 1e9), options).to_json()
    assert all("actions_ms" not in s["predicted"] for s in plan["stages"]) and "replay" not in plan["pipeline"]
    costed = plan_chain(chain(), Topology.flat(2, 1e9), options).to_json()
    assert all("actions_ms" in s["predicted"] for s in costed["stages"]) and costed["pipeline"]["replay"]["cores"] == 1


def test_replay_charges_packing_to_the_sender_and_unpacking_to_the_receiver() -> None:
    spec = ScheduleSpec.make("gpipe", 2, 1, 1)
    base = [StageCost(1.0, 1.0, comm_ms=0.5), StageCost(1.0, 1.0, comm_ms=0.5)]
    plain = simulate(spec, base)
    costed = simulate(spec, [dataclasses.replace(base[0], send_acts_ms=0.2, recv_grads_ms=0.1),
                             dataclasses.replace(base[1], recv_acts_ms=0.3, send_grads_ms=0.4)])
    # one microbatch through both stages and back: every CPU cost is on the critical path
    assert costed.makespan_ms == pytest.approx(plain.makespan_ms + 0.2 + 0.3 + 0.4 + 0.1)
    sender = {type(t.action).__name__: t for t in costed.timeline[0]}
    assert sender["SendActivations"].end_ms - sender["SendActivations"].start_ms == pytest.approx(0.2)


def test_replay_interpreter_gap_and_core_bound() -> None:
    spec = ScheduleSpec.make("pipedream", 2, 4, 8)
    costs = [StageCost(1.0, 2.0), StageCost(1.0, 2.0)]
    alone = simulate(spec, costs).time_per_minibatch_ms
    assert alone == pytest.approx(12.0)
    gapped = simulate(spec, [dataclasses.replace(c, gap_ms=0.1) for c in costs]).time_per_minibatch_ms
    assert gapped > alone
    # two busy ranks on one core: their CPU time per minibatch, in a short run as in a long one
    long = ScheduleSpec.make("pipedream", 2, 4, 32)
    assert simulate(long, costs, cores=1).time_per_minibatch_ms == pytest.approx(24.0, rel=0.01)
    assert simulate(spec, costs, cores=1).time_per_minibatch_ms == pytest.approx(24.0, rel=0.01)
    assert simulate(spec, costs, cores=2).time_per_minibatch_ms == pytest.approx(alone)


def test_the_steady_time_stops_where_the_pipeline_drains() -> None:
    """After the first stage's last forward the stages run out of work one by one, and on
    shared cores the first stage gets the cores the others give up: the minibatches still in
    flight complete faster than the pipeline sustains. The steady time stops there, so a
    replay of 16 minibatches prices what one of 256 does; the whole second half would not."""
    costs = [StageCost(2.0, 3.0, 0.1, 0.3)] * 4  # 4 ranks on 2 cores: CPU-bound at 4 x 5.3 / 2 ms
    short, long = (simulate(ScheduleSpec.make("pipedream", 4, 1, n), costs, cores=2) for n in (16, 256))
    assert long.time_per_minibatch_ms == pytest.approx(4 * 5.3 / 2, rel=0.01)
    assert short.time_per_minibatch_ms == pytest.approx(long.time_per_minibatch_ms, rel=0.01)
    done = short.done_ms
    assert (done[-1] - done[-4]) / 3 < 0.75 * long.time_per_minibatch_ms  # the drain
    half = (len(done) - 1) // 2
    assert (done[-1] - done[half]) / (len(done) - 1 - half) < 0.95 * long.time_per_minibatch_ms
    # the window: the second half of the completions no later than the drain's start
    assert steady_window([10.0 * k for k in range(1, 13)], 95.0) == (4, 8)
    assert steady_window([10.0 * k for k in range(1, 13)]) == (5, 11)
    assert steady_window([10.0, 20.0, 30.0], 15.0) == (1, 2)  # too few before it: all of them


def test_shared_cores_queue_ranks_for_a_core_and_stretch_what_waits() -> None:
    # 4 ranks on 2 cores, gpipe with one microbatch: one rank computes at a time (the chain of
    # one microbatch), so nothing waits for a core
    spec = ScheduleSpec.make("gpipe", 4, 1, 1)
    costs = [StageCost(1.0, 2.0)] * 4
    assert simulate(spec, costs, cores=2).makespan_ms == pytest.approx(simulate(spec, costs).makespan_ms)
    # pipedream keeps every rank busy: CPU-bound, 4 ranks x 4 microbatches x 3 ms on 2 cores
    pipedream = ScheduleSpec.make("pipedream", 4, 4, 32)
    shared = simulate(pipedream, costs, cores=2)
    assert shared.time_per_minibatch_ms == pytest.approx(4 * 4 * 3.0 / 2, rel=0.02)
    assert simulate(pipedream, costs).time_per_minibatch_ms == pytest.approx(4 * 3.0)  # a core each
    # a backward (2 ms) outlasts a 1 ms slice with others queued: preempted, its span stretches;
    # a receive's span holds the wait for a core after its message came
    sliced = simulate(pipedream, costs, cores=2, time_slice_ms=1.0)
    spans = {name: [t.end_ms - t.start_ms for rank in sliced.timeline for t in rank if type(t.action).__name__ == name]
             for name in ("Forward", "Backward", "RecvActivations")}
    assert min(spans["Forward"]) == pytest.approx(1.0) and min(spans["Backward"]) == pytest.approx(2.0)
    assert max(spans["Backward"]) > 2.5
    assert sliced.time_per_minibatch_ms == pytest.approx(24.0, rel=0.02)  # the same CPU, shared
    # an all-reduce between replicas waits for both and stretches like any CPU work
    replicated = ScheduleSpec.make("gpipe", 1, 3, 2, [3])
    reduce_costs = [StageCost(1.0, 1.0, allreduce_ms=0.5)]
    timed = simulate(replicated, reduce_costs, cores=1).timeline
    ends = {rank: [t.end_ms for t in timed[rank] if type(t.action).__name__ == "AllReduceGrads"] for rank in range(3)}
    assert ends[0] == ends[1] == ends[2]


def test_fit_affine_recovers_a_line_and_keeps_terms_non_negative() -> None:
    xs = [0.5, 1.0, 2.0, 4.0]
    fit = fit_affine(xs, [1.5 * x + 0.2 for x in xs])
    assert fit.scale == pytest.approx(1.5) and fit.fixed_ms == pytest.approx(0.2)
    through_origin = fit_affine(xs, [2.0 * x - 0.1 for x in xs])
    assert through_origin.fixed_ms == 0.0 and through_origin.scale > 0
    assert fit_affine([1.0, 1.0], [3.0, 3.0]) == Affine(3.0, 0.0)
    assert fit_affine([1.0, 1.0], [3.0, 3.0], single="fixed") == Affine(0.0, 3.0)


def test_probe_stages_hold_growing_shares_of_the_work() -> None:
    c = chain(None, n=20)
    ranges = probe_boundaries(c)
    assert ranges[0][0] == 0 and ranges[-1][1] == 20 and len(ranges) == 4
    assert all(a < b for a, b in ranges) and all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))
    work = np.cumsum([n.fwd_ms + n.bwd_ms for n in c.nodes])
    shares = [(work[b - 1] - (work[a - 1] if a else 0.0)) / work[-1] for a, b in ranges]
    assert shares == sorted(shares)  # different sizes: a fixed cost and a scale can be told apart
    assert probe_boundaries(chain(None, n=2)) == [(0, 1), (1, 2)]


def test_replay_refines_the_searched_split() -> None:
    """The plan's time is its replay, and no plan one boundary away replays faster."""
    c = chain()
    options = PlanOptions(schedule="pipedream", num_microbatches=4, batch_size=64, num_stages=2)
    plan = plan_chain(c, Topology.flat(2, 1e9), options)
    cut = plan.stages[1].start
    for other in range(1, len(c.nodes)):
        if other != cut:
            assert predicted_ms(c, boundaries=(other,)) >= plan.time_per_minibatch_ms * (1 - 1e-9) or abs(other - cut) > 2


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["pipedream", "1f1b", "2bw"])
def test_replay_ranks_the_stage_counts(schedule: str) -> None:
    """The search's own pick (data parallelism here, by its stage-time model) is not what the
    plan keeps when another stage count's best replays faster: the plan is at least as fast
    as every stage count's searched plan, replayed."""
    c = chain(n=12)
    topology = Topology.flat(4, 1e9)
    options = PlanOptions(schedule=schedule, num_microbatches=4, batch_size=64, split_backward=schedule == "1f1b")
    plan = plan_chain(c, topology, options)
    space, scale = SplitSpace.from_chain(c), batch_scale(c.meta, options)
    per_count = []
    for count in range(1, 5):
        found = pd_search(space, topology, dataclasses.replace(options, num_stages=count), scale)
        assert found is not None
        partition = [(s.start, s.end, s.replicas) for s in found.stages]
        per_count.append(evaluate_pd(space, topology, options, scale, partition).time_per_minibatch_ms)
    assert plan.time_per_minibatch_ms <= min(per_count) * (1 + 1e-9)
    assert plan.time_per_minibatch_ms < per_count[0] * 0.99  # faster than the search's pick, 1 stage x 4
    assert pd_search(space, topology, options, scale).stages[0].replicas == 4


@pytest.mark.slow
def test_the_unconstrained_best_is_never_slower_than_the_users_split() -> None:
    """The user's split is a plan without constraints too: when the free search's plan replays
    slower, the user's is the unconstrained best (0% faster, not a negative gain)."""
    n = 13
    c = chain(n=n)
    options = PlanOptions(schedule="pipedream", num_microbatches=4, batch_size=64, num_stages=2)
    search_ms = plan_chain(c, Topology.flat(2, 1e9), options).time_per_minibatch_ms
    beaten = 0
    for boundary in range(1, n):
        plan = plan_chain(c, Topology.flat(2, 1e9), dataclasses.replace(options, num_stages=None,
                                                                        boundaries=(boundary,)))
        free = plan.pipeline["unconstrained"]
        assert free["time_per_minibatch_ms"] <= plan.time_per_minibatch_ms * (1 + 1e-9) and free["faster_pct"] >= 0.0
        if plan.time_per_minibatch_ms < search_ms * (1 - 1e-9):  # the user's split replays faster
            beaten += 1
            assert free["boundaries"] == [boundary] and free["faster_pct"] == 0.0
    assert beaten  # the case this test is about: some split replays faster than the search's pick


def test_probes_run_long_enough_to_measure_by_time() -> None:
    """A probe's measured half lasts `seconds` at the profiled time, within its floor and cap."""
    from pdcli.probe.runtime import minibatches_for, profiled_ms

    assert minibatches_for(0.25, 2.0, 12, 400) == 250  # 2 ms per minibatch: 125 measured = 0.25 s
    assert minibatches_for(0.25, 100.0, 12, 400) == 12  # a slow stage keeps the floor
    assert minibatches_for(10.0, 0.01, 12, 400) == 400
    assert minibatches_for(0.0, 2.0, 12, 400) == 12
    c = chain(n=4)
    assert profiled_ms(c, 1, 3) == pytest.approx(sum(n.fwd_ms + n.bwd_ms for n in c.nodes[1:3]))


def test_pipeline_probe_runs_the_stages_the_recipe_plans() -> None:
    """`pd profile`'s pipeline probe runs the workers and split the recipe's plan has (two
    stages on two of three devices, not three workers; a worker's chunks with virtual stages),
    and its own layout otherwise."""
    from pathlib import Path

    from pdcli.config import load_config
    from pdcli.probe.pipeline import PIPELINE_MAX_WORKERS, balanced_cuts, pipeline_layout
    from pdcli.steps.plan import planned_layout

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
    c = chain(n=8)
    cfg = load_config(recipe, ["cluster.levels.0.devices=3", "plan.num_stages=2", "plan.straight=true"]).config
    layout = planned_layout(c, cfg)
    assert layout is not None and len(layout) == 2 and [r for _, _, r in layout] == [1, 1]
    assert pipeline_layout(cfg, c, layout) == ([layout[1][0]], [1, 1])
    assert pipeline_layout(cfg, c, [(0, 3, 2), (3, 8, 1)]) == ([3], [2, 1])
    assert pipeline_layout(cfg, c, [(0, 8, 1)]) is None  # one worker: nothing to probe
    balanced = (balanced_cuts(c, 3), [1, 1, 1])
    assert pipeline_layout(cfg, c, None) == balanced
    assert pipeline_layout(cfg, c, [(0, 8, 3)]) == balanced  # no pipeline to probe
    wide = [(0, 4, PIPELINE_MAX_WORKERS), (4, 8, 1)]
    assert pipeline_layout(cfg, c, wide) == balanced
    # virtual stages: the chunks are the stages, two per worker
    virtual = load_config(recipe, ["schedule.name=interleaved", "schedule.virtual_stages=2"]).config
    chunks = planned_layout(c, virtual)
    assert chunks is not None and len(chunks) == 4
    assert pipeline_layout(virtual, c, chunks) == ([start for start, _, _ in chunks[1:]], [1, 1])
    assert pipeline_layout(virtual, c, None) == (balanced_cuts(c, 4), [1, 1])


def test_workers_sharing_cores_are_priced_their_measured_slowdown() -> None:
    """`shared_slowdown` multiplies the replay of a plan whose workers outnumber the cores (and
    the search's bound on it), and leaves a plan with a core per worker as it was;
    `shared_cpu_scale` goes to the plan's replay for the report's compute per stage and leaves
    the time alone."""
    from pdcli.planner.search import oversubscription_of

    def priced(slowdown: float, stages: int, cpu_scale: float = 1.0) -> float:
        runtime = dataclasses.replace(RUNTIME, cores=2, shared_slowdown=slowdown, shared_cpu_scale=cpu_scale)
        options = PlanOptions(schedule="pipedream", num_microbatches=4, batch_size=64, num_stages=stages,
                              use_fewer_devices=True, straight=True)
        plan = plan_chain(chain(runtime), Topology.flat(3, 1e9), options)
        assert sum(s.replicas for s in plan.stages) == stages
        assert plan.pipeline["replay"].get("shared_slowdown", 1.0) == (slowdown if stages > 2 else 1.0)
        assert plan.pipeline["replay"].get("shared_cpu_scale", 1.0) == (cpu_scale if stages > 2 else 1.0)
        return plan.time_per_minibatch_ms

    assert priced(1.3, 3) == pytest.approx(1.3 * priced(1.0, 3))
    assert priced(1.3, 2) == pytest.approx(priced(1.0, 2))
    assert priced(1.3, 3, 1.2) == priced(1.3, 3) and priced(1.3, 2, 1.2) == priced(1.3, 2)
    assert RUNTIME.slowdown(2) == 1.2 and RUNTIME.slowdown(1) == 1.0 and RUNTIME.without("cores").slowdown(4) == 1.0
    scaled = dataclasses.replace(RUNTIME, shared_cpu_scale=1.1)
    assert scaled.cpu_sharing(2) == 1.1 and scaled.cpu_sharing(1) == 1.0
    assert scaled.without("sharing").cpu_sharing(2) == 1.0 and scaled.without("sharing").slowdown(2) == 1.0
    assert RuntimeCosts.from_json(scaled.to_json()) == scaled
    assert oversubscription_of(2, 3, 1.3) == pytest.approx(1.5 * 1.3) and oversubscription_of(2, 2, 1.3) == 1.0


def test_the_pipeline_probe_fits_on_a_core_per_worker_and_measures_sharing_apart() -> None:
    """The probe's two layouts: the costs come from a run whose workers each have a core (the
    planned layout, or the balanced pipeline over the cores when the planned one shares them),
    and a layout that shares the cores (the planned one, else the devices' balanced pipeline)
    measures `shared_slowdown`."""
    from pathlib import Path

    from pdcli.config import load_config
    from pdcli.probe.pipeline import balanced_cuts, probe_layouts

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
    c = chain(n=8)
    cfg = load_config(recipe, ["cluster.levels.0.devices=3", "plan.num_stages=2"]).config
    two, three = (balanced_cuts(c, 2), [1, 1]), (balanced_cuts(c, 3), [1, 1, 1])
    assert probe_layouts(cfg, c, ([4], [1, 1]), 2) == (([4], [1, 1]), three)
    # the planned layout shares the cores: fitted on the cores' own pipeline, the plan measures the sharing
    assert probe_layouts(cfg, c, ([3, 6], [1, 1, 1]), 2) == (two, ([3, 6], [1, 1, 1]))
    assert probe_layouts(cfg, c, ([3], [2, 1]), 2) == (two, ([3], [2, 1]))
    assert probe_layouts(cfg, c, ([4], [1, 1]), 4) == (([4], [1, 1]), None)  # 3 devices on 4 cores: nothing shares
    assert probe_layouts(cfg, c, ([3, 6], [1, 1, 1]), 1) == (([3, 6], [1, 1, 1]), None)  # no pipeline fits one core
    two_devices = load_config(recipe, ["cluster.levels.0.devices=2"]).config
    assert probe_layouts(two_devices, c, ([4], [1, 1]), 2) == (([4], [1, 1]), None)


def test_the_profile_summary_shows_the_all_reduce() -> None:
    from pdcli.profiler.summary import runtime_rows

    def row(runtime: RuntimeCosts) -> list[str]:
        return next(r for r in runtime_rows(runtime.to_json()) if r[0] == "all-reduce")

    assert row(RUNTIME)[1].startswith("not measured")
    assert row(dataclasses.replace(RUNTIME, allreduce=Affine(1e-6, 0.5)))[1].startswith("0.500 ms + 1.049 ms/MiB")


@pytest.mark.slow  # some 400 replays
def test_shared_core_fit_recovers_a_replays_compute_and_says_when_it_cannot() -> None:
    """`fit_shared` on three ranks sharing two cores: given what the replay at a CPU factor of
    1.2 takes and computes, it finds a factor whose replay computes that; given a compute no
    replay at that time reaches, it takes the largest factor and says it is capped."""
    from pdcli.report.calibrate import fit_latency, fit_shared, replayed_compute_ms, replayed_ms

    runtime = dataclasses.replace(RUNTIME, cores=2, position_scale=None)
    c = runtime.priced(chain(runtime, n=9))
    options = PlanOptions(schedule="pipedream", num_microbatches=4, batch_size=64, num_stages=3, boundaries=(3, 6))
    plan = plan_chain(c, Topology.flat(3, 1e9), options).to_json()
    run = runtime.cpu_scaled(1.2)
    target_ms, compute_ms = replayed_ms(run, c, plan), replayed_compute_ms(run, c, plan)
    assert compute_ms is not None
    fitted, fit = fit_shared(runtime, c, plan, compute_ms, target_ms)
    assert fit is not None and not fit.capped
    assert fit.replayed_compute_ms == pytest.approx(compute_ms, rel=0.02)
    assert replayed_ms(fit_latency(fitted, c, plan, target_ms), c, plan) == pytest.approx(target_ms, rel=0.02)
    _, beyond = fit_shared(runtime, c, plan, 3 * compute_ms, target_ms)
    assert beyond is not None and beyond.capped and beyond.factor == pytest.approx(beyond.max_factor)
    assert beyond.replayed_compute_ms < 3 * compute_ms


def test_the_profile_summary_says_the_layers_are_timed_without_the_probes_autocast() -> None:
    """A profile probed under bf16 prints that its layer table is timed without autocast and that
    the probe's scales price the layers at bf16; an fp32 probe, or one of an older pd, says nothing."""
    from pdcli.profiler.summary import summarize

    def text(precision: str | None) -> str:
        runtime = RUNTIME if precision is None else dataclasses.replace(RUNTIME, sources={"precision": precision})
        return summarize(chain(runtime))

    assert "the probe ran them under bf16 autocast" in text("bf16")
    assert "autocast" not in text("fp32") and "autocast" not in text(None)


@pytest.mark.parametrize("cores", [None, 1])
def test_a_link_slower_than_the_compute_carries_one_message_at_a_time(cores: int | None) -> None:
    """Messages that hold their link (`wire_ms`) leave one after another: gpipe's eight
    activations go down one by one and its eight gradients come back one by one (each way 8 x
    3 ms on the wire); without `wire_ms` the link carries them side by side."""
    spec = ScheduleSpec.make("gpipe", 2, 8, 1)
    free = [StageCost(0.5, 0.5, comm_ms=3.0), StageCost(0.5, 0.5)]
    held = [dataclasses.replace(free[0], wire_ms=3.0), free[1]]
    assert simulate(spec, free, cores=cores).makespan_ms < 8 * 1.0 * 2 + 2 * 3.0 + 1e-9  # the compute, two latencies
    assert simulate(spec, held, cores=cores).makespan_ms >= 2 * 8 * 3.0


def test_a_cluster_of_several_levels_prices_its_links_at_their_bandwidth() -> None:
    """On several levels the measured latency and all-reduce floor stay, the core bound goes (each
    host has its own), and a message pays its bytes at the slower of the transport and the level."""
    from pdcli.planner.search import runtime_of

    measured = dataclasses.replace(RUNTIME, allreduce=Affine(2e-6, 3.0))
    space = SplitSpace.from_chain(chain(measured))
    assert runtime_of(space, Topology.flat(2, 1e9)) == measured
    two_hosts = Topology.from_levels([{"devices": 1, "bandwidth_bytes_per_s": 1e10},
                                      {"devices": 2, "bandwidth_bytes_per_s": 1e6}])
    priced = runtime_of(space, two_hosts)
    assert priced is not None and priced.cluster_links and priced.cores is None
    assert priced.allreduce == measured.allreduce and priced.latency_ms == measured.latency_ms
    assert priced.link_ms(1e4, 1e6) == pytest.approx(1.0 + 10.0)  # the level's 1 MB/s
    assert priced.link_ms(1e4, 1e10) == pytest.approx(1.0 + 1e4 / 5e7 * 1e3)  # the transport's 50 MB/s
    assert priced.link_wire_ms(1e4, 1e6) == pytest.approx(10.0) and measured.link_wire_ms(1e4, 1e6) == 0.0
    options = PlanOptions(schedule="pipedream", num_microbatches=4, batch_size=64, boundaries=(4,), num_stages=2,
                          straight=True)
    plan = plan_chain(chain(measured), two_hosts, options)
    # 8192 bytes a profiled batch of 16, x 4 a minibatch of 64, one way through a 1 MB/s link
    link_bound = 8192 * 4 / 1e6 * 1e3
    assert plan.stages[0].predicted["comm_out_ms"] == pytest.approx(link_bound)
    assert plan.time_per_minibatch_ms >= link_bound  # the link sets the pace


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b", "gpipe"])
def test_the_data_parallel_baseline_is_ddps_step_whatever_the_plans_schedule(schedule: str) -> None:
    """`speedup_over_data_parallel` is against DDP: every device one share of the minibatch, one
    all-reduce and one optimizer step per minibatch, the same for every schedule the plan runs."""
    from pdcli.planner.costs import replica_allreduce_ms
    from pdcli.planner.evaluate import data_parallel_eval

    c, topology = chain(RUNTIME.without("cores")), Topology.flat(2, 1e8)
    options = PlanOptions(schedule=schedule, num_microbatches=4, batch_size=64)
    space = SplitSpace.from_chain(c)
    ddp = data_parallel_eval(space, topology, options, batch_scale(c.meta, options))
    params = sum(node.parameter_bytes for node in c.nodes)
    assert [st.replicas for st in ddp.stages] == [2]
    assert ddp.stages[0].terms["sync_ms"] == pytest.approx(float(replica_allreduce_ms(params, 2, 1e8)))  # once
    plan = plan_chain(c, topology, options)
    assert plan.pipeline["data_parallel_time_per_minibatch_ms"] == pytest.approx(ddp.time_per_minibatch_ms)
    same = data_parallel_eval(space, topology, PlanOptions(schedule="1f1b", num_microbatches=2, batch_size=64),
                              batch_scale(c.meta, options))
    assert same.time_per_minibatch_ms == pytest.approx(ddp.time_per_minibatch_ms)

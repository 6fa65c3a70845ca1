"""The planner: DP == brute force on small chains (both cost models), memory model, plan file."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from typing import Iterator

import numpy as np
import pytest

from pdcli.errors import UserError
from pdcli.planner import Plan, PlanOptions, Topology, plan_chain, render_plan
from pdcli.planner.costs import SHARE_DIGITS, bubble_factor, replayed_bubble_factor, split_shares
from pdcli.planner.evaluate import batch_scale, evaluate_pd, evaluate_pipedream
from pdcli.planner.memory import MemorySettings, StageBytes, split_sets, stage_memory
from pdcli.planner.pipedream import PdStage
from pdcli.planner.search import pd_search
from pdcli.schedule.simulator import StageCost, simulate
from pdcli.planner.space import SplitSpace
from pdcli.profiler.chain import Chain, ChainNode
from pdcli.profiler.graphtxt import graph_to_chain, parse_graph
from pdcli.rundir import canonical_json
from pdcli.schedule import ScheduleSpec

SCHEDULES = ("pipedream", "1f1b", "gpipe", "2bw")
REL = 1e-9


def random_node(rng: random.Random, i: int) -> ChainNode:
    params = rng.choice([0, rng.randrange(1, 20_000_000)])
    return ChainNode(name=f"n{i}", label=f"layer{i}", fwd_ms=rng.uniform(0.1, 10), bwd_ms=rng.uniform(0.1, 20),
                     parameter_bytes=params, activation_bytes=rng.randrange(1, 30_000_000),
                     backward_memory_bytes=rng.choice([0, rng.randrange(1, 1_000_000)]),
                     optimizer_ms=rng.uniform(0.05, 8) if params else 0.0,
                     optimizer_state_bytes=rng.choice([0, 1, 2]) * params)


def random_chain(rng: random.Random, n: int) -> Chain:
    nodes = tuple(random_node(rng, i) for i in range(n))
    meta = {"optimizer": {"step_overhead_ms": rng.choice([0.0, 0.1, 1.0])},
            "calibration": {"ratio": rng.choice([None, 0.8, 1.7])}} if rng.random() < 0.7 else {}
    return Chain(nodes=nodes, cut_bytes=tuple(rng.randrange(0, 20_000_000) for _ in range(n - 1)), meta=meta)


def hand_optimizer_ms(chain: Chain, start: int, end: int, replicas: int, options: PlanOptions) -> float:
    """The optimizer term by its definition: one step = the fixed cost once + each position's
    step less the fixed cost; pipedream steps M / r times per minibatch, the others once."""
    overhead = chain.meta.get("optimizer", {}).get("step_overhead_ms", 0.0)
    step = overhead + sum(max(n.optimizer_ms - overhead, 0.0) for n in chain.nodes[start:end] if n.optimizer_ms > 0)
    return step * (options.num_microbatches / replicas if options.schedule == "pipedream" else 1.0)


def random_dag_chain(rng: random.Random) -> Chain:
    """A small branching graph (two parallel branches and a skip) imported as antichain states."""
    def line(i: int, desc: str) -> str:
        return (f"node{i} -- {desc} -- forward_compute_time={rng.uniform(0.1, 9):.3f}, "
                f"backward_compute_time={rng.uniform(0.1, 9):.3f}, activation_size={rng.randrange(1, 9_000_000)}.0, "
                f"parameter_size={rng.randrange(0, 9_000_000)}.000")
    edges = [(1, 2), (2, 3), (2, 4), (3, 5), (4, 5), (5, 6), (2, 6)]
    text = "\n".join([line(i, f"L{i}") for i in range(1, 7)] + [f"\tnode{a} -- node{b}" for a, b in edges])
    return graph_to_chain(parse_graph(text))


def topologies(rng: random.Random) -> list[Topology]:
    return [
        Topology.flat(rng.randint(1, 4), rng.choice([1e9, 5e9])),
        Topology.from_levels([{"devices": 2, "bandwidth_bytes_per_s": 8e9},
                              {"devices": 2, "bandwidth_bytes_per_s": 5e8}]),
    ]


def partitions(space: SplitSpace, start: int = 0) -> Iterator[list[tuple[int, int]]]:
    n, valid = space.num_positions, space.valid_stages()
    for end in range(start + 1, n + 1):
        if valid[start, end]:
            if end == n:
                yield [(start, end)]
            else:
                for rest in partitions(space, end):
                    yield [(start, end)] + rest


def replica_choices(num_stages: int, devices: int, options: PlanOptions) -> Iterator[tuple[int, ...]]:
    top = 1 if options.straight else devices
    for reps in itertools.product(range(1, top + 1), repeat=num_stages):
        if sum(reps) == devices or (options.use_fewer_devices and sum(reps) < devices):
            yield reps


def brute_pd(chain: Chain, topology: Topology, options: PlanOptions) -> float:
    space, scale = SplitSpace.from_chain(chain), batch_scale(chain.meta, options)
    best = math.inf
    for part in partitions(space):
        if options.num_stages is not None and len(part) != options.num_stages:
            continue
        for reps in replica_choices(len(part), topology.num_devices, options):
            if any(options.num_microbatches % r for r in reps):
                continue  # the runtime cannot spread the microbatches evenly over the replicas
            ev = evaluate_pd(space, topology, options, scale, [(s, e, r) for (s, e), r in zip(part, reps)])
            for st in ev.stages:
                t = st.terms
                assert t["optimizer_ms"] == pytest.approx(
                    hand_optimizer_ms(chain, st.start, st.end, st.replicas, options), rel=REL)
                assert t["stage_time_ms"] == pytest.approx(max(
                    t["compute_ms"] + t["optimizer_ms"] + t["sync_ms"], t["comm_in_ms"], t["comm_out_ms"]), rel=REL)
                state = sum(n.optimizer_state_bytes for n in chain.nodes[st.start:st.end])
                assert st.memory.optimizer_state_bytes == state
                # gradients and activations peak together (pipedream, 2bw) or not (flush schedules)
                held = state + st.memory.stashed_weights_bytes + st.memory.activations_bytes
                assert st.memory.weights_bytes / 2 + held <= st.memory.total_bytes * (1 + REL)
                assert st.memory.total_bytes <= (st.memory.weights_bytes + held) * (1 + REL)
            limit = options.memory_bytes_per_device
            if limit is None or all(st.memory.total_bytes <= limit for st in ev.stages):
                best = min(best, ev.time_per_minibatch_ms)
    return best


def brute_pipedream(chain: Chain, topology: Topology, options: PlanOptions) -> float:
    """PipeDream's flat model: max over stages; its memory rule ceil((D - ranks so far) / r)."""
    space, devices, best = SplitSpace.from_chain(chain), topology.num_devices, math.inf
    for part in partitions(space):
        for reps in replica_choices(len(part), devices, options):
            stages, used, fits = [], 0, True
            for k, ((s, e), r) in enumerate(zip(part, reps)):
                stages.append(PdStage(s, e, tuple(range(used, used + r)), ((0, s, e, r, k == 0),)))
                used += r
                held = space.range_total(space.covered_activation_bytes, s, e) + space.range_total(
                    space.covered_parameter_bytes, s, e)
                limit = options.memory_bytes_per_device
                fits &= limit is None or math.ceil((devices - used) / r) * held <= limit
            if fits:
                best = min(best, evaluate_pipedream(space, topology, options, 1.0, stages).time_per_minibatch_ms)
    return best


def planned_ms(chain: Chain, topology: Topology, options: PlanOptions) -> float:
    try:
        return plan_chain(chain, topology, options).time_per_minibatch_ms
    except UserError:
        return math.inf


def random_options(rng: random.Random, cost_model: str, chain: Chain, topology: Topology) -> PlanOptions:
    schedule = rng.choice(SCHEDULES)
    limit = None
    if rng.random() < 0.4:  # a limit around what the stages need, so it sometimes binds
        total = sum(2 * n.parameter_bytes + n.optimizer_state_bytes + 2 * n.activation_bytes for n in chain.nodes)
        limit = float(rng.uniform(0.2, 1.2) * total)
    stages = None
    if cost_model == "pd" and rng.random() < 0.25:
        stages = rng.randint(1, min(len(chain), topology.num_devices))
    precision, recompute = "fp32", False
    if cost_model == "pd":
        precision, recompute = rng.choice(["fp32", "fp32", "bf16"]), rng.random() < 0.25
    return PlanOptions(schedule=schedule, num_microbatches=rng.choice([1, 2, 4]), batch_size=8,
                       memory_bytes_per_device=limit, straight=rng.random() < 0.3,
                       use_fewer_devices=rng.random() < 0.5, cost_model=cost_model, num_stages=stages,
                       precision=precision, recompute=recompute)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", range(6))
def test_pd_dp_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    checked = 0
    for _ in range(25):
        chain = random_dag_chain(rng) if rng.random() < 0.25 else random_chain(rng, rng.randint(3, 7))
        for topology in topologies(rng):
            options = random_options(rng, "pd", chain, topology)
            if options.straight and options.num_stages is None and not options.use_fewer_devices \
                    and topology.num_devices > len(chain):
                continue  # no plan by construction; covered by the error tests
            want, got = brute_pd(chain, topology, options), planned_ms(chain, topology, options)
            assert (math.isinf(want) and math.isinf(got)) or got == pytest.approx(want, rel=REL), (options, topology)
            checked += math.isfinite(want)
    assert checked > 20


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", range(4))
def test_pipedream_dp_equals_brute_force(seed: int) -> None:
    rng = random.Random(100 + seed)
    checked = 0
    for _ in range(30):
        chain = random_dag_chain(rng) if rng.random() < 0.25 else random_chain(rng, rng.randint(3, 7))
        topology = Topology.flat(rng.randint(1, 4), rng.choice([1e9, 5e9]))
        options = random_options(rng, "pipedream", chain, topology)
        want, got = brute_pipedream(chain, topology, options), planned_ms(chain, topology, options)
        assert (math.isinf(want) and math.isinf(got)) or got == pytest.approx(want, rel=REL), (options, topology)
        checked += math.isfinite(want)
    assert checked > 10


def test_memory_model_per_schedule() -> None:
    p, a, m = 100.0, 80.0, 4  # params, activations per minibatch, microbatches
    # stage 0 of 3 stages, 4 devices from here on, 2 replicas: pipedream and 2bw hold the
    # microbatches one replica has in flight, ceil(4 / 2) (ScheduleSpec.stash_depth)
    expect = {"pipedream": (200, 100, 2 * 20), "2bw": (200, 100, 2 * 20), "1f1b": (200, 0, 3 * 20), "gpipe": (200, 0, 80)}
    for schedule, (weights, stashed, acts) in expect.items():
        run, where = MemorySettings(schedule=schedule, num_microbatches=m), dict(replicas=2, devices_from=4, stages_from=3)
        mem = stage_memory(run, StageBytes(parameters=p, activations=a), **where)
        assert (float(mem.weights_bytes), float(mem.stashed_weights_bytes), float(mem.activations_bytes)) == (
            weights, stashed, acts), schedule
        assert float(mem.total_bytes) == weights + stashed + acts
        with_state = stage_memory(run, StageBytes(parameters=p, activations=a, optimizer_state=2 * p),  # Adam: two moments
                                  **where)
        assert float(with_state.optimizer_state_bytes) == 2 * p
        assert float(with_state.total_bytes) == weights + 2 * p + stashed + acts
        assert float(with_state.stashed_weights_bytes) == stashed  # a stashed version has no state
        half = stage_memory(dataclasses.replace(run, precision="bf16"), StageBytes(parameters=p, activations=a), **where)
        sets = acts / (a / m)
        # half-width activations, plus the half-width weight copy each held microbatch keeps
        assert float(half.activations_bytes) == acts / 2 + sets * p / 2 and float(half.weights_bytes) == weights
        # recompute: each held microbatch keeps its inputs (40 bytes per minibatch -> 10 per
        # microbatch), plus one microbatch's activations, less the input it already holds,
        # while its forward is re-run
        again = stage_memory(dataclasses.replace(run, recompute=True), StageBytes(parameters=p, activations=a, inputs=40.0), **where)
        assert float(again.activations_bytes) == sets * 10 + a / m - 10
        both = stage_memory(dataclasses.replace(run, precision="fp16", recompute=True),
                            StageBytes(parameters=p, activations=a, inputs=40.0), **where)
        assert float(both.activations_bytes) == sets * 10 + a / m / 2 + p / 2 - 10


def test_precision_and_recompute_reach_the_plan_and_let_a_tighter_limit_fit() -> None:
    nodes = tuple(ChainNode(f"n{i}", f"l{i}", 1.0, 2.0, 1000, 100_000) for i in range(4))
    chain = Chain(nodes=nodes, cut_bytes=(1000, 1000, 1000))
    base = dict(schedule="gpipe", num_microbatches=4, straight=True, num_stages=2)
    fp32 = plan_chain(chain, Topology.flat(2), PlanOptions(**base))
    need = max(s.predicted["total_bytes"] for s in fp32.stages)
    for extra in ({"precision": "bf16"}, {"recompute": True}):
        plan = plan_chain(chain, Topology.flat(2), PlanOptions(**base, **extra))
        assert max(s.predicted["total_bytes"] for s in plan.stages) < need
        assert plan.to_json()["inputs"]["precision"] == extra.get("precision", "fp32")
        limited = PlanOptions(**base, **extra, memory_bytes_per_device=0.9 * need)
        assert plan_chain(chain, Topology.flat(2), limited).stages  # fits where fp32 does not
        with pytest.raises(UserError, match="no plan fits|smallest memory"):
            plan_chain(chain, Topology.flat(2), PlanOptions(**base, memory_bytes_per_device=0.9 * need))
    assert "precision" not in fp32.to_json()["inputs"]  # fp32 plans are as before
    with pytest.raises(UserError, match="precision 'fp8'"):
        PlanOptions(precision="fp8")


def test_plan_is_deterministic_and_round_trips() -> None:
    chain = random_chain(random.Random(7), 6)
    topology = Topology.from_levels([{"devices": 2, "bandwidth_bytes_per_s": 1e10}, {"devices": 2, "bandwidth_bytes_per_s": 1e9}])
    options = PlanOptions(schedule="1f1b", num_microbatches=4, batch_size=16, profile_sha256="ab" * 32)
    first = canonical_json(plan_chain(chain, topology, options).to_json())
    second = canonical_json(plan_chain(chain, topology, options).to_json())
    assert first == second
    obj = json.loads(first)
    assert canonical_json(Plan.from_json(obj).to_json()) == first
    assert obj["inputs"]["profile_sha256"] == "ab" * 32 and obj["inputs"]["topology"] == topology.to_json()
    ranks = [r for s in obj["stages"] for r in s["ranks"]]
    assert ranks == list(range(len(ranks)))  # contiguous, stage by stage
    assert [s["node_names"] for s in obj["stages"]] == [
        [f"n{i}" for i in range(s["start"], s["end"])] for s in obj["stages"]]
    worst = max(s["predicted"]["stage_time_ms"] for s in obj["stages"])
    assert obj["stages"][obj["pipeline"]["bottleneck_stage"]]["predicted"]["stage_time_ms"] == worst


def test_flush_bubble_and_data_parallel_baseline() -> None:
    chain = Chain(nodes=tuple(ChainNode(f"n{i}", f"l{i}", 1.0, 2.0, 0, 10) for i in range(4)), cut_bytes=(0, 0, 0))
    topology = Topology.flat(4)
    straight = dict(straight=True, num_stages=4, num_microbatches=4, batch_size=4)
    flush = plan_chain(chain, topology, PlanOptions(schedule="gpipe", **straight))
    steady = plan_chain(chain, topology, PlanOptions(schedule="pipedream", **straight))
    assert steady.time_per_minibatch_ms == pytest.approx(3.0)  # one stage's fwd + bwd
    assert flush.time_per_minibatch_ms == pytest.approx(3.0 * (4 + 4 - 1) / 4)
    assert steady.pipeline["data_parallel_time_per_minibatch_ms"] == pytest.approx(12.0 / 4)  # no params
    assert steady.pipeline["throughput_samples_per_s"] == pytest.approx(4 / 3.0 * 1000)


def test_batch_scale_from_profiled_batch() -> None:
    chain = Chain(nodes=(ChainNode("a", "a", 2.0, 4.0, 0, 8),), cut_bytes=(), meta={"batch_size": 2})
    plan = plan_chain(chain, Topology.flat(1), PlanOptions(batch_size=8))
    assert batch_scale(chain.meta, PlanOptions(batch_size=8)) == 4.0
    assert plan.stages[0].predicted["fwd_ms"] == pytest.approx(8.0)
    assert plan.stages[0].predicted["activations_bytes"] == pytest.approx(32.0)


def test_infeasible_requests_say_why() -> None:
    chain = random_chain(random.Random(3), 3)
    with pytest.raises(UserError, match=r"3 positions into 5 stages \(5 > 3\)"):
        plan_chain(chain, Topology.flat(8), PlanOptions(num_stages=5))
    with pytest.raises(UserError, match="need at least 3 devices, the cluster has 2"):
        plan_chain(chain, Topology.flat(2), PlanOptions(num_stages=3))
    with pytest.raises(UserError, match="devices must be an integer >= 1, got 0"):
        Topology.flat(0)
    options = PlanOptions(schedule="1f1b", num_microbatches=2, memory_bytes_per_device=1.0)
    with pytest.raises(UserError, match="smallest memory that fits a plan is"):
        plan_chain(chain, Topology.flat(2), options)
    space = SplitSpace.from_chain(chain)
    smallest = pd_search(space, Topology.flat(2), options, 1.0, minimize="memory").objective
    fits = PlanOptions(schedule="1f1b", num_microbatches=2, memory_bytes_per_device=smallest)
    plan = plan_chain(chain, Topology.flat(2), fits)
    assert max(s.predicted["total_bytes"] for s in plan.stages) <= smallest
    with pytest.raises(UserError, match="no plan fits"):
        plan_chain(chain, Topology.flat(2), PlanOptions(schedule="1f1b", num_microbatches=2,
                                                          memory_bytes_per_device=smallest * 0.999))


def test_use_fewer_devices_can_leave_devices_idle() -> None:
    # huge parameters and a slow link: replicating costs more than it gains
    chain = Chain(nodes=(ChainNode("a", "a", 1.0, 1.0, 10**10, 1),), cut_bytes=())
    plan = plan_chain(chain, Topology.flat(4, 1e9), PlanOptions(use_fewer_devices=True, num_microbatches=4))
    assert plan.pipeline["num_devices_used"] == 1 and plan.stages[0].ranks == (0,)
    forced = plan_chain(chain, Topology.flat(4, 1e9), PlanOptions(use_fewer_devices=False, num_microbatches=4))
    assert forced.pipeline["num_devices_used"] == 4
    assert forced.time_per_minibatch_ms > plan.time_per_minibatch_ms


def test_small_weights_on_a_fast_link_plan_data_parallel_and_say_so() -> None:
    # 4 layers of 10 ms each way, 1 KB of weights, 4 MB activations: an all-reduce is free, a cut is not
    nodes = tuple(ChainNode(f"n{i}", f"layer{i}", 10.0, 10.0, 1000, 4_000_000) for i in range(4))
    chain = Chain(nodes=nodes, cut_bytes=(4_000_000,) * 3)
    plan = plan_chain(chain, Topology.flat(2, 1e8), PlanOptions(schedule="1f1b", num_microbatches=2,
                                                                 use_fewer_devices=False))
    assert [s.replicas for s in plan.stages] == [2]
    assert plan.pipeline["speedup_over_data_parallel"] == pytest.approx(1.0)
    assert "data parallel: the whole model on each of 2 devices" in render_plan(plan, chain)
    # heavy weights on a slow link: a pipeline, and no such line
    heavy = Chain(nodes=tuple(dataclasses.replace(n, parameter_bytes=50_000_000, activation_bytes=1000) for n in nodes),
                  cut_bytes=(1000,) * 3)
    piped = plan_chain(heavy, Topology.flat(2, 1e8), PlanOptions(schedule="1f1b", num_microbatches=2,
                                                                  use_fewer_devices=False))
    assert len(piped.stages) == 2 and "data parallel:" not in render_plan(piped, heavy)


@pytest.mark.parametrize("fmt", ["text", "markdown", "json"])
def test_render_plan(fmt: str) -> None:
    chain = random_chain(random.Random(11), 5)
    plan = plan_chain(chain, Topology.flat(3), PlanOptions(schedule="1f1b", num_microbatches=2))
    out = render_plan(plan.to_json(), chain, fmt)
    if fmt == "json":
        assert json.loads(out) == plan.to_json()
        return
    bottleneck = plan.pipeline["bottleneck_stage"]
    assert f"{bottleneck}*" in out and "time per minibatch" in out and "layer0" in out
    assert ("|" in out) == (fmt == "markdown")
    assert len([line for line in out.splitlines() if "layer" in line]) >= len(plan.stages)


def test_stage_memory_is_reported_and_bounded_by_the_limit() -> None:
    chain = random_chain(random.Random(5), 6)
    limit = 1.5 * max(2 * n.parameter_bytes + 4 * n.activation_bytes for n in chain.nodes)
    try:
        plan = plan_chain(chain, Topology.flat(4), PlanOptions(schedule="pipedream", memory_bytes_per_device=limit))
    except UserError:
        pytest.skip("this chain does not fit; the brute-force tests cover infeasibility")
    for s in plan.stages:
        p = s.predicted
        assert p["total_bytes"] <= limit
        assert p["total_bytes"] == pytest.approx(p["weights_bytes"] + p["optimizer_state_bytes"]
                                                 + p["stashed_weights_bytes"] + p["activations_bytes"])
    assert np.isfinite(plan.time_per_minibatch_ms)


def test_planner_never_imports_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, pdcli.planner, pdcli.planner.search, pdcli.planner.pipedream, "
            "pdcli.profiler.graphtxt; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_fixed_boundaries_are_kept_and_checked() -> None:
    chain = random_chain(random.Random(7), 6)
    topology = Topology.flat(3)
    plan = plan_chain(chain, topology, PlanOptions(boundaries=(2, 5)))
    assert [(s.start, s.end, s.replicas) for s in plan.stages] == [(0, 2, 1), (2, 5, 1), (5, 6, 1)]
    searched = plan_chain(chain, topology, PlanOptions(num_stages=3, straight=True))
    # the search can only do as well as or better than any fixed split of the same shape
    assert searched.pipeline["time_per_minibatch_ms"] <= plan.pipeline["time_per_minibatch_ms"] + 1e-9
    for bad in [(0, 2), (3, 2), (2, 6), (1, 2, 3)]:
        with pytest.raises(UserError, match="plan.boundaries"):
            plan_chain(chain, topology, PlanOptions(boundaries=bad))


def optimizer_chain(optimizer_ms: list[float], overhead_ms: float = 0.0) -> Chain:
    """Equal layers (1 ms forward, 2 ms backward, parameters) with the given optimizer steps."""
    nodes = tuple(ChainNode(f"n{i}", f"l{i}", 1.0, 2.0, 1000, 10, optimizer_ms=o, optimizer_state_bytes=2000)
                  for i, o in enumerate(optimizer_ms))
    return Chain(nodes=nodes, cut_bytes=(0,) * (len(nodes) - 1),
                 meta={"batch_size": 4, "optimizer": {"step_overhead_ms": overhead_ms}})


@pytest.mark.parametrize(("schedule", "updates"), [("pipedream", 4 / 2), ("1f1b", 1), ("gpipe", 1), ("2bw", 1)])
def test_optimizer_term_counts_the_updates_of_each_schedule(schedule: str, updates: float) -> None:
    chain = optimizer_chain([3.0, 5.0], overhead_ms=1.0)
    options = PlanOptions(schedule=schedule, num_microbatches=4, batch_size=4, boundaries=None)
    ev = evaluate_pd(SplitSpace.from_chain(chain), Topology.flat(2, 1e12), options, 1.0, [(0, 2, 2)])
    (stage,) = ev.stages
    step_ms = 1.0 + (3.0 - 1.0) + (5.0 - 1.0)  # the fixed cost once, not once per position
    assert stage.terms["optimizer_ms"] == pytest.approx(step_ms * updates)
    assert stage.terms["stage_time_ms"] == pytest.approx(
        stage.terms["compute_ms"] + stage.terms["sync_ms"] + step_ms * updates)
    assert stage.memory.optimizer_state_bytes == 4000


def test_a_heavy_optimizer_shifts_the_split() -> None:
    topology = Topology.flat(2)
    options = PlanOptions(schedule="1f1b", num_microbatches=4, batch_size=4, straight=True, num_stages=2)
    light = plan_chain(optimizer_chain([0.0] * 6), topology, options)
    assert [(s.start, s.end) for s in light.stages] == [(0, 3), (3, 6)]  # equal layers: half each
    heavy = plan_chain(optimizer_chain([6.0, 0, 0, 0, 0, 0]), topology, options)
    # 2 x 3 + 6 ms = 12 ms vs 4 x 3 ms = 12 ms (one layer: 9 ms vs 15 ms, three: 15 ms vs 9 ms)
    assert [(s.start, s.end) for s in heavy.stages] == [(0, 2), (2, 6)]
    first = heavy.stages[0].predicted
    assert first["optimizer_ms"] == pytest.approx(6.0)
    assert heavy.to_json()["stages"][0]["predicted"]["optimizer_ms"] == pytest.approx(6.0)
    assert "optim ms" in render_plan(heavy, None)
    assert heavy.time_per_minibatch_ms > light.time_per_minibatch_ms


def test_plans_without_optimizer_terms_still_round_trip() -> None:
    plan = plan_chain(optimizer_chain([1.0, 1.0]), Topology.flat(2), PlanOptions(num_stages=2, straight=True))
    obj = plan.to_json()
    for stage in obj["stages"]:
        del stage["predicted"]["optimizer_ms"], stage["predicted"]["optimizer_state_bytes"]
    assert Plan.from_json(obj).to_json() == obj
    assert "optim ms" in render_plan(obj, None)


def test_calibration_ratio_above_one_scales_compute() -> None:
    nodes = tuple(ChainNode(f"n{i}", f"l{i}", 1.0, 2.0, 1000, 10, optimizer_ms=0.5) for i in range(2))
    topology, options = Topology.flat(2), PlanOptions(schedule="1f1b", num_stages=2, straight=True)
    for ratio, factor in [(None, 1.0), (0.8, 1.0), (2.5, 2.5)]:
        chain = Chain(nodes=nodes, cut_bytes=(0,), meta={"calibration": {"ratio": ratio}})
        stage = plan_chain(chain, topology, options).stages[0].predicted
        assert (stage["fwd_ms"], stage["bwd_ms"]) == (pytest.approx(factor), pytest.approx(2 * factor))
        assert stage["optimizer_ms"] == pytest.approx(0.5)  # the optimizer step is not calibrated
    pipedream = plan_chain(chain, Topology.flat(1), PlanOptions(cost_model="pipedream"))
    assert pipedream.stages[0].predicted["fwd_ms"] == pytest.approx(2.0)  # PipeDream's model: as profiled


def test_replicas_divide_the_microbatches() -> None:
    # one heavy layer, no parameters: replicating it 3 times would be fastest, but 3 replicas
    # cannot share 4 microbatches evenly (the runtime refuses), so the plan uses 2 or 4
    chain = Chain(nodes=(ChainNode("a", "a", 30.0, 60.0, 0, 1), ChainNode("b", "b", 1.0, 1.0, 0, 1)), cut_bytes=(0,))
    for devices in (3, 4, 5):
        plan = plan_chain(chain, Topology.flat(devices), PlanOptions(num_microbatches=4, use_fewer_devices=True))
        assert all(4 % s.replicas == 0 for s in plan.stages), [s.replicas for s in plan.stages]
    with pytest.raises(UserError, match="no plan exists"):
        plan_chain(chain, Topology.flat(3), PlanOptions(num_microbatches=4, num_stages=1))


# ---- split backward ------------------------------------------------------------------------


def with_wgrad(chain: Chain, rng: random.Random) -> Chain:
    """`chain` with weight gradients on some positions (0 <= wgrad_ms <= bwd_ms), as `pd profile`
    measures them for nn.Linear layers."""
    nodes = tuple(dataclasses.replace(n, wgrad_ms=rng.choice([0.0, rng.uniform(0.1, 0.9) * n.bwd_ms]))
                  for n in chain.nodes)
    return dataclasses.replace(chain, nodes=nodes)


def linear_chain(wgrad_ms: float, n: int = 4) -> Chain:
    return Chain(nodes=tuple(ChainNode(f"n{i}", f"l{i}", 1.0, 2.0, 1000, 100, wgrad_ms=wgrad_ms) for i in range(n)),
                 cut_bytes=(0,) * (n - 1))


def steady_factor(schedule: str, num_stages: int, num_microbatches: int, fwd_ms: float, bwd_ms: float,
                  wgrad_ms: float, num_steps: int = 8) -> float:
    """The bubble factor of a long replay of equal stages: steady time per minibatch / (M (F + B))."""
    spec = ScheduleSpec.make(schedule, num_stages, num_microbatches, num_steps, split_backward=True)
    sim = simulate(spec, [StageCost(fwd_ms, bwd_ms, wgrad_ms=wgrad_ms)] * num_stages)
    return sim.time_per_minibatch_ms / (num_microbatches * (fwd_ms + bwd_ms))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_split_factor_without_weight_grads_is_the_unsplit_factor(schedule: str) -> None:
    for num_stages, m in itertools.product((1, 2, 3, 5), (1, 2, 4, 8)):
        closed = float(bubble_factor(schedule, m, num_stages))
        assert closed == (m + num_stages - 1) / m
        # the replay itself reproduces the closed form when there is nothing to defer ...
        assert replayed_bubble_factor(schedule, m, num_stages, 0.25, 0.0) == pytest.approx(closed, rel=1e-12)
        # ... and without W the planner does not replay: the factor is exactly the unsplit one
        assert split_shares(1.0, 3.0, 0.0) is None
        assert float(bubble_factor(schedule, m, num_stages, split_shares(1.0, 3.0, 0.0))) == closed
    topology = Topology.flat(2)
    for m in (2, 8):
        base = dict(schedule=schedule, num_microbatches=m, straight=True, num_stages=2)
        plain = plan_chain(linear_chain(0.0), topology, PlanOptions(**base)).to_json()
        split = plan_chain(linear_chain(0.0), topology, PlanOptions(**base, split_backward=True)).to_json()
        assert split["pipeline"] == plain["pipeline"]
        assert split["inputs"].pop("split_backward") is True and split["inputs"] == plain["inputs"]
    imported = random_dag_chain(random.Random(1))  # PipeDream's graph.txt has no weight gradients
    assert all(n.wgrad_ms == 0.0 for n in imported.nodes)
    base = dict(schedule=schedule, num_microbatches=4)
    assert plan_chain(imported, topology, PlanOptions(**base, split_backward=True)).pipeline == (
        plan_chain(imported, topology, PlanOptions(**base)).pipeline)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_replayed_factor_is_the_steady_state_and_at_most_the_unsplit_one(schedule: str) -> None:
    for num_stages, m, (fwd, wgrad) in itertools.product((2, 3, 4), (1, 3, 4, 8), ((0.3, 0.2), (0.5, 0.45))):
        factor = replayed_bubble_factor(schedule, m, num_stages, fwd, wgrad)
        assert factor == pytest.approx(steady_factor(schedule, num_stages, m, fwd, 1.0 - fwd, wgrad), rel=1e-9)
        assert 1.0 <= factor <= (m + num_stages - 1) / m + 1e-12
        assert float(bubble_factor(schedule, m, num_stages, split_shares(fwd, 1.0 - fwd, wgrad))) == factor
    assert list(bubble_factor(schedule, 4, np.array([2, 3]), split_shares(1.0, 2.0, 1.0))) == [
        replayed_bubble_factor(schedule, 4, k, round(1 / 3, SHARE_DIGITS), round(1 / 3, SHARE_DIGITS)) for k in (2, 3)]


def test_split_backward_lowers_the_predicted_time_of_a_2_stage_1f1b_plan() -> None:
    m, fwd, bwd, wgrad = 8, 1.0, 2.0, 1.0
    chain = dataclasses.replace(linear_chain(wgrad), meta={"batch_size": 4, "calibration": {"ratio": 1.5}})
    base = dict(schedule="1f1b", num_microbatches=m, straight=True, num_stages=2, batch_size=8)
    plain = plan_chain(chain, Topology.flat(2), PlanOptions(**base))
    split = plan_chain(chain, Topology.flat(2), PlanOptions(**base, split_backward=True))
    assert split.time_per_minibatch_ms < plain.time_per_minibatch_ms
    assert [s.predicted["stage_time_ms"] for s in split.stages] == [s.predicted["stage_time_ms"] for s in plain.stages]
    bottleneck = max(s.predicted["stage_time_ms"] for s in split.stages)
    assert split.time_per_minibatch_ms == pytest.approx(steady_factor("1f1b", 2, m, fwd, bwd, wgrad) * bottleneck, rel=1e-5)
    assert plain.time_per_minibatch_ms == pytest.approx((m + 1) / m * bottleneck)
    for stage in split.stages:  # calibrated and batch-scaled like bwd_ms
        assert stage.predicted["wgrad_ms"] == pytest.approx(2 * wgrad * 1.5 * 2)
        assert stage.predicted["wgrad_ms"] / stage.predicted["bwd_ms"] == pytest.approx(wgrad / bwd)
    obj = split.to_json()
    assert obj["inputs"]["split_backward"] is True and "split_backward" not in plain.to_json()["inputs"]
    assert all("wgrad_ms" in s["predicted"] for s in obj["stages"])
    assert canonical_json(plan_chain(chain, Topology.flat(2), PlanOptions(**base, split_backward=True)).to_json()) == (
        canonical_json(obj))
    assert "with split backward" in render_plan(obj, chain)
    pipedream = plan_chain(chain, Topology.flat(1), PlanOptions(cost_model="pipedream", schedule="1f1b",
                                                                split_backward=True))
    assert "wgrad_ms" not in pipedream.to_json()["stages"][0]["predicted"]  # PipeDream's model has no W


def test_merged_weight_grads_are_replayed_at_the_flush_and_held_until_it() -> None:
    m = 8
    chain = dataclasses.replace(linear_chain(1.0), meta={"batch_size": 4})
    base = dict(schedule="1f1b", num_microbatches=m, straight=True, num_stages=2, batch_size=4, split_backward=True)
    lagged = plan_chain(chain, Topology.flat(2), PlanOptions(**base))
    merged = plan_chain(chain, Topology.flat(2), PlanOptions(**base, merge_weight_grads=True))
    obj = merged.to_json()
    assert obj["inputs"].pop("merge_weight_grads") is True and obj["inputs"] == lagged.to_json()["inputs"]
    assert "weight gradients merged per chunk" in render_plan(merged.to_json(), chain)
    # the same work per stage (the merged matmul is priced as M microbatches' W's), placed at the flush
    assert [s.predicted["stage_time_ms"] for s in merged.stages] == [s.predicted["stage_time_ms"] for s in lagged.stages]
    spec = ScheduleSpec.make("1f1b", 2, m, 8, split_backward=True, merge_weight_grads=True)
    sim = simulate(spec, [StageCost(1.0, 2.0, wgrad_ms=1.0)] * 2)
    assert replayed_bubble_factor("1f1b", m, 2, 1 / 3, 1 / 3, merged=True) == pytest.approx(
        sim.time_per_minibatch_ms / (m * 3.0), rel=1e-9)
    assert replayed_bubble_factor("1f1b", m, 2, 1 / 3, 1 / 3, merged=True) != replayed_bubble_factor("1f1b", m, 2, 1 / 3, 1 / 3)
    # memory: every microbatch waits for the flush, whatever the stage count
    for num_stages, stages_from in [(2, 1), (2, 2), (4, 2), (6, 5)]:
        kw = dict(replicas=1, devices_from=stages_from, stages_from=stages_from, num_stages=num_stages)
        split = MemorySettings(schedule="1f1b", num_microbatches=m, split_backward=True)
        sizes = StageBytes(parameters=100.0, activations=80.0)
        assert float(stage_memory(dataclasses.replace(split, merge_weight_grads=True), sizes, **kw).activations_bytes) == 80.0
        assert float(stage_memory(split, sizes, **kw).activations_bytes) == min(stages_from + num_stages, m) * 10.0


@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_split_backward_needs_a_flush_schedule(schedule: str) -> None:
    with pytest.raises(UserError, match=f"split_backward only applies to .*not '{schedule}'"):
        PlanOptions(schedule=schedule, split_backward=True)


def test_split_backward_memory_holds_1f1b_microbatches_until_their_weight_grads() -> None:
    p, a, m = 100.0, 80.0, 8
    for num_stages, stages_from in [(2, 1), (2, 2), (3, 3), (4, 2), (6, 5)]:
        where, sizes = dict(replicas=1, devices_from=stages_from, stages_from=stages_from), StageBytes(parameters=p, activations=a)
        mem = stage_memory(MemorySettings(schedule="1f1b", num_microbatches=m, split_backward=True), sizes, **where,
                           num_stages=num_stages)
        assert float(mem.activations_bytes) == min(stages_from + num_stages, m) * a / m
        plain = stage_memory(MemorySettings(schedule="1f1b", num_microbatches=m), sizes, **where)
        assert float(plain.activations_bytes) == min(stages_from, m) * a / m
        gpipe = stage_memory(MemorySettings(schedule="gpipe", num_microbatches=m, split_backward=True), sizes, **where,
                             num_stages=num_stages)
        assert float(gpipe.activations_bytes) == a
    # the planner's sets are the runtime's declared stash depth, stage by stage
    for name, num_stages, m in itertools.product(("1f1b", "gpipe"), (2, 3, 4), (2, 4, 8, 16)):
        spec = ScheduleSpec.make(name, num_stages, m, 1, split_backward=True)
        for stage_id in range(num_stages):
            left = num_stages - stage_id
            sets = split_sets(name, num_stages, m, left)
            assert int(sets) == spec.stash_depth(stage_id).activation_sets, (name, num_stages, m, stage_id)


def test_split_backward_waiting_microbatches_hold_no_weight_copy_nor_only_their_input() -> None:
    # past its Backward a microbatch keeps the Linear inputs and output gradients: not the
    # half-width weight copy autocast made for it, and all of them even under recompute
    p, a, inp, m, num_stages, stages_from = 100.0, 80.0, 8.0, 8, 3, 1
    where = dict(replicas=1, devices_from=stages_from, stages_from=stages_from, num_stages=num_stages)
    split = MemorySettings(schedule="1f1b", num_microbatches=m, split_backward=True)
    half = stage_memory(dataclasses.replace(split, precision="bf16"), StageBytes(parameters=p, activations=a), **where)
    assert float(half.activations_bytes) == 1 * (a / m + p) / 2 + 3 * (a / m) / 2
    rec = stage_memory(dataclasses.replace(split, recompute=True), StageBytes(parameters=p, activations=a, inputs=inp), **where)
    # (the recomputed microbatch's input is among what it saves: counted once)
    assert float(rec.activations_bytes) == 1 * inp / m + (a / m - inp / m) + 3 * a / m
    # gpipe's last stage: all inputs held after the forwards, but late in the backwards
    # three microbatches wait for their W while the fourth one's forward is recomputed
    m = 4
    rec = stage_memory(MemorySettings(schedule="gpipe", num_microbatches=m, recompute=True, split_backward=True),
                       StageBytes(parameters=p, activations=a, inputs=inp), **where)
    assert float(rec.activations_bytes) == 1 * inp / m + 3 * a / m + (a / m - inp / m) > m * inp / m + a / m - inp / m


def test_split_backward_memory_reaches_the_plan() -> None:
    chain = linear_chain(1.0)
    base = dict(schedule="1f1b", num_microbatches=8, straight=True, num_stages=2)
    plain = plan_chain(chain, Topology.flat(2), PlanOptions(**base))
    split = plan_chain(chain, Topology.flat(2), PlanOptions(**base, split_backward=True))
    per_set = [s.predicted["activations_bytes"] / min(2 - k, 8) for k, s in enumerate(plain.stages)]
    assert [s.predicted["activations_bytes"] for s in split.stages] == pytest.approx(
        [per_set[k] * min(2 - k + 2, 8) for k in range(2)])
    need = max(s.predicted["total_bytes"] for s in split.stages)
    assert need > max(s.predicted["total_bytes"] for s in plain.stages)
    limited = dict(base, num_stages=None, memory_bytes_per_device=0.99 * need)
    plan_chain(chain, Topology.flat(2), PlanOptions(**limited))  # unsplit fits
    with pytest.raises(UserError, match="no plan fits"):
        plan_chain(chain, Topology.flat(2), PlanOptions(**limited, split_backward=True))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", range(3))
def test_pd_dp_equals_brute_force_with_split_backward(seed: int) -> None:
    """The memory of 1f1b with a split backward depends on the whole stage count, which the
    suffix program learns by running once per count: brute force over every partition checks it."""
    rng = random.Random(200 + seed)
    checked = 0
    for _ in range(20):
        chain = with_wgrad(random_chain(rng, rng.randint(3, 6)), rng)
        for topology in topologies(rng):
            options = random_options(rng, "pd", chain, topology)
            if options.memory_bytes_per_device is None and rng.random() < 0.6:  # where the stage count matters
                need = sum(2 * n.parameter_bytes + n.optimizer_state_bytes + 2 * n.activation_bytes for n in chain.nodes)
                options = dataclasses.replace(options, memory_bytes_per_device=float(rng.uniform(0.2, 1.2) * need))
            options = dataclasses.replace(options, schedule=rng.choice(["1f1b", "1f1b", "gpipe"]),
                                          num_microbatches=rng.choice([2, 4, 8]), split_backward=True)
            if options.straight and options.num_stages is None and not options.use_fewer_devices \
                    and topology.num_devices > len(chain):
                continue
            want, got = brute_pd(chain, topology, options), planned_ms(chain, topology, options)
            assert (math.isinf(want) and math.isinf(got)) or got == pytest.approx(want, rel=REL), (options, topology)
            checked += math.isfinite(want)
    assert checked > 8


def test_split_backward_reaches_the_plan_options_and_the_plan_hash() -> None:
    from pdcli.config.schema import Config, ScheduleConfig
    from pdcli.steps.plan import plan_inputs_hash, plan_options

    for name, split, on in [("1f1b", None, True), ("gpipe", None, True), ("1f1b", False, False), ("pipedream", None, False)]:
        cfg = Config(schedule=ScheduleConfig(name=name, split_backward=split))
        assert plan_options(cfg, None).split_backward is on
    hashes = {plan_inputs_hash(Config(schedule=ScheduleConfig(name="1f1b", split_backward=split)), "ab" * 32)
              for split in (None, True, False)}
    assert len(hashes) == 3  # changing schedule.split_backward re-plans


def test_vertical_sync_stashes_the_versions_stage_0_pins_on_every_stage() -> None:
    from pdcli.planner.memory import VerticalSync, weight_versions
    from pdcli.planner.search import search_vertical_sync

    params = (1000, 1000, 1000, 2000)
    nodes = tuple(ChainNode(f"n{i}", f"l{i}", 1.0, 2.0, p, 40) for i, p in enumerate(params))
    chain = Chain(nodes=nodes, cut_bytes=(1000, 1000, 1000))
    base = dict(schedule="pipedream", num_microbatches=4, straight=True, num_stages=4)
    stashed = {}
    for sync in (False, True):
        plan = plan_chain(chain, Topology.flat(4), PlanOptions(**base, vertical_sync=sync))
        stashed[sync] = [s.predicted["stashed_weights_bytes"] / p for s, p in zip(plan.stages, params)]
        spec = ScheduleSpec.make("pipedream", 4, 4, 1, vertical_sync=sync)
        assert stashed[sync] == [spec.stash_depth(k).weight_versions - 1 for k in range(4)]
        assert plan.to_json()["inputs"].get("vertical_sync", False) is sync
    assert stashed == {False: [3, 2, 1, 0], True: [3, 3, 3, 3]}
    # a limit the unsynced plan fits: vertical sync needs more than it on the last (largest) stage
    limit = max(s.predicted["total_bytes"] for s in plan_chain(chain, Topology.flat(4), PlanOptions(**base)).stages)
    with pytest.raises(UserError):
        plan_chain(chain, Topology.flat(4), PlanOptions(**base, vertical_sync=True, memory_bytes_per_device=limit))
    # every replication on up to 5 devices: exact with stage 0 known, and the search's count
    # (stage 0 not yet chosen, on as many devices or more) never below it
    for devices in range(1, 6):
        for k in range(1, devices + 1):
            for cuts in itertools.combinations(range(1, devices), k - 1):
                edges = (0, *cuts, devices)
                replicas = tuple(b - a for a, b in zip(edges, edges[1:]))
                spec = ScheduleSpec.make("pipedream", k, 60, 1, replicas, vertical_sync=True)
                options = PlanOptions(schedule="pipedream", num_microbatches=60, vertical_sync=True)
                for stage_id, r in enumerate(replicas):
                    d = devices - edges[stage_id]
                    exact = weight_versions("pipedream", d, r, VerticalSync(devices, (replicas[0],)))
                    assert exact == spec.stash_depth(stage_id).weight_versions, (replicas, stage_id)
                    for anchor in range(devices, 6):
                        bound = weight_versions("pipedream", d, r, search_vertical_sync(options, anchor))
                        assert bound >= exact, (replicas, stage_id, anchor)

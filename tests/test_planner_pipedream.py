"""cost_model="pipedream" reproduces PipeDream's optimizer on PipeDream's own profiles."""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

from pdcli.planner import PlanOptions, Topology, plan_chain
from pdcli.planner.plan import Plan
from pdcli.profiler.antichain import antichain_states, prefix_states
from pdcli.profiler.chain import Chain
from pdcli.profiler.graphtxt import graph_to_chain, load_graph

SHARED = Path(__file__).resolve().parents[2] / "shared" / "pipedream-profiles"
CASES = [(p, c) for p in ("vgg16", "resnet50", "gnmt") for c in ("flat4", "flat8", "flat16", "h4x4", "straight8")]
RELATIVE_TOLERANCE = 1e-6


@lru_cache(maxsize=None)
def expected() -> dict:
    return json.loads((SHARED / "expected.json").read_text())


@lru_cache(maxsize=None)
def chain_of(profile: str) -> Chain:
    return graph_to_chain(load_graph(SHARED / expected()["profiles"][profile]["graph"]))


@pytest.fixture(autouse=True)
def need_shared() -> None:
    if not (SHARED / "expected.json").exists():
        pytest.skip("../shared/pipedream-profiles is not beside the repo")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("profile, cluster", CASES)
def test_matches_pipedream_optimum(profile: str, cluster: str) -> None:
    case = expected()["profiles"][profile]["optima"][cluster]
    topology = Topology.from_levels(case["levels"])
    options = PlanOptions(cost_model="pipedream", schedule="pipedream", straight=case["straight_pipeline"],
                          use_fewer_devices=False, memory_bytes_per_device=None)
    plan = plan_chain(chain_of(profile), topology, options)
    got_s = plan.time_per_minibatch_ms / 1000.0
    assert got_s == pytest.approx(case["pipeline_time_s"], rel=RELATIVE_TOLERANCE)

    n = len(chain_of(profile))
    assert plan.stages[0].start == 0 and plan.stages[-1].end == n
    assert all(a.end == b.start for a, b in zip(plan.stages, plan.stages[1:]))
    ranks = sorted(r for s in plan.stages for r in s.ranks)
    assert ranks == list(range(topology.num_devices))  # use_fewer off: every device used
    if case["straight_pipeline"]:
        assert all(s.replicas == 1 for s in plan.stages) and len(plan.stages) == topology.num_devices
    if len(case["levels"]) == 1:  # one level: the per-stage terms explain the optimum exactly
        worst = max(s.predicted["stage_time_ms"] for s in plan.stages)
        assert worst == pytest.approx(plan.time_per_minibatch_ms, rel=1e-9)
    # every graph node lands in exactly one stage
    names = [m for s in plan.stages for m in s.node_names]
    assert len(names) == len(set(names)) == sum(len(x.members) for x in chain_of(profile).nodes)


def test_data_parallel_baseline_matches_single_device_time() -> None:
    """One device: PipeDream's data-parallel time is the single-device time it reports."""
    profile = expected()["profiles"]["vgg16"]
    plan = plan_chain(chain_of("vgg16"), Topology.flat(1), PlanOptions(cost_model="pipedream"))
    assert plan.pipeline["data_parallel_time_per_minibatch_ms"] == pytest.approx(
        profile["single_device_time_s"] * 1000.0, rel=RELATIVE_TOLERANCE)
    assert plan.time_per_minibatch_ms == pytest.approx(profile["single_device_time_s"] * 1000.0)


MAX_STATES = 2000
"""`plan.max_states`'s default: inception_v3 has far more antichain states."""
INCEPTION_CLUSTERS = {
    "flat4": [{"devices": 4, "bandwidth_bytes_per_s": 1e10}],
    "flat16": [{"devices": 16, "bandwidth_bytes_per_s": 1e10}],
    "h4x4": [{"devices": 4, "bandwidth_bytes_per_s": 1e10}, {"devices": 4, "bandwidth_bytes_per_s": 1e9}],
}


@lru_cache(maxsize=None)
def inception() -> tuple[Chain, int]:
    graph = load_graph(SHARED / "inception_v3" / "graph.txt")
    return graph_to_chain(graph, max_states=MAX_STATES), len(graph.nodes)


def check_valid(plan: Plan, chain: Chain, graph_nodes: int, devices: int) -> None:
    """Contiguous stages over the whole chain, every graph node in exactly one stage, no rank twice."""
    assert plan.stages[0].start == 0 and plan.stages[-1].end == len(chain)
    assert all(a.end == b.start and a.start < a.end for a, b in zip(plan.stages, plan.stages[1:]))
    names = [m for s in plan.stages for m in s.node_names]
    assert len(names) == len(set(names)) == graph_nodes
    ranks = [r for s in plan.stages for r in s.ranks]
    assert len(ranks) == len(set(ranks)) and max(ranks) < devices


def test_inception_plans_over_prefixes_at_least_as_well_as_pipedream_compressed() -> None:
    """inception_v3 uncompressed: past plan.max_states the positions are the prefixes of one
    topological order, one per layer (bounded however many antichains the graph has), and
    the plan on 4 flat devices is at least as good as PipeDream's after its branch
    compression (0.17461 s)."""
    chain, graph_nodes = inception()
    assert chain.meta["search_space"]["method"] == "topological_prefixes"
    assert len(chain) < graph_nodes  # one position per layer besides the dropped input
    compressed = expected()["unplannable_by_pipedream"]["inception_v3"]["pipedream_compressed"]
    plan = plan_chain(chain, Topology.from_levels(INCEPTION_CLUSTERS["flat4"]), PlanOptions(cost_model="pipedream"))
    assert plan.time_per_minibatch_ms / 1000.0 <= compressed["flat4_time_per_minibatch_s"] * (1 + 1e-9)
    assert plan.inputs["search_space"]["method"] == "topological_prefixes"
    check_valid(plan, chain, graph_nodes, 4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cluster", sorted(INCEPTION_CLUSTERS))
@pytest.mark.parametrize("cost_model", ["pipedream", "pd"])
def test_inception_plans_on_every_cluster(cluster: str, cost_model: str) -> None:
    chain, graph_nodes = inception()
    topology = Topology.from_levels(INCEPTION_CLUSTERS[cluster])
    plan = plan_chain(chain, topology, PlanOptions(cost_model=cost_model, num_microbatches=4))
    check_valid(plan, chain, graph_nodes, topology.num_devices)
    assert plan.time_per_minibatch_ms < plan.pipeline["data_parallel_time_per_minibatch_ms"] * 1.001


@pytest.mark.parametrize("profile", ["vgg16", "resnet50", "gnmt"])
def test_prefix_states_are_antichain_states_of_the_same_cost(profile: str) -> None:
    """A prefix state covering the same layers as one of PipeDream's states sends the same
    bytes and sums the same costs (the restricted space prices a cut as the exact one does),
    and the restricted optimum is never below the exact one."""
    graph = load_graph(SHARED / expected()["profiles"][profile]["graph"])
    exact = {frozenset(s.covered): s for s in antichain_states(graph).states}
    prefixes = prefix_states(graph).states
    matched = 0
    for state in prefixes:
        twin = exact.get(frozenset(state.covered))
        if twin is not None:
            matched += 1
            assert state.output_activation_bytes == pytest.approx(twin.output_activation_bytes)
            assert state.fwd_ms == pytest.approx(twin.fwd_ms) and state.parameter_bytes == pytest.approx(
                twin.parameter_bytes)
    assert matched >= 2
    restricted = graph_to_chain(graph, prefixes=True)
    assert len(restricted) == len(prefixes) and restricted.meta["search_space"]
    topology = Topology.flat(4)
    options = PlanOptions(cost_model="pipedream", use_fewer_devices=False)
    best = plan_chain(chain_of(profile), topology, options).time_per_minibatch_ms
    assert plan_chain(restricted, topology, options).time_per_minibatch_ms >= best * (1 - 1e-9)


def levels_of(inner: int, outer: int = 1) -> list[dict]:
    levels = [{"devices": inner, "bandwidth_bytes_per_s": 1e10}]
    return levels + ([{"devices": outer, "bandwidth_bytes_per_s": 1e9}] if outer > 1 else [])


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("profile", ["resnet50", "gnmt"])
def test_parametric_top_level_finds_the_tables_optimum(profile: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bisection on the bottleneck that solves a big outermost level finds the optimum the
    (machines^2) table finds, using every device unless fewer are allowed."""
    import pdcli.planner.pipedream as pipedream

    for inner, outer in ((16, 1), (33, 1), (4, 4), (8, 3)) if profile == "gnmt" else ((16, 1), (8, 3)):
        topology = Topology.from_levels(levels_of(inner, outer))
        for fewer in (False, True):
            options = PlanOptions(cost_model="pipedream", use_fewer_devices=fewer)
            monkeypatch.setattr(pipedream, "PARAMETRIC_MACHINES", 10 ** 9)
            table = plan_chain(chain_of(profile), topology, options)
            monkeypatch.setattr(pipedream, "PARAMETRIC_MACHINES", 0)
            bisected = plan_chain(chain_of(profile), topology, options)
            assert bisected.time_per_minibatch_ms == pytest.approx(table.time_per_minibatch_ms, rel=1e-12)
            used = sum(s.replicas for s in bisected.stages)
            assert used == topology.num_devices or fewer
            if len(topology.levels) == 1:
                worst = max(s.predicted["stage_time_ms"] for s in bisected.stages)
                assert worst == pytest.approx(bisected.time_per_minibatch_ms, rel=1e-9)


RESNET50_1024_FLAT_MS = 0.47247257491416467
"""PipeDream's model on ResNet-50 and 1,024 flat devices, as the full (machines^2) table found it
(in 213 s and 1.4 GB)."""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resnet50_on_1024_devices_with_either_cost_model() -> None:
    chain = chain_of("resnet50")
    flat = Topology.from_levels(levels_of(1024))
    plan = plan_chain(chain, flat, PlanOptions(cost_model="pipedream", use_fewer_devices=False))
    assert plan.time_per_minibatch_ms == pytest.approx(RESNET50_1024_FLAT_MS, rel=1e-12)
    check_valid(plan, chain, sum(len(x.members) for x in chain.nodes), 1024)
    assert sum(s.replicas for s in plan.stages) == 1024
    nodes = Topology.from_levels(levels_of(8, 128))
    for cost_model in ("pipedream", "pd"):  # pd: at most 240 stages of 4 replicas, so fewer devices
        options = PlanOptions(cost_model=cost_model, num_microbatches=4, use_fewer_devices=True)
        plan = plan_chain(chain, nodes, options)
        check_valid(plan, chain, sum(len(x.members) for x in chain.nodes), 1024)
        # more nodes than 8 x 16 never make the best plan slower (fewer devices are allowed)
        smaller = plan_chain(chain, Topology.from_levels(levels_of(8, 16)), options)
        assert plan.time_per_minibatch_ms <= smaller.time_per_minibatch_ms * (1 + 1e-12)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_flush_schedules_bounded_stage_counts_keep_the_optimum(schedule: str) -> None:
    """A flush schedule's search runs only the stage counts whose bubble can still win (under a
    memory limit, deepening as plans are found): it finds the best of the plans with each
    stage count fixed (each searched on its own, every count), with and without a limit that binds."""
    from pdcli.errors import UserError

    chain = chain_of("resnet50")
    for levels in (levels_of(8), levels_of(4, 2)):
        topology = Topology.from_levels(levels)
        free = plan_chain(chain, topology, PlanOptions(cost_model="pd", schedule=schedule, num_microbatches=4))
        peak = max(s.predicted["total_bytes"] for s in free.stages)
        for limit in (None, 0.5 * peak):
            options = PlanOptions(cost_model="pd", schedule=schedule, num_microbatches=4, use_fewer_devices=True,
                                  memory_bytes_per_device=limit)
            each = []
            for count in range(1, topology.num_devices + 1):
                try:
                    each.append(plan_chain(chain, topology, dataclasses.replace(options, num_stages=count)))
                except UserError:  # no plan with this many stages fits
                    pass
            best = plan_chain(chain, topology, options)
            assert best.time_per_minibatch_ms == min(p.time_per_minibatch_ms for p in each)
            if limit is not None:
                assert best.time_per_minibatch_ms > free.time_per_minibatch_ms  # the limit binds
                assert max(s.predicted["total_bytes"] for s in best.stages) <= limit


@pytest.mark.timeout(60)
def test_the_benchmarks_deep_profile_is_a_graph_txt_both_models_plan(deep_profile: Any) -> None:
    from pdcli.profiler.graphtxt import format_graph, parse_graph

    graph = deep_profile.deep_graph(blocks=40)
    assert parse_graph(format_graph(graph)) == graph  # a graph.txt as pd plan --profile reads it
    chain = graph_to_chain(graph, max_states=MAX_STATES)
    assert "search_space" not in chain.meta and len(chain) >= len(graph.nodes) - 1  # exact antichains
    for levels in (levels_of(16), levels_of(4, 4)):
        topology = Topology.from_levels(levels)
        for cost_model in ("pipedream", "pd"):
            plan = plan_chain(chain, topology, PlanOptions(cost_model=cost_model, num_microbatches=4))
            check_valid(plan, chain, len(graph.nodes), topology.num_devices)
            assert plan.time_per_minibatch_ms < plan.pipeline["data_parallel_time_per_minibatch_ms"] * 1.001


def test_a_table_past_plan_max_states_switches_method_or_stops_with_exit_2(tmp_path: Path) -> None:
    """plan.max_states also bounds the tables PipeDream's model builds (positions^2 x 256 bytes):
    past it the outermost level is bisected instead (same optimum), and an inner level, which
    has no other method, stops with exit 2 naming the limit."""
    from typer.testing import CliRunner

    from pdcli.cli import app
    from pdcli.errors import UserError

    chain, flat = chain_of("resnet50"), Topology.from_levels(levels_of(32))
    unbounded = plan_chain(chain, flat, PlanOptions(cost_model="pipedream"))
    bounded = plan_chain(chain, flat, PlanOptions(cost_model="pipedream", max_positions=300))
    assert bounded.time_per_minibatch_ms == pytest.approx(unbounded.time_per_minibatch_ms, rel=1e-12)
    with pytest.raises(UserError, match=r"table of cluster level 0 .* more than plan.max_states=300"):
        plan_chain(chain, Topology.from_levels(levels_of(4, 4)), PlanOptions(cost_model="pipedream", max_positions=300))
    result = CliRunner().invoke(app, ["plan", "--profile", str(SHARED / "resnet50" / "graph.txt"), f"run.root={tmp_path}",
                                      "cluster.levels=[{devices: 4, bandwidth_bytes_per_s: 1e10}, "
                                      "{devices: 4, bandwidth_bytes_per_s: 1e9}]",
                                      "plan.cost_model=pipedream", "plan.max_states=300"])
    assert result.exit_code == 2 and "plan.max_states=300" in result.output and "Traceback" not in result.output

"""cost_model="pipedream" reproduces PipeDream's optimizer on PipeDream's own profiles."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from pdcli.planner import PlanOptions, Topology, plan_chain
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

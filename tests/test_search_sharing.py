"""The configuration search shares the partition search's work among configurations that price
alike (`pdcli.planner.search.shared_programs`, `min_over_ends`, the stage-count cap of a split
backward with nothing to defer): the points it finds are the points of planning each
configuration alone, one `plan_chain` at a time."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest

from pdcli.errors import UserError
from pdcli.planner import PlanOptions, Topology, plan_chain
from pdcli.planner.pareto import ConfigSpace, Point, _point, config_options, search_points
from pdcli.planner.search import ROW_BLOCK, min_over_ends
from pdcli.profiler.batch_points import BATCH_POINTS_META, chain_at_precision, chain_at_rows
from pdcli.profiler.chain import Chain, ChainNode

SHARED = Path(__file__).resolve().parents[2] / "shared" / "pipedream-profiles"
SPACE = ConfigSpace(("pipedream", "2bw", "1f1b", "gpipe"), (1, 2, 3, 4, 6, 12), (True, False), (False, True))


def random_chain(seed: int, n: int = 14, wgrad: bool = False, points: bool = False) -> Chain:
    """n positions of uneven costs profiled at 12 rows; `wgrad`: Linear-like weight gradients
    (a split backward has work to defer); `points`: measured at 2 and 6 rows too, slower per row."""
    rng = random.Random(seed)
    nodes = []
    for i in range(n):
        bwd = rng.uniform(0.5, 4.0)
        nodes.append(ChainNode(name=f"n{i}", label=f"layer{i}", fwd_ms=rng.uniform(0.2, 2.0), bwd_ms=bwd,
                               parameter_bytes=rng.choice([0, 1_000_000, 6_000_000]),
                               activation_bytes=rng.randint(100_000, 2_000_000),
                               backward_memory_bytes=rng.randint(0, 1_000_000), optimizer_ms=rng.uniform(0, 0.2),
                               wgrad_ms=rng.uniform(0, bwd) if wgrad else 0.0))
    meta: dict = {"batch_size": 12}
    if points:
        meta[BATCH_POINTS_META] = {"rows": [2, 6], **{f: [[getattr(x, f) * r / 12 * slow for x in nodes]
                                                         for r, slow in ((2, 2.5), (6, 1.3))]
                                                      for f in ("fwd_ms", "bwd_ms", "wgrad_ms")}}
    cuts = tuple(rng.randint(50_000, 3_000_000) for _ in range(n - 1))
    return Chain(nodes=tuple(nodes), cut_bytes=cuts, meta=meta)


def planned_alone(profiled: Chain, topology: Topology, base: PlanOptions,
                  space: ConfigSpace) -> list[Point]:
    """Every configuration planned on its own, in the space's order (what the search shares)."""
    points = []
    for config in space.configurations():
        rows = base.batch_size // config.num_microbatches
        chain = chain_at_precision(chain_at_rows(profiled, rows), config.precision, rows)
        try:
            points.append(_point(config, plan_chain(chain, topology, config_options(base, config))))
        except UserError:
            pass
    return points


def same_points(shared: list[Point], alone: list[Point]) -> None:
    assert [p.config for p in shared] == [p.config for p in alone]
    for p, q in zip(shared, alone):
        assert p.objectives() == q.objectives(), p.config
        assert json.dumps(p.plan.to_json(), sort_keys=True) == json.dumps(q.plan.to_json(), sort_keys=True)


@pytest.mark.parametrize("case", ["linear", "batch_points", "wgrad", "memory_limit", "two_levels"])
def test_the_shared_search_finds_the_points_of_each_configuration_planned_alone(case: str) -> None:
    c = random_chain(seed=len(case), wgrad=case == "wgrad", points=case == "batch_points")
    topology = Topology.from_levels(Topology.flat(2, 1e9).levels + Topology.flat(3, 2e8).levels) \
        if case == "two_levels" else Topology.flat(6, 1e9)
    base = PlanOptions(batch_size=12, use_fewer_devices=True)
    if case == "memory_limit":  # binding: some configurations fit, some not
        free = planned_alone(c, topology, base, SPACE)
        peaks = sorted(p.peak_bytes for p in free)
        base = dataclasses.replace(base, memory_bytes_per_device=peaks[len(peaks) // 3])
    shared, refused = search_points(c, topology, base, SPACE)
    alone = planned_alone(c, topology, base, SPACE)
    same_points(shared, alone)
    assert refused == len(SPACE.configurations()) - len(alone)
    assert len({p.time_per_minibatch_ms for p in shared}) > 10  # the configurations do differ
    if case == "memory_limit":
        assert refused > 0 and shared


def test_a_held_out_pipedream_profile_on_16_devices_gives_the_same_points() -> None:
    if not (SHARED / "vgg16/graph.txt").exists():
        pytest.skip("../shared/pipedream-profiles is not beside the repo")
    from pdcli.profiler.graphtxt import graph_to_chain, load_graph

    c = graph_to_chain(load_graph(SHARED / "vgg16/graph.txt"))
    space = ConfigSpace(("pipedream", "2bw", "1f1b", "gpipe"), (1, 4, 16, 32), (True, False), (False, True))
    base, topology = PlanOptions(batch_size=32), Topology.flat(16, 1e10)
    shared, _ = search_points(c, topology, base, space)
    same_points(shared, planned_alone(c, topology, base, space))


def test_a_split_backward_with_nothing_to_defer_finds_the_best_stage_count() -> None:
    """With no weight gradients a split backward has the unsplit bubble, and its search runs only
    the stage counts that can still win: the best of the plans with each count fixed."""
    c = random_chain(seed=7, n=16)
    topology = Topology.flat(8, 1e9)
    for schedule in ("gpipe", "1f1b"):
        options = PlanOptions(schedule=schedule, num_microbatches=4, batch_size=12, split_backward=True,
                              use_fewer_devices=True)
        each = [plan_chain(c, topology, dataclasses.replace(options, num_stages=k)).time_per_minibatch_ms
                for k in range(1, 9)]
        best = plan_chain(c, topology, options)
        assert best.time_per_minibatch_ms == min(each)
        assert best.time_per_minibatch_ms == plan_chain(
            c, topology, dataclasses.replace(options, split_backward=False)).time_per_minibatch_ms


@pytest.mark.parametrize("n", [1, 2, ROW_BLOCK - 1, ROW_BLOCK, ROW_BLOCK + 1, 2 * ROW_BLOCK + 5])
def test_min_over_ends_reads_only_the_ends_after_each_start(n: int) -> None:
    rng = np.random.default_rng(n)
    for layers, stage_layers in ((1, 1), (3, 1), (3, 3)):
        stage = rng.random((stage_layers, n, n))
        stage[:, np.tril_indices(n)[0], np.tril_indices(n)[1]] = np.inf  # [i, e) needs i < e
        stage[rng.random(stage.shape) < 0.2] = np.inf  # invalid stages
        rest = rng.random((layers, n))
        rest[rng.random(rest.shape) < 0.2] = np.inf
        square = np.maximum(stage, rest[:, None, :]).min(axis=2)
        assert np.array_equal(min_over_ends(stage, rest), square)

"""The planner's fast paths give exactly what the plain computations give.

PipeDream's model: the tables built over the windows of k a `ComputeBound` leaves, and the inner
level holding only the rows an outer stage can use, against the dense tables over every row
(`ComputeBound.of` patched to None), on random chains and DAGs and several cluster shapes. The
flush schedules' memory peaks against their definition, point by point."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import pytest

import pdcli.planner.minmax as minmax
import pdcli.planner.pipedream as pipedream
from pdcli.planner import PlanOptions, Topology, plan_chain
from pdcli.planner.memory import MemorySettings, StageBytes, held_points, stage_memory
from pdcli.planner.space import SplitSpace
from pdcli.profiler.chain import Chain, ChainNode
from pdcli.profiler.graph import Graph, GraphNode
from pdcli.profiler.graphtxt import graph_to_chain

FAST, SLOW = 1e10, 1e9
CLUSTERS = {
    "flat3": [3],
    "flat6": [6],
    "2x3": [2, 3],
    "3x2": [3, 2],
    "4x4": [4, 4],
    "2x2x2": [2, 2, 2],
}


def random_graph(seed: int, layers: int, branchy: bool) -> Graph:
    """Layers with skips over 1-3 layers (each state covers one more layer: the bound holds),
    or with two-branch blocks (antichain states that do not grow: it does not)."""
    rng = random.Random(seed)
    nodes = [GraphNode("node0", "Input0", 0.0, 0.0, (4e6,), 0.0)]
    edges: list[tuple[str, str]] = []

    def add(*inputs: str) -> str:
        name = f"node{len(nodes)}"
        fwd = round(rng.uniform(0.1, 3.0), 3)
        nodes.append(GraphNode(name, f"Layer{len(nodes)}", fwd, round(2 * fwd * rng.uniform(0.5, 1.5), 3),
                               (rng.choice([1e6, 4e6, 2e7]),), rng.choice([0.0, 1e6, 3e7])))
        edges.extend((src, name) for src in inputs)
        return name

    x = add("node0")
    while len(nodes) < layers:
        if branchy and rng.random() < 0.3:
            x = add(add(x), add(add(x)))
        elif rng.random() < 0.4:
            y = x
            for _ in range(rng.randint(1, 3)):
                y = add(y)
            x = add(y, x)
        else:
            x = add(x)
    return Graph(nodes=tuple(nodes), edges=tuple(edges))


def random_chain(seed: int, n: int) -> Chain:
    rng = random.Random(seed)
    nodes = [ChainNode(name=f"n{i}", label=f"layer{i}", fwd_ms=rng.choice([0.0, rng.uniform(0.1, 5)]),
                       bwd_ms=rng.uniform(0.1, 9), parameter_bytes=rng.choice([0, rng.randrange(1, 30_000_000)]),
                       activation_bytes=rng.randrange(1, 20_000_000)) for i in range(n)]
    return Chain(nodes=tuple(nodes), cut_bytes=tuple(x.activation_bytes for x in nodes[:-1]))


def topology_of(devices: list[int]) -> Topology:
    return Topology.from_levels([{"devices": d, "bandwidth_bytes_per_s": FAST if i == 0 else SLOW}
                                 for i, d in enumerate(devices)])


def search(space: SplitSpace, topology: Topology, options: PlanOptions) -> Any:
    found = pipedream.pipedream_search(space, topology, options, 1.0)
    return None if found is None else (found[0], [(s.start, s.end, s.ranks, s.path) for s in found[1]])


def spaces() -> list[tuple[str, SplitSpace]]:
    out = [(f"chain{seed}", SplitSpace.from_chain(random_chain(seed, 50))) for seed in range(2)]
    out += [(f"skips{seed}", SplitSpace.from_chain(graph_to_chain(random_graph(seed, 60, False)))) for seed in range(2)]
    return out + [("branchy", SplitSpace.from_chain(graph_to_chain(random_graph(7, 50, True))))]


@pytest.mark.timeout(120)
def test_pruned_pipedream_tables_give_the_dense_tables_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same optimum, same stages, same ranks, ties included: every cluster shape, with and
    without fewer devices, straight, and under a memory limit (which slows most plans)."""
    gathered, held_rows = [], []
    gather, level = minmax._gather, pipedream._level
    monkeypatch.setattr(minmax, "_gather", lambda *a: gathered.append(1) or gather(*a))
    monkeypatch.setattr(pipedream, "_level", lambda *a: held_rows.append((len(a[-2]), a[0].shape[0])) or level(*a))
    optima: dict[tuple[str, str, str], float] = {}
    for name, space in spaces():
        bound = minmax.ComputeBound.of(space.covered_fwd_ms + space.covered_bwd_ms, space.covered_parameter_bytes, 1)
        assert (bound is None) == (name == "branchy")  # the branchy DAG's states do not grow
        budget = float(space.covered_parameter_bytes[-1] + space.covered_activation_bytes[-1])
        for cluster, devices in CLUSTERS.items():
            topology = topology_of(devices)
            for extra in ({}, {"use_fewer_devices": True}, {"straight": True},
                          {"memory_bytes_per_device": budget / topology.num_devices / 2}):
                options = PlanOptions(cost_model="pipedream", **extra)
                with monkeypatch.context() as dense:
                    dense.setattr(pipedream.ComputeBound, "of", classmethod(lambda cls, *a: None))
                    expected = search(space, topology, options)
                got = search(space, topology, options)
                assert got == expected and expected is not None, (name, cluster, extra)
                optima[name, cluster, next(iter(extra), "")] = expected[0]
    assert gathered  # the windows ran
    limited = [optima[key[:2] + ("memory_bytes_per_device",)] > optima[key] for key in optima if key[2] == ""]
    assert sum(limited) > len(limited) / 2
    assert any(rows < total for rows, total in held_rows)  # some inner levels held only the usable rows


DEEP_OPTIMUM_MS = 168.5310000000011
"""PipeDream's model on benchmarks/deep_profile.py's graph (1,752 positions), on 16 flat devices
and on 4 x 4, as the dense table over every row found it (41 s on 4 x 4)."""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_deep_profile_plans_at_the_dense_tables_optimum(deep_profile: Any) -> None:
    chain = graph_to_chain(deep_profile.deep_graph(), max_states=2000)
    assert len(chain) == 1752
    for devices in ([16], [4, 4]):
        for fewer in (False, True):
            options = PlanOptions(cost_model="pipedream", use_fewer_devices=fewer)
            plan = plan_chain(chain, topology_of(devices), options)
            assert plan.time_per_minibatch_ms == DEEP_OPTIMUM_MS


def peaks_by_definition(schedule: str, num_stages: int, num_microbatches: int, stages_from: int,
                        split_backward: bool, costs: tuple[float, ...], static: float) -> tuple[float, float]:
    """The two peaks over every point of the stage's action list, one element at a time."""
    acts, total = 0.0, 0.0
    for point in held_points(schedule, num_stages, num_microbatches, num_stages - stages_from, split_backward):
        value = point[0] * costs[0] + point[1] * costs[1] + point[2] * costs[2]
        acts, total = max(acts, value), max(total, value + point[3] * costs[3])
    return acts, static + total


@pytest.mark.parametrize("schedule, split_backward, recompute", [("1f1b", False, False), ("1f1b", True, False),
                                                                 ("gpipe", False, True), ("gpipe", True, False)])
def test_flush_memory_peaks_match_their_definition(schedule: str, split_backward: bool, recompute: bool) -> None:
    """stage_memory's flush peaks, over the search's (stages, start, end) arrays and over arrays
    whose stage counts vary elementwise, equal the peaks taken point by point."""
    rng = np.random.default_rng(3)
    n, stages, m = 7, 5, 4
    params, held, state, inputs, waiting = (rng.uniform(0, 1e8, (n, n + 1)) for _ in range(5))
    settings = MemorySettings(schedule=schedule, num_microbatches=m, recompute=recompute, split_backward=split_backward)
    for stages_from in (np.arange(1, stages + 1, dtype=float)[:, None, None],
                        rng.integers(1, stages + 1, size=(n, n + 1)).astype(float)):
        mem = stage_memory(settings, StageBytes(parameters=params, activations=held, optimizer_state=state, inputs=inputs,
                                                waiting=waiting if split_backward else None),
                           replicas=1, devices_from=4, stages_from=stages_from, num_stages=stages)
        want_shape = np.broadcast_shapes(stages_from.shape, params.shape)
        assert np.shape(mem.total_bytes) == np.shape(mem.activations_bytes) == want_shape
        for index in np.ndindex(*want_shape):
            cell = index[-2:]
            per = held[cell] / m
            costs = (inputs[cell] / m if recompute else per, waiting[cell] / m if split_backward else 0.0,
                     per - inputs[cell] / m if recompute and per > inputs[cell] / m else 0.0, params[cell])
            acts, total = peaks_by_definition(schedule, stages, m, int(np.broadcast_to(stages_from, want_shape)[index]),
                                              split_backward, costs, params[cell] + state[cell])
            assert mem.activations_bytes[index] == pytest.approx(acts, rel=1e-12)
            assert mem.total_bytes[index] == pytest.approx(total, rel=1e-12)
    one = stage_memory(settings, StageBytes(parameters=1e8, activations=4e8, optimizer_state=1e7, inputs=1e6,
                                            waiting=1e8 if split_backward else None),
                       replicas=2, devices_from=4, stages_from=2, num_stages=stages)  # a report's single stage
    assert isinstance(one.activations_bytes, float) and one.total_bytes > one.activations_bytes > 0

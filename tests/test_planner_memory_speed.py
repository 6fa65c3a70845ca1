"""The `pd` search under a memory limit computes each stage's memory once per `memory_key`, holds
the layers of the stage-count axis that price alike once (`LayerCosts`), and plans a split 1f1b
in one program for every stage count from `split_counts_alike_from` on (with the counts capped
by `bubble_factor_floor`): the same plans, optima and memory as the straightforward search that
recomputes every stage's memory for each (devices, replicas) and runs each stage count alone."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import pytest

from pdcli.planner import PlanOptions, Topology, plan_chain
from pdcli.planner import search
from pdcli.planner.costs import bubble_factor, bubble_factor_floor, replayed_bubble_factor
from pdcli.planner.memory import (MemorySettings, StageBytes, VerticalSync, held_points, memory_key, split_counts_alike_from,
                                  stage_memory)
from pdcli.planner.search import LayerCosts, PdCosts, SearchResult, backward_split, pd_search
from pdcli.planner.costs import SplitShares
from pdcli.planner.space import SplitSpace
from pdcli.profiler.chain import Chain, ChainNode

CLUSTERS = {
    "flat4": Topology.flat(4, 1e9),
    "flat6": Topology.flat(6, 1e9),
    "2x3": Topology.from_levels([{"devices": 2, "bandwidth_bytes_per_s": 1e9},
                                 {"devices": 3, "bandwidth_bytes_per_s": 2e8}]),
    "3x2": Topology.from_levels([{"devices": 3, "bandwidth_bytes_per_s": 1e9},
                                 {"devices": 2, "bandwidth_bytes_per_s": 1e8}]),
}
CASES = [("1f1b", True, False), ("1f1b", False, False), ("gpipe", False, False), ("gpipe", True, False),
         ("1f1b", True, True)]  # the last: merged weight gradients, searched in one run for every count


def random_chain(seed: int, n: int = 12) -> Chain:
    """Uneven positions with Linear-like weight gradients (a split backward has W to defer)."""
    rng = random.Random(seed)
    nodes = []
    for i in range(n):
        bwd = rng.uniform(0.5, 4.0)
        params = rng.choice([0, 1_000_000, 6_000_000])
        nodes.append(ChainNode(name=f"n{i}", label=f"layer{i}", fwd_ms=rng.uniform(0.2, 2.0), bwd_ms=bwd,
                               parameter_bytes=params, activation_bytes=rng.randint(100_000, 8_000_000),
                               backward_memory_bytes=rng.randint(0, 1_000_000), optimizer_ms=rng.uniform(0, 0.2),
                               optimizer_state_bytes=rng.choice([0, 1, 2]) * params, wgrad_ms=rng.uniform(0, bwd)))
    cuts = tuple(rng.randint(50_000, 3_000_000) for _ in range(n - 1))
    return Chain(nodes=tuple(nodes), cut_bytes=cuts, meta={"batch_size": 8})


def straightforward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stage's memory recomputed for each (devices, replicas), each layer held apart."""
    monkeypatch.setattr(search, "_cached", lambda cache, key, make: make())
    monkeypatch.setattr(search, "distinct_layers", lambda array: LayerCosts(np.array(array), np.arange(len(array))))


def per_count(space: SplitSpace, topology: Topology, options: PlanOptions, minimize: str) -> SearchResult | None:
    """The best plan over the stage counts each searched alone (no cap, no shared program)."""
    split = backward_split(space, options)
    runs = [search._search(space, topology, dataclasses.replace(options, num_stages=k), 1.0, minimize, split)
            for k in range(1, min(space.num_positions, topology.num_devices) + 1)]
    found = [run for run in runs if run is not None]
    return min(found, key=lambda run: run[0])[1] if found else None


def peak(plan: Any) -> float:
    return max(s.predicted["total_bytes"] for s in plan.stages)


def limits(chain: Chain, topology: Topology, options: PlanOptions) -> list[float]:
    """Two binding memory limits: between the smallest peak any plan reaches and the unlimited plan's."""
    space = SplitSpace.from_chain(chain)
    smallest = pd_search(space, topology, options, 1.0, minimize="memory")
    assert smallest is not None
    free = peak(plan_chain(chain, topology, options))
    assert smallest.objective < free
    return [smallest.objective + (free - smallest.objective) * f for f in (0.05, 0.25, 0.6)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,split,merge", CASES)
def test_the_search_under_a_memory_limit_finds_the_straightforward_plans(
        schedule: str, split: bool, merge: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    checked = slower = replicated = 0
    for seed in range(2):
        chain = random_chain(seed)
        space = SplitSpace.from_chain(chain)
        for name, topology in CLUSTERS.items():
            options = PlanOptions(schedule=schedule, num_microbatches=4, batch_size=8, split_backward=split,
                                  use_fewer_devices=True, merge_weight_grads=merge)
            per_stage_count = split and not merge and schedule == "1f1b"
            assert search.memory_needs_stage_count(
                dataclasses.replace(options, memory_bytes_per_device=1.0), "time") == per_stage_count
            for limit in limits(chain, topology, options):
                limited = dataclasses.replace(options, memory_bytes_per_device=limit)
                got = pd_search(space, topology, limited, 1.0)
                smallest = pd_search(space, topology, limited, 1.0, minimize="memory")
                plan = plan_chain(chain, topology, limited)
                with monkeypatch.context() as m:
                    straightforward(m)
                    expected = per_count(space, topology, limited, "time")
                    expected_smallest = per_count(space, topology, limited, "memory")
                    expected_plan = plan_chain(chain, topology, limited)
                assert got == expected and got is not None, (seed, name, limit)
                assert smallest == expected_smallest, (seed, name, limit)
                assert plan.to_json() == expected_plan.to_json()
                assert peak(plan) <= limit
                checked += 1
                slower += plan.time_per_minibatch_ms > plan_chain(chain, topology, options).time_per_minibatch_ms
                replicated += any(s.replicas > 1 for s in got.stages)
    assert checked == 24 and slower >= 12 and replicated >= 6  # the limits bind; stages replicate


@pytest.mark.parametrize("schedule", ["pipedream", "2bw", "1f1b", "gpipe"])
def test_stage_memory_is_the_same_for_every_pair_with_the_same_memory_key(schedule: str) -> None:
    space = SplitSpace.from_chain(random_chain(3))
    for sync in (None, VerticalSync(8, (1, 2))) if schedule == "pipedream" else (None,):
        seen: dict[Any, np.ndarray] = {}
        keys = set()
        for d in range(1, 9):
            for r in range(1, d + 1):
                memory = stage_memory(MemorySettings(schedule=schedule, num_microbatches=4, vertical_sync=sync),
                                      StageBytes(parameters=space.range_matrix(space.covered_parameter_bytes),
                                                 activations=space.range_matrix(space.covered_activation_bytes)),
                                      replicas=r, devices_from=d, stages_from=np.arange(1, 5)[:, None, None]).total_bytes
                key = memory_key(schedule, d, r, sync)
                keys.add(key)
                if key in seen:
                    assert np.array_equal(seen[key], memory, equal_nan=True), (schedule, d, r)
                seen[key] = memory
        assert len(keys) == (1 if schedule in ("1f1b", "gpipe") else 8 if sync is None else 36)


def test_pd_costs_hold_each_memory_key_once_and_expand_to_every_layer() -> None:
    space = SplitSpace.from_chain(random_chain(4))
    options = PlanOptions(schedule="1f1b", num_microbatches=4, batch_size=8, memory_bytes_per_device=3e7)
    costs = PdCosts(space, Topology.flat(8, 1e9), options, 1.0, 8, 7)
    full = stage_memory(MemorySettings(schedule="1f1b", num_microbatches=4, eager_sends=costs.eager_sends),
                        StageBytes(parameters=costs.params, activations=costs.acts.held, optimizer_state=costs.optimizer_state,
                                   copies=costs.acts.copies, waiting=costs.acts.waiting),
                        replicas=1, devices_from=8, stages_from=costs.stages_from, num_stages=7).total_bytes
    for d, r in ((8, 1), (3, 2), (5, 4)):
        held = costs.memory(d, r)
        assert held.kind is not None and held.values.shape[0] < 7  # layers 4.. hold alike (M = 4)
        expanded = held.values[held.kind]
        assert np.array_equal(expanded, np.where(costs.valid & (4 % r == 0), full, np.inf))
    assert len(costs._memory_cache) == 1


@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 6])
def test_a_split_1f1b_stage_holds_alike_in_every_pipeline_from_the_alike_count_on(microbatches: int) -> None:
    first = split_counts_alike_from(microbatches)
    top = first + 5
    for count in range(first, top + 1):
        for stages_from in range(1, count + 1):
            for eager in (None, False, True):
                assert held_points("1f1b", count, microbatches, count - stages_from, True, eager) == \
                    held_points("1f1b", top, microbatches, top - stages_from, True, eager), (count, stages_from)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_bubble_floor_is_at_most_the_factor_and_grows_with_the_stage_count(schedule: str) -> None:
    for microbatches in (1, 2, 4, 8):
        for shares in (SplitShares(0.33, 0.2), SplitShares(0.5, 0.45), SplitShares(0.2, 0.05), None):
            floors = [bubble_factor_floor(schedule, microbatches, s, shares) for s in range(1, 13)]
            assert floors == sorted(floors)
            for s, floor in enumerate(floors, start=1):
                factor = bubble_factor(schedule, microbatches, s) if shares is None else \
                    replayed_bubble_factor(schedule, microbatches, s, shares.fwd, shares.wgrad)
                assert floor <= factor + 1e-12, (microbatches, shares, s)
                if shares is None:
                    assert floor == factor


def test_unlimited_split_plans_are_the_best_of_each_stage_count() -> None:
    """Without a limit a split backward's counts are capped by the floor: the same plans as
    each stage count searched alone."""
    for seed in range(2):
        chain = random_chain(seed)
        space = SplitSpace.from_chain(chain)
        for topology in CLUSTERS.values():
            for schedule in ("1f1b", "gpipe"):
                options = PlanOptions(schedule=schedule, num_microbatches=4, batch_size=8, split_backward=True,
                                      use_fewer_devices=True)
                assert pd_search(space, topology, options, 1.0) == per_count(space, topology, options, "time")

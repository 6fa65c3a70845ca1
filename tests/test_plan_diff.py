"""`pd plan diff`: what changed between two plans, and whether throughput regressed."""

from __future__ import annotations

import copy
import json

import pytest

from pdcli.planner import PlanOptions, Topology, diff_plans, plan_chain, render_diff
from pdcli.profiler.chain import Chain, ChainNode


def make_plan(num_devices: int, fwd_ms: float = 1.0, schedule: str = "pipedream") -> dict:
    nodes = tuple(ChainNode(f"n{i}", f"layer{i}", fwd_ms * (i + 1), 2.0, 1000, 100) for i in range(6))
    chain = Chain(nodes=nodes, cut_bytes=(10,) * 5)
    return plan_chain(chain, Topology.flat(num_devices), PlanOptions(schedule=schedule, num_microbatches=2)).to_json()


def test_identical_plans_are_unchanged() -> None:
    a = make_plan(3)
    d = diff_plans(a, copy.deepcopy(a))
    assert not d.changed and d.changes == () and d.throughput_change_pct == 0.0
    assert not d.regressed(0.0)
    assert "plans are identical" in render_diff(d, "text")


def test_input_only_differences_are_listed_but_not_a_change() -> None:
    a = make_plan(3)
    b = copy.deepcopy(a)
    b["inputs"]["profile_sha256"] = "f" * 64
    d = diff_plans(a, b)
    assert not d.changed and any("profile_sha256" in line for line in d.input_changes)


def test_more_devices_change_boundaries_and_raise_throughput() -> None:
    a, b = make_plan(2), make_plan(4)
    d = diff_plans(a, b)
    assert d.changed
    assert any(c.startswith("number of stages") or " end:" in c or " replicas:" in c for c in d.changes)
    expected_pct = (b["pipeline"]["throughput_samples_per_s"] / a["pipeline"]["throughput_samples_per_s"] - 1) * 100
    assert d.throughput_change_pct == pytest.approx(expected_pct)
    assert d.throughput_change_pct > 0 and not d.regressed(0.0)
    back = diff_plans(b, a)  # the reverse is a regression
    assert back.throughput_change_pct < 0
    assert back.regressed(1.0) and not back.regressed(-back.throughput_change_pct + 1.0)


@pytest.mark.parametrize("key, value", [("schedule", "1f1b"), ("num_microbatches", 4), ("split_backward", True),
                                        ("merge_weight_grads", True)])
def test_a_changed_schedule_or_microbatch_count_alone_is_a_change(key: str, value: object) -> None:
    a = make_plan(2)
    b = copy.deepcopy(a)
    b["inputs"][key] = value
    d = diff_plans(a, b)
    assert d.changed and d.changes == (f"{key}: {a['inputs'].get(key)} -> {value}",)
    assert not d.regressed(0.0)


def test_a_plan_without_split_backward_means_none() -> None:
    a = make_plan(2)
    a["inputs"].pop("split_backward", None)
    b = copy.deepcopy(a)
    b["inputs"]["split_backward"] = False
    assert not diff_plans(a, b).changed


def test_prediction_change_alone_is_a_change() -> None:
    a = make_plan(2)
    b = copy.deepcopy(a)
    b["stages"][0]["predicted"]["total_bytes"] += 1
    d = diff_plans(a, b)
    assert d.changed and d.changes == ("stage 0 predicted total_bytes: "
                                       f"{a['stages'][0]['predicted']['total_bytes']} -> "
                                       f"{b['stages'][0]['predicted']['total_bytes']}",)
    assert not d.regressed(0.0)  # throughput is the same


@pytest.mark.parametrize("fmt", ["text", "markdown", "json"])
def test_render_diff_formats(fmt: str) -> None:
    a, b = make_plan(2), make_plan(4)
    out = render_diff(diff_plans(a, b), fmt)
    if fmt == "json":
        obj = json.loads(out)
        assert obj["changed"] is True and len(obj["stages"]) == max(len(a["stages"]), len(b["stages"]))
        assert obj["pipeline"]["num_devices"] == {"a": 2, "b": 4}
        return
    assert "throughput:" in out and "->" in out and "plans differ" in out
    assert ("|" in out) == (fmt == "markdown")

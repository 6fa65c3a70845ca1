"""The step subcommands through the CLI: artifacts, reuse, plan diff exit codes, quickstart."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdcli.cli import app
from pdcli.profiler.chain import Chain, ChainNode

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "recipes/quickstart.yaml")
runner = CliRunner()


def invoke(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args))


@pytest.fixture
def root(tmp_path: Path) -> str:
    return f"run.root={tmp_path}"


@pytest.mark.slow
def test_profile_then_reuse_then_force(root: str, tmp_path: Path) -> None:
    first = invoke("profile", QUICKSTART, root, "profile.repeats=2")
    assert first.exit_code == 0, first.output
    assert "wrote" in first.output and "positions" in first.output
    profile = tmp_path / "quickstart/profile.json"
    assert json.loads(profile.read_text())["nodes"]
    again = invoke("profile", QUICKSTART, root, "profile.repeats=2")
    assert again.exit_code == 0 and "reused" in again.output
    forced = invoke("profile", QUICKSTART, root, "profile.repeats=2", "--force")
    assert forced.exit_code == 0 and "wrote" in forced.output
    as_json = invoke("profile", QUICKSTART, root, "profile.repeats=2", "--format", "json")
    assert json.loads(as_json.stdout)["version"] == 1


@pytest.mark.slow
def test_profile_exports_pipedream_graph_that_plans_alike(root: str, tmp_path: Path) -> None:
    graph = tmp_path / "graph.txt"
    result = invoke("profile", QUICKSTART, root, "profile.repeats=2", "--export-graph", str(graph))
    assert result.exit_code == 0, result.output
    assert graph.read_text().startswith("node")
    out = tmp_path / "from-graph.json"
    # the same profile; straight, because a replica's weight sync does not scale with the batch
    pipedream = ("~plan.num_stages", "plan.cost_model=pipedream", "plan.straight=true", "profile.repeats=2")
    planned = invoke("plan", QUICKSTART, "--profile", str(graph), root, *pipedream, "-o", str(out))
    assert planned.exit_code == 0, planned.output
    own = invoke("plan", QUICKSTART, root, *pipedream, "-o", str(tmp_path / "own.json"))
    assert own.exit_code == 0, own.output
    from_graph, own_plan = (json.loads(p.read_text()) for p in (out, tmp_path / "own.json"))
    assert [(s["start"], s["end"], s["replicas"]) for s in from_graph["stages"]] == [
        (s["start"], s["end"], s["replicas"]) for s in own_plan["stages"]
    ]
    # graph.txt has no field for the profiled batch (a microbatch of 16 here): the export
    # writes the costs of the minibatch of 64, the batch the run's own profile is scaled to
    ratio = own_plan["pipeline"]["time_per_minibatch_ms"] / from_graph["pipeline"]["time_per_minibatch_ms"]
    assert ratio == pytest.approx(1.0, rel=1e-3)


@pytest.mark.slow
def test_hand_edited_artifact_is_refused(root: str, tmp_path: Path) -> None:
    assert invoke("plan", QUICKSTART, root).exit_code == 0
    plan = tmp_path / "quickstart/plan.json"
    plan.write_text(plan.read_text().replace('"replicas": 1', '"replicas": 2', 1))
    result = invoke("plan", QUICKSTART, root)
    assert result.exit_code == 2
    assert "changed after it was written" in result.output and "--force" in result.output
    assert invoke("plan", QUICKSTART, root, "--force").exit_code == 0


def fixed_profile(path: Path, batch_size: int = 64) -> str:
    """A profile the test writes (8 equal layers, no measured runtime costs): plans made from
    it are the same under any load of the host."""
    nodes = tuple(ChainNode(name=f"n{i}", label=f"l{i}", fwd_ms=1.0, bwd_ms=2.0, parameter_bytes=50_000,
                            activation_bytes=16_000) for i in range(8))
    path.write_text(json.dumps(Chain(nodes=nodes, cut_bytes=(16_000,) * 7, meta={"batch_size": batch_size}).to_json()))
    return str(path)


def test_plan_diff_exit_codes(root: str, tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    profile = fixed_profile(tmp_path / "profile.json")
    assert invoke("plan", QUICKSTART, root, "--profile", profile, "-o", str(a)).exit_code == 0
    assert invoke("plan", QUICKSTART, root, "--gpus", "4", "--profile", profile, "-o", str(b)).exit_code == 0
    same = invoke("plan", "diff", str(a), str(a))
    assert same.exit_code == 0, same.output
    changed = invoke("plan", "diff", str(a), str(b), "--format", "markdown")
    assert changed.exit_code == 1 and "|" in changed.output
    data = json.loads(invoke("plan", "diff", str(a), str(b), "--format", "json").stdout)
    assert data["throughput_change_pct"] > 5  # 4 devices predict more throughput than 2 ...
    assert invoke("plan", "diff", str(a), str(b), "--fail-on-regression", "1").exit_code == 0  # ... no regression
    assert invoke("plan", "diff", str(b), str(a), "--fail-on-regression", "1").exit_code == 1  # the reverse is one
    assert invoke("plan", "diff", str(b), str(a), "--fail-on-regression", "99").exit_code == 0
    missing = invoke("plan", "diff", str(a), str(tmp_path / "nope.json"))
    assert missing.exit_code == 2 and "not found" in missing.output


def test_plan_pipedream_profile_directly(shared_profiles: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = invoke(
        "plan", "--profile", str(shared_profiles / "vgg16/graph.txt"), "--gpus", "4",
        "plan.cost_model=pipedream", "plan.use_fewer_devices=false", f"run.root={tmp_path}", "-o", str(out),
    )
    assert result.exit_code == 0, result.output
    expected = json.loads((shared_profiles / "expected.json").read_text())
    optimum_ms = expected["profiles"]["vgg16"]["optima"]["flat4"]["pipeline_time_s"] * 1e3
    got = json.loads(out.read_text())["pipeline"]["time_per_minibatch_ms"]
    assert got == pytest.approx(optimum_ms, rel=1e-6)


@pytest.mark.slow
def test_plan_memory_follows_train_precision_and_recompute(root: str, tmp_path: Path) -> None:
    plans = {}
    for name, extra in {"fp32": (), "bf16": ("train.precision=bf16",), "recompute": ("train.recompute=true",)}.items():
        out = tmp_path / f"{name}.json"
        # one split for all three (each precision is profiled apart and could tip the search)
        result = invoke("plan", QUICKSTART, root, "profile.repeats=2", "plan.boundaries=[9]", *extra, "-o", str(out))
        assert result.exit_code == 0, result.output
        plans[name] = json.loads(out.read_text())
    acts = {k: [s["predicted"]["activations_bytes"] for s in p["stages"]] for k, p in plans.items()}
    weights = [s["predicted"]["weights_bytes"] / 2 for s in plans["fp32"]["stages"]]  # P: weights + grads = 2P
    sets = [2, 1]  # pipedream on 2 stages holds 2 microbatches on stage 0, 1 on stage 1
    for fp32, bf16, n, p in zip(acts["fp32"], acts["bf16"], sets, weights):
        # half-width saved tensors (a stage still receives fp32 wires and keeps them), plus at
        # most one half-width copy of the weights per held microbatch (the profile's bf16 pass:
        # the first Linear, fed by the data, keeps none)
        assert fp32 / 2 <= bf16 < fp32 + n * p / 2 and bf16 != fp32
    # stage 0 holds two microbatches (pipedream on 2 stages): recompute keeps only its input
    # for one of them; the last stage holds one, so recompute saves it nothing
    assert acts["recompute"][0] < acts["fp32"][0]
    assert plans["recompute"]["inputs"]["recompute"] is True and plans["bf16"]["inputs"]["precision"] == "bf16"


@pytest.mark.slow
def test_infeasible_plans_are_user_errors(root: str) -> None:
    too_many = invoke("plan", QUICKSTART, root, "plan.num_stages=50", "--gpus", "64")
    assert too_many.exit_code == 2 and "50" in too_many.output
    tiny = invoke("plan", QUICKSTART, root, "cluster.memory_bytes_per_device=1000")
    assert tiny.exit_code == 2 and "memory" in tiny.output
    assert "Traceback" not in tiny.output


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quickstart_trains_and_learns(root: str, tmp_path: Path) -> None:
    result = invoke("train", QUICKSTART, root, "train.steps=60", "train.log_every=10")
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (tmp_path / "quickstart/train/metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if not x.get("final") and "loss" in x]
    evals = [x for x in lines if "eval_accuracy" in x]  # held-out digits: every 50 minibatches and at the end
    assert [x["step"] for x in evals] == [50, 60] and evals[-1]["final"] and evals[-1]["eval_accuracy"] > 0.7
    assert f"held-out eval: loss {evals[-1]['eval_loss']:.4f}, accuracy {evals[-1]['eval_accuracy']:.3f}" in result.output
    assert steps[-1]["loss"] < 0.6 * steps[0]["loss"], steps
    assert steps[-1]["accuracy"] > steps[0]["accuracy"] + 0.2, steps
    for artifact in ("config.yaml", "profile.json", "plan.json", "stages/manifest.json", "train/trace.json"):
        assert (tmp_path / "quickstart" / artifact).exists(), artifact


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["vgg16", "resnet18", "gnmt", "gpt", "inception"])
def test_paper_recipes_run_end_to_end_on_cpu(name: str, root: str, tmp_path: Path) -> None:
    recipe = str(REPO / f"recipes/{name}.yaml")
    result = invoke("train", recipe, root, "train.steps=2", "profile.repeats=2", "profile.warmup=1")
    assert result.exit_code == 0, result.output
    run = tmp_path / name  # each recipe's run.name is its file name
    plan = json.loads((run / "plan.json").read_text())
    processes = sum(s["replicas"] for s in plan["stages"])
    assert 2 <= processes <= 4 and len(plan["stages"]) >= 2, plan["stages"]
    summary = json.loads((run / "train/summary.json").read_text())
    assert len(summary["stages"]) == len(plan["stages"]) and summary["schedule"]
    assert summary["final_loss"] is not None and 0 < summary["final_loss"] < 1e4
    # the evaluation at the end on the held-out stream; token data (gpt, gnmt) reports the perplexity
    assert [e["step"] for e in summary["evals"]] == [2] and summary["evals"][0]["eval_samples"] > 0
    if name in ("gpt", "gnmt"):
        assert summary["eval_perplexity"] == pytest.approx(math.exp(summary["eval_loss"]))
        assert f"perplexity {summary['eval_perplexity']:.2f}" in result.output
    else:
        assert "eval_perplexity" not in summary and 0 <= summary["eval_accuracy"] <= 1

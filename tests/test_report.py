"""`pd report`: per-stage predicted vs measured numbers, the drift warning, the charts, errors.

The synthetic runs are written in the runtime's real formats (summary.json, metrics.jsonl,
trace.json, plan.json); their trace is the simulator's timeline of the real action lists
with "measured" costs = the plan's costs x a factor, so every expected number is known.
One real 2-process quickstart run (a few seconds) checks the report against `pd train`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pdcli.cli import app
from pdcli.schedule.simulator import StageCost, simulate
from pdcli.report import ReplanCommands, locate_run, make_report
from pdcli.report.charts import LOSS_FILE, TIMELINE_FILE
from pdcli.report.measured import completion_times_ms, read_trace
from pdcli.report.predicted import stage_costs
from pdcli.schedule import (
    Backward, Forward, OptimizerStep, RecvActivations, RecvGrads, ScheduleSpec, SendActivations, SendGrads, WeightGrads,
)

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NUM_MICROBATCHES, BATCH_SIZE, NUM_STEPS = 2, 8, 12
FWD_MS, BWD_MS = (1.0, 1.2), (2.0, 2.2)  # per minibatch, stages 0 and 1
WGRAD_MS = (0.8, 1.0)  # of BWD_MS, the weight gradients (split backward)
US_PER_MS = 1e3
runner = CliRunner()


def plan_json(schedule: str, split: bool = False) -> dict[str, Any]:
    stages = []
    for k in range(2):
        compute = FWD_MS[k] + BWD_MS[k]
        stages.append({
            "stage_id": k, "start": 9 * k, "end": 9 * (k + 1), "first_node": f"_{9 * k}", "last_node": f"_{9 * k + 8}",
            "node_names": [f"_{i}" for i in range(9 * k, 9 * (k + 1))], "replicas": 1, "ranks": [k],
            "predicted": {"fwd_ms": FWD_MS[k], "bwd_ms": BWD_MS[k], "compute_ms": compute, "sync_ms": 0.0,
                          "comm_in_ms": 0.0, "comm_out_ms": 0.0, "stage_time_ms": compute,
                          "weights_bytes": 1000.0, "stashed_weights_bytes": 0.0, "activations_bytes": 100.0, "total_bytes": 1100.0},
        })
        if split:
            stages[-1]["predicted"]["wgrad_ms"] = WGRAD_MS[k]
    bottleneck = max(FWD_MS[k] + BWD_MS[k] for k in range(2))
    plan: dict[str, Any] = {
        "version": 1,
        "inputs": {"batch_size": BATCH_SIZE, "cost_model": "pd", "memory_bytes_per_device": None,
                   "num_microbatches": NUM_MICROBATCHES, "num_stages": 2, "schedule": schedule, "straight": False,
                   "topology": {"levels": [{"bandwidth_bytes_per_s": 1e9, "devices": 2}]}, "use_fewer_devices": True},
        "stages": stages,
        "pipeline": {"bottleneck_stage": 1, "data_parallel_time_per_minibatch_ms": 2 * bottleneck, "num_devices": 2,
                     "num_devices_used": 2, "speedup_over_data_parallel": 1.5,
                     "throughput_samples_per_s": BATCH_SIZE * US_PER_MS / bottleneck, "time_per_minibatch_ms": bottleneck},
    }
    if split:
        plan["inputs"]["split_backward"] = True
    return plan


def category(action: Any) -> str:
    if isinstance(action, (SendActivations, SendGrads)):
        return "comm"
    if isinstance(action, (RecvActivations, RecvGrads)):
        return "idle"
    return "compute"


def measured_costs(plan: dict[str, Any], schedule: str, compute_scale: float) -> list[StageCost]:
    return [StageCost(c.fwd_ms * compute_scale, c.bwd_ms * compute_scale, wgrad_ms=c.wgrad_ms * compute_scale)
            for c in stage_costs(plan, schedule, NUM_MICROBATCHES)]


def write_run(run_dir: Path, schedule: str = "pipedream", compute_scale: float = 1.0, send_ms: float = 0.0,
              split: bool = False, first_step: int = 0) -> Path:
    """A trained run: plan.json, config.yaml and train/ (summary, metrics, trace) in the runtime's formats.

    Measured forward/backward (and WeightGrads, `split`) = the plan's x `compute_scale`; each
    send takes `send_ms` (comm); an optimizer step costs nothing; receives wait as the simulator says.
    `first_step`: the launch resumed after that many minibatches and trained NUM_STEPS more."""
    plan = plan_json(schedule, split)
    spec = ScheduleSpec.make(schedule, 2, NUM_MICROBATCHES, NUM_STEPS, split_backward=split)
    costs = measured_costs(plan, schedule, compute_scale)
    sim = simulate(spec, costs)
    events: list[dict[str, Any]] = []
    stages = []
    for rank, timed in enumerate(sim.timeline):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank} (stage {rank}, replica 0)"}})
        totals = {"compute": 0.0, "comm": 0.0, "idle": 0.0}
        for t in timed:
            cat = category(t.action)
            dur_ms = send_ms if cat == "comm" else t.end_ms - t.start_ms
            totals[cat] += dur_ms
            events.append({"name": type(t.action).__name__, "cat": cat, "ph": "X", "ts": 1.7e15 + t.start_ms * US_PER_MS,
                           "dur": dur_ms * US_PER_MS, "pid": rank, "tid": 0})
        stages.append({"stage_id": rank, "replicas": 1, "compute_ms": totals["compute"], "comm_ms": totals["comm"],
                       "idle_ms": totals["idle"], "wall_ms": sim.makespan_ms + 1000.0, "weight_versions_max": 2})
    train = run_dir / "train"
    train.mkdir(parents=True)
    (run_dir / "plan.json").write_text(json.dumps(plan))
    (run_dir / "config.yaml").write_text(f"schedule:\n  name: {schedule}\n  vertical_sync: false\nrun:\n  root: {run_dir.parent}\n  name: {run_dir.name}\n")
    loop_s = sim.makespan_ms / US_PER_MS
    samples_per_s = BATCH_SIZE * NUM_STEPS / loop_s
    losses = [2.3 / (1 + t) for t in range(NUM_STEPS)]
    summary = {"final_loss": losses[-1], "final_accuracy": 0.9, "samples_per_s": samples_per_s, "loop_s": loop_s,
               "steps": first_step + NUM_STEPS, "first_step": first_step, "schedule": schedule, "stages": stages,
               "minibatch_losses": losses,
               "microbatch_losses": {}, "checkpoint": str(train / "checkpoints" / f"step_{NUM_STEPS}")}
    (train / "summary.json").write_text(json.dumps(summary))
    lines = [{"accuracy": 0.5 + 0.1 * i, "loss": losses[3 * i + 2], "samples_per_s": samples_per_s, "step": 3 * i + 3} for i in range(4)]
    lines.append({"accuracy": 0.9, "final": True, "loss": losses[-1], "samples_per_s": samples_per_s, "stages": stages, "step": NUM_STEPS})
    (train / "metrics.jsonl").write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in lines))
    (train / "trace.json").write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return run_dir


def report_json(run_dir: Path, *args: str) -> dict[str, Any]:
    result = runner.invoke(app, ["report", str(run_dir), "--format", "json", "--no-charts", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b", "gpipe"])
def test_per_stage_numbers_are_per_minibatch(tmp_path: Path, schedule: str) -> None:
    scale = 1.5
    out = report_json(write_run(tmp_path / "run", schedule, compute_scale=scale))
    for k, stage in enumerate(out["stages"]):
        assert stage["predicted"]["compute_ms"] == pytest.approx(FWD_MS[k] + BWD_MS[k])
        assert stage["measured"]["compute_ms"] == pytest.approx((FWD_MS[k] + BWD_MS[k]) * scale)
        assert stage["measured"]["actions_ms"]["Forward"] == pytest.approx(FWD_MS[k] * scale)
        assert stage["stage_time_drift_pct"] == pytest.approx((scale - 1) * 100)
        # the trace's wall span, not the runtime's wall_ms (which includes setup)
        m = stage["measured"]
        assert m["bubble_fraction"] == pytest.approx(m["idle_ms"] / m["wall_ms"])
        assert 0.0 <= m["bubble_fraction"] < 1.0
    plan = plan_json(schedule)
    spec = ScheduleSpec.make(schedule, 2, NUM_MICROBATCHES, NUM_STEPS)
    predicted = simulate(spec, stage_costs(plan, schedule, NUM_MICROBATCHES))
    measured = simulate(spec, [StageCost(c.fwd_ms * scale, c.bwd_ms * scale) for c in stage_costs(plan, schedule, NUM_MICROBATCHES)])
    pipeline = out["pipeline"]
    assert pipeline["predicted"]["bubble_fraction"] == pytest.approx(predicted.bubble_fraction)
    assert pipeline["predicted"]["simulated_time_per_minibatch_ms"] == pytest.approx(predicted.time_per_minibatch_ms)
    # the whole loop, fill and drain included, on both sides
    assert pipeline["predicted"]["whole_loop_per_minibatch_ms"] == pytest.approx(predicted.makespan_ms / NUM_STEPS)
    assert pipeline["measured"]["steady_time_per_minibatch_ms"] == pytest.approx(measured.time_per_minibatch_ms)
    assert pipeline["measured"]["time_per_minibatch_ms"] == pytest.approx(measured.makespan_ms / NUM_STEPS)


def test_a_resumed_run_is_measured_per_minibatch_of_its_own_launch(tmp_path: Path) -> None:
    whole = report_json(write_run(tmp_path / "whole", compute_scale=1.5))
    resumed = report_json(write_run(tmp_path / "resumed", compute_scale=1.5, first_step=3 * NUM_STEPS))
    assert resumed["num_steps"] == whole["num_steps"] == NUM_STEPS
    for a, b in zip(whole["stages"], resumed["stages"], strict=True):
        assert b["measured"]["compute_ms"] == pytest.approx(a["measured"]["compute_ms"])
        assert b["measured"]["actions_ms"] == pytest.approx(a["measured"]["actions_ms"])
    for key in ("time_per_minibatch_ms", "steady_time_per_minibatch_ms", "bubble_fraction"):
        assert resumed["pipeline"]["measured"][key] == pytest.approx(whole["pipeline"]["measured"][key])
    text = runner.invoke(app, ["report", str(tmp_path / "resumed"), "--no-charts"]).output
    assert f"resumed after minibatch {3 * NUM_STEPS}" in text


def test_the_whole_loop_of_a_run_longer_than_the_replay_adds_its_steady_minibatches() -> None:
    from pdcli.report.predicted import MAX_SIMULATED_STEPS, predict

    plan = plan_json("pipedream")  # no flush: the pipeline fills and drains once per run
    short = simulate(ScheduleSpec.make("pipedream", 2, NUM_MICROBATCHES, MAX_SIMULATED_STEPS),
                     stage_costs(plan, "pipedream", NUM_MICROBATCHES))
    steps = 5 * MAX_SIMULATED_STEPS
    out = predict(plan, "pipedream", NUM_MICROBATCHES, steps)
    assert out.whole_loop_per_minibatch_ms == pytest.approx(
        (short.makespan_ms + (steps - MAX_SIMULATED_STEPS) * short.time_per_minibatch_ms) / steps)
    assert out.simulated_time_per_minibatch_ms < out.whole_loop_per_minibatch_ms < short.makespan_ms / MAX_SIMULATED_STEPS


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_split_backward_is_replayed_with_weight_grads(tmp_path: Path, schedule: str) -> None:
    scale = 1.5
    run_dir = write_run(tmp_path / "run", schedule, compute_scale=scale, split=True)
    out = report_json(run_dir)
    plan = plan_json(schedule, split=True)
    costs = stage_costs(plan, schedule, NUM_MICROBATCHES)
    assert [c.wgrad_ms for c in costs] == pytest.approx([w / NUM_MICROBATCHES for w in WGRAD_MS])
    split_spec = ScheduleSpec.make(schedule, 2, NUM_MICROBATCHES, NUM_STEPS, split_backward=True)
    predicted = simulate(split_spec, costs)
    assert any(isinstance(t.action, WeightGrads) for rank in predicted.timeline for t in rank)
    unsplit = simulate(ScheduleSpec.make(schedule, 2, NUM_MICROBATCHES, NUM_STEPS), costs)
    assert predicted.time_per_minibatch_ms < unsplit.time_per_minibatch_ms  # W fills the drain
    pipeline = out["pipeline"]
    assert pipeline["predicted"]["split_backward"] is True
    assert pipeline["predicted"]["simulated_time_per_minibatch_ms"] == pytest.approx(predicted.time_per_minibatch_ms)
    assert pipeline["predicted"]["bubble_fraction"] == pytest.approx(predicted.bubble_fraction)
    measured = simulate(split_spec, measured_costs(plan, schedule, scale))
    # a minibatch completes with its last WeightGrads, as the simulator counts it
    assert pipeline["measured"]["steady_time_per_minibatch_ms"] == pytest.approx(measured.time_per_minibatch_ms)
    first_stage = read_trace(run_dir / "train" / "trace.json")[0]
    done_ms = completion_times_ms([first_stage], NUM_MICROBATCHES)
    ends_ms = {name: max(s.end_ms for s in first_stage.spans if s.name == name) for name in ("Backward", "WeightGrads")}
    assert len(done_ms) == NUM_STEPS and done_ms[-1] == ends_ms["WeightGrads"] > ends_ms["Backward"]
    for k, stage in enumerate(out["stages"]):
        busy_ms = sum(t.end_ms - t.start_ms for t in predicted.timeline[k]
                      if isinstance(t.action, (Forward, Backward, WeightGrads, OptimizerStep)))
        assert stage["predicted"]["idle_ms"] == pytest.approx((predicted.makespan_ms - busy_ms) / NUM_STEPS)
        assert stage["predicted"]["wgrad_ms"] == WGRAD_MS[k]
        assert stage["predicted"]["compute_ms"] == pytest.approx(FWD_MS[k] + BWD_MS[k])
        actions = stage["measured"]["actions_ms"]
        assert actions["WeightGrads"] == pytest.approx(WGRAD_MS[k] * scale)
        assert actions["Backward"] == pytest.approx((BWD_MS[k] - WGRAD_MS[k]) * scale)
        assert stage["measured"]["compute_ms"] == pytest.approx((FWD_MS[k] + BWD_MS[k]) * scale)
    lines = runner.invoke(app, ["report", str(run_dir), "--no-charts"]).stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("stage") and "plan fwd" in line)
    header, first_row = lines[at].split(), lines[at + 2].split()  # a rule of dashes between them
    assert header.index("WeightGrads") == header.index("Backward") + 1
    assert header.index("wgrad") == header.index("optim") - 2  # "plan wgrad" right after "plan bwd"
    # the plan's bwd less its wgrad beside it: what Backward and WeightGrads each run
    assert [float(x) for x in first_row[1:4]] == pytest.approx([FWD_MS[0], BWD_MS[0] - WGRAD_MS[0], WGRAD_MS[0]], abs=1e-3)
    assert f"{schedule} with split backward" in lines[0]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_plan_with_merged_weight_grads_is_replayed_with_them_at_the_flush(schedule: str) -> None:
    from pdcli.report.predicted import predict

    plan = plan_json(schedule, split=True)
    plan["inputs"]["merge_weight_grads"] = True
    costs = stage_costs(plan, schedule, NUM_MICROBATCHES)
    p = predict(plan, schedule, NUM_MICROBATCHES, NUM_STEPS)
    merged = simulate(ScheduleSpec.make(schedule, 2, NUM_MICROBATCHES, NUM_STEPS, split_backward=True,
                                        merge_weight_grads=True), costs)
    assert p.merge_weight_grads and p.simulated_time_per_minibatch_ms == pytest.approx(merged.time_per_minibatch_ms)
    assert not predict(plan, "pipedream", NUM_MICROBATCHES, NUM_STEPS).merge_weight_grads  # a run that cannot merge


def test_runs_without_weight_grads_keep_the_old_action_table(tmp_path: Path) -> None:
    text = runner.invoke(app, ["report", str(write_run(tmp_path / "run", "1f1b")), "--no-charts"]).stdout
    assert "WeightGrads" not in text and "plan wgrad" not in text and "split backward" not in text
    out = report_json(tmp_path / "run")
    assert out["pipeline"]["predicted"]["split_backward"] is False
    assert all(s["predicted"]["wgrad_ms"] == 0.0 for s in out["stages"])


def test_timeline_draws_weight_grads_in_their_own_colour(tmp_path: Path) -> None:
    from pdcli.report.charts import KIND_COLORS, _kind

    assert _kind("WeightGrads", "compute") == "WeightGrads"
    assert KIND_COLORS["WeightGrads"] not in {c for k, c in KIND_COLORS.items() if k != "WeightGrads"}
    run_dir = write_run(tmp_path / "run", "1f1b", split=True)
    result = runner.invoke(app, ["report", str(run_dir), "--timeline-steps", "2"])
    assert result.exit_code == 0, result.output
    assert (run_dir / "train" / TIMELINE_FILE).read_bytes()[:8] == PNG_MAGIC


def test_a_truncated_trace_keeps_the_totals_of_the_whole_run(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "1f1b", compute_scale=1.5)
    full = report_json(run_dir)
    trace_path = run_dir / "train" / "trace.json"
    events = json.loads(trace_path.read_text())["traceEvents"]
    kept = [e for e in events if e["ph"] == "M"]
    for rank in (0, 1):  # the runtime stops tracing a rank after MAX_TRACE_EVENTS
        own = [e for e in events if e["ph"] == "X" and e["pid"] == rank]
        kept += own[: len(own) * 2 // 3]
    trace_path.write_text(json.dumps({"traceEvents": kept}))
    cut = report_json(run_dir)
    for a, b in zip(full["stages"], cut["stages"]):
        assert b["measured"]["compute_ms"] == pytest.approx(a["measured"]["compute_ms"])
        assert b["measured"]["compute_ms"] + b["measured"]["idle_ms"] <= b["measured"]["wall_ms"] * 1.001
        assert b["measured"]["actions_ms"]["Forward"] == pytest.approx(a["measured"]["actions_ms"]["Forward"], rel=0.25)


def test_flush_schedules_show_a_bigger_predicted_bubble_than_pipedream(tmp_path: Path) -> None:
    bubbles = {s: report_json(write_run(tmp_path / s, s))["pipeline"]["predicted"]["bubble_fraction"] for s in ("gpipe", "pipedream")}
    assert bubbles["gpipe"] > bubbles["pipedream"]


@pytest.mark.parametrize("scale,threshold,drifts", [(1.2, 25, False), (1.2, 15, True), (0.7, 25, True), (0.8, 25, False), (1.0, 0.5, False)])
def test_drift_warning_appears_when_and_only_when_the_threshold_is_crossed(tmp_path: Path, scale: float, threshold: float, drifts: bool) -> None:
    run_dir = write_run(tmp_path / "run", compute_scale=scale)
    result = runner.invoke(app, ["report", str(run_dir), "--no-charts", "--drift-threshold", str(threshold)])
    assert result.exit_code == 0, result.output
    assert ("WARNING" in result.stdout) is drifts
    assert ("pd profile" in result.stdout) is drifts  # compute drifted: re-profile, then re-plan
    assert ("no drift" in result.stdout) is not drifts
    out = report_json(run_dir, "--drift-threshold", str(threshold))
    assert (out["drift"] is not None) is drifts
    if drifts:
        assert out["drift"]["stage_ids"] == [0, 1]
        assert out["drift"]["command"].startswith(f"pd profile {run_dir / 'config.yaml'} --force && pd plan ")


@pytest.mark.parametrize("profiled_ms,run_ms,note", [(1.0, 1.3, "slower"), (1.0, 1.05, None), (1.3, 1.0, "faster"),
                                                     (None, 1.0, None)])
def test_the_report_compares_the_hosts_speed_after_the_run_with_the_profiles(
        tmp_path: Path, profiled_ms: float | None, run_ms: float, note: str | None) -> None:
    """The host's reference matmul after the run against the profile's: shown, and called out
    beyond 10%; nothing where the profile did not measure it."""
    from pdcli.host import HOST_SPEED_META

    run_dir = write_run(tmp_path / "run")
    summary_path = run_dir / "train" / "summary.json"
    summary_path.write_text(json.dumps({**json.loads(summary_path.read_text()), HOST_SPEED_META: run_ms}))
    if profiled_ms is not None:
        (run_dir / "profile.json").write_text(json.dumps({"meta": {HOST_SPEED_META: profiled_ms}}))
    result = runner.invoke(app, ["report", str(run_dir), "--no-charts"])
    assert result.exit_code == 0, result.output
    out = report_json(run_dir)["host_speed"]
    if profiled_ms is None:
        assert "host:" not in result.stdout and out["ratio"] is None
        return
    ratio = run_ms / profiled_ms
    assert f"took {profiled_ms:.3f} ms when profiled, {run_ms:.3f} ms after the run ({ratio:.2f}x)" in result.stdout
    assert out == {"profiled_ms": profiled_ms, "run_ms": run_ms, "ratio": pytest.approx(ratio)}
    assert ("the host ran" in result.stdout) is (note is not None)
    if note is not None:
        assert f"the host ran {note} than when profiled" in result.stdout


def test_communication_drift_asks_for_a_replan_only(tmp_path: Path) -> None:
    out = report_json(write_run(tmp_path / "run", send_ms=1.0))
    assert out["drift"] is not None and not out["drift"]["reprofile"]
    assert out["drift"]["command"].startswith("pd plan ") and "pd profile" not in out["drift"]["command"]
    for stage in out["stages"]:
        assert stage["compute_drift_pct"] == pytest.approx(0.0, abs=1e-6)
        assert stage["measured"]["comm_ms"] == pytest.approx(NUM_MICROBATCHES * 1.0)


def test_charts_are_valid_pngs_and_their_paths_are_printed(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    result = runner.invoke(app, ["report", str(run_dir), "--timeline-steps", "2", "--timeline-start", "0"])
    assert result.exit_code == 0, result.output
    for name in (TIMELINE_FILE, LOSS_FILE):
        path = run_dir / "train" / name
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000
        assert str(path) in result.stdout
    assert not [p for p in (run_dir / "train").iterdir() if p.name.endswith(".tmp")]  # atomic writes left no temp file


def test_markdown_format_has_tables(tmp_path: Path) -> None:
    result = runner.invoke(app, ["report", str(write_run(tmp_path / "run")), "--format", "markdown", "--no-charts"])
    assert result.exit_code == 0, result.output
    assert "|---" in result.stdout and "## pd report" in result.stdout


def test_a_recipe_and_overrides_name_the_run(tmp_path: Path) -> None:
    write_run(tmp_path / "synthetic", compute_scale=2.0)
    overrides = [f"run.root={tmp_path}", "run.name=synthetic"]
    run_dir, commands = locate_run(REPO / "recipes" / "quickstart.yaml", overrides)
    assert run_dir == tmp_path / "synthetic"
    c = make_report(run_dir, commands, 25.0, charts=False).comparison
    assert c.drift is not None and c.drift.command.startswith(f"pd profile {REPO / 'recipes' / 'quickstart.yaml'} run.root=")
    assert not (run_dir / "manifest.json").exists()  # reporting writes nothing but the charts


def test_run_dir_elsewhere_pins_root_and_name_in_the_command(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    (run_dir / "config.yaml").write_text("run:\n  root: somewhere/else\n  name: other\n")
    commands = locate_run(run_dir)[1]
    assert commands.overrides == (f"run.root={tmp_path.resolve()}", "run.name=run")


@pytest.mark.parametrize("setup,args,message", [
    ("nothing", [], "no such run directory or recipe"),
    ("empty", [], "pd train"),
    ("plan_only", [], "pd train"),
    ("train_no_plan", [], "pd plan"),
    ("full", ["key=value"], "overrides"),
    ("full", ["--format", "yaml"], "--format"),
    ("full", ["--drift-threshold", "-5"], "--drift-threshold"),
])
def test_user_errors_exit_2_and_name_the_next_command(tmp_path: Path, setup: str, args: list[str], message: str) -> None:
    run_dir = tmp_path / "run"
    if setup == "empty":
        run_dir.mkdir()
    elif setup == "plan_only":
        run_dir.mkdir()
        (run_dir / "plan.json").write_text(json.dumps(plan_json("pipedream")))
    elif setup in ("train_no_plan", "full"):
        write_run(run_dir)
        if setup == "train_no_plan":
            (run_dir / "plan.json").unlink()
    result = runner.invoke(app, ["report", str(run_dir), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output



# ---- one real run --------------------------------------------------------------------------

REAL_STEPS = 8


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("real")
    pd = Path(sys.executable).parent / "pd"
    proc = subprocess.run(
        [str(pd), "train", str(REPO / "recipes" / "quickstart.yaml"), f"train.steps={REAL_STEPS}", "train.log_every=2", "profile.warmup=1", "profile.repeats=2",
         f"run.root={root}"], capture_output=True, text=True, timeout=120, cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root / "quickstart"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_report_of_a_real_quickstart_run(real_run: Path) -> None:
    result = runner.invoke(app, ["report", str(real_run), "--format", "json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    summary = json.loads((real_run / "train" / "summary.json").read_text())
    plan = json.loads((real_run / "plan.json").read_text())
    assert [s["stage_id"] for s in out["stages"]] == [s["stage_id"] for s in plan["stages"]]
    for stage, totals in zip(out["stages"], summary["stages"]):
        m = stage["measured"]
        assert m["compute_ms"] * REAL_STEPS == pytest.approx(totals["compute_ms"])
        assert 0 < m["compute_cpu_ms"] and m["compute_cpu_ms"] * REAL_STEPS == pytest.approx(totals["compute_cpu_ms"])
        assert 0 < m["comm_cpu_ms"] and m["comm_cpu_ms"] * REAL_STEPS == pytest.approx(totals["comm_cpu_ms"])
        assert m["idle_ms"] * REAL_STEPS == pytest.approx(totals["idle_ms"])
        assert m["actions_ms"]["Forward"] > 0 and m["actions_ms"]["Backward"] > 0
        assert m["compute_ms"] + m["comm_ms"] + m["idle_ms"] <= m["wall_ms"] * 1.001  # the trace span holds them all
        planned = plan["stages"][stage["stage_id"]]["predicted"]
        if "actions_ms" in planned:  # replayed in the runtime's categories: busy = compute + comm
            p = stage["predicted"]
            assert p["stage_time_ms"] == pytest.approx(p["compute_ms"] + p["comm_ms"])
            assert p["compute_ms"] >= planned["compute_ms"] + planned["optimizer_ms"] * (1 - 1e-6)
        else:
            assert stage["predicted"]["stage_time_ms"] == planned["stage_time_ms"]
    assert out["pipeline"]["measured"]["steady_time_per_minibatch_ms"] > 0
    profile = json.loads((real_run / "profile.json").read_text())
    assert out["host_speed"] == {"profiled_ms": profile["meta"]["host_speed_ms"], "run_ms": summary["host_speed_ms"],
                                 "ratio": pytest.approx(summary["host_speed_ms"] / profile["meta"]["host_speed_ms"])}
    for log in sorted((real_run / "train").glob("rank*.log")):  # each worker's loop walks only its own objects
        assert re.search(r"\b[1-9]\d* objects of the setup frozen out of the garbage collector", log.read_text()), log
    for name in (TIMELINE_FILE, LOSS_FILE):
        assert (real_run / "train" / name).read_bytes()[:8] == PNG_MAGIC


def test_a_trace_of_virtual_stages_names_each_actions_chunk(tmp_path: Path) -> None:
    from pdcli.runtime.metrics import Timeline, chrome_trace

    timeline = Timeline(rank=0, stage_id=0, replica_id=0)
    for i, label in enumerate(("F0:c0@v0", "SA0:c0->r0", "RA0:c2<-r0", "F0:c2@v0", "W0:c2", "U#0/4")):
        timeline.add(label.split("0")[0], "compute", float(i), i + 0.5, label)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(chrome_trace([timeline.stats])))
    assert [s.chunk for s in read_trace(path)[0].spans] == [0, 0, 2, 2, 2, None]


def shared_core_prediction() -> tuple[Any, Any]:
    """A runtime-costed plan whose replay runs its 2 ranks on 1 core, and its prediction (layers
    of a few ms: an action outlasts the kernel's time slice)."""
    import dataclasses

    from pdcli.planner import PlanOptions, Topology, plan_chain
    from pdcli.report.predicted import predict
    from test_runtime_costs import chain

    small = chain()
    slow = dataclasses.replace(small, nodes=tuple(dataclasses.replace(n, fwd_ms=n.fwd_ms * 30, bwd_ms=n.bwd_ms * 30)
                                                   for n in small.nodes))
    options = PlanOptions(schedule="pipedream", num_microbatches=4, batch_size=64, num_stages=2, boundaries=(4,))
    plan = plan_chain(slow, Topology.flat(2, 1e9), options).to_json()
    assert plan["pipeline"]["replay"]["cores"] == 1
    return plan, predict(plan, "pipedream", 4, 20)


def test_a_replay_on_shared_cores_predicts_each_stages_own_compute_beside_its_queued_time() -> None:
    from pdcli.report.predicted import predict

    plan, shared = shared_core_prediction()
    assert shared.shared_cores
    alone = predict({**plan, "pipeline": {**plan["pipeline"], "replay": {"cores": 2}}}, "pipedream", 4, 20)
    assert not alone.shared_cores
    for s, a in zip(shared.stages, alone.stages):
        assert s.compute_cpu_ms == pytest.approx(a.compute_ms)  # the actions' own cost: nobody queued
        assert s.compute_ms > s.compute_cpu_ms * 1.05  # on one core a rank's actions also hold the other's turns
        assert a.compute_cpu_ms == a.compute_ms


def test_on_shared_cores_each_stages_compute_is_priced_the_cpu_time_sharing_costs_it() -> None:
    """A plan priced with `shared_cpu_scale` (its workers' compute takes that much more CPU time
    on shared cores) predicts each stage's compute in CPU time that much higher; the time, the
    wall compute and a plan whose ranks each have a core are as they were."""
    from pdcli.report.predicted import predict

    plan, shared = shared_core_prediction()
    replay = plan["pipeline"]["replay"]
    scaled = predict({**plan, "pipeline": {**plan["pipeline"], "replay": {**replay, "shared_cpu_scale": 1.25}}},
                     "pipedream", 4, 20)
    assert scaled.time_per_minibatch_ms == shared.time_per_minibatch_ms
    for s, base in zip(scaled.stages, shared.stages):
        assert base.compute_cpu_ms is not None and s.compute_cpu_ms == pytest.approx(1.25 * base.compute_cpu_ms)
        assert s.compute_ms == base.compute_ms


@pytest.mark.parametrize("shared", [True, False])
def test_on_shared_cores_a_stage_is_held_to_its_cpu_time(shared: bool) -> None:
    """A stage whose compute took 1.6x and whose sends took 3x their predicted wall time (the
    kernel ran the other worker during them) but used the CPU time the plan prices has not
    drifted where the replay shared cores; held to wall time, it has."""
    import dataclasses

    from pdcli.report.compare import compare
    from pdcli.report.measured import Measured, MeasuredStage
    from pdcli.report.render import TEXT, render

    _, predicted = shared_core_prediction()
    predicted = dataclasses.replace(predicted, shared_cores=shared)
    assert all(p.comm_cpu_ms for p in predicted.stages)
    stages = tuple(MeasuredStage(stage_id=p.stage_id, replicas=1, compute_ms=p.compute_ms * 1.6,
                                 comm_ms=p.comm_ms * 3, idle_ms=p.idle_ms, wall_ms=p.wall_ms, actions_ms={},
                                 compute_cpu_ms=p.compute_cpu_ms, comm_cpu_ms=p.comm_cpu_ms) for p in predicted.stages)
    measured = Measured(schedule="pipedream", num_steps=20, batch_size=64, num_microbatches=4, stages=stages,
                        time_per_minibatch_ms=predicted.time_per_minibatch_ms, steady_time_per_minibatch_ms=None,
                        samples_per_s=1.0, final_loss=1.0, final_accuracy=None, minibatch_losses=(), metrics=(), ranks={})
    c = compare(predicted, measured, 25.0, ReplanCommands("recipe.yaml"))
    for s in c.stages:
        assert s.compute_drift_pct == (pytest.approx(0.0, abs=1e-9) if shared else pytest.approx(60.0))
        assert s.stage_time_drift_pct == (pytest.approx(0.0, abs=1e-9) if shared else pytest.approx(
            (1.6 * s.predicted.compute_ms + 3 * s.predicted.comm_ms) / (s.predicted.compute_ms + s.predicted.comm_ms) * 100 - 100))
    assert (c.drift is None) is shared
    text = render(c, TEXT, Path("run"), {})
    assert ("judged on compute CPU + comm CPU" in text) is shared
    assert ("no drift: every stage's compute CPU + comm CPU is within 25%" in text) is shared

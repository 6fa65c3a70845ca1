"""`pd plan --calibrate RUN`: a real run refits the runtime's costs; re-planning the same
configuration then predicts that run, and `pd train` keeps the calibrated plan."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pdcli.cli import app

REPO = Path(__file__).resolve().parents[1]
PD = Path(sys.executable).parent / "pd"
RECIPE = str(REPO / "recipes" / "quickstart.yaml")
STEPS = 40
RUN = ["plan.boundaries=[9]", f"train.steps={STEPS}", "train.log_every=10", "profile.repeats=3"]
runner = CliRunner()


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(240)
def test_calibrated_plan_predicts_the_run_it_was_fitted_to(tmp_path: Path) -> None:
    args = [*RUN, f"run.root={tmp_path}"]
    proc = subprocess.run([str(PD), "train", RECIPE, *args], capture_output=True, text=True, timeout=200, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = tmp_path / "quickstart"
    before = json.loads((run_dir / "plan.json").read_text())
    report = runner.invoke(app, ["report", str(run_dir), "--format", "json", "--no-charts"])
    assert report.exit_code == 0, report.output
    out = json.loads(report.stdout)
    measured_ms = out["pipeline"]["measured"]["steady_time_per_minibatch_ms"]
    # "bubble (all ranks)": one rule for the plan's replay and the run, waiting over wall time
    # (the replay's optimizer steps, loads and messages are not waiting)
    for side in ("predicted", "measured"):
        idle = sum(s[side]["idle_ms"] * s["replicas"] for s in out["stages"])
        wall = sum(s[side]["wall_ms"] * s["replicas"] for s in out["stages"])
        assert out["pipeline"][side]["bubble_fraction"] == pytest.approx(idle / wall)

    result = runner.invoke(app, ["plan", RECIPE, *args, "--calibrate", str(run_dir), "--format", "json"])
    assert result.exit_code == 0, result.output
    calibration = json.loads((run_dir / "calibration.json").read_text())
    assert calibration["runtime"]["sources"]["calibrated_from"] == str(run_dir)
    after = json.loads((run_dir / "plan.json").read_text())
    assert after["pipeline"]["time_per_minibatch_ms"] == pytest.approx(measured_ms, rel=0.05)
    assert after["pipeline"]["time_per_minibatch_ms"] != before["pipeline"]["time_per_minibatch_ms"]

    # the calibrated plan is the run's plan now: planning again reuses it
    again = runner.invoke(app, ["plan", RECIPE, *args])
    assert again.exit_code == 0 and "reused" in again.output

    # each stage's forward and backward take what the run's stage's took (its positions
    # refitted), which the line through both stages alone does not promise
    from pdcli.planner.runtime_costs import RuntimeCosts, steady_mean
    from pdcli.profiler.chain import Chain
    from pdcli.report.calibrate import replayed_traces
    from pdcli.report.measured import read_trace

    chain = Chain.from_json(json.loads((run_dir / "profile.json").read_text()))
    runtime = RuntimeCosts.from_json(calibration["runtime"])
    assert runtime.position_scale is not None and len(runtime.position_scale) == len(chain.nodes)
    traces = read_trace(run_dir / "train" / "trace.json")
    replayed = replayed_traces(runtime, chain, before)
    assert replayed is not None

    def work_ms(spans: Any) -> float:
        return sum(steady_mean([s.dur_ms for s in spans if s.name == name])
                   for name in ("Forward", "Backward", "WeightGrads"))

    for stage in before["stages"]:
        rank = int(stage["ranks"][0])
        assert work_ms(replayed[rank].spans) == pytest.approx(work_ms(traces[rank].spans), rel=0.02), stage


def test_a_receive_is_priced_by_what_it_ran_after_its_message_was_sent_not_by_its_wait(tmp_path: Path) -> None:
    """Under 1f1b with one microbatch every receive waits for its peer's whole compute; the refit
    prices a receive by what it ran after the matching send ended (`_after_arrival`), so the wait
    is not counted as its cost. A receive whose message was sent before it began counts whole."""
    from pdcli.report.calibrate import _after_arrival, _sends_ended
    from pdcli.report.measured import RankTrace, Span, read_trace

    plan = {"stages": [{"stage_id": 0, "ranks": [0]}, {"stage_id": 1, "ranks": [1]}]}
    sender = RankTrace(1, "stage 1", (Span("SendGrads", "comm", 30.0, 0.5, None, 6),
                                      Span("SendGrads", "comm", 100.0, 0.5, None, 7)))
    receives = (Span("RecvGrads", "comm", 5.0, 26.5, None, 6),  # waited 25.5 ms, ran 1.0 after the send
                Span("RecvGrads", "comm", 101.0, 0.8, None, 7),  # its message there before it began
                Span("RecvGrads", "comm", 200.0, 3.0, None, 8))  # its send not in the trace
    sent = _sends_ended({0: RankTrace(0, "stage 0", receives), 1: sender}, plan, chunked=False)
    assert sent == {("SendGrads", 1, 6): 30.5, ("SendGrads", 1, 7): 100.5}
    assert _after_arrival(receives, sent, "SendGrads", 1) == pytest.approx([1.0, 0.8])
    assert _after_arrival(receives, sent, "SendGrads", 0) == []  # not that stage's sends

    # the trace's action text names the microbatch of a message, and only of a message
    events = [{"ph": "X", "name": name, "cat": "comm", "ts": ts, "dur": 10.0, "pid": 0, "args": {"action": action}}
              for name, ts, action in (("RecvGrads", 0.0, "RG6<-r0"), ("SendActivations", 20.0, "SA7:c1->r0"),
                                       ("Forward", 40.0, "F7@v1"))]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    spans = read_trace(tmp_path / "trace.json")[0].spans
    assert [(s.microbatch, s.chunk) for s in spans] == [(6, None), (7, 1), (None, None)]


@pytest.mark.slow
@pytest.mark.serial
def test_calibrate_needs_a_run_directory(tmp_path: Path) -> None:
    result = runner.invoke(app, ["plan", RECIPE, f"run.root={tmp_path}", "profile.repeats=2", "profile.probe_minibatches=4",
                                 "--calibrate", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "not a run directory" in result.output


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(240)
def test_pipeline_probe_refits_the_profile_to_a_real_two_worker_run(tmp_path: Path) -> None:
    """`pd profile` runs the schedule on two workers three times and refits its costs to the
    median run: a plan of the probe run's split then predicts that run's steady time."""
    from pdcli.profiler.chain import Chain

    env = {**__import__("os").environ, "PD_PIPELINE_PROBE": "1"}
    args = [f"run.root={tmp_path}", "profile.repeats=3", "profile.pipeline_probe_minibatches=30"]
    proc = subprocess.run([str(PD), "profile", RECIPE, *args], capture_output=True, text=True, timeout=200,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "what the runtime pays per action" in proc.stdout
    chain = Chain.from_json(json.loads((tmp_path / "quickstart" / "profile.json").read_text()))
    sources = chain.meta["runtime"]["sources"]
    assert sources["pipeline_probe"].startswith("30 minibatches of pipedream on 2 workers")
    assert "pipeline probe" in proc.stdout and "the median of 3 runs" in proc.stdout
    measured_ms = sources["pipeline"]["steady_time_per_minibatch_ms"]
    runs_ms = sources["pipeline_runs_ms"]
    assert len(runs_ms) == 3 and runs_ms == sorted(runs_ms) and measured_ms == pytest.approx(runs_ms[1], abs=1e-3)
    out = tmp_path / "plan.json"
    # the probe ran the recipe's planned split (not necessarily the balanced one): plan that split
    cuts = sources["pipeline"]["boundaries"]
    assert len(cuts) == 1 and f"split at {cuts}" in sources["pipeline_probe"]
    result = runner.invoke(app, ["plan", RECIPE, *args, f"plan.boundaries={cuts}", "-o", str(out)],
                           env={"PD_PIPELINE_PROBE": "1"})
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["pipeline"]["time_per_minibatch_ms"] == pytest.approx(measured_ms, rel=0.05)


def test_pipeline_probe_run_reuses_the_probes_profile(tmp_path: Path) -> None:
    """The run directory of a pipeline probe's `pd train` holds the profile the probe measured,
    under the inputs hash that run computes: its profile step finds it fresh and measures nothing.
    The runtime's costs, which that run does not price with, are left out."""
    from omegaconf import OmegaConf

    from pdcli.config.loader import load_config, run_dir_path
    from pdcli.planner.runtime_costs import RUNTIME_META
    from pdcli.probe.pipeline import PIPELINE_RUN, _probe_overrides, seed_run
    from pdcli.rundir import RunDir
    from pdcli.steps.profile import ensure_profile, seed_profile

    cfg = load_config(RECIPE, [f"run.root={tmp_path}", "profile.repeats=1", "profile.runtime_probe=false"]).config
    chain, _ = ensure_profile(cfg, RunDir(run_dir_path(cfg)).create())
    recipe = tmp_path / "config.yaml"
    recipe.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    items = [f"run.root={tmp_path / 'probe'}", f"run.name={PIPELINE_RUN}", *_probe_overrides(cfg, chain, [9], [1, 1], 30)]
    seed_run(recipe, items, replace(chain, meta={**chain.meta, RUNTIME_META: {"as": "the probe passes it"}}), seed_profile)
    probe_cfg = load_config(recipe, items).config
    seeded, reused = ensure_profile(probe_cfg, RunDir(run_dir_path(probe_cfg)))
    assert reused and seeded.to_json() == chain.to_json()
    unseeded, reused = ensure_profile(probe_cfg, RunDir(tmp_path / "elsewhere").create())
    assert not reused


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(240)
def test_pipeline_probe_of_a_searched_recipe_runs_its_stand_ins(tmp_path: Path) -> None:
    """With the schedule, microbatches and precision left to the planner (`auto`), the probe's
    run trains the stand-ins its stages were probed with (pipedream, 4 microbatches of the
    64-row minibatch, fp32), not a configuration it searched for itself: the refit reads the run
    as that configuration."""
    from pdcli.profiler.chain import Chain

    env = {**__import__("os").environ, "PD_PIPELINE_PROBE": "1"}
    args = [f"run.root={tmp_path}", "profile.repeats=3", "profile.pipeline_probe_minibatches=30",
            "schedule.name=auto", "schedule.num_microbatches=auto", "train.precision=auto", "train.recompute=auto",
            "profile.pipeline_probe_runs=1"]
    proc = subprocess.run([str(PD), "profile", RECIPE, *args], capture_output=True, text=True, timeout=200,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sources = Chain.from_json(json.loads((tmp_path / "quickstart" / "profile.json").read_text())).meta["runtime"]["sources"]
    ran = sources["pipeline"]
    assert (ran["schedule"], ran["num_microbatches"], ran["precision"]) == ("pipedream", 4, "fp32"), sources["pipeline_probe"]


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(300)
@pytest.mark.parametrize("planned_shares", [False, True], ids=["planned-on-a-core-each", "planned-sharing"])
def test_pipeline_probe_measures_what_sharing_the_cores_costs(tmp_path: Path, planned_shares: bool) -> None:
    """On a cluster with more devices than the host has cores, `pd profile` fits the costs on
    a pipeline whose workers each have a core (the planned two workers; or, when the plan
    itself uses every device, a pipeline over the cores), trains a layout that shares the cores
    (the devices' balanced pipeline; or the planned one) and keeps how much slower it ran than
    its replay: a plan of that layout then predicts that run's steady time, and a plan with a
    core per worker is priced without it."""
    from pdcli.host import host_cores
    from pdcli.probe.pipeline import PIPELINE_MAX_WORKERS, balanced_cuts
    from pdcli.profiler.chain import Chain

    cores = host_cores()
    if not 2 <= cores < PIPELINE_MAX_WORKERS:
        pytest.skip(f"needs 2-{PIPELINE_MAX_WORKERS - 1} cores to share (this host has {cores})")
    devices = cores + 1
    positions = 18  # the quickstart's chain
    planned_cuts = [positions * k // devices for k in range(1, devices)]
    plan_args = [f"plan.num_stages={devices}", f"plan.boundaries={planned_cuts}"] if planned_shares \
        else ["plan.num_stages=2"]
    env = {**__import__("os").environ, "PD_PIPELINE_PROBE": "1"}
    args = [f"run.root={tmp_path}", "profile.repeats=3", "profile.pipeline_probe_minibatches=30",
            "profile.pipeline_probe_runs=1", f"cluster.levels.0.devices={devices}", *plan_args]
    proc = subprocess.run([str(PD), "profile", RECIPE, *args], capture_output=True, text=True, timeout=250,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "workers sharing cores:" in proc.stdout
    chain = Chain.from_json(json.loads((tmp_path / "quickstart" / "profile.json").read_text()))
    assert len(chain.nodes) == positions
    runtime = chain.meta["runtime"]
    sources = runtime["sources"]
    fitted_on = cores if planned_shares else 2
    assert sources["pipeline_probe"].startswith(f"30 minibatches of pipedream on {fitted_on} workers"), \
        sources["pipeline_probe"]
    assert f"on {devices} workers sharing {cores} cores" in sources["shared_probe"], sources["shared_probe"]
    [(run_ms, replay_ms)] = sources["shared_runs_ms"]
    assert runtime["shared_slowdown"] == pytest.approx(run_ms / replay_ms, rel=1e-4)  # the stored times are rounded
    [(run_cpu_ms, replay_cpu_ms)] = sources["shared_compute_cpu_ms"]
    assert run_cpu_ms > 0 and replay_cpu_ms > 0
    assert runtime["shared_cpu_scale"] == pytest.approx(run_cpu_ms / replay_cpu_ms, rel=1e-3)
    shared_cuts = planned_cuts if planned_shares else balanced_cuts(chain, devices)
    assert f"split at {shared_cuts}" in sources["shared_probe"], sources["shared_probe"]

    def predicted(cuts: list[int]) -> dict[str, Any]:
        out = tmp_path / f"plan-{len(cuts)}.json"
        result = runner.invoke(app, ["plan", RECIPE, *args, f"plan.num_stages={len(cuts) + 1}",
                                     f"plan.boundaries={cuts}", "-o", str(out)], env={"PD_PIPELINE_PROBE": "1"})
        assert result.exit_code == 0, result.output
        return json.loads(out.read_text())["pipeline"]

    shared = predicted(shared_cuts)
    assert shared["time_per_minibatch_ms"] == pytest.approx(run_ms, rel=0.02)
    assert shared["replay"]["shared_slowdown"] == pytest.approx(runtime["shared_slowdown"], rel=1e-6)
    assert shared["replay"]["shared_cpu_scale"] == pytest.approx(runtime["shared_cpu_scale"], rel=1e-6)
    alone = predicted(balanced_cuts(chain, 2))["replay"]
    assert "shared_slowdown" not in alone and "shared_cpu_scale" not in alone


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(240)
def test_pipeline_probe_of_virtual_stages_runs_their_chunks(tmp_path: Path) -> None:
    """The probe trains the chunked schedule itself (each worker several chunks) and refits
    its costs from that run."""
    from pdcli.profiler.chain import Chain

    env = {**__import__("os").environ, "PD_PIPELINE_PROBE": "1"}
    args = [f"run.root={tmp_path}", "profile.repeats=3", "profile.pipeline_probe_minibatches=30",
            "schedule.name=interleaved", "schedule.virtual_stages=2", "profile.pipeline_probe_runs=1"]
    proc = subprocess.run([str(PD), "profile", RECIPE, *args], capture_output=True, text=True, timeout=200,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sources = Chain.from_json(json.loads((tmp_path / "quickstart" / "profile.json").read_text())).meta["runtime"]["sources"]
    assert sources["pipeline_probe"].startswith("30 minibatches of interleaved on 2 workers"), sources["pipeline_probe"]
    assert sources["pipeline"]["schedule"] == "interleaved"
    assert [s["stage_id"] for s in sources["pipeline"]["stages"]] == [0, 1, 2, 3]  # one refit point per chunk
    assert sources["pipeline"]["steady_time_per_minibatch_ms"] > 0


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(240)
def test_calibrated_plan_of_virtual_stages_predicts_its_run(tmp_path: Path) -> None:
    """A run of chunks refits per chunk (a rank's trace holds several); re-planning it predicts the run."""
    args = ["schedule.name=interleaved", "schedule.virtual_stages=2", "plan.boundaries=[5,9,14]",
            f"train.steps={STEPS}", "train.log_every=10", "profile.repeats=3", f"run.root={tmp_path}"]
    proc = subprocess.run([str(PD), "train", RECIPE, *args], capture_output=True, text=True, timeout=200, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = tmp_path / "quickstart"
    report = runner.invoke(app, ["report", str(run_dir), "--format", "json", "--no-charts"])
    assert report.exit_code == 0, report.output
    measured_ms = json.loads(report.stdout)["pipeline"]["measured"]["steady_time_per_minibatch_ms"]
    result = runner.invoke(app, ["plan", RECIPE, *args, "--calibrate", str(run_dir), "--format", "json"])
    assert result.exit_code == 0, result.output
    calibration = json.loads((run_dir / "calibration.json").read_text())
    assert [s["stage_id"] for s in calibration["measured"]["stages"]] == [0, 1, 2, 3]  # refitted per chunk
    for chunk in calibration["measured"]["stages"]:
        assert chunk["actions_ms"]["Forward"] > 0 and "OptimizerStep" not in chunk["actions_ms"]  # a rank's, not a chunk's
    after = json.loads((run_dir / "plan.json").read_text())
    assert after["inputs"]["virtual_stages"] == 2 and len(after["stages"]) == 4
    assert after["pipeline"]["time_per_minibatch_ms"] == pytest.approx(measured_ms, rel=0.05)


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(300)
def test_calibration_on_shared_cores_matches_the_runs_time_and_compute(tmp_path: Path) -> None:
    """More workers than cores: the calibrated replay (ranks queued for the cores) takes the
    run's steady time and computes what the run's spans computed, and refits its CPU costs."""
    from pdcli.host import host_cores
    from pdcli.planner.runtime_costs import RuntimeCosts
    from pdcli.profiler.chain import Chain
    from pdcli.report.calibrate import calibrate_from_run, replayed_compute_ms, replayed_ms, steady_compute_ms
    from pdcli.report.measured import read_trace

    workers = host_cores() + 1
    args = [f"train.steps={STEPS}", "train.log_every=10", "profile.repeats=3", "profile.pipeline_probe_minibatches=0",
            f"plan.num_stages={workers}", f"cluster.levels.0.devices={workers}", f"run.root={tmp_path}"]
    proc = subprocess.run([str(PD), "train", RECIPE, *args], capture_output=True, text=True, timeout=250, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = tmp_path / "quickstart"
    chain = Chain.from_json(json.loads((run_dir / "profile.json").read_text()))
    plan = json.loads((run_dir / "plan.json").read_text())
    base = RuntimeCosts.from_meta(chain.meta)
    assert base is not None and base.cores == host_cores()
    calibrated, measured = calibrate_from_run(run_dir, chain, base)
    traces = read_trace(run_dir / "train" / "trace.json")
    m = int(plan["inputs"]["num_microbatches"])
    compute_ms = steady_compute_ms([traces[r] for r in plan["stages"][0]["ranks"]], list(traces.values()), m)
    target_ms = measured["steady_time_per_minibatch_ms"]
    assert replayed_ms(calibrated, chain, plan) == pytest.approx(target_ms, rel=0.05)
    fit = measured["shared_cores"]
    assert fit["run_compute_ms"] == pytest.approx(compute_ms)
    assert replayed_compute_ms(calibrated, chain, plan) == pytest.approx(fit["replayed_compute_ms"])
    (f_low, c_low), (f_high, c_high) = fit["bracket"]
    if fit["capped"]:
        # the kernel stretched the run's compute spans more than the replay's queue for the
        # cores can at the run's time: the fit took its largest factor, and a larger one
        # (a quarter larger) replays slower than the run with no latency at all
        assert f_high == pytest.approx(fit["max_factor"]) and c_high < compute_ms
        assert replayed_ms(replace(calibrated.cpu_scaled(f_high * 1.25 / fit["factor"]), latency_ms=0.0),
                           chain, plan) > target_ms
    elif abs(fit["replayed_compute_ms"] / compute_ms - 1) > 0.1:
        # the replay's compute jumps over the run's between two factors 1% apart (where the
        # cores' queue changes order)
        assert f_high / f_low < 1.02 and c_low < compute_ms <= c_high
    assert abs(fit["replayed_compute_ms"] - compute_ms) <= min(abs(c_low - compute_ms), abs(c_high - compute_ms))

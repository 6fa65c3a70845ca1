"""Reliability: drain points, checkpoints, --resume, export / init_from, failures and Ctrl-C.

Pure tests first (schedules with drain points, the reference, checkpoint files), then
few, small multi-process runs (the toy pipeline of `pdcli.testing.toy`, and the
quickstart recipe through the CLI), each with a timeout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pdcli.cli import app
from pdcli.errors import UserError
from pdcli.rundir import RunDir
from pdcli.runtime import checkpoint
from pdcli.schedule.checker import ScheduleError, SendMode, check_schedules
from pdcli.runtime.launcher import Hosts, check_devices, first_slurm_host, hosts_from_env
from pdcli.schedule import Backward, Forward, ScheduleSpec, build_all, build_for, drain_points
from pdcli.runtime.job import TrainingFailed, run_training
from pdcli.runtime.progress import journal_path, read_journal
from pdcli.testing.toy import write_toy_run
from pdcli.runtime.watchdog import CHECKPOINT_FAULT_ENV, status_path

pytestmark = pytest.mark.slow  # real processes over torch.distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_runtime import processes_mentioning  # noqa: E402
from test_transparency import by_original_name, reference, stage_specs, toy_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "recipes/quickstart.yaml")
PD = REPO / ".venv/bin/pd"
runner = CliRunner()


# ---- pure: drain points in the schedules and the reference -------------------------------


def test_drain_points_cut_pipedream_into_complete_runs() -> None:
    assert drain_points(7, 3) == (3, 6) and drain_points(6, 3) == (3,) and drain_points(5, 0, extra=[2]) == (2,)
    spec = ScheduleSpec.make("pipedream", 3, 2, 4, drain_after=drain_points(4, 2))
    lists = build_all(spec)
    check_schedules(lists, spec)  # no deadlock, versions follow the rule, nothing in flight across a drain
    for stage_id, actions in enumerate(lists):
        forwards = [a for a in actions if isinstance(a, Forward)]
        # the second segment starts on the weights after all 4 updates of the first, no staleness
        assert forwards[4].microbatch_id == 4 and forwards[4].weight_version == 4, stage_id
        before = [a for a in actions[: actions.index(forwards[4])] if isinstance(a, (Forward, Backward))]
        assert {a.microbatch_id for a in before} == {0, 1, 2, 3}  # drained: every forward has its backward
        resumed = build_for(spec, stage_id, 0, start_minibatch=2)
        assert resumed == actions[len(actions) - len(resumed):]  # a resumed run is the tail of the same list
        assert [a for a in resumed if isinstance(a, Forward)] == forwards[4:]
    unsegmented = ScheduleSpec.make("pipedream", 3, 2, 4)
    assert unsegmented.weight_version(0, 4) == 2  # without the drain, microbatch 4 is stale on stage 0
    with pytest.raises(ValueError, match="not a drain point"):
        build_for(unsegmented, 0, 0, start_minibatch=2)


@pytest.mark.parametrize("name,replicas", [("pipedream", [1, 2]), ("pipedream", [2, 1]), ("2bw", [1, 1]), ("1f1b", [1, 2])])
def test_every_schedule_with_drain_points_checks_and_resumes_cleanly(name: str, replicas: list[int]) -> None:
    for steps, every in ((5, 2), (4, 1), (3, 3)):
        spec = ScheduleSpec.make(name, len(replicas), 2, steps, replicas, drain_after=drain_points(steps, every))
        lists = build_all(spec)
        check_schedules(lists, spec, SendMode.EAGER)  # replicated pipedream needs posted sends (as the runtime's)
        for t in spec.drain_after:
            for rank, actions in enumerate(lists):
                suffix = build_for(spec, *spec.stage_replica_of(rank), start_minibatch=t)
                assert suffix == actions[len(actions) - len(suffix):]
                assert min(a.microbatch_id for a in suffix if isinstance(a, Forward)) >= t * 2


def test_checker_refuses_a_list_that_does_not_drain() -> None:
    drained = ScheduleSpec.make("pipedream", 2, 2, 4, drain_after=(2,))
    with pytest.raises(ScheduleError, match="drain point 2"):
        check_schedules(build_all(ScheduleSpec.make("pipedream", 2, 2, 4)), drained)


def test_reference_with_a_drain_is_two_runs_back_to_back(tmp_path: Path) -> None:
    """pipedream with a drain after 2 minibatches == the reference on 0..1 then on 2..3 from its weights."""
    from pdcli.compiler import load_stage
    from pdcli.data import build_data
    from pdcli.models import build_loss
    from pdcli.testing.reference import StageSpec, reference_train

    cfg = toy_config(tmp_path / "run", "pipedream")
    _, manifest = write_toy_run(tmp_path / "run", cfg, [1, 1, 1])
    data = build_data(cfg.data, cfg.data.batch_size)
    batches = [data.batch(t) for t in range(4)]

    def stages() -> list[StageSpec]:
        out = []
        for e in manifest["stages"]:
            module, _ = load_stage(tmp_path / "run" / "stages", e["stage_id"])
            out.append(StageSpec(module, tuple(t["name"] for t in e["inputs"]), tuple(t["name"] for t in e["outputs"])))
        return out

    def sgd(ps: list) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=cfg.optim.lr)  # no momentum: no optimizer state to carry over

    whole = reference_train(stages(), build_loss("cross_entropy"), batches, "pipedream", 2, sgd, drain_after=(2,))
    parts = stages()
    first = reference_train(parts, build_loss("cross_entropy"), batches[:2], "pipedream", 2, sgd)
    second = reference_train(parts, build_loss("cross_entropy"), batches[2:], "pipedream", 2, sgd)
    assert whole.losses == pytest.approx(first.losses + second.losses, abs=1e-6)
    for a, b in zip(whole.state_dicts, second.state_dicts):
        for name in a:
            torch.testing.assert_close(a[name], b[name])
    stale = reference_train(stages(), build_loss("cross_entropy"), batches, "pipedream", 2, sgd)
    assert abs(stale.losses[5] - whole.losses[5]) > 1e-6  # the drain changes the numerics (not a no-op)


def test_devices_available_on_cpu_and_nnodes_must_divide_the_ranks() -> None:
    check_devices(2, Hosts(), "cpu")
    with pytest.raises(UserError, match="needs 1000 devices"):
        check_devices(1000, Hosts(), "cpu")
    with pytest.raises(UserError, match="--nnodes 3"):
        check_devices(2, Hosts(nnodes=3), "cpu")


def test_hosts_come_from_the_command_line_then_torchrun_then_slurm() -> None:
    assert hosts_from_env(None, None, None, None, {}) == Hosts()
    slurm = {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[03-06],login1"}
    assert hosts_from_env(None, None, None, None, slurm) == Hosts(4, 2, "gpu03", None)
    torchrun = slurm | {"PET_NNODES": "2", "PET_NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert hosts_from_env(None, None, None, None, torchrun) == Hosts(2, 1, "10.0.0.1", 29500)
    assert hosts_from_env(8, 0, "head", 1234, torchrun) == Hosts(8, 0, "head", 1234)  # the command line wins
    assert [first_slurm_host(x) for x in ("node7", "a[1,4-5]", "b[10-12],c2")] == ["node7", "a1", "b10"]
    with pytest.raises(UserError, match="SLURM_NNODES='x'"):
        hosts_from_env(None, None, None, None, {"SLURM_NNODES": "x"})


def test_corrupt_stage_file_is_a_user_error_naming_it(tmp_path: Path) -> None:
    module = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    checkpoint.save_stage(tmp_path, 3, 0, module, {}, opt, 3, {})
    checkpoint.mark_complete(tmp_path, 3, num_stages=1, keep=2)
    checkpoint.stage_file(tmp_path, 3, 0).write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match=r"step_3/stage_0.pt is corrupt") as e:
        checkpoint.load_model_state(tmp_path, 3)
    assert "delete" in (e.value.hint or "")


# ---- real processes: resume == uninterrupted ---------------------------------------------


def _train(run_dir: Path, schedule: str, monkeypatch: pytest.MonkeyPatch, fault: str | None = None, resume: bool = False, **train: object):
    cfg = toy_config(run_dir, schedule, steps=4, **train)
    if not resume:
        plan, manifest = write_toy_run(run_dir, cfg, [1, 1, 1])
    else:
        plan, manifest = json.loads((run_dir / "plan.json").read_text()), json.loads((run_dir / "stages/manifest.json").read_text())
    if fault:
        monkeypatch.setenv(CHECKPOINT_FAULT_ENV, fault)
    else:
        monkeypatch.delenv(CHECKPOINT_FAULT_ENV, raising=False)
    return cfg, manifest, run_training(cfg, RunDir(run_dir), plan, manifest, resume=resume)


def _outcome(run_dir: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    lines = [json.loads(x) for x in (run_dir / "train/metrics.jsonl").read_text().splitlines()]
    keep = [{k: v for k, v in line.items() if k in ("step", "loss", "accuracy", "final")} for line in lines]
    return keep, checkpoint.load_model_state(run_dir / "train", 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule,every,fault,resumes_at", [
    ("1f1b", 1, "1:2:written", 1),  # rank 1 dies after writing its file of checkpoint 2: step 2 stays incomplete
    ("pipedream", 2, "0:2:complete", 2),  # rank 0 exits right after checkpoint 2 is complete
])
def test_interrupted_and_resumed_run_ends_like_the_uninterrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, schedule: str, every: int, fault: str, resumes_at: int
) -> None:
    cfg, manifest, _ = _train(tmp_path / "whole", schedule, monkeypatch, checkpoint_every=every)
    whole_metrics, whole_weights = _outcome(tmp_path / "whole")
    assert [m["step"] for m in whole_metrics] == [1, 2, 3, 4, 4]
    # every microbatch's loss is in the last stage's journal, exactly; no checkpoint holds them
    losses = json.loads((tmp_path / "whole/train/summary.json").read_text())["microbatch_losses"]
    journal = read_journal(journal_path(tmp_path / "whole/train", 0))
    assert {str(mb): r[0] for mb, r in journal.items()} == losses and len(losses) == 4 * cfg.schedule.num_microbatches
    for step in checkpoint.complete_steps(tmp_path / "whole/train"):
        assert "loss_records" not in checkpoint.load_stage_file(tmp_path / "whole/train", step, 2)

    broken = tmp_path / "broken"
    with pytest.raises(TrainingFailed, match=f"rank {fault[0]} "):
        _train(broken, schedule, monkeypatch, fault=fault, checkpoint_every=every)
    assert checkpoint.latest_step(broken / "train") == resumes_at
    if fault.endswith("written"):
        assert checkpoint.stage_file(broken / "train", 2, 1).exists()  # a partial checkpoint 2 ...
        assert not (checkpoint.checkpoint_dir(broken / "train", 2) / checkpoint.COMPLETE).exists()  # ... never used
    _train(broken, schedule, monkeypatch, resume=True, checkpoint_every=every)
    metrics, weights = _outcome(broken)
    assert read_journal(journal_path(broken / "train", 0)) == journal  # the records past the cut done again
    # metrics.jsonl continues from the checkpoint: the same lines, the same losses
    assert [(m["step"], m.get("final")) for m in metrics] == [(m["step"], m.get("final")) for m in whole_metrics]
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in whole_metrics], abs=1e-6)
    assert [m["accuracy"] for m in metrics] == [m["accuracy"] for m in whole_metrics]
    for name in whole_weights:
        torch.testing.assert_close(weights[name], whole_weights[name], atol=1e-6, rtol=1e-6, msg=name)
    if schedule == "pipedream":  # and the pipeline follows the reference with the same drain points
        summary = json.loads((tmp_path / "whole/train/summary.json").read_text())
        losses = [summary["microbatch_losses"][str(i)] for i in range(8)]
        cfg.train.steps = 4
        ref_losses, ref_weights = _reference_with_drains(cfg, manifest, tmp_path / "whole/stages", (2,))
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        for name in whole_weights:
            torch.testing.assert_close(whole_weights[name], ref_weights[name], atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(60)
def test_2bw_with_checkpoints_drains_like_its_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, manifest, _ = _train(tmp_path / "run", "2bw", monkeypatch, checkpoint_every=2)
    summary = json.loads((tmp_path / "run/train/summary.json").read_text())
    losses = [summary["microbatch_losses"][str(i)] for i in range(8)]
    ref_losses, ref_weights = _reference_with_drains(cfg, manifest, tmp_path / "run/stages", (2,))
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    weights = checkpoint.load_model_state(tmp_path / "run/train", 4)
    for name in ref_weights:
        torch.testing.assert_close(weights[name], ref_weights[name], atol=1e-5, rtol=1e-5)
    assert checkpoint.complete_steps(tmp_path / "run/train") == [2, 4]
    stale_losses, _ = _reference_with_drains(cfg, manifest, tmp_path / "run/stages", ())
    assert abs(stale_losses[5] - losses[5]) > 1e-6  # without the drain, minibatch 2 would run on version 1


def _reference_with_drains(cfg, manifest, stages_dir: Path, drains: tuple[int, ...]):
    from pdcli.data import build_data
    from pdcli.models import build_loss
    from pdcli.testing.reference import reference_train

    specs = stage_specs(stages_dir, manifest)
    data = build_data(cfg.data, cfg.data.batch_size)
    result = reference_train(
        specs, build_loss("cross_entropy"), [data.batch(t) for t in range(cfg.train.steps)], cfg.schedule.name,
        cfg.schedule.num_microbatches, lambda ps: torch.optim.SGD(ps, lr=cfg.optim.lr, momentum=cfg.optim.momentum),
        model_input_names=manifest["model_inputs"], drain_after=drains,
    )
    return result.losses, by_original_name(manifest, result.state_dicts)


# ---- real processes: a worker killed from outside ---------------------------------------

KILL_SCRIPT = """
import sys
from pathlib import Path
from pdcli.config import load_resolved
from pdcli.rundir import RunDir
from pdcli.runtime.job import TrainingFailed, run_training
import json
run = Path(sys.argv[1])
cfg = load_resolved(run / "config.yaml")
try:
    run_training(cfg, RunDir(run), json.loads((run / "plan.json").read_text()), json.loads((run / "stages/manifest.json").read_text()))
except TrainingFailed as e:
    print(e, file=sys.stderr)
    sys.exit(1)
"""


def worker_pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of the live workers of `run_dir` (from /proc: command line and RANK)."""
    out = {}
    for pid in processes_mentioning(str(run_dir)):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pdcli.runtime.worker" in cmdline:
            rank = next((int(e.split(b"=")[1]) for e in environ if e.startswith(b"RANK=")), None)
            if rank is not None:
                out[rank] = pid
    return out


@pytest.mark.timeout(90)
def test_worker_killed_from_outside_stops_the_job_fast(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = toy_config(run_dir, "1f1b", steps=10_000, timeout_s=10, log_every=1000)
    cfg.optim.lr, cfg.optim.momentum = 0.01, 0.0  # the toy's lr 0.2 with momentum reaches NaN by minibatch ~70
    write_toy_run(run_dir, cfg, [1, 1, 1])
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(run_dir)], cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until rank 1 is training
            status = (status_path(run_dir / "train", 1).read_bytes().decode(errors="replace")
                      if status_path(run_dir / "train", 1).exists() else "")
            if re.search(r"\b[FB]\d+@v\d+", status):  # a Forward or Backward, in the actions' text form
                break
            time.sleep(0.2)
        pids = worker_pids(run_dir)
        assert sorted(pids) == [0, 1, 2], pids
        os.kill(pids[1], signal.SIGKILL)
        killed_s = time.monotonic()
        _, stderr = proc.communicate(timeout=cfg.train.timeout_s + 20)
        elapsed_s = time.monotonic() - killed_s
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    first_line = stderr.strip().splitlines()[0]
    assert "rank 1 (stage 1, replica 0) was killed by signal 9" in first_line, stderr
    assert "last: step=" in first_line
    assert elapsed_s < cfg.train.timeout_s + 15, elapsed_s  # bounded by train.timeout_s, not by the run
    assert processes_mentioning(str(run_dir)) == []


# ---- through the CLI: export, init_from under another plan, corrupt checkpoints, Ctrl-C ----


def invoke(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args))


TRAIN_ARGS = ("plan.num_stages=2", "train.steps=6", "train.checkpoint_every=2", "train.log_every=1")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart recipe trained for 6 minibatches with checkpoints every 2 (pipedream: drains)."""
    root = tmp_path_factory.mktemp("trained")
    result = invoke("train", QUICKSTART, f"run.root={root}", *TRAIN_ARGS)
    assert result.exit_code == 0, result.output
    assert checkpoint.complete_steps(root / "quickstart/train") == [4, 6]  # keep_checkpoints=2
    return root


def _copy_run(trained: Path, tmp_path: Path) -> Path:
    shutil.copytree(trained, tmp_path / "root")
    return tmp_path / "root"


@pytest.mark.timeout(180)
def test_export_is_a_model_state_dict_and_trains_three_stages_from_where_it_was(trained: Path, tmp_path: Path) -> None:
    from pdcli.config import load_resolved
    from pdcli.data import build_data
    from pdcli.models import build_loss, build_model

    out = tmp_path / "export.pt"
    result = invoke("export", str(trained / "quickstart"), "-o", str(out))
    assert result.exit_code == 0, result.output
    cfg = load_resolved(trained / "quickstart/config.yaml")
    model = build_model(cfg.model)
    state = torch.load(out, weights_only=True)
    model.load_state_dict(state, strict=True)  # original names, nothing missing or extra
    assert all(torch.equal(state[k], v) for k, v in checkpoint.load_model_state(trained / "quickstart/train", 6).items())
    assert invoke("export", str(trained / "quickstart"), "--step", "3").exit_code == 2  # no such checkpoint

    root = tmp_path / "three"
    result = invoke("train", QUICKSTART, f"run.root={root}", "plan.num_stages=3", "cluster.levels=[{devices: 3}]",
                    f"train.init_from={out}", "train.steps=2", "train.log_every=1")
    assert result.exit_code == 0, result.output
    assert len(json.loads((root / "quickstart/plan.json").read_text())["stages"]) == 3
    # The 3-stage run's first microbatch ran on the exported weights (pipedream: version 0 everywhere).
    micro = build_data(cfg.data, cfg.data.batch_size).batch(0).split(cfg.schedule.num_microbatches)[0]
    with torch.no_grad():
        exported_loss = float(build_loss(cfg.model.loss)(model(*micro.inputs), micro.target))
    summary = json.loads((root / "quickstart/train/summary.json").read_text())
    assert summary["microbatch_losses"]["0"] == pytest.approx(exported_loss, abs=1e-5)
    first = json.loads((trained / "quickstart/train/metrics.jsonl").read_text().splitlines()[0])
    assert summary["minibatch_losses"][0] < first["loss"] - 0.05  # continues, not from scratch


@pytest.mark.timeout(120)
def test_corrupt_checkpoint_and_checkpoint_of_another_model_are_refused(trained: Path, tmp_path: Path) -> None:
    root = _copy_run(trained, tmp_path)
    stage_file = checkpoint.stage_file(root / "quickstart/train", 6, 1)
    stage_file.write_bytes(stage_file.read_bytes()[:100])  # truncated, as a disk-full write would leave it
    result = invoke("train", QUICKSTART, f"run.root={root}", *TRAIN_ARGS, "train.steps=8", "--resume")
    assert result.exit_code == 2, result.output
    assert "profile: reused" in result.output and "plan:    reused" in result.output and "compile: reused" in result.output
    assert f"{stage_file} is corrupt" in result.output and "delete" in result.output
    assert "Traceback" not in result.output

    shutil.rmtree(stage_file.parent)  # as the hint says: the previous checkpoint (step 4) is used
    other = invoke("train", QUICKSTART, f"run.root={root}", *TRAIN_ARGS, "train.steps=8", "--resume",
                   "model.kwargs.hidden=64")
    assert other.exit_code == 2, other.output
    # a changed input re-runs every step after it: profile -> plan -> stages
    assert "profile: measured" in other.output and "plan:    wrote" in other.output and "compile: wrote" in other.output
    assert "checkpoints/step_4/stage_" in other.output and ("shape" in other.output or "lacks" in other.output)
    assert "pd export" in other.output and "without --resume" in other.output


@pytest.mark.timeout(150)
def test_ctrl_c_stops_every_worker_and_keeps_the_last_checkpoint(trained: Path, tmp_path: Path) -> None:
    root = _copy_run(trained, tmp_path)
    train_dir = root / "quickstart/train"
    shutil.rmtree(train_dir)  # profile, plan, stages reused; the checkpoints to wait for are this run's
    proc = subprocess.Popen(
        [str(PD), "train", QUICKSTART, f"run.root={root}", *TRAIN_ARGS, "train.steps=3000"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not checkpoint.complete_steps(train_dir) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert checkpoint.complete_steps(train_dir), "no checkpoint appeared"
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: pd train and its workers
        sent_s = time.monotonic()
        _, stderr = proc.communicate(timeout=40)
        stopped_s = time.monotonic() - sent_s
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted" in stderr and "--resume" in stderr
    assert stopped_s < 30, stopped_s
    assert processes_mentioning(str(root)) == []
    step = checkpoint.latest_step(train_dir)
    assert step is not None and step >= 2
    from pdcli.config import load_resolved
    from pdcli.models import build_model

    build_model(load_resolved(root / "quickstart/config.yaml").model).load_state_dict(
        checkpoint.load_model_state(train_dir, step), strict=True)
    # ... and the run goes on from it
    resumed = invoke("train", QUICKSTART, f"run.root={root}", *TRAIN_ARGS, f"train.steps={step + 2}", "--resume")
    assert resumed.exit_code == 0, resumed.output
    lines = [json.loads(x) for x in (train_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [*range(1, step + 3), step + 2] and lines[-1]["final"]
    assert checkpoint.latest_step(train_dir) == step + 2

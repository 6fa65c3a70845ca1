"""Bad input to `pd train`: one clear message (naming the file/key and the fix), exit 2, no traceback.

Everything here fails before a worker starts; the tests that need profile/plan/stages
share one compiled quickstart run directory.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdcli.cli import app
from pdcli.runtime import launcher

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "recipes/quickstart.yaml")
runner = CliRunner()


def fails(*args: str, expect: tuple[str, ...]) -> str:
    """Run `pd ARGS`; it must exit 2 with every string of `expect` in its output and no traceback."""
    result = runner.invoke(app, list(args))
    assert result.exit_code == 2, (result.exit_code, result.output)
    for text in expect:
        assert text in result.output, (text, result.output)
    assert "Traceback" not in result.output and "error:" in result.output
    return result.output


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`run.root=...` of a quickstart run with profile, plan and stages (no training)."""
    root = tmp_path_factory.mktemp("compiled")
    result = runner.invoke(app, ["compile", QUICKSTART, f"run.root={root}"])
    assert result.exit_code == 0, result.output
    return f"run.root={root}"


def test_malformed_yaml(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("train:\n  steps: [1, 2\n")
    fails("train", str(recipe), expect=(str(recipe), "malformed YAML"))


def test_unknown_key_wrong_type_and_missing_recipe(tmp_path: Path) -> None:
    fails("train", QUICKSTART, "train.stepz=3", expect=("train.stepz", "unknown key", "train.steps"))
    fails("train", QUICKSTART, "train.steps=abc", expect=("train.steps", "int", "abc"))
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("defaults:\n  - model: mlp\ntrain:\n  timeout_s: soon\n")
    fails("train", str(recipe), expect=("train.timeout_s",))
    fails("train", str(tmp_path / "nope.yaml"), expect=("recipe not found", "nope.yaml"))


def test_unknown_model_and_data_set(tmp_path: Path) -> None:
    fails("train", QUICKSTART, f"run.root={tmp_path}", "model.name=resnet9000", expect=("model.name", "resnet9000", "mlp"))
    fails("train", QUICKSTART, f"run.root={tmp_path}", "data.name=imagenet22k", expect=("data.name", "imagenet22k", "digits"))


def test_evaluation_and_epochs_that_cannot_run_fail_before_profiling(tmp_path: Path) -> None:
    root = f"run.root={tmp_path}"
    fails("train", QUICKSTART, root, "data.eval_fraction=0.01", "data.kwargs.split=all", "data.batch_size=64",
          expect=("held-out split of digits has 18 examples", "data.batch_size=64", "train.eval_batches=0"))
    fails("train", QUICKSTART, root, "data.eval_path=held_out.pt", expect=("data.eval_path", "digits", "null"))
    fails("train", QUICKSTART, root, "train.eval_batches=9", expect=("train.eval_batches: 9", "holds 5 whole", "359"))
    fails("train", QUICKSTART, root, "data=synthetic_images", "model=resnet18", "train.epochs=2",
          expect=("train.epochs", "infinite", "train.steps"))
    fails("train", QUICKSTART, root, "optim.schedule.name=exponential", "optim.clip_grad_norm=-1",
          expect=("optim.schedule.name", "optim.clip_grad_norm"))
    assert not (tmp_path / "quickstart/profile.json").exists()  # none of them profiled


def test_merged_weight_grads_where_pd_does_not_place_them(tmp_path: Path) -> None:
    root = f"run.root={tmp_path}"
    merge = "schedule.merge_weight_grads=true"
    fails("train", QUICKSTART, root, "schedule.name=pipedream", merge,
          expect=("schedule.merge_weight_grads", "not 'pipedream'", "set it to false"))
    fails("train", QUICKSTART, root, "schedule.name=1f1b", "schedule.split_backward=false", merge,
          expect=("schedule.merge_weight_grads", "with it off"))
    fails("train", QUICKSTART, root, "schedule.name=zbv", "schedule.virtual_stages=2", merge,
          expect=("schedule.merge_weight_grads", "zbv's own order places its WeightGrads"))
    lines = tmp_path / "mine.txt"
    lines.write_text("F0 F1 B0 W0 B1 W1\nF0 B0 W0 F1 B1 W1\n")
    fails("train", QUICKSTART, root, "schedule.name=file", f"schedule.path={lines}", "schedule.num_microbatches=2", merge,
          expect=("schedule.merge_weight_grads", "mine.txt", "leave the W's out"))
    assert not (tmp_path / "quickstart/profile.json").exists()


def test_schedule_that_needs_more_memory_than_a_device_has(compiled: str) -> None:
    fails("train", QUICKSTART, compiled, "cluster.memory_bytes_per_device=100000",
          expect=("memory", "cluster.memory_bytes_per_device"))


def test_plan_for_more_devices_than_available(compiled: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # On CPU "available" = CPU_PROCESSES_PER_CORE per core (at least MIN_CPU_PROCESSES): pretend 1.
    monkeypatch.setattr(launcher, "CPU_PROCESSES_PER_CORE", 0)
    monkeypatch.setattr(launcher, "MIN_CPU_PROCESSES", 1)
    fails("train", QUICKSTART, compiled, "cluster.device=cpu", expect=("needs 2 devices", "only 1", "--nnodes"))
    monkeypatch.undo()
    monkeypatch.setenv("PD_JOB_SECRET", "given out of band")
    fails("train", QUICKSTART, compiled, "--nnodes", "3", expect=("--nnodes 3", "node 0's address", "--master-addr"))
    with socket.socket() as s:  # a port free now, for node 0's store
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    fails("train", QUICKSTART, compiled, "--nnodes", "3", "--master-addr", "127.0.0.1", "--master-port", port,
          expect=("2 ranks", "--nnodes 3"))


def test_several_hosts_without_a_secret_given_out_of_band_are_refused(
        compiled: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PD_JOB_SECRET", raising=False)
    nodes = ("--nnodes", "2", "--master-addr", "127.0.0.1")
    fails("train", QUICKSTART, compiled, *nodes, expect=("--nnodes 2", "secret", "--secret-file", "PD_JOB_SECRET",
                                                         "--insecure-network"))
    secret = tmp_path / "job.secret"
    secret.write_text("s3cret\n")
    secret.chmod(0o644)
    fails("train", QUICKSTART, compiled, *nodes, "--secret-file", str(secret), expect=("readable by others", "chmod 600"))
    secret.chmod(0o600)
    secret.write_text("  \n")
    fails("train", QUICKSTART, compiled, *nodes, "--secret-file", str(secret), expect=("empty",))
    fails("train", QUICKSTART, compiled, *nodes, "--secret-file", str(tmp_path / "none"), expect=("cannot be read",))
    assert "PD_JOB_SECRET" not in __import__("os").environ  # nothing set for a refused job


def test_resume_without_a_checkpoint(compiled: str) -> None:
    fails("train", QUICKSTART, compiled, "--resume", expect=("--resume", "no complete checkpoint", "without --resume"))


def test_init_from_a_missing_or_foreign_file(compiled: str, tmp_path: Path) -> None:
    import torch

    fails("train", QUICKSTART, compiled, f"train.init_from={tmp_path / 'nope.pt'}", expect=("train.init_from", "does not exist"))
    foreign = tmp_path / "foreign.pt"
    torch.save({"fc.weight": torch.zeros(2, 2)}, foreign)
    fails("train", QUICKSTART, compiled, f"train.init_from={foreign}", expect=(str(foreign), "lacks", "pd export"))


def test_non_finite_or_negative_learning_rate(tmp_path: Path) -> None:
    for value in ("nan", "inf", "-0.5"):
        fails("train", QUICKSTART, f"run.root={tmp_path}", f"optim.lr={value}", expect=("optim.lr", "finite number > 0"))


def test_a_directory_passed_as_recipe() -> None:
    fails("train", str(REPO / "recipes"), expect=("recipes is a directory, not a YAML file", "quickstart.yaml"))


@pytest.fixture
def checkpointed(tmp_path: Path) -> Path:
    """A run directory with one complete checkpoint of a one-stage model (no training)."""
    import torch

    from pdcli.runtime import checkpoint

    module = torch.nn.Linear(2, 2)
    train_dir = tmp_path / "run" / "train"
    checkpoint.save_stage(train_dir, 1, 0, module, {}, torch.optim.SGD(module.parameters(), lr=0.1), 0, {})
    checkpoint.mark_complete(train_dir, 1, 1, keep=1)
    return tmp_path / "run"


def test_outputs_that_cannot_be_written(checkpointed: Path, tmp_path: Path) -> None:
    import os

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    fails("export", str(checkpointed), "-o", str(tmp_path), expect=(f"cannot write {tmp_path}: it is a directory",))
    fails("export", str(checkpointed), "-o", str(a_file / "m.pt"), expect=(f"cannot write {a_file / 'm.pt'}",))
    fails("train", QUICKSTART, f"run.root={a_file}", expect=("cannot create the run directory", f"{a_file} is a file", "run.root"))
    if os.path.exists("/proc/self"):
        fails("export", str(checkpointed), "-o", "/proc/x.pt", expect=("cannot write /proc/x.pt",))
    if os.geteuid() != 0:  # root writes into read-only directories anyway
        read_only = tmp_path / "ro"
        read_only.mkdir(mode=0o555)
        fails("export", str(checkpointed), "-o", str(read_only / "m.pt"), expect=(str(read_only / "m.pt"), "Permission denied"))
    result = runner.invoke(app, ["export", str(checkpointed), "-o", str(tmp_path / "ok.pt")])
    assert result.exit_code == 0 and (tmp_path / "ok.pt").is_file(), result.output


def test_a_checkpoint_changed_after_it_was_written_is_refused_by_pd_export(checkpointed: Path, tmp_path: Path) -> None:
    """A weight of a stage file changed in place (still a valid torch file): the marker's sha256
    refuses it, naming the file, where torch would load the changed weight."""
    import torch

    from pdcli.runtime import checkpoint

    path = checkpoint.stage_file(checkpointed / "train", 1, 0)
    payload = torch.load(path, weights_only=True)
    payload["model"]["weight"][0, 0] += 1.0
    torch.save(payload, path)
    fails("export", str(checkpointed), "-o", str(tmp_path / "m.pt"),
          expect=(f"checkpoint file {path} is corrupt: changed or damaged after it was written", "delete"))
    assert not (tmp_path / "m.pt").exists()


def test_a_model_and_a_data_set_that_do_not_fit(tmp_path: Path) -> None:
    fails("train", QUICKSTART, f"run.root={tmp_path}", "data=synthetic_images",
          expect=("model.name=mlp does not fit data.name=synthetic_images", "(16, 3, 32, 32) float32",
                  "(Linear) takes 64 features", "got (16, 3072)"))
    fails("profile", QUICKSTART, f"run.root={tmp_path}", "data=synthetic_images", "model=resnet18", "model.kwargs.num_classes=5",
          expect=("model.name=resnet18 does not fit data.name=synthetic_images", "model.loss=cross_entropy",
                  "output (16, 5) float32", "target (16,) int64"))
    assert not (tmp_path / "quickstart" / "profile.json").exists()


def test_a_factory_that_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "raising_factory_16.py").write_text("def make(**kwargs):\n    raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fails("train", QUICKSTART, f"run.root={tmp_path}", "model.target=raising_factory_16:make",
          expect=("model.target: raising_factory_16:make", "raised RuntimeError: no GPU here"))


def test_a_bad_transport_is_refused_before_any_worker_starts(compiled: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdcli.runtime.sockets import TRANSPORT_ENV

    started: list[object] = []
    monkeypatch.setattr("pdcli.runtime.job.launch_workers", lambda *args: started.append(args))
    monkeypatch.setenv(TRANSPORT_ENV, "bogus")
    fails("train", QUICKSTART, compiled, expect=("PD_TRANSPORT='bogus'", "socket, gloo", "unset PD_TRANSPORT"))
    monkeypatch.delenv(TRANSPORT_ENV)
    fails("train", QUICKSTART, compiled, "train.transport=carrier_pigeon",
          expect=("train.transport", "'carrier_pigeon' is not one of auto, socket, gloo"))
    assert started == []

"""Atomic writes and the artifact manifest: fresh, stale and tampered artifacts."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from pdcli.errors import UserError
from pdcli.rundir import RunDir, artifact_inputs_hash, atomic_save, atomic_write_json, atomic_write_text, read_json


def test_atomic_write_leaves_old_file_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    atomic_write_json(target, {"v": 1})

    def failing_save(name: str) -> None:
        Path(name).write_text('{"v": 2, "half')
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_save(target, failing_save)
    assert read_json(target) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]  # no temp file left behind


def test_fresh_stale_and_tampered(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run").create()
    h1 = artifact_inputs_hash({"lr": 1})
    h2 = artifact_inputs_hash({"lr": 2})
    assert h1 != h2 and h1 == artifact_inputs_hash({"lr": 1})
    assert not run.fresh("profile.json", h1)
    run.write_json("profile.json", {"x": 1}, h1)
    assert run.fresh("profile.json", h1)
    assert not run.fresh("profile.json", h2)  # inputs changed: redo
    (run / "profile.json").write_text('{"x": 2}\n')  # hand edit
    with pytest.raises(UserError, match="changed after it was written"):
        run.fresh("profile.json", h1)


def test_directory_artifact(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run").create()
    d = run / "stages"
    d.mkdir()
    (d / "stage_0.py").write_text("x = 1\n")
    run.register("stages", "h")
    assert run.fresh("stages", "h")
    (d / "stage_0.py").write_text("x = 2\n")
    with pytest.raises(UserError):
        run.verify("stages")


def test_corrupt_json_is_a_user_error(tmp_path: Path) -> None:
    p = tmp_path / "plan.json"
    p.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        read_json(p)
    with pytest.raises(UserError, match="not found"):
        read_json(tmp_path / "missing")


def test_artifacts_get_ordinary_permissions(tmp_path: Path) -> None:
    import os

    target = tmp_path / "a.json"
    atomic_write_json(target, {"v": 1})
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_write_removes_leftovers_of_interrupted_writes_of_the_same_file_only(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    leftover = tmp_path / ".plan.json.k3x_9q2z.tmp"  # what an interrupted atomic write of plan.json leaves
    held = tmp_path / ".plan.json.abcd1234.tmp"  # a write of plan.json still in progress (holds its lock)
    kept = [
        tmp_path / ".profile.json.k3x_9q2z.tmp",  # another file's temp: another step's business
        tmp_path / ".plan.json.tmp",  # not the pattern this code makes
        tmp_path / ".plan.json.toolongname.tmp",
        tmp_path / "plan.json.tmp",
        tmp_path / "sub" / ".plan.json.k3x_9q2z.tmp",  # another directory
    ]
    for p in (leftover, held, *kept):
        p.parent.mkdir(exist_ok=True)
        p.write_text("half a file")
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        atomic_write_json(target, {"v": 1})
    finally:
        os.close(fd)
    assert read_json(target) == {"v": 1}
    assert not leftover.exists()
    assert held.exists() and all(p.exists() for p in kept)
    atomic_write_json(target, {"v": 2})  # the writer of `held` is gone now: its temp goes too
    assert not held.exists() and all(p.exists() for p in kept)


def test_unwritable_targets_are_user_errors_naming_the_path(tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(UserError, match=f"cannot write {tmp_path}: it is a directory"):
        atomic_write_text(tmp_path, "x")
    with pytest.raises(UserError, match=f"cannot write {a_file / 'x.json'}"):
        atomic_write_text(a_file / "x.json", "x")
    with pytest.raises(UserError, match=f"cannot create the run directory {a_file / 'run'}: {a_file} is a file"):
        RunDir(a_file / "run").create()
    if Path("/proc/self").exists():  # a location nobody, not even root, can create files in
        with pytest.raises(UserError, match="cannot write /proc/x.pt"):
            atomic_write_text("/proc/x.pt", "x")
    if os.geteuid() != 0:  # root writes into read-only directories anyway
        read_only = tmp_path / "ro"
        read_only.mkdir(mode=0o555)
        with pytest.raises(UserError, match=f"cannot write {read_only / 'x.json'}: Permission denied"):
            atomic_write_text(read_only / "x.json", "x")

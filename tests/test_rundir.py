"""Atomic writes and the artifact manifest: fresh, stale and tampered artifacts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcli.errors import UserError
from pdcli.rundir import RunDir, artifact_inputs_hash, atomic_save, atomic_write_json, read_json


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

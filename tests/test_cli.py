"""The `pd` app in-process (typer's CliRunner; `--debug`'s traceback in a process of its own):
exit codes and messages of user errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from typer.testing import CliRunner

from pdcli.cli import app

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args))


def test_help_lists_subcommands() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for name in ("profile", "plan", "compile", "train", "config"):
        assert name in result.output


def test_config_show_resolves_quickstart() -> None:
    result = invoke("config", "show", str(REPO / "recipes/quickstart.yaml"), "train.steps=7", "schedule.name=gpipe")
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.output)
    assert resolved["train"]["steps"] == 7
    assert resolved["schedule"]["name"] == "gpipe"
    assert resolved["model"]["name"] == "mlp"
    assert resolved["data"]["name"] == "digits"


def test_user_errors_exit_2_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stepz: 3\n  seed: x\n")
    cases = {
        ("config", "show", str(tmp_path / "missing.yaml")): "recipe not found",
        ("config", "show", str(bad)): "train.stepz: unknown key (did you mean train.steps?)",
        ("config", "show", str(REPO / "recipes/quickstart.yaml"), "model=nosuch"): "model/nosuch.yaml",
        ("config", "show", str(REPO / "recipes/quickstart.yaml"), "schedule.name=fast"): "schedule.name",
    }
    for args, needle in cases.items():
        result = invoke(*args)
        assert result.exit_code == 2, (args, result.output)
        assert needle in result.output, (args, result.output)
        assert "Traceback" not in result.output
    both = invoke("config", "show", str(bad))
    assert "train.seed: expected int" in both.output  # all problems reported together


def test_debug_shows_the_exception(tmp_path: Path) -> None:
    """With --debug a user error keeps its traceback. CliRunner catches the exception before
    it is printed, so the command runs as `pd` does, in a process of its own."""
    missing = str(tmp_path / "missing.yaml")
    shown = subprocess.run([sys.executable, "-c", "from pdcli.cli import main; main()", "--debug", "config", "show", missing],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    assert shown.returncode == 1, shown.stderr
    assert "Traceback (most recent call last)" in shown.stderr
    assert f"pdcli.errors.UserError: recipe not found: {missing}" in shown.stderr
    plain = invoke("config", "show", missing)
    assert plain.exit_code == 2 and "Traceback" not in plain.output

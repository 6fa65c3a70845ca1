"""`pd report`'s library call: find the run, load the plan it trained with and what it measured,
compare them, draw the charts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from pdcli.errors import UserError
from pdcli.report.compare import Comparison, ReplanCommands, compare
from pdcli.report.measured import TRAIN_DIR, load_measured
from pdcli.report.predicted import device_stages, predict
from pdcli.schedule.orders import Order, read_orders
from pdcli.schedule.spec import SCHEDULES, rules
from pdcli.runtime.launch import LAUNCH_FILE, PLAN_KEY

PLAN_FILE = "plan.json"
CONFIG_FILE = "config.yaml"
RECIPE_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class ReportResult:
    comparison: Comparison
    charts: dict[str, Path]
    """Chart name (timeline, loss) -> PNG written."""


def locate_run(target: Path, overrides: Sequence[str] = (), run_name: str | None = None) -> tuple[Path, ReplanCommands]:
    """The run directory named by `target` (a run directory, or a recipe + overrides) and how
    to name it on a `pd` command line."""
    if target.is_dir():
        if overrides or run_name:
            raise UserError(f"{target} is a run directory: overrides and --run only apply to a recipe",
                            hint="pass the recipe instead (e.g. `pd report recipes/quickstart.yaml key=value`)")
        return target, _commands_for_run_dir(target)
    if target.suffix in RECIPE_SUFFIXES and target.is_file():
        from pdcli.config import load_config, run_dir_path

        items = [*overrides, *([f"run.name={run_name}"] if run_name else [])]
        cfg = load_config(target, items).config  # not `commands.common.load`: a report must not write config.yaml
        return run_dir_path(cfg), ReplanCommands(str(target), tuple(items))
    raise UserError(f"{target}: no such run directory or recipe file",
                    hint="pass a run directory (e.g. runs/quickstart) or the recipe it was trained from")


def _commands_for_run_dir(run_dir: Path) -> ReplanCommands:
    """`pd plan <run>/config.yaml`: the resolved config is a recipe; its run.root/name are pinned
    when they would not lead back to this directory from here."""
    config = _read_config(run_dir)
    recipe = str(run_dir / CONFIG_FILE)
    run = config.get("run", {}) if isinstance(config, dict) else {}
    home = Path(str(run.get("root", ""))) / str(run.get("name", ""))
    if home.resolve() == run_dir.resolve():
        return ReplanCommands(recipe)
    return ReplanCommands(recipe, (f"run.root={run_dir.resolve().parent}", f"run.name={run_dir.name}"))


def _read_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / CONFIG_FILE
    if not path.exists():
        return {}
    loaded = yaml.safe_load(path.read_text())
    return loaded if isinstance(loaded, dict) else {}


def written_orders(schedule: dict[str, Any], name: str, num_microbatches: int, num_stages: int) -> tuple[Order, ...]:
    """A hand-written schedule's orders from the run's config.yaml `schedule` section (none when
    it has none, or not one per stage)."""
    lines = schedule.get("orders") if name in SCHEDULES and rules(name).hand_written else None
    if not lines or len(lines) != num_stages:
        return ()
    return read_orders(lines, num_microbatches, True, schedule.get("path") or "schedule.orders")  # checked as the run loaded


def read_trained_plan(run_dir: Path, commands: ReplanCommands) -> dict[str, Any]:
    """The plan the run trained with (train/launch.json), else plan.json."""
    train_dir = run_dir / TRAIN_DIR
    for path in (train_dir / LAUNCH_FILE, run_dir / PLAN_FILE):
        if path.exists():
            try:
                obj = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})", hint=f"re-run `{commands.train()}`") from None
            return obj[PLAN_KEY] if path.name == LAUNCH_FILE else obj
    if not train_dir.exists():
        raise UserError(f"{run_dir}: no {PLAN_FILE} and no {TRAIN_DIR}/: nothing to report",
                        hint=f"run `{commands.train()}` first (it profiles, plans, compiles and trains)")
    raise UserError(f"{run_dir / PLAN_FILE} not found", hint=f"run `{commands.plan()}` first")


def profiled_host_speed(run_dir: Path) -> float | None:
    """The host's speed when the run's profile was measured (`meta.host_speed_ms` of its
    profile.json; None where it has none)."""
    from pdcli.host import HOST_SPEED_META
    from pdcli.profiler.chain import PROFILE_ARTIFACT

    path = run_dir / PROFILE_ARTIFACT
    try:
        value = json.loads(path.read_text()).get("meta", {}).get(HOST_SPEED_META) if path.exists() else None
    except (json.JSONDecodeError, AttributeError):
        return None
    return float(value) if value else None


def make_report(run_dir: Path, commands: ReplanCommands, threshold_pct: float, charts: bool = True,
                timeline_steps: int = 3, timeline_start: int | None = None) -> ReportResult:
    """Compare what the run measured with its plan; write train/timeline.png and train/loss.png."""
    if threshold_pct < 0:
        raise UserError(f"--drift-threshold must be >= 0 percent, got {threshold_pct:g}")
    if timeline_steps < 1:
        raise UserError(f"--timeline-steps must be >= 1, got {timeline_steps}")
    plan = read_trained_plan(run_dir, commands)
    inputs = plan.get("inputs", {})
    num_microbatches, batch_size = int(inputs["num_microbatches"]), int(inputs["batch_size"])
    # virtual stages: the plan's stages are chunks, several per rank; the run is held per device
    chunks_per_rank = int(inputs.get("virtual_stages", 1))
    stage_ranks = [list(s["ranks"]) for s in (device_stages(plan) if chunks_per_rank > 1 else plan["stages"])]
    train_dir = run_dir / TRAIN_DIR
    measured = load_measured(train_dir, batch_size, num_microbatches, stage_ranks, commands.train(), chunks_per_rank)
    if len(measured.stages) != len(stage_ranks):
        raise UserError(f"{train_dir}: the run measured {len(measured.stages)} stages, its plan has {len(stage_ranks)}",
                        hint=f"the plan changed after training: re-run `{commands.train()}`")
    schedule = _read_config(run_dir).get("schedule", {})
    vertical_sync = bool(schedule.get("vertical_sync", False))
    predicted = predict(plan, measured.schedule, num_microbatches, measured.num_steps, vertical_sync,
                        written_orders(schedule, measured.schedule, num_microbatches, len(plan["stages"])))
    from pdcli.report.predicted import runtime_costed

    comparison = compare(predicted, measured, threshold_pct, commands,
                         str(run_dir) if runtime_costed(plan) else None, profiled_host_speed(run_dir), str(run_dir))
    written: dict[str, Path] = {}
    if charts:
        from pdcli.report.charts import LOSS_FILE, TIMELINE_FILE, draw_loss, draw_timeline

        if measured.ranks:
            written["timeline"] = draw_timeline(measured.ranks, num_microbatches * chunks_per_rank, stage_ranks,
                                                train_dir / TIMELINE_FILE, timeline_steps, timeline_start)
        if measured.metrics:
            written["loss"] = draw_loss(measured.metrics, measured.minibatch_losses, batch_size, train_dir / LOSS_FILE,
                                         measured.evals)
    return ReportResult(comparison, written)

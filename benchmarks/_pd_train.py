"""The `pd train` rows of the runtime benchmark: write a recipe for the benchmark shape, run
`pd train` in a subprocess, read samples/s from the run's `train/metrics.jsonl`."""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from _bench_common import NUM_CLASSES, NUM_STAGES, BenchFailed, BenchShape, model_kwargs, run_bounded, stderr_tail

PD_SCHEDULES = ("pipedream", "1f1b")
THREADS_PER_WORKER = 1
WORKER_SILENCE_TIMEOUT_S = 60.0
"""`train.timeout_s`: a worker silent this long stops the job (pd's own watchdog)."""
METRIC_FIELD = "samples_per_s"
RECIPE_NAME = "bench_runtime.yaml"
LR = 0.01


@dataclass(frozen=True)
class PdResult:
    """What one `pd train` run measured."""

    samples_per_s: float
    num_logged_steps: int
    split: str
    """The stage boundaries `pd` planned, e.g. `[0:9) [9:18)` chain positions, or `?`."""


def pd_executable() -> Path:
    """`pd` beside the running interpreter (the venv's console script)."""
    return Path(sys.executable).parent / "pd"


def recipe(shape: BenchShape, schedule_name: str, run_root: Path) -> dict[str, Any]:
    """The recipe: the benchmark MLP on synthetic `width`-feature inputs, 2 stages on 2 devices.

    The inputs are `synthetic_images` of shape (width, 1, 1): the MLP flattens them to
    `width` features, which gives any width without a data file.
    """
    return {
        "model": {"name": "mlp", "kwargs": model_kwargs(shape)},
        "data": {
            "name": "synthetic_images",
            "kwargs": {"channels": shape.width, "image_size": 1, "num_classes": NUM_CLASSES},
            "batch_size": shape.batch_size,
            "seed": shape.seed,
        },
        "cluster": {"levels": [{"devices": NUM_STAGES}], "device": "cpu"},
        "plan": {"num_stages": NUM_STAGES, "straight": True, "use_fewer_devices": False},
        "schedule": {"name": schedule_name, "num_microbatches": shape.num_microbatches},
        "optim": {"name": "sgd", "lr": LR},
        "train": {
            "steps": shape.num_warmup_steps + shape.num_steps,
            "log_every": 1,
            "threads_per_worker": THREADS_PER_WORKER,
            "timeout_s": WORKER_SILENCE_TIMEOUT_S,
            "seed": shape.seed,
        },
        "run": {"name": f"bench_{schedule_name}", "root": str(run_root)},
    }


def run_pd_train(shape: BenchShape, schedule_name: str, work_dir: Path, timeout_s: float) -> PdResult:
    """Run `pd train` with `schedule_name` in `work_dir`; raise BenchFailed with the reason."""
    if schedule_name not in PD_SCHEDULES:
        raise ValueError(f"schedule {schedule_name!r} is not one of {', '.join(PD_SCHEDULES)}")
    pd = pd_executable()
    if not pd.exists():
        raise BenchFailed(f"{pd} not found (pip install -e . first)")
    work_dir.mkdir(parents=True, exist_ok=True)
    spec = recipe(shape, schedule_name, work_dir / "runs")
    recipe_path = work_dir / RECIPE_NAME
    recipe_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    run_dir = Path(spec["run"]["root"]) / spec["run"]["name"]
    returncode, _, err = run_bounded([str(pd), "train", str(recipe_path)], timeout_s)
    if returncode != 0:
        raise BenchFailed(f"pd train exit status {returncode}: {stderr_tail(err)}")
    samples_per_s, num_logged = median_samples_per_s(run_dir / "train" / "metrics.jsonl")
    return PdResult(samples_per_s, num_logged, planned_split(run_dir / "plan.json"))


def median_samples_per_s(metrics_path: Path) -> tuple[float, int]:
    """Median `samples_per_s` over the logged steps after the first (the first holds start-up)."""
    if not metrics_path.exists():
        raise BenchFailed(f"no {metrics_path.name} written")
    values = []
    for line in metrics_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a half-written last line
        value = record.get(METRIC_FIELD) if isinstance(record, dict) else None
        if isinstance(value, (int, float)) and value > 0:
            values.append(float(value))
    if len(values) < 2:
        raise BenchFailed(f"{metrics_path.name} has {len(values)} lines with {METRIC_FIELD}; need >= 2")
    return statistics.median(values[1:]), len(values) - 1


def planned_split(plan_path: Path) -> str:
    """`[start:end)` chain positions of each planned stage, or `?` if the plan is unreadable."""
    try:
        stages = json.loads(plan_path.read_text())["stages"]
        return " ".join(f"[{s['start']}:{s['end']})" for s in stages)
    except (OSError, ValueError, KeyError, TypeError):
        return "?"

"""The `pd train` rows of the runtime benchmark: write a recipe for the benchmark shape, run
`pd train` in a subprocess, read samples/s from the run's `train/metrics.jsonl`."""

from __future__ import annotations

import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from _bench_common import (
    NUM_CLASSES,
    NUM_STAGES,
    VIRTUAL_STAGES,
    BenchFailed,
    BenchShape,
    chunk_points,
    model_kwargs,
    run_bounded,
    split_point,
    stderr_tail,
)

PD_SCHEDULES = ("pipedream", "1f1b", "gpipe", "interleaved", "loopedbfs", "zbv")
THREADS_PER_WORKER = 1
WORKER_SILENCE_TIMEOUT_S = 60.0
"""`train.timeout_s`: a worker silent this long stops the job (pd's own watchdog)."""
METRIC_FIELD = "samples_per_s"
FINAL_FIELD = "final"
"""pd's last metrics line (`"final": true`) is a whole-run summary, not a step."""
RECIPE_NAME = "bench_runtime.yaml"
RUNS_DIR = "runs"
LR = 0.01
PROFILE_WARMUP = 3
PROFILE_REPEATS = 15


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


def recipe(shape: BenchShape, run_root: Path) -> dict[str, Any]:
    """The recipe: the benchmark MLP on synthetic `width`-feature inputs, 2 stages on 2 devices.

    The inputs are `synthetic_images` of shape (width, 1, 1): the MLP flattens them to
    `width` features, which gives any width without a data file. The schedule and the run
    name are command-line overrides (`overrides`), one recipe serves every row.
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
        # more repeats than the default: the planner's split follows the profile, and on a
        # shared 2-core host a 5-repeat median can tip it off the balanced cut
        "profile": {"warmup": PROFILE_WARMUP, "repeats": PROFILE_REPEATS},
        # the baselines' balanced split, fixed: this benchmark measures the runtime, and a
        # noisy profile on a shared host can tip the planner one layer off (5 vs 3 matmuls)
        "plan": {"num_stages": NUM_STAGES, "straight": True, "use_fewer_devices": False,
                 "boundaries": [split_point(shape)]},
        "schedule": {"num_microbatches": shape.num_microbatches},
        "optim": {"name": "sgd", "lr": LR},
        "train": {
            "steps": shape.num_warmup_steps + shape.num_steps,
            "log_every": 1,
            "threads_per_worker": THREADS_PER_WORKER,
            "timeout_s": WORKER_SILENCE_TIMEOUT_S,
            "seed": shape.seed,
        },
        "run": {"root": str(run_root)},
    }


def write_recipe(shape: BenchShape, work_dir: Path) -> Path:
    """Write `recipe(shape)` to `work_dir` (runs go to `work_dir/runs`); return its path."""
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / RECIPE_NAME
    path.write_text(yaml.safe_dump(recipe(shape, work_dir / RUNS_DIR), sort_keys=False))
    return path


def overrides(schedule_name: str, extra: Sequence[str] = ()) -> list[str]:
    """`schedule.name`, the run's name, then `extra` (`key=value` as on pd's command line)."""
    return [f"schedule.name={schedule_name}", f"run.name={run_name(schedule_name, extra)}", *extra]


def virtual_overrides(shape: BenchShape) -> list[str]:
    """The virtual-stage rows' settings: VIRTUAL_STAGES chunks per rank at the baselines' chunk cuts."""
    return [f"schedule.virtual_stages={VIRTUAL_STAGES}",
            f"plan.boundaries=[{','.join(map(str, chunk_points(shape)))}]"]


def run_name(schedule_name: str, extra: Sequence[str] = ()) -> str:
    # a run directory per setting: `schedule.split_backward=false` -> `-split_backward_false`
    suffix = "".join("-" + re.sub(r"[^A-Za-z0-9]+", "_", e.rsplit(".", 1)[-1]) for e in extra)
    return f"bench_{schedule_name}{suffix}"


def run_pd_train(shape: BenchShape, schedule_name: str, work_dir: Path, timeout_s: float,
                 extra: Sequence[str] = ()) -> PdResult:
    """Run `pd train` with `schedule_name` (and `extra` overrides) in `work_dir`; raise BenchFailed with the reason."""
    if schedule_name not in PD_SCHEDULES:
        raise ValueError(f"schedule {schedule_name!r} is not one of {', '.join(PD_SCHEDULES)}")
    pd = pd_executable()
    if not pd.exists():
        raise BenchFailed(f"{pd} not found (pip install -e . first)")
    recipe_path = write_recipe(shape, work_dir)
    returncode, _, err = run_bounded([str(pd), "train", str(recipe_path), *overrides(schedule_name, extra)], timeout_s)
    if returncode != 0:
        raise BenchFailed(f"pd train exit status {returncode}: {stderr_tail(err)}")
    run_dir = work_dir / RUNS_DIR / run_name(schedule_name, extra)
    samples_per_s, num_logged = median_samples_per_s(run_dir / "train" / "metrics.jsonl", shape.num_warmup_steps)
    return PdResult(samples_per_s, num_logged, planned_split(run_dir / "plan.json"))


def median_samples_per_s(metrics_path: Path, num_skip: int = 1) -> tuple[float, int]:
    """(median `samples_per_s` over the logged steps after the first `num_skip`, how many).

    The first steps hold start-up (connections, allocator); the last `"final"` line, a
    whole-run summary, is not a step.
    """
    num_skip = max(1, num_skip)
    if not metrics_path.exists():
        raise BenchFailed(f"no {metrics_path.name} written")
    values = []
    for line in metrics_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a half-written last line
        if not isinstance(record, dict) or record.get(FINAL_FIELD):
            continue  # the final line's samples/s covers the whole run, start-up included
        value = record.get(METRIC_FIELD)
        if isinstance(value, (int, float)) and value > 0:
            values.append(float(value))
    if len(values) <= num_skip:
        raise BenchFailed(
            f"{metrics_path.name} has {len(values)} step lines with {METRIC_FIELD}; need > {num_skip}"
        )
    return statistics.median(values[num_skip:]), len(values) - num_skip


def planned_split(plan_path: Path) -> str:
    """`[start:end)` chain positions of each planned stage, or `?` if the plan is unreadable."""
    try:
        stages = json.loads(plan_path.read_text())["stages"]
        return " ".join(f"[{s['start']}:{s['end']})" for s in stages)
    except (OSError, ValueError, KeyError, TypeError):
        return "?"

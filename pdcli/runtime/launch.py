"""What a worker is told when it starts: by `pd train` in `train/launch.json` (the plan and the
resume step), by torchrun / the elastic agent in its environment (`WorkerEnv`).

`run_training` writes it before each launch; each worker reads the plan it trains with from
it and the checkpoint step it resumes from (null: a fresh start); a restart of a failed job
points that step at the newest complete checkpoint (`pdcli.runtime.restarts`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdcli.rundir import atomic_write_json, read_json

LAUNCH_FILE = "launch.json"
PLAN_KEY = "plan"
"""Key of the plan the launch trains with (a plan's JSON object)."""
RESUME_KEY = "resume_step"
"""Key of the checkpoint step a launch resumes from (null: fresh)."""


def write_launch(train_dir: Path, plan_json: dict[str, Any], resume_step: int | None) -> None:
    """Record what the next launch of the workers trains with and resumes from."""
    atomic_write_json(train_dir / LAUNCH_FILE, {PLAN_KEY: plan_json, RESUME_KEY: resume_step})


def read_plan(run_dir: Path) -> dict[str, Any]:
    """The plan `run_training` recorded for this launch (else the run's plan.json)."""
    launch = run_dir / "train" / LAUNCH_FILE
    if launch.exists():
        return json.loads(launch.read_text())[PLAN_KEY]
    return json.loads((run_dir / "plan.json").read_text())


def read_resume_step(train_dir: Path) -> int | None:
    """The step this launch resumes from, as `pd train --resume` recorded it in launch.json."""
    path = train_dir / LAUNCH_FILE
    if not path.exists():
        return None
    step = json.loads(path.read_text()).get(RESUME_KEY)
    return None if step is None else int(step)


def set_resume_step(train_dir: Path, step: int | None) -> None:
    """Point the recorded launch at checkpoint `step` (None: the start), keeping its plan."""
    launch = read_json(train_dir / LAUNCH_FILE, "launch record")
    atomic_write_json(train_dir / LAUNCH_FILE, {**launch, RESUME_KEY: step})


@dataclass(frozen=True)
class WorkerEnv:
    """What torchrun / the elastic agent tells a worker through its environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @staticmethod
    def from_env() -> "WorkerEnv":
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise SystemExit(f"pd worker: {', '.join(missing)} not set; start workers with `pd train` or torchrun")
        world = int(os.environ["WORLD_SIZE"])
        return WorkerEnv(
            rank=int(os.environ["RANK"]),
            world_size=world,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        )

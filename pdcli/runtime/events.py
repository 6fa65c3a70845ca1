"""The run's event log `train/events.jsonl`: one JSON object per line, appended, never rewritten.

Written by the launcher (`pdcli.runtime.launcher.FailureEvents`): `restart` (the elastic
agent restarted every worker after a failure; `resume_step` is the checkpoint they resumed
from) and `failure` (the job stopped), each with the root cause's `rank`, `stage`, `cause`
(`signal SIGKILL`, `exit code 3`, `silent`, `diverged`, ...) and `message`. Read by
`pd report`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pdcli.runtime.metrics import read_metrics

EVENTS_FILE = "events.jsonl"


def append_event(train_dir: Path, event: dict[str, Any]) -> None:
    """One line of `train/events.jsonl` (appended: an event log is never rewritten)."""
    train_dir.mkdir(parents=True, exist_ok=True)
    with open(train_dir / EVENTS_FILE, "a") as f:
        f.write(json.dumps({"time_s": round(time.time(), 3), **event}, sort_keys=True) + "\n")


def read_events(train_dir: Path) -> list[dict[str, Any]]:
    """The run's events, oldest first (a line cut by a crash is skipped)."""
    return read_metrics(train_dir / EVENTS_FILE)

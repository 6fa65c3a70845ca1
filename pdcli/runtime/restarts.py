"""Restarts of a failed job (`train.max_restarts`): torch's elastic agent, pd's bookkeeping around it.

torch's elastic agent does the restarting: when a worker dies (or a peer's watchdog kills a
silent one) it stops every worker and starts them all again, up to `max_restarts` times.
`RestartingAgent` adds two hooks to that machinery: each failure goes to `on_failure` (the
launcher logs its cause in `train/events.jsonl`, and refuses a restart for a diverged run,
which would diverge again), and `before_restart` runs between stopping and starting the
workers (`prepare_restart`: `launch.json`'s resume step becomes the newest complete
checkpoint, so the new workers resume as `pd train --resume` would). The same
train-directory resets serve a fresh launch and a resume (`reset_attempt`,
`keep_metrics_through`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.launcher import api as launcher_api

from pdcli.rundir import atomic_write_text
from pdcli.runtime import checkpoint
from pdcli.runtime.evaluation import is_eval_line
from pdcli.runtime.launch import set_resume_step
from pdcli.runtime.metrics import TENSORBOARD_DIR, add_scalars, open_tensorboard, read_metrics
from pdcli.runtime.metrics import METRICS_FILE, SUMMARY_FILE, TRACE_FILE

NO_RESTART_KINDS = ("diverged",)
"""Error-report kinds a restart cannot cure: the job stops with its restarts unused."""


def reset_attempt(train_dir: Path) -> None:
    """Remove what one launch of the workers leaves for the next to misread: status and error
    files (they would blame the wrong rank), the summary and the trace."""
    shutil.rmtree(train_dir / "status", ignore_errors=True)
    for name in (SUMMARY_FILE, TRACE_FILE):
        (train_dir / name).unlink(missing_ok=True)


def keep_metrics_through(train_dir: Path, step: int | None, tensorboard: bool) -> None:
    """Keep the metrics lines up to minibatch `step` (a checkpoint the launch resumes from),
    none for a fresh start: the resumed workers append from there. The evaluation after
    `step` runs again, so its line goes; TensorBoard's scalars are rewritten from the kept lines."""
    metrics = train_dir / METRICS_FILE
    if step is None:
        metrics.unlink(missing_ok=True)
        shutil.rmtree(train_dir / TENSORBOARD_DIR, ignore_errors=True)
        return
    kept = [line for line in read_metrics(metrics) if not line.get("final") and int(line.get("step", 0)) <= step
            and not (is_eval_line(line) and int(line["step"]) == step)]
    atomic_write_text(metrics, "".join(json.dumps(line, sort_keys=True) + "\n" for line in kept))
    writer = open_tensorboard(train_dir, tensorboard, fresh=True)
    if writer is not None:
        for line in kept:
            add_scalars(writer, line)
        writer.close()


def restart_step(train_dir: Path, num_steps: int) -> int | None:
    """The checkpoint a restarted job resumes from: the newest complete one before the end
    (one at the end was followed by a failure in the final report: that part is redone)."""
    steps = [s for s in checkpoint.complete_steps(train_dir) if s < num_steps]
    return steps[-1] if steps else None


def prepare_restart(train_dir: Path, num_steps: int) -> int | None:
    """Point `launch.json` at the newest complete checkpoint and reset the train directory
    to it; returns the step the restarted workers resume from (None: from the start)."""
    step = restart_step(train_dir, num_steps)
    set_resume_step(train_dir, step)
    reset_attempt(train_dir)
    keep_metrics_through(train_dir, step, (train_dir / TENSORBOARD_DIR).exists())
    return step


FailureHandler = Callable[[Mapping[int, int], int], bool]
"""on_failure(exit code by global rank, restarts left) -> whether a restart may cure it."""


class RestartingAgent(LocalElasticAgent):
    """torch's local elastic agent, telling `on_failure` about each failure before it decides
    to restart, and calling `before_restart()` between stopping and starting the workers."""

    def __init__(self, *args: Any, on_failure: FailureHandler, before_restart: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_failure = on_failure
        self._before_restart = before_restart

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state in {WorkerState.FAILED, WorkerState.UNHEALTHY}:
            exit_codes = {int(rank): failure.exitcode for rank, failure in result.failures.items()}
            if not self._on_failure(exit_codes, self._remaining_restarts):
                self._remaining_restarts = 0
        return result

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        if self._remaining_restarts < worker_group.spec.max_restarts:  # a restart, not the first start
            self._before_restart()
        super()._initialize_workers(worker_group)


@contextlib.contextmanager
def restarting_agent(on_failure: FailureHandler, before_restart: Callable[[], None]) -> Iterator[None]:
    """Inside: torch's `elastic_launch` runs a `RestartingAgent`. torch builds its agent inside
    `launch_agent` with no way to pass another class, so the name it uses is swapped for the
    duration of the launch (and restored after), rather than copying torch's launch code."""
    def make(*args: Any, **kwargs: Any) -> RestartingAgent:
        return RestartingAgent(*args, on_failure=on_failure, before_restart=before_restart, **kwargs)

    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = make  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original  # type: ignore[misc]

"""Failure reporting of one worker: its current action, a hang watchdog, an error file.

- `Heartbeat` keeps the rank's current step and action in a small memory-mapped file
  (`train/status/rank<r>.txt`): a memory write per action, no syscall, and still readable
  by the launcher after the process was killed.
- `Watchdog` is a daemon thread: if one action runs longer than `timeout_s`, it writes an
  error file naming rank, stage and action and ends the process (`os._exit`), so the
  elastic launcher stops the other workers.
- `write_error` records why a worker failed (`train/status/rank<r>.error.json`).
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
from pathlib import Path

STATUS_BYTES = 512
WATCHDOG_EXIT_CODE = 124  # like timeout(1)
FAULT_ENV = "PD_TEST_FAULT"
"""Tests only: `<rank>:<step>:exit|hang` makes that rank exit (code 3) or hang in its first
Forward/Backward once it has taken `step` optimizer steps."""
CHECKPOINT_FAULT_ENV = "PD_TEST_CHECKPOINT_FAULT"
"""Tests only: `<rank>:<step>:written|complete` makes that rank exit (code 3) while taking the
checkpoint of minibatch `step`: right after writing its stage file (`written`: the checkpoint
stays incomplete, a crash mid-write) or once the checkpoint is complete (`complete`)."""
CHECKPOINT_FAULT_POINTS = ("written", "complete")
WAITING_ACTIONS = ("RecvActivations", "RecvGrads", "AllReduceGrads", "init_process_group", "connect", "checkpoint", "report")
"""Actions that wait for other ranks: a timeout there points at a peer."""
STARTUP_ACTIONS = ("init_process_group", "load_stage", "connect")
STARTUP_MIN_TIMEOUT_S = 60.0
"""Start-up (imports, process group, loading the stage) is slow on a loaded host and is not a
training step: it gets at least this long before the watchdog calls it a hang."""


def status_path(train_dir: Path, rank: int) -> Path:
    return train_dir / "status" / f"rank{rank}.txt"


def error_path(train_dir: Path, rank: int) -> Path:
    return train_dir / "status" / f"rank{rank}.error.json"


class Heartbeat:
    """Current step/action of this rank, readable from outside after a crash."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(b" " * STATUS_BYTES)
        self._f = open(path, "r+b")
        self._map = mmap.mmap(self._f.fileno(), STATUS_BYTES)
        self.step = 0
        self.action = "start"
        self.started_s = time.monotonic()

    def beat(self, step: int, action: str) -> None:
        self.step, self.action, self.started_s = step, action, time.monotonic()
        text = f"step={step} action={action}".encode()[: STATUS_BYTES - 1]
        self._map[:STATUS_BYTES] = text.ljust(STATUS_BYTES)

    def close(self) -> None:
        self._map.close()
        self._f.close()


def read_status(train_dir: Path, rank: int) -> str | None:
    """`step=<n> action=<action>` last recorded by `rank`, or None."""
    p = status_path(train_dir, rank)
    if not p.exists():
        return None
    text = p.read_bytes().decode(errors="replace").strip()
    return text or None


def write_error(train_dir: Path, rank: int, kind: str, message: str) -> None:
    """`kind`: `error` (raised), `hang` (watchdog, stuck in compute), `waiting` (watchdog, stuck
    waiting for a peer), `peer` (a communication error: a peer probably died)."""
    p = error_path(train_dir, rank)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, "kind": kind, "message": message, "time_s": time.time()}))
    os.replace(tmp, p)


def read_error(train_dir: Path, rank: int) -> dict | None:
    p = error_path(train_dir, rank)
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


class Watchdog(threading.Thread):
    """Ends the process when the heartbeat's current action exceeds `timeout_s`."""

    def __init__(self, heartbeat: Heartbeat, timeout_s: float, train_dir: Path, rank: int, who: str) -> None:
        super().__init__(name="pd-watchdog", daemon=True)
        self.heartbeat = heartbeat
        self.timeout_s = timeout_s
        self.train_dir = train_dir
        self.rank = rank
        self.who = who
        self._stop_event = threading.Event()

    def run(self) -> None:
        poll_s = min(1.0, self.timeout_s / 10)
        while not self._stop_event.wait(poll_s):
            stuck_s = time.monotonic() - self.heartbeat.started_s
            starting = self.heartbeat.action in STARTUP_ACTIONS
            if stuck_s > (max(self.timeout_s, STARTUP_MIN_TIMEOUT_S) if starting else self.timeout_s):
                waiting = self.heartbeat.action.startswith(WAITING_ACTIONS)
                message = (
                    f"{self.who} {'waited' if waiting else 'made no progress'} for {stuck_s:.1f} s "
                    f"(train.timeout_s={self.timeout_s:g}) in action {self.heartbeat.action} at step {self.heartbeat.step}"
                )
                # Waiting on a peer is a symptom; stuck in compute is a cause.
                write_error(self.train_dir, self.rank, "waiting" if waiting else "hang", message)
                print(f"pd worker: {message}", flush=True)
                os._exit(WATCHDOG_EXIT_CODE)

    def stop(self) -> None:
        self._stop_event.set()


def parse_fault(spec: str | None, rank: int) -> tuple[int, str] | None:
    """(step, mode) of the fault `FAULT_ENV` asks of `rank`, or None."""
    if not spec:
        return None
    fault_rank, step, mode = spec.split(":")
    if mode not in ("exit", "hang"):
        raise ValueError(f"{FAULT_ENV}={spec!r}: mode must be exit or hang")
    return (int(step), mode) if int(fault_rank) == rank else None


def inject_fault(mode: str) -> None:
    if mode == "exit":
        os._exit(3)
    while True:  # "hang": the watchdog must end this process
        time.sleep(3600)


def checkpoint_fault(rank: int, step: int, point: str) -> None:
    """Exit here if `CHECKPOINT_FAULT_ENV` asks it of (rank, step, point)."""
    spec = os.environ.get(CHECKPOINT_FAULT_ENV)
    if not spec:
        return
    fault_rank, fault_step, fault_point = spec.split(":")
    if fault_point not in CHECKPOINT_FAULT_POINTS:
        raise ValueError(f"{CHECKPOINT_FAULT_ENV}={spec!r}: point must be one of {CHECKPOINT_FAULT_POINTS}")
    if (int(fault_rank), int(fault_step), fault_point) == (rank, step, point):
        os._exit(3)

"""Failure reporting of one worker: its current action, a hang watchdog, an error file.

- `Heartbeat` keeps the rank's current step and action in a small memory-mapped file
  (`train/status/rank<r>.txt`): a memory write per action, no syscall, and still readable
  by the launcher after the process was killed. Its last line is the process's sign of
  life (`host=<h> pid=<p> alive=<unix time>`), written by the watchdog thread.
- `Watchdog` is a daemon thread: if one action runs longer than `timeout_s`, it writes an
  error file naming rank, stage and action and ends the process (`os._exit`), so the
  elastic launcher stops the other workers. It also watches the other ranks of this host:
  a rank whose sign of life is older than `timeout_s` is stopped or frozen (SIGSTOP, a
  debugger) and cannot run any handler, so the watchdog writes the error for it ("sent
  nothing for T s") and SIGKILLs its process group itself; the launcher then stops the rest
  at once instead of waiting out torch's SIGTERM grace for a process that cannot exit. And
  it ends its own process when the launcher is gone (the parent check, the portable
  fallback of the parent-death signal `die_with_parent` asks of Linux).
- `write_error` records why a worker failed (`train/status/rank<r>.error.json`).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pdcli.schedule.actions import waits_for_peer

STATUS_BYTES = 512
ACTION_BYTES = 384
"""The status file: the current step and action in its first ACTION_BYTES, the sign of life after."""
DONE = "done"
"""The sign of life of a rank that finished (or stopped its watchdog): never silent."""
WATCHDOG_EXIT_CODE = 124  # like timeout(1)
ORPHAN_EXIT_CODE = 125
FROZEN_S = 3.0
"""A rank whose own wait timed out (its watchdog, or a receive's timeout) blames a local peer
whose sign of life is this old (the watchdog thread of a running process writes it every
<= 1 s): the peer is the cause."""
PR_SET_PDEATHSIG = 1
FAULT_ENV = "PD_TEST_FAULT"
"""Tests only: `<rank>:<step>:exit|hang|kill|stop` makes that rank exit (code 3), hang, SIGKILL
or SIGSTOP itself (going on where a SIGCONT continues it) in its first Forward/Backward once it has
taken `step` optimizer steps, in the first attempt of the job only (a restarted job,
`train.max_restarts`, runs clean)."""
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
"""Set by torch's elastic agent in each worker: how many times the job was restarted."""
CHECKPOINT_FAULT_ENV = "PD_TEST_CHECKPOINT_FAULT"
"""Tests only: `<rank>:<step>:written|complete` makes that rank exit (code 3) while taking the
checkpoint of minibatch `step`: right after writing its stage file (`written`: the checkpoint
stays incomplete, a crash mid-write) or once the checkpoint is complete (`complete`)."""
CHECKPOINT_FAULT_POINTS = ("written", "complete")
WAITING_STEPS = ("init_process_group", "connect", "checkpoint", "report")
"""Steps outside the action lists that wait for other ranks (with the receives and all-reduces,
`schedule.actions.waits_for_peer`): a timeout there points at a peer."""
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
        self.alive()

    def beat(self, step: int, action: str) -> None:
        self.step, self.action, self.started_s = step, action, time.monotonic()
        text = f"step={step} action={action}".encode()[: ACTION_BYTES - 1]
        self._map[:ACTION_BYTES] = text.ljust(ACTION_BYTES)

    def alive(self, done: bool = False) -> None:
        """The sign of life (the watchdog thread's, so a long action still shows one)."""
        when = DONE if done else f"{time.time():.3f}"
        text = f"\nhost={socket.gethostname()} pid={os.getpid()} alive={when}".encode()
        self._map[ACTION_BYTES:STATUS_BYTES] = text[: STATUS_BYTES - ACTION_BYTES].ljust(STATUS_BYTES - ACTION_BYTES)

    def close(self) -> None:
        self._map.close()
        self._f.close()


def read_status(train_dir: Path, rank: int) -> str | None:
    """`step=<n> action=<action>` last recorded by `rank`, or None."""
    p = status_path(train_dir, rank)
    if not p.exists():
        return None
    text = p.read_bytes()[:ACTION_BYTES].decode(errors="replace").strip()
    return text or None


def read_life(train_dir: Path, rank: int) -> tuple[int, float] | None:
    """(pid, seconds since its last sign of life) of `rank` if it runs on this host and has
    not finished, else None."""
    try:
        tail = status_path(train_dir, rank).read_bytes()[ACTION_BYTES:].decode(errors="replace")
        fields = dict(f.split("=", 1) for f in tail.split() if "=" in f)
        if fields.get("host") != socket.gethostname() or fields.get("alive", DONE) == DONE:
            return None
        return int(fields["pid"]), max(0.0, time.time() - float(fields["alive"]))
    except (OSError, KeyError, ValueError):
        return None


def exists(pid: int) -> bool:
    """`pid` is a process that has not ended (a zombie has: it died, it is not silent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (not Linux): os.kill said it exists


def kill_process_group(pid: int) -> None:
    """SIGKILL `pid`'s process group when it leads one (the elastic agent starts each worker
    in its own session), else the process alone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def die_with_parent(launcher_pid: int | None) -> None:
    """Ask Linux to SIGKILL this process when its parent (the launcher) dies, and exit now if
    the launcher (`launcher_pid`, when known) is already gone. Elsewhere the watchdog's parent
    check does the job."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if launcher_pid is not None and os.getppid() != launcher_pid:
        os._exit(ORPHAN_EXIT_CODE)  # the launcher died before the signal was armed


def write_error(train_dir: Path, rank: int, kind: str, message: str) -> None:
    """`kind`: `error` (raised), `hang` (watchdog, stuck in compute), `waiting` (watchdog, stuck
    waiting for a peer), `peer` (a communication error: a peer probably died), `silent` (written
    for `rank` by the watchdog of a peer that found it without a sign of life and killed it)."""
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
    """Ends the process when the heartbeat's current action exceeds `timeout_s`, SIGKILLs a
    silent rank of this host, and exits when the launcher is gone.

    `world_size` and `describe(rank)` (e.g. "rank 2 (stage 1)") name the ranks it watches."""

    def __init__(self, heartbeat: Heartbeat, timeout_s: float, train_dir: Path, rank: int, who: str,
                 world_size: int = 1, describe: Callable[[int], str] = lambda r: f"rank {r}") -> None:
        super().__init__(name="pd-watchdog", daemon=True)
        self.heartbeat = heartbeat
        self.timeout_s = timeout_s
        self.poll_s = min(1.0, timeout_s / 10)
        self.train_dir = train_dir
        self.rank = rank
        self.who = who
        self.world_size = world_size
        self.describe = describe
        self.parent_pid = os.getppid()
        self.killed: set[int] = set()
        self._stop_event = threading.Event()

    def stop_silent_peers(self, silent_s: float) -> bool:
        """SIGKILL every other rank of this host without a sign of life for `silent_s`,
        writing its error file first; True if it killed one now."""
        killed = False
        for peer in range(self.world_size):
            life = read_life(self.train_dir, peer) if peer != self.rank and peer not in self.killed else None
            if life is None or life[1] <= silent_s or not exists(life[0]):
                continue  # alive, finished, or dead (then the launcher names how it died)
            pid, quiet_s = life
            message = (f"{self.describe(peer)} sent nothing for {quiet_s:.1f} s (no sign of life: stopped or frozen; "
                       f"train.timeout_s={self.timeout_s:g}); rank {self.rank} killed it (SIGKILL); "
                       f"last: {read_status(self.train_dir, peer) or 'no action started'}")
            write_error(self.train_dir, peer, "silent", message)
            print(f"pd worker: {message}", flush=True)
            kill_process_group(pid)
            self.killed.add(peer)
            killed = True
        return killed

    def await_stuck_peers(self) -> bool:
        """Wait (at most one timeout and two polls, keeping this rank's sign of life) while another rank of this
        host stays in the compute action it is in now without an error report: it is likely stuck,
        and its own watchdog names it as the cause before this rank's wait on it (a symptom) does.
        A rank that moves on to another action, reports, or ends is not waited for. One that falls
        silent meanwhile (stopped after this rank's wait began) is killed as the cause, with its
        report (`stop_silent_peers`): True then, and this rank need not fail."""
        deadline_s = time.monotonic() + self.timeout_s + 2 * self.poll_s
        busy = {}
        for peer in range(self.world_size):
            status = read_status(self.train_dir, peer) if peer != self.rank else None
            if status and read_life(self.train_dir, peer) and not _is_waiting(_action_of(status)) \
                    and read_error(self.train_dir, peer) is None:
                busy[peer] = status
        while busy and time.monotonic() < deadline_s:
            time.sleep(0.1)
            self.heartbeat.alive()
            if self.stop_silent_peers(FROZEN_S):
                return True
            for peer, status in list(busy.items()):
                life = read_life(self.train_dir, peer)
                if life is None or not exists(life[0]) or read_error(self.train_dir, peer) is not None \
                        or read_status(self.train_dir, peer) != status:
                    del busy[peer]
        return False

    def run(self) -> None:
        while not self._stop_event.wait(self.poll_s):
            self.heartbeat.alive()
            if os.getppid() != self.parent_pid:  # the launcher is gone: nobody will stop this process
                os._exit(ORPHAN_EXIT_CODE)
            self.stop_silent_peers(self.timeout_s)
            stuck_s = time.monotonic() - self.heartbeat.started_s
            starting = self.heartbeat.action in STARTUP_ACTIONS
            if stuck_s > (max(self.timeout_s, STARTUP_MIN_TIMEOUT_S) if starting else self.timeout_s):
                waiting = _is_waiting(self.heartbeat.action)
                if waiting and self.stop_silent_peers(FROZEN_S):
                    continue  # the silent peer is the cause; its death stops the job
                if waiting and self.await_stuck_peers():
                    continue  # a peer fell silent while this rank waited for it: the cause, killed
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
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5.0)  # its last sign of life must not follow the `done` below
        self.heartbeat.alive(done=True)


def _is_waiting(action: str) -> bool:
    """`action` waits for another rank (a receive, an all-reduce, a step outside the action lists)."""
    return action.startswith(WAITING_STEPS) or waits_for_peer(action)


def _action_of(status: str) -> str:
    """The action of a `step=<n> action=<action>` status line."""
    return status.split("action=", 1)[-1]


def parse_fault(spec: str | None, rank: int) -> tuple[int, str] | None:
    """(step, mode) of the fault `FAULT_ENV` asks of `rank`, or None."""
    if not spec:
        return None
    fault_rank, step, mode = spec.split(":")
    if mode not in ("exit", "hang", "kill", "stop"):
        raise ValueError(f"{FAULT_ENV}={spec!r}: mode must be exit, hang, kill or stop")
    first_attempt = os.environ.get(RESTART_COUNT_ENV, "0") == "0"
    return (int(step), mode) if int(fault_rank) == rank and first_attempt else None


def inject_fault(mode: str) -> None:
    if mode == "exit":
        os._exit(3)
    if mode in ("kill", "stop"):
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
    if mode == "stop":
        return  # continued (SIGCONT): it trains on as if it had been slow
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

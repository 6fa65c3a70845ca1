"""Worker entry point: `python -m pdcli.runtime.worker --run-dir runs/<name>`.

Started by `pd train` (elastic launcher) or by `torchrun` as is: it reads RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT from the environment, finds its
stage and replica in the plan, runs its action list, checkpoints, and reports.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch.distributed as dist

from pdcli.runtime.checkpoint import last_good
from pdcli.runtime.divergence import Diverged
from pdcli.runtime.launch import WorkerEnv, read_plan
from pdcli.runtime.placement import Placement
from pdcli.runtime.watchdog import FROZEN_S, Heartbeat, Watchdog, die_with_parent, status_path, write_error


def rank_logger(train_dir: Path, rank: int) -> logging.Logger:
    train_dir.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"pd.rank{rank}")
    logger.setLevel(logging.INFO)
    handler = logging.FileHandler(train_dir / f"rank{rank}.log", mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s rank" + str(rank) + " %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    return logger


def is_comm_error(error: BaseException) -> bool:
    """A failed send/recv/collective: most likely a peer died (a consequence, not the cause)."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return any(w in text for w in ("gloo", "nccl", "connection", "peer", "timed out", "broken pipe"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdcli.runtime.worker")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--launcher-pid", type=int, default=None,
                        help="the process that started this worker (pd train): exit if it is gone")
    args = parser.parse_args(argv)
    die_with_parent(args.launcher_pid)
    env = WorkerEnv.from_env()
    run_dir: Path = args.run_dir
    train_dir = run_dir / "train"
    placement = Placement.from_plan(read_plan(run_dir))
    if placement.world_size != env.world_size:
        raise SystemExit(f"pd worker: the plan has {placement.world_size} ranks, WORLD_SIZE is {env.world_size}")
    stage_id, replica_id = placement.of(env.rank)
    who = f"rank {env.rank} (stage {stage_id}, replica {replica_id})"
    logger = rank_logger(train_dir, env.rank)

    from pdcli.config import load_resolved  # after the env checks: keeps `--help` fast

    cfg = load_resolved(run_dir / "config.yaml")
    heartbeat = Heartbeat(status_path(train_dir, env.rank))
    watchdog = Watchdog(heartbeat, cfg.train.timeout_s, train_dir, env.rank, who, placement.world_size,
                        describe=lambda r: f"rank {r} (stage {placement.of(r)[0]})")
    watchdog.start()
    try:
        from pdcli.runtime.session import run_session

        run_session(cfg, run_dir, placement, env, heartbeat, logger)
    except BaseException as e:  # noqa: BLE001 - report, then re-raise with the traceback
        if isinstance(e, Diverged):
            kind, message = "diverged", f"{who} diverged: {e}; last good checkpoint: {last_good(train_dir)}"
        else:
            kind = "peer" if is_comm_error(e) else "error"
            notes = "".join(f" ({note})" for note in getattr(e, "__notes__", ()))
            message = f"{who} failed in {heartbeat.action} at step {heartbeat.step}: {type(e).__name__}: {e}{notes}"
            if kind == "peer":  # a receive that timed out on a stopped peer: name and kill the cause first
                watchdog.stop_silent_peers(FROZEN_S)
        write_error(train_dir, env.rank, kind, message)
        logger.error(message)
        if kind == "peer":  # a peer stuck in compute: its watchdog's report names the cause
            watchdog.await_stuck_peers()
        raise
    finally:
        watchdog.stop()
    logger.info("done")
    return 0


def exit_now(code: int) -> None:
    """Flush and leave without the interpreter's teardown. Now and then after a complete run
    (rank logged "done", summary written) a C++ thread torch left joinable is destroyed at
    exit, `terminate called without an active exception`, SIGABRT, and the launcher would
    report a finished job as failed. Everything the worker writes is closed by now (atomic
    files, logs flushed here)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())

"""Training under a flood of junk connections, beside the same run undisturbed.

The quickstart (`recipes/quickstart.yaml`, its 2-stage plan) is profiled, planned and compiled
once; then each round trains it twice from that same start, in turn: undisturbed, and with
`--connections` junk connections (`pdcli.testing.flood.open_junk`: a third silent, a third a
few random bytes, a third a buffer of 0xff) to every TCP port the job listens on (the
rendezvous store's, torch's process group's), opened as soon as the workers listen and held
until the job ends. Per run: samples/s over the second half of the loop (`train/metrics.jsonl`;
the flood is open by then, and its own opening, this process's CPU on the same cores, is left
out) and over the whole loop (`train/summary.json`), how long opening the flood took, the exit
status, whether the final loss equals the undisturbed run's, the most threads any process of
the job had.

    .venv/bin/python benchmarks/bench_flood.py [--rounds 3] [--steps 600] [--connections 1000]

Prints a table and the median ratio flooded / undisturbed; writes `runs/benchmarks/flood.json`.
Nothing is asserted (`tests/test_multihost.py` checks the flood changes nothing it trains).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the _helpers beside this script

from tabulate import tabulate  # noqa: E402

from _pd_train import RUNS_DIR, pd_executable  # noqa: E402
from pdcli.rundir import atomic_write_json  # noqa: E402
from pdcli.runtime.watchdog import read_life  # noqa: E402
from pdcli.testing.flood import listening_tcp_ports, open_junk, threads_of  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart.yaml"
DEFAULT_OUT = Path(RUNS_DIR) / "benchmarks" / "flood.json"
NAME = "flood"
RANKS = 2
BATCH_SIZE = 64
"""The quickstart's minibatch (data.batch_size), where the summary does not say it."""
TIMEOUT_S = 600.0


def overrides(root: Path, steps: int) -> list[str]:
    return [f"run.root={root}", f"run.name={NAME}", f"train.steps={steps}", f"train.log_every={max(1, steps // 10)}",
            "train.threads_per_worker=1"]


def second_half_samples_per_s(train_dir: Path, steps: int, batch_size: int) -> tuple[float, float] | None:
    """(samples/s over the second half of the run, when that half began: time.time()), from the
    metrics' training lines (each written at the end of its interval)."""
    lines = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = sorted((int(x["step"]), float(x["time"])) for x in lines if "loss" in x and "time" in x and not x.get("final"))
    half = [(step, t) for step, t in timed if step >= steps // 2]
    if len(half) < 2:
        return None
    (a, ta), (b, tb) = half[0], half[-1]
    return (b - a) * batch_size / (tb - ta), ta


def run(base: Path, work: Path, steps: int, connections: int) -> dict[str, Any]:
    """One `pd train` from a copy of `base`, flooded with `connections` junk connections (0: none)."""
    root = work / ("flooded" if connections else "undisturbed")
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(base, root)
    train_dir = root / NAME / "train"
    proc = subprocess.Popen([str(pd_executable()), "train", str(RECIPE), *overrides(root, steps)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    junk: list[Any] = []
    most_threads, ports, opened_at, open_s = 0, [], None, None
    deadline_s = time.monotonic() + TIMEOUT_S
    try:
        while proc.poll() is None and time.monotonic() < deadline_s:
            lives = [read_life(train_dir, r) for r in range(RANKS)]
            pids = [proc.pid, *(life[0] for life in lives if life is not None)]
            if connections and not junk and len(pids) == RANKS + 1:
                ports = listening_tcp_ports(pids)
                if len(ports) > RANKS:  # the store's and each worker's
                    start_s = time.perf_counter()
                    junk = open_junk(ports, connections)
                    open_s, opened_at = time.perf_counter() - start_s, time.time()
            try:
                most_threads = max(most_threads, *(threads_of(p) for p in pids))
            except (OSError, ValueError):
                pass  # a worker just ended
            time.sleep(0.05)
        out, err = proc.communicate(timeout=max(1.0, deadline_s - time.monotonic()))
    finally:
        for s in junk:
            s.close()
        if proc.poll() is None:
            proc.kill()
    summary = json.loads((train_dir / "summary.json").read_text()) if proc.returncode == 0 else {}
    half = second_half_samples_per_s(train_dir, steps, int(summary.get("batch_size", BATCH_SIZE))) if summary else None
    return {"connections": len(junk), "ports": len(ports), "exit": proc.returncode, "open_s": open_s,
            "flood_open_in_second_half": opened_at is not None and half is not None and opened_at <= half[1],
            "samples_per_s": half[0] if half else None, "whole_loop_samples_per_s": summary.get("samples_per_s"),
            "final_loss": summary.get("final_loss"),
            "most_threads": most_threads, "error": err.strip().splitlines()[-1] if proc.returncode else None}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process's end of each connection
    with tempfile.TemporaryDirectory(prefix="pd-bench-flood-") as tmp:
        work = Path(tmp)
        base = work / "base"
        made = subprocess.run([str(pd_executable()), "compile", str(RECIPE), *overrides(base, args.steps)],
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        if made.returncode != 0:
            print(made.stderr, file=sys.stderr)
            return 1
        rows = []
        for r in range(args.rounds):
            for connections in (0, args.connections):
                row = {"round": r, **run(base, work, args.steps, connections)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    ratios = [f["samples_per_s"] / u["samples_per_s"] for u, f in zip(rows[::2], rows[1::2])
              if u["samples_per_s"] and f["samples_per_s"]]
    same_loss = all(f["final_loss"] == u["final_loss"] for u, f in zip(rows[::2], rows[1::2]))
    arms = [[row["samples_per_s"] for row in rows[k::2] if row["samples_per_s"]] for k in (0, 1)]
    medians = [statistics.median(arm) if arm else None for arm in arms]
    result = {"steps": args.steps, "connections": args.connections, "rows": rows,
              "median_ratio": statistics.median(ratios) if ratios else None,
              "median_undisturbed": medians[0], "median_flooded": medians[1],
              "ratio_of_medians": medians[1] / medians[0] if medians[0] and medians[1] else None,
              "same_final_loss": same_loss}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    print(tabulate([[row["round"], row["connections"], row["ports"], row["exit"], row["open_s"] and round(row["open_s"], 2),
                     row["samples_per_s"] and round(row["samples_per_s"]),
                     row["whole_loop_samples_per_s"] and round(row["whole_loop_samples_per_s"]),
                     row["final_loss"], row["most_threads"]] for row in rows],
                   headers=["round", "connections", "ports", "exit", "open s", "samples/s (2nd half)",
                            "samples/s (loop)", "final loss", "most threads"]))
    print(f"flooded / undisturbed samples/s (2nd half): each round {', '.join(f'{x:.3f}' for x in ratios)}, "
          f"their median {result['median_ratio']}; the arms' medians {medians[1]} / {medians[0]} = "
          f"{result['ratio_of_medians']}; the same final loss in every run: {same_loss}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

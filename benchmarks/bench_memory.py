"""Memory per stage, predicted vs measured, for every schedule on one model and split.

For `pipedream`, `2bw`, `1f1b` and `gpipe` it runs `pd train` (an MLP, a fixed split into
`--stages` stages, a few steps) and sets the planner's prediction (`plan.json`
`stages[k].predicted.*_bytes`) beside what the workers measured (`train/summary.json`
`stages[k].*_bytes`, see `pdcli.runtime.memory`), with measured / predicted ratios.

    .venv/bin/python benchmarks/bench_memory.py [--stages 3] [--width 512] [--layers 6]
        [--batch 64] [--microbatches 4] [--steps 3] [--optim sgd] [--out PATH]
        [--set train.recompute=true] [--set train.precision=bf16]

Prints a table, writes `runs/benchmarks/memory.json`. Nothing is asserted. The optimizer
state (momentum, Adam's two moments) is in both the predicted total and the measured
peak, and shown apart. `--set KEY=VALUE` (repeatable) passes an override to every run,
e.g. to compare the plan's recompute or mixed-precision prediction with the measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the _helpers beside this script

from tabulate import tabulate  # noqa: E402

from _bench_common import BenchFailed, BenchShape, run_bounded, stderr_tail, own_profiles  # noqa: E402
from _pd_train import RUNS_DIR, pd_executable, recipe  # noqa: E402
from pdcli.rundir import atomic_write_json  # noqa: E402

import yaml  # noqa: E402

DEFAULT_OUT = Path("runs") / "benchmarks" / "memory.json"
SCHEDULES = ("pipedream", "2bw", "1f1b", "gpipe")
CATEGORIES = ("weights_bytes", "stashed_weights_bytes", "activations_bytes")
PREDICTED_TOTAL, MEASURED_PEAK = "total_bytes", "peak_bytes"
OPTIMIZER_STATE = "optimizer_state_bytes"
MIB = float(1 << 20)


def memory_recipe(shape: BenchShape, num_stages: int, optim_name: str, run_root: Path) -> dict[str, Any]:
    """The runtime benchmark's MLP recipe on `num_stages` devices, with a fixed balanced split."""
    out = recipe(shape, run_root)
    out["cluster"]["levels"] = [{"devices": num_stages}]
    # chain: flatten, (linear, relu) x L, classifier -> stage k starts at 1 + 2 * (k L / S)
    boundaries = [1 + 2 * (k * shape.num_layers // num_stages) for k in range(1, num_stages)]
    out["plan"] = {"num_stages": num_stages, "straight": True, "use_fewer_devices": False, "boundaries": boundaries}
    out["optim"] = {"name": optim_name, "lr": 0.01, **({"momentum": 0.9} if optim_name == "sgd" else {})}
    out["profile"] = {"warmup": 1, "repeats": 3}
    out["train"]["threads_per_worker"] = 1
    out["train"]["log_every"] = max(1, shape.num_steps)
    return out


def run_schedule(recipe_path: Path, work_dir: Path, schedule_name: str, timeout_s: float,
                 overrides: list[str]) -> dict[str, Any]:
    """Run `pd train` with `schedule_name`; return {"plan": plan.json, "summary": summary.json}."""
    name = f"mem_{schedule_name}"
    argv = [str(pd_executable()), "train", str(recipe_path), f"schedule.name={schedule_name}", f"run.name={name}",
            *overrides]
    returncode, _, err = run_bounded(argv, timeout_s)
    if returncode != 0:
        raise BenchFailed(f"pd train {schedule_name}: exit status {returncode}: {stderr_tail(err)}")
    run_dir = work_dir / RUNS_DIR / name
    return {
        "plan": json.loads((run_dir / "plan.json").read_text()),
        "summary": json.loads((run_dir / "train" / "summary.json").read_text()),
    }


def compare(schedule_name: str, plan: dict[str, Any], summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per stage: predicted and measured bytes per category, measured / predicted."""
    measured_by_stage = {s["stage_id"]: s for s in summary["stages"]}
    rows = []
    for stage in plan["stages"]:
        k = stage["stage_id"]
        predicted, measured = stage["predicted"], measured_by_stage.get(k, {})
        row: dict[str, Any] = {"schedule": schedule_name, "stage_id": k}
        for cat in CATEGORIES:
            row[f"predicted_{cat}"] = predicted.get(cat)
            row[f"measured_{cat}"] = measured.get(cat)
            row[f"ratio_{cat}"] = ratio(measured.get(cat), predicted.get(cat))
        row["predicted_total_bytes"] = predicted.get(PREDICTED_TOTAL)
        row["measured_peak_bytes"] = measured.get(MEASURED_PEAK)
        row["measured_optimizer_state_bytes"] = measured.get(OPTIMIZER_STATE)
        row["ratio_total"] = ratio(measured.get(MEASURED_PEAK), predicted.get(PREDICTED_TOTAL))
        row["memory_source"] = measured.get("memory_source", "")
        row["weight_versions_max"] = measured.get("weight_versions_max")
        rows.append(row)
    return rows


def ratio(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or not predicted:
        return None
    return measured / predicted


def table(rows: list[dict[str, Any]]) -> str:
    def mib(v: float | None) -> str:
        return "-" if v is None else f"{v / MIB:.2f}"

    def r(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    body = []
    for row in rows:
        cells = [row["schedule"], row["stage_id"]]
        for cat in CATEGORIES:
            cells.append(f"{mib(row[f'predicted_{cat}'])} / {mib(row[f'measured_{cat}'])} ({r(row[f'ratio_{cat}'])})")
        cells.append(mib(row["measured_optimizer_state_bytes"]))
        cells.append(f"{mib(row['predicted_total_bytes'])} / {mib(row['measured_peak_bytes'])} ({r(row['ratio_total'])})")
        body.append(cells)
    headers = ["schedule", "stage", "weights MiB pred/meas (x)", "stashed MiB pred/meas (x)",
               "activations MiB pred/meas (x)", "optimizer MiB meas", "total pred / peak meas (x)"]
    return tabulate(body, headers=headers, disable_numparse=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--optim", choices=("sgd", "adam"), default="sgd", help="sgd runs with momentum 0.9")
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per schedule")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a pd override for every run, e.g. train.recompute=true (repeatable)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    own_profiles()  # fresh profiles, not copies of an earlier run's
    try:
        shape = BenchShape(args.width, args.layers, args.batch, args.microbatches, args.steps, 0)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not 2 <= args.stages <= args.layers:
        print(f"error: --stages must be in [2, --layers={args.layers}], got {args.stages}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="pd-bench-memory-") as tmp:
        work_dir = Path(tmp)
        recipe_path = work_dir / "bench_memory.yaml"
        recipe_path.write_text(yaml.safe_dump(memory_recipe(shape, args.stages, args.optim, work_dir / RUNS_DIR), sort_keys=False))
        for name in args.schedules:
            print(f"pd train {name} ...", file=sys.stderr, flush=True)
            try:
                got = run_schedule(recipe_path, work_dir, name, args.timeout_s, args.overrides)
            except BenchFailed as exc:
                failures[name] = str(exc)
                print(f"  unavailable: {exc}", file=sys.stderr)
                continue
            rows.extend(compare(name, got["plan"], got["summary"]))
    print(
        f"MLP {shape.num_layers} x {shape.width}, batch {shape.batch_size}, {shape.num_microbatches} microbatches, "
        f"{args.stages} stages, {args.optim}{''.join(', ' + o for o in args.overrides)}; "
        "MiB predicted / measured (measured / predicted)"
    )
    print(table(rows))
    for name, reason in failures.items():
        print(f"{name}: unavailable: {reason}")
    result = {"shape": vars(args) | {"out": str(args.out)}, "rows": rows, "failures": failures}
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

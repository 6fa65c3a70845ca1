"""Prediction accuracy: the plan's predicted time per minibatch and per-stage time vs what `pd train` measured.

For a few recipes: `pd train RECIPE train.steps=N run.root=<tmp>` in a subprocess (profile,
plan, compile, train), then the run is read with `pd report`'s library (`pdcli.report`):
predicted vs measured time per minibatch (steady state, from the trace), their ratio, and
per stage the plan's stage_time_ms vs the measured compute + comm, with where the measured
compute goes (forward, backward, optimizer step). Prints a table and writes
`runs/benchmarks/prediction.json`. Nothing is asserted.

`calib` is the profile's `meta.calibration.ratio` (whole fwd+bwd step / sum of the layers;
the `pd` cost model multiplies forward and backward by max(1, ratio), see costs.py) and
what measured / predicted would be without it: per stage compute / max(1, ratio) +
optimizer + sync, times the plan's bubble factor (an estimate: the split is kept).

    .venv/bin/python benchmarks/bench_prediction.py [--recipes quickstart resnet18 ...] [--steps N] [--rounds R]

Each recipe is trained `--rounds` times in the same run directory (the profile and plan are
made once, so the prediction is the same); the row shown is the round with the (lower)
median measured time per minibatch, and the range over rounds is shown beside it. On a
shared host the measured times move with the load, so look at the range, not one number.
About 2.5 minutes on a quiet 2-core host (5 under heavy load).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _bench_common import BenchFailed, run_bounded, stderr_tail  # noqa: E402

from pdcli.planner.costs import compute_calibration  # noqa: E402
from pdcli.report import ReplanCommands, make_report  # noqa: E402
from pdcli.rundir import atomic_write_json  # noqa: E402

OUT = REPO / "runs" / "benchmarks" / "prediction.json"
PD = Path(sys.executable).parent / "pd"
RECIPE_STEPS = {"quickstart": 150, "resnet18": 16, "gnmt": 30, "gpt": 24, "vgg16": 6}
"""Minibatches per recipe: enough for a steady state (the second half is timed), small enough
that the four runs (profiling included) take a few minutes on a shared 2-core host."""
TRAIN_TIMEOUT_S = 240.0
DEFAULT_ROUNDS = 2
DRIFT_THRESHOLD_PCT = 25.0


def run_recipe(name: str, steps: int, root: Path) -> dict[str, Any]:
    """Train `recipes/<name>.yaml` for `steps` minibatches under `root`; the prediction row."""
    recipe = REPO / "recipes" / f"{name}.yaml"
    overrides = [f"train.steps={steps}", f"train.log_every={max(1, steps // 4)}", f"run.root={root}"]
    start_s = time.perf_counter()
    code, _, err = run_bounded([str(PD), "train", str(recipe), *overrides], TRAIN_TIMEOUT_S)
    if code != 0:
        raise BenchFailed(f"pd train exit status {code}: {stderr_tail(err)}")
    wall_s = time.perf_counter() - start_s
    run_dir = root / name
    c = make_report(run_dir, ReplanCommands(str(recipe), tuple(overrides)), DRIFT_THRESHOLD_PCT, charts=False).comparison
    m, p = c.measured, c.predicted
    measured_ms = m.steady_time_per_minibatch_ms or m.time_per_minibatch_ms
    plan = json.loads((run_dir / "plan.json").read_text())
    profile_meta = json.loads((run_dir / "profile.json").read_text())["meta"]
    ratio = (profile_meta.get("calibration") or {}).get("ratio") or 1.0
    terms = [st["predicted"] for st in plan["stages"]]
    bubble = p.time_per_minibatch_ms / max(t["stage_time_ms"] for t in terms)
    factor = compute_calibration(ratio)
    uncalibrated_ms = bubble * max(t["compute_ms"] / factor + t.get("optimizer_ms", 0.0) + t["sync_ms"] for t in terms)
    return {
        "recipe": name, "schedule": m.schedule, "num_stages": len(c.stages), "steps": steps, "wall_s": wall_s,
        "predicted_time_per_minibatch_ms": p.time_per_minibatch_ms,
        "simulated_time_per_minibatch_ms": p.simulated_time_per_minibatch_ms,
        "measured_time_per_minibatch_ms": measured_ms,
        "measured_loop_time_per_minibatch_ms": m.time_per_minibatch_ms,
        "ratio": measured_ms / p.time_per_minibatch_ms if p.time_per_minibatch_ms > 0 else None,
        "calibration_ratio": ratio, "uncalibrated_time_per_minibatch_ms": uncalibrated_ms,
        "uncalibrated_ratio": measured_ms / uncalibrated_ms if uncalibrated_ms > 0 else None,
        "predicted_bubble": p.bubble_fraction,
        "stages": [
            {"stage_id": s.stage_id, "predicted_stage_time_ms": s.predicted.stage_time_ms,
             "measured_stage_time_ms": s.measured.stage_time_ms, "predicted_fwd_ms": s.predicted.fwd_ms,
             "predicted_bwd_ms": s.predicted.bwd_ms, "predicted_optimizer_ms": terms[s.stage_id].get("optimizer_ms"),
             "measured_compute_ms": s.measured.compute_ms,
             "measured_comm_ms": s.measured.comm_ms, "measured_idle_ms": s.measured.idle_ms,
             "measured_bubble": s.measured.bubble_fraction, "measured_actions_ms": s.measured.actions_ms}
            for s in c.stages
        ],
    }


def _stage_cell(row: dict[str, Any], key: str, fmt: str = "{:.2f}") -> str:
    return " | ".join(fmt.format(s[key]) if s.get(key) is not None else "-" for s in row["stages"])


def _action_cell(row: dict[str, Any], action: str) -> str:
    return " | ".join(f"{s['measured_actions_ms'].get(action, 0.0):.2f}" for s in row["stages"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPE_STEPS), help="recipe names under recipes/")
    parser.add_argument("--steps", type=int, default=None, help="minibatches per recipe (default: per recipe)")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="trainings per recipe")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pd-bench-prediction-") as tmp:
        for name in args.recipes:
            steps = args.steps or RECIPE_STEPS.get(name, 10)
            rounds: list[dict[str, Any]] = []
            try:
                for round_index in range(max(1, args.rounds)):
                    print(f"{name}: pd train, {steps} minibatches, round {round_index + 1} ...", file=sys.stderr, flush=True)
                    rounds.append(run_recipe(name, steps, Path(tmp)))
            except BenchFailed as e:
                rows.append({"recipe": name, "error": str(e)})
                continue
            rounds.sort(key=lambda r: r["measured_time_per_minibatch_ms"])
            times = [r["measured_time_per_minibatch_ms"] for r in rounds]
            rows.append({**rounds[(len(rounds) - 1) // 2], "measured_range_ms": [times[0], times[-1]], "rounds": rounds})
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["recipe"], "-", "-", "-", "-", "-", "-", "-", f"failed: {r['error']}", "", "", "", "", ""])
            continue
        table.append([
            r["recipe"], r["schedule"], r["num_stages"], f"{r['predicted_time_per_minibatch_ms']:.2f}",
            f"{r['measured_time_per_minibatch_ms']:.2f}", "{:.2f}-{:.2f}".format(*r["measured_range_ms"]), f"{r['ratio']:.2f}x",
            f"{r['calibration_ratio']:.2f}: {r['uncalibrated_ratio']:.2f}x",
            _stage_cell(r, "predicted_stage_time_ms"), _stage_cell(r, "measured_stage_time_ms"),
            _stage_cell(r, "predicted_fwd_ms") + " / " + _stage_cell(r, "predicted_bwd_ms"),
            _action_cell(r, "Forward") + " / " + _action_cell(r, "Backward"),
            _stage_cell(r, "predicted_optimizer_ms"), _action_cell(r, "OptimizerStep"),
        ])
    print(tabulate(table, headers=[
        "recipe", "schedule", "stages", "pred ms/mb", "meas ms/mb", "meas range", "meas/pred",
        "calib: uncalibrated meas/pred", "pred stage ms", "meas stage ms", "pred fwd / bwd", "meas fwd / bwd", "pred optim", "meas optim",
    ], disable_numparse=True))
    print("\nms per minibatch (data.batch_size samples); stage columns list stages 0 | 1 | ...; "
          "measured stage time = compute + comm; measured time per minibatch = steady state from the trace")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(OUT, {"rows": rows})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

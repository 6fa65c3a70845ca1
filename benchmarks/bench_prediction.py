"""Prediction accuracy: what `pd plan` predicts against what `pd train` measures, three cost models side by side.

For every case (each recipe with its own schedule, the quickstart with every schedule, the
runtime benchmark's shape; with `--every-schedule` each recipe under each of pipedream, 2bw,
1f1b and gpipe too): `pd train` in a subprocess (profile with the runtime probe,
plan, compile, train), then the run is read with `pd report`'s library. For the same run
(the same stages) three predictions of the steady time per minibatch:

- `profile`: the cost model of the per-layer profile alone (`profile.runtime_probe=false`:
  layer times, the calibration ratio, the optimizer, nominal bandwidth) - the model before
  the runtime probe;
- `probe`: the runtime's measured costs (`meta.runtime`, the plan the run trained with);
- `calibrated`: the probe's costs refitted from the PREVIOUS round's run of the same case
  (`pd plan --calibrate`), so each is predicted from a run it has not seen (rounds >= 2).

and per stage the compute measured against the `probe` plan's (in CPU time where the workers
share cores, as `pd report` compares it), and how much slower the host's reference matmul ran
after the run than when its profile was measured (`pd report`'s host line; the probe's error is
also shown with each run's time divided by it). Measured / predicted is the
ratio shown; mean |error| closes each column. Later rounds train the same plan again from the
same profile (`pd train` keeps what is not stale); with two rounds or more each case's median
measured / probe over its rounds closes the output, the run-to-run noise beside it. Writes
`runs/benchmarks/prediction.json`; nothing is asserted.

    .venv/bin/python benchmarks/bench_prediction.py [--cases quickstart gpt ...] [--every-schedule] [--rounds R]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _bench_common import BenchFailed, run_bounded, stderr_tail, own_profiles  # noqa: E402
from _trained import AS_PLANNED  # noqa: E402

from pdcli.planner.evaluate import evaluate_plan  # noqa: E402
from pdcli.planner.runtime_costs import RUNTIME_META, RuntimeCosts  # noqa: E402
from pdcli.profiler.chain import Chain  # noqa: E402
from pdcli.report import ReplanCommands, make_report  # noqa: E402
from pdcli.report.calibrate import calibrate_from_run, replayed_ms  # noqa: E402
from pdcli.rundir import atomic_write_json  # noqa: E402

OUT = REPO / "runs" / "benchmarks" / "prediction.json"
PD = Path(sys.executable).parent / "pd"
RUNTIME_SHAPE = (
    "model.kwargs.in_features=1024", "model.kwargs.hidden=1024", "data=synthetic_images", "data.kwargs.channels=1024",
    "data.kwargs.image_size=1", "data.batch_size=256", "schedule.num_microbatches=8", "plan.boundaries=[9]",
    "train.threads_per_worker=1", "optim.lr=0.01",
)
"""`benchmarks/bench_runtime.py`'s small section: MLP 8 x 1024, 8 microbatches of 32 rows, its split."""
CASES: dict[str, tuple[str, tuple[str, ...], int]] = {
    "quickstart": ("quickstart", (), 2700),
    "quickstart-1f1b": ("quickstart", ("schedule.name=1f1b",), 2700),
    "quickstart-gpipe": ("quickstart", ("schedule.name=gpipe",), 2700),
    "quickstart-2bw": ("quickstart", ("schedule.name=2bw",), 2700),
    "quickstart-interleaved": ("quickstart", ("schedule.name=interleaved", "schedule.virtual_stages=2"), 2700),
    "gpt": ("gpt", (), 480),
    "resnet18": ("resnet18", (), 210),
    "inception": ("inception", (), 135),
    "gnmt": ("gnmt", (), 780),
    "vgg16": ("vgg16", (), 450),
    "gpt2_hf": ("gpt2_hf", ("train.eval_every=0", "train.eval_at_start=false"), 750),
    "llama_hf": ("llama_hf", ("train.eval_every=0", "train.eval_at_start=false"), 630),
    "runtime-shape": ("quickstart", RUNTIME_SHAPE, 120),
}
"""Case -> (recipe, overrides, minibatches): the timed second half lasts about 8 s on this host
(a half-second window moved the same plan's time by 5-12% from run to run, a 3-second one by up
to 7%: a short run samples the host's level as well as the plan's)."""
OTHER_SCHEDULES = ("pipedream", "2bw", "1f1b", "gpipe")
"""`--every-schedule`: each recipe (the quickstart has its cases) also under each of these
it does not name itself, as `<recipe>-<schedule>`."""


def every_schedule_cases() -> dict[str, tuple[str, tuple[str, ...], int]]:
    """Each recipe of CASES under each of OTHER_SCHEDULES but its own (`--every-schedule`)."""
    import yaml

    out: dict[str, tuple[str, tuple[str, ...], int]] = {}
    for name, (recipe_name, extra, steps) in CASES.items():
        if name != recipe_name or recipe_name == "quickstart":
            continue
        own = yaml.safe_load((REPO / "recipes" / f"{recipe_name}.yaml").read_text())["schedule"]["name"]
        for schedule in OTHER_SCHEDULES:
            if schedule != own:
                out[f"{recipe_name}-{schedule}"] = (recipe_name, (*extra, f"schedule.name={schedule}"), steps)
    return out
TRAIN_TIMEOUT_S = 300.0
DEFAULT_ROUNDS = 2
DRIFT_THRESHOLD_PCT = 25.0


def profile_model_ms(chain: Chain, plan: dict[str, Any]) -> float | None:
    """The plan's stages priced by the per-layer profile's model (no runtime costs; None for
    virtual stages, which only the replay prices)."""
    if int(plan["inputs"].get("virtual_stages", 1)) > 1:
        return None
    meta = {k: v for k, v in chain.meta.items() if k != RUNTIME_META}
    return evaluate_plan(dataclasses.replace(chain, meta=meta), plan).time_per_minibatch_ms


def run_case(name: str, case: tuple[str, tuple[str, ...], int], root: Path, previous: Path | None) -> dict[str, Any]:
    """Train case `name` ((recipe, overrides, minibatches)) under `root`; its row (`previous`: a
    copy of the last round's run)."""
    recipe_name, extra, steps = case
    recipe = REPO / "recipes" / f"{recipe_name}.yaml"
    overrides = [AS_PLANNED, *extra, f"run.name={name}", f"train.steps={steps}", f"train.log_every={max(1, steps // 4)}",
                 f"run.root={root}"]
    start_s = time.perf_counter()
    code, _, err = run_bounded([str(PD), "train", str(recipe), *overrides], TRAIN_TIMEOUT_S)
    if code != 0:
        raise BenchFailed(f"pd train exit status {code}: {stderr_tail(err)}")
    wall_s = time.perf_counter() - start_s
    run_dir = root / name
    c = make_report(run_dir, ReplanCommands(str(recipe), tuple(overrides)), DRIFT_THRESHOLD_PCT, charts=False).comparison
    measured_ms = c.measured.steady_time_per_minibatch_ms or c.measured.time_per_minibatch_ms
    plan = json.loads((run_dir / "plan.json").read_text())
    chain = Chain.from_json(json.loads((run_dir / "profile.json").read_text()))
    probe_ms = c.predicted.time_per_minibatch_ms
    row: dict[str, Any] = {
        "case": name, "schedule": c.measured.schedule, "num_stages": len(c.stages), "steps": steps, "wall_s": wall_s,
        "measured_ms": measured_ms, "profile_ms": profile_model_ms(chain, plan), "probe_ms": probe_ms,
        "calibrated_ms": None, "drift_warning": c.drift is not None, "host_ratio": c.host_speed_ratio,
        "shared_cores": c.predicted.shared_cores,
        "stages": [{"stage_id": s.stage_id, "predicted_compute_ms": s.predicted.compute_ms,
                    "measured_compute_ms": s.measured.compute_ms, "measured_actions_ms": s.measured.actions_ms,
                    "predicted_compute_cpu_ms": s.predicted.compute_cpu_ms,
                    "measured_compute_cpu_ms": s.measured.compute_cpu_ms,
                    "compute_ratio": 1.0 + s.compute_drift_pct / 100.0 if s.compute_drift_pct is not None else None,
                    "measured_comm_ms": s.measured.comm_ms, "predicted_comm_ms": s.predicted.comm_ms,
                    "stage_time_drift_pct": s.stage_time_drift_pct}
                   for s in c.stages],
    }
    base = RuntimeCosts.from_meta(chain.meta)
    if previous is not None and base is not None:
        calibrated, _ = calibrate_from_run(previous, chain, base)
        row["calibrated_ms"] = replayed_ms(calibrated, chain, plan)
    return row


def _ratio(row: dict[str, Any], key: str) -> float | None:
    value = row.get(key)
    return row["measured_ms"] / value if value else None


def over_rounds(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The cases measured in two rounds or more: per case the median of its rounds' measured /
    probe ratios and their range; over them the host's noise (the mean |measured / mean of its
    case's rounds - 1|, what a perfect prediction of that mean would score run by run), the
    probe's mean error against each case's median, and how many medians are within 0.9-1.1
    (None: no case has two rounds)."""
    by_case: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if "error" not in r:
            by_case.setdefault(r["case"], []).append(r)
    spread: list[float] = []
    cases: dict[str, dict[str, float]] = {}
    for name, runs in by_case.items():
        if len(runs) < 2:
            continue
        mean_ms = statistics.mean(r["measured_ms"] for r in runs)
        spread.extend(abs(r["measured_ms"] / mean_ms - 1.0) for r in runs)
        ratios = [q for r in runs if (q := _ratio(r, "probe_ms")) is not None]
        cases[name] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    if not cases:
        return None
    errors = [abs(c["median"] - 1.0) for c in cases.values()]
    return {"spread_pct": statistics.mean(spread) * 100, "median_error_pct": statistics.mean(errors) * 100,
            "medians_within_10pct": sum(e <= 0.1 for e in errors), "cases": cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    every = every_schedule_cases()
    cases = {**CASES, **every}
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=[*CASES, *every])
    parser.add_argument("--every-schedule", action="store_true",
                        help=f"also each recipe under each of {', '.join(OTHER_SCHEDULES)} it does not name itself")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="trainings per case (>= 2 for `calibrated`)")
    args = parser.parse_args()
    own_profiles()  # fresh profiles, not copies of an earlier run's
    if args.every_schedule:
        args.cases = [*args.cases, *(c for c in every if c not in args.cases)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pd-bench-prediction-") as tmp:
        root, kept = Path(tmp) / "runs", Path(tmp) / "previous"
        for round_index in range(max(1, args.rounds)):  # rounds outermost: a slow spell hits every case
            for name in args.cases:
                print(f"{name}: round {round_index + 1} ...", file=sys.stderr, flush=True)
                previous = kept / name if (kept / name).exists() else None
                try:
                    row = run_case(name, cases[name], root, previous)
                except BenchFailed as e:
                    rows.append({"case": name, "round": round_index, "error": str(e)})
                    continue
                rows.append({**row, "round": round_index})
                print(f"  measured {row['measured_ms']:.2f} ms, probe {row['probe_ms']:.2f} ms, stage compute "
                      + " | ".join(f"{s['compute_ratio']:.2f}" for s in row["stages"]),
                      file=sys.stderr, flush=True)
                if (kept / name).exists():
                    shutil.rmtree(kept / name)
                shutil.copytree(root / name, kept / name)
    table: list[list[Any]] = []
    errors: dict[str, list[float]] = {"profile_ms": [], "probe_ms": [], "calibrated_ms": []}
    host_adjusted: list[float] = []  # the probe's error where the host's level moved between profile and run
    for r in rows:
        if "error" in r:
            table.append([r["case"], r["round"] + 1, "-", "-", f"failed: {r['error']}"])
            continue
        ratios = {k: _ratio(r, k) for k in errors}
        for k, v in ratios.items():
            if v is not None:
                errors[k].append(abs(v - 1.0))
        host = r.get("host_ratio")
        if host and ratios["probe_ms"] is not None:
            host_adjusted.append(abs(ratios["probe_ms"] / host - 1.0))
        table.append([
            r["case"], r["round"] + 1, r["schedule"], r["num_stages"], f"{r['measured_ms']:.2f}",
            f"{r['profile_ms']:.2f} ({ratios['profile_ms']:.2f}x)" if r["profile_ms"] else "-",
            f"{r['probe_ms']:.2f} ({ratios['probe_ms']:.2f}x)",
            f"{r['calibrated_ms']:.2f} ({ratios['calibrated_ms']:.2f}x)" if r["calibrated_ms"] else "-",
            " | ".join(f"{s['compute_ratio']:.2f}" for s in r["stages"]) + (" (CPU)" if r.get("shared_cores") else ""),
            "yes" if r["drift_warning"] else "no", f"{host:.2f}x" if host else "-",
        ])
    print(tabulate(table, headers=["case", "round", "schedule", "stages", "measured ms/mb", "profile model",
                                   "runtime probe", "calibrated (previous round)", "stage compute meas/pred",
                                   "drift warning", "host run / profile"], disable_numparse=True))
    summary = {k: statistics.mean(v) * 100 if v else None for k, v in errors.items()}
    print("\nmean |measured / predicted - 1|: " + ", ".join(
        f"{k.removesuffix('_ms')} {v:.1f}%" for k, v in summary.items() if v is not None))
    adjusted = statistics.mean(host_adjusted) * 100 if host_adjusted else None
    if adjusted is not None:
        print(f"the probe's with each run's time divided by how much slower the host's reference matmul ran after it "
              f"than when its profile was measured (`pd report`'s host line): {adjusted:.1f}%")
    noise = over_rounds(rows)
    if noise is not None:
        print("\nover the rounds, measured / runtime probe per case: median (range)")
        print(tabulate([[name, f"{c['median']:.2f}x", f"{c['min']:.2f}-{c['max']:.2f}"]
                        for name, c in noise["cases"].items()], headers=["case", "median", "rounds"],
                       disable_numparse=True))
        print(f"run to run: a case's measured time differs from the mean of its rounds by {noise['spread_pct']:.1f}% "
              f"on average; the probe against each case's median: {noise['median_error_pct']:.1f}%, "
              f"{noise['medians_within_10pct']} of {len(noise['cases'])} medians within 0.9-1.1")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(OUT, {"rows": rows, "mean_abs_error_pct": summary, "probe_host_adjusted_pct": adjusted,
                            "over_rounds": noise})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

"""The configuration search, trained: does `pd plan`'s choice of schedule and microbatches hold?

For each case `pd plan --pareto` (the schedule, its microbatches and recompute searched with
the partition) prints the Pareto front; then the chosen point, the point `plan.max_staleness=0` chooses (the best
flush configuration), the case's listed configurations and (for the recipes) the front's
other points up to `--top` are each trained for a short run with the configuration fixed
(and, where a plan on the front has more workers than the host has cores, the choice of the
same search over as many devices as cores: the best plan that gives each worker a core, which
the front's first points may not hold)
(`schedule.*`, `train.recompute`, `plan.boundaries`, `plan.replicas`), interleaved over rounds, and their
steady time per minibatch is measured as `pd report` reads it. Printed: predicted beside
measured for every configuration, the chosen one's gap to the best measured, and the flush
choice's gap to the best measured flush configuration. Writes `runs/benchmarks/pareto.json`;
nothing is asserted.

    .venv/bin/python benchmarks/bench_pareto.py [--cases runtime-shape gpt vgg16] [--rounds R] [--top K]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _bench_common import BenchFailed, own_profiles  # noqa: E402
from _trained import pd_command, run_cases, steady_ms  # noqa: E402
from bench_prediction import RUNTIME_SHAPE  # noqa: E402

from pdcli.host import host_cores  # noqa: E402
from pdcli.planner import Topology, plan_chain  # noqa: E402
from pdcli.planner.evaluate import plan_options_of  # noqa: E402
from pdcli.profiler.batch_points import chain_at_precision, chain_at_rows  # noqa: E402
from pdcli.profiler.chain import Chain  # noqa: E402
from pdcli.rundir import atomic_write_json  # noqa: E402

OUT = REPO / "runs" / "benchmarks" / "pareto.json"
TIMEOUT_S = 900.0
STEADY_S = 2.0
"""Each trained point runs long enough that its timed second half lasts about this long by its
prediction (`minibatches_for`), so that a slow spell of the host's lasting a second or two
moves its time by a fraction, not wholly."""
Point = tuple[str, int, bool, bool, str, tuple[int, ...], tuple[int, ...]]
"""(schedule, microbatches, split backward, recompute, precision, boundaries, replicas)."""
SHAPE = tuple(o for o in RUNTIME_SHAPE if not o.startswith("schedule.num_microbatches"))
CASES: dict[str, tuple[str, tuple[str, ...], int, tuple[Point, ...]]] = {
    "runtime-shape": ("quickstart", SHAPE, 40, (
        ("pipedream", 1, False, False, "fp32", (9,), (1, 1)), ("pipedream", 8, False, False, "fp32", (9,), (1, 1)),
        ("1f1b", 4, True, False, "fp32", (9,), (1, 1)), ("1f1b", 8, True, False, "fp32", (9,), (1, 1)))),
    "gpt": ("gpt", (), 24, ()),
    "vgg16": ("vgg16", (), 30, ()),
}
"""Case -> (recipe, overrides, fewest minibatches per run (`minibatches_for`), configurations
trained besides the front's): the runtime shape's are the ones issue 19 measured by hand
(pipedream 1 x 256 and 8 x 32 rows, 1f1b 4 x 64 and 8 x 32)."""


def minibatches_for(predicted_ms: float, least: int) -> int:
    """Minibatches of a run whose second half (the steady time `pd report` reads) lasts about
    STEADY_S at `predicted_ms` per minibatch; at least `least`."""
    return max(least, 2 * math.ceil(STEADY_S * 1000.0 / max(predicted_ms, 1e-3)))


def point_of(row: dict[str, Any]) -> Point:
    return (row["schedule"], int(row["num_microbatches"]), bool(row["split_backward"]), bool(row.get("recompute")),
            str(row.get("precision", "fp32")), tuple(row["boundaries"]), tuple(row["replicas"]))


def overrides_of(point: Point) -> list[str]:
    schedule, m, split, recompute, precision, bounds, reps = point
    return [f"schedule.name={schedule}", f"schedule.num_microbatches={m}", f"train.recompute={str(recompute).lower()}",
            f"train.precision={precision}",
            f"schedule.split_backward={'true' if split else 'null' if schedule in ('pipedream', '2bw') else 'false'}",
            "plan.num_stages=null", f"plan.boundaries=[{','.join(map(str, bounds))}]",
            f"plan.replicas=[{','.join(map(str, reps))}]"]


def label(point: Point) -> str:
    schedule, m, split, recompute, precision, bounds, reps = point
    return (f"{schedule}{' (split bwd)' if split else ''}{', recompute' if recompute else ''}"
            f"{'' if precision == 'fp32' else ', ' + precision} M={m} "
            f"cuts {list(bounds)} x{list(reps)}")


def front_of(recipe: Path, root: Path, name: str, extra: tuple[str, ...], *more: str) -> dict[str, Any]:
    out = pd_command("plan", str(recipe), f"run.root={root}", f"run.name={name}-plan", *extra, *more,
                     "--pareto", "--format", "json", timeout_s=TIMEOUT_S)
    return json.loads(out)


def predict(plan_dir: Path, point: Point) -> float:
    """The search's prediction for `point` (its profile priced at the point's microbatch size)."""
    plan = json.loads((plan_dir / "plan.json").read_text())
    chain = Chain.from_json(json.loads((plan_dir / "profile.json").read_text()))
    schedule, m, split, recompute, precision, bounds, reps = point
    options = dataclasses.replace(plan_options_of(plan), schedule=schedule, num_microbatches=m, split_backward=split,
                                  recompute=recompute, precision=precision,
                                  boundaries=bounds, replicas=reps, num_stages=None,
                                  memory_bytes_per_device=plan["inputs"].get("memory_bytes_per_device"))
    topology = Topology.from_levels(plan["inputs"]["topology"]["levels"])
    rows = options.batch_size // m
    priced = chain_at_precision(chain_at_rows(chain, rows), options.precision, rows)
    return plan_chain(priced, topology, options).time_per_minibatch_ms


def run_case(name: str, rounds: int, top: int, root: Path) -> dict[str, Any]:
    recipe_name, extra, steps, listed = CASES[name]
    recipe = REPO / "recipes" / f"{recipe_name}.yaml"
    if recipe_name != "quickstart":
        extra = (*extra, "plan.num_stages=null")
    search = front_of(recipe, root, name, extra)
    flush = front_of(recipe, root, name, extra, "plan.max_staleness=0")
    predicted = {point_of(r): r for r in search["front"]}
    predicted.update({point_of(r): r for r in flush["front"]})
    chosen = point_of(search["front"][search["chosen"]])
    chosen_flush = point_of(flush["front"][flush["chosen"]])
    own_cores = None  # the choice among plans that give each worker a core, where others share them
    cores = host_cores()
    if any(sum(point_of(r)[6]) > cores for r in search["front"]):  # the chosen point is on the front
        fewer = front_of(recipe, root, f"{name}-own-cores", extra, f"cluster.levels.0.devices={cores}")
        own_cores = point_of(fewer["front"][fewer["chosen"]])
    others = [p for p in (point_of(r) for r in search["front"]) if p not in (chosen, chosen_flush)]
    trained = list(dict.fromkeys([chosen, chosen_flush, *([own_cores] if own_cores else []), *listed,
                                  *others[: max(0, top - 2)]]))
    predicted_ms = {p: predict(root / f"{name}-plan", p) for p in trained}
    minibatches = {p: minibatches_for(predicted_ms[p], steps) for p in trained}
    measured: dict[Point, list[float]] = {p: [] for p in trained}
    for round_index in range(rounds):
        for k, point in enumerate(trained):
            print(f"{name}: {label(point)}, round {round_index + 1} ...", file=sys.stderr, flush=True)
            try:
                overrides = [*extra, *overrides_of(point)]
                measured[point].append(steady_ms(recipe, root, f"{name}-{k}", minibatches[point], overrides, TIMEOUT_S))
            except BenchFailed as e:
                print(f"  failed: {e}", file=sys.stderr)
    medians = {p: statistics.median(v) for p, v in measured.items() if v}
    best = min(medians.values())
    flush_points = [p for p in medians if p[0] in ("1f1b", "gpipe")]
    best_flush = min((medians[p] for p in flush_points), default=None)
    return {
        "case": name, "front_points": len(search["front"]), "chosen": label(chosen), "chosen_flush": label(chosen_flush),
        "gap_pct": (medians[chosen] / best - 1) * 100 if chosen in medians else None,
        "flush_gap_pct": (medians[chosen_flush] / best_flush - 1) * 100
        if best_flush and chosen_flush in medians else None,
        "own_cores": label(own_cores) if own_cores else None,
        "rows": [{"config": label(p), "chosen": p == chosen, "chosen_flush": p == chosen_flush,
                  "own_cores": p == own_cores,
                  "on_front": p in predicted,
                  "predicted_ms": predicted_ms[p],
                  "peak_bytes": predicted[p]["peak_bytes"] if p in predicted else None,
                  "staleness": predicted[p]["staleness"] if p in predicted else None,
                  "measured_ms": medians.get(p), "measured_runs_ms": measured[p]} for p in trained],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--top", type=int, default=3, help="front points trained per case (chosen ones included)")
    args = parser.parse_args()
    own_profiles()  # fresh profiles, not copies of an earlier run's
    results = run_cases(args.cases, "pd-bench-pareto-", lambda name, root: run_case(name, args.rounds, args.top, root))
    for r in results:
        if "error" in r:
            print(f"\n{r['case']}: failed: {r['error']}")
            continue
        gap = f"{r['gap_pct']:+.1f}%" if r["gap_pct"] is not None else "-"
        flush_gap = f"{r['flush_gap_pct']:+.1f}%" if r["flush_gap_pct"] is not None else "-"
        print(f"\n{r['case']}: {r['front_points']} points on the front; chosen {r['chosen']} ({gap} from the best "
              f"measured); max_staleness=0 chose {r['chosen_flush']} ({flush_gap} from the best measured flush one)")
        print(tabulate([[("* " if x["chosen"] else "") + ("0 " if x["chosen_flush"] else "")
                         + ("c " if x.get("own_cores") else "") + x["config"],
                         f"{x['predicted_ms']:.2f}" + ("" if x["on_front"] else " (off the front)"),
                         f"{x['measured_ms']:.2f}" if x["measured_ms"] else "failed",
                         " ".join(f"{v:.2f}" for v in x["measured_runs_ms"])] for x in r["rows"]],
                       headers=["configuration (* chosen, 0 chosen at max_staleness=0, c chosen with a core per "
                                "worker)", "predicted ms/mb",
                                "measured ms/mb (median)", "rounds"], disable_numparse=True))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(OUT, {"results": results})
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()

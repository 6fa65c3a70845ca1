"""Planner regret: train the planner's pick and its strongest alternatives, and see whether the pick is the fastest.

Cases:
- `quickstart-splits`: every 2-stage split of the quickstart MLP (pipedream; its first and last
  Linear differ in size from the others);
- `gpt`, `resnet18`: the planner's pick and the next `--top` configurations by predicted time
  among every configuration of their cluster (stage count, split, replicas per stage that
  divide the microbatches; fewer devices too).

The run directory is profiled once per case (`pd profile`, runtime probe included); every
configuration is predicted from that profile (`pdcli.planner.evaluate.evaluate_pd`, the
plan's own replay) and trained with `plan.boundaries` / `plan.replicas` for a short run;
rounds are interleaved and the median steady time per minibatch is kept. Prints predicted
rank beside measured rank and the gap between the pick and the best measured
configuration, by the medians, by each configuration's fastest round (the host's slow spells
only ever slow a run down), and within each round; writes `runs/benchmarks/planner_regret.json`.
Nothing is asserted.

    .venv/bin/python benchmarks/bench_planner_regret.py [--cases ...] [--rounds 2] [--top 4]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Iterator

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _bench_common import own_profiles  # noqa: E402
from _trained import pd_command, run_cases, steady_ms  # noqa: E402

from pdcli.planner.evaluate import batch_scale, evaluate_pd, plan_options_of  # noqa: E402
from pdcli.planner.space import SplitSpace  # noqa: E402
from pdcli.planner.topology import Topology  # noqa: E402
from pdcli.profiler.chain import Chain  # noqa: E402
from pdcli.rundir import atomic_write_json  # noqa: E402

OUT = REPO / "runs" / "benchmarks" / "planner_regret.json"
CASES: dict[str, tuple[str, int, bool, tuple[str, ...]]] = {
    "quickstart-splits": ("quickstart", 600, True, ()),
    "gpt": ("gpt", 100, False, ()),
    "resnet18": ("resnet18", 50, False, ("cluster.levels.0.devices=2", "plan.straight=false")),
}
"""Case -> (recipe, minibatches per training, every 2-stage split instead of the top-k, overrides);
a timed second half of about 2 s (the same plan's half-second windows moved 5-12% run to run)."""
TIMEOUT_S = 300.0
Config = tuple[tuple[int, int, int], ...]
"""(start, end, replicas) per stage."""


def configurations(n: int, devices: int, num_microbatches: int) -> Iterator[Config]:
    """Every contiguous split of n positions into stages with replicas dividing the
    microbatches, on at most `devices` devices."""
    divisors = [r for r in range(1, devices + 1) if num_microbatches % r == 0]
    for k in range(1, min(n, devices) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            edges = (0, *cuts, n)
            for reps in itertools.product(divisors, repeat=k):
                if sum(reps) <= devices:
                    yield tuple((a, b, r) for a, b, r in zip(edges, edges[1:], reps))


def overrides_of(config: Config) -> list[str]:
    bounds = ",".join(str(a) for a, _, _ in config[1:])
    reps = ",".join(str(r) for _, _, r in config)
    return ["plan.num_stages=null", f"plan.boundaries=[{bounds}]", f"plan.replicas=[{reps}]"]


def label(config: Config) -> str:
    return " ".join(f"[{a}:{b})" + (f"x{r}" if r > 1 else "") for a, b, r in config)


def predict_all(run_dir: Path, every_split: bool) -> tuple[dict[Config, float], Config]:
    """Predicted time per minibatch of every configuration, and the planner's pick."""
    chain = Chain.from_json(json.loads((run_dir / "profile.json").read_text()))
    plan = json.loads((run_dir / "plan.json").read_text())
    options = plan_options_of(plan)
    topology = Topology.from_levels(plan["inputs"]["topology"]["levels"])
    space, scale = SplitSpace.from_chain(chain), batch_scale(chain.meta, options)
    n = space.num_positions
    configs = ([((0, b, 1), (b, n, 1)) for b in range(1, n)] if every_split
               else configurations(n, topology.num_devices, options.num_microbatches))
    predicted = {c: evaluate_pd(space, topology, options, scale, list(c)).time_per_minibatch_ms for c in configs}
    pick = tuple((int(s["start"]), int(s["end"]), int(s["replicas"])) for s in plan["stages"])
    return predicted, pick


def run_case(name: str, rounds: int, top: int, root: Path) -> dict[str, Any]:
    recipe_name, steps, every_split, extra = CASES[name]
    recipe = REPO / "recipes" / f"{recipe_name}.yaml"
    # profile (with the runtime probe) and the pick; the stage count is the planner's too
    pd_command("plan", str(recipe), f"run.root={root}", f"run.name={name}", *extra,
               *([] if every_split else ["plan.num_stages=null"]), timeout_s=TIMEOUT_S)
    predicted, pick = predict_all(root / name, every_split)
    ranked = sorted(predicted, key=lambda c: predicted[c])
    chosen = ranked if every_split else [pick, *[c for c in ranked if c != pick][: top - 1]]
    measured: dict[Config, list[float]] = {c: [] for c in chosen}
    for round_index in range(rounds):
        for config in chosen:
            print(f"{name}: {label(config)}, round {round_index + 1} ...", file=sys.stderr, flush=True)
            measured[config].append(steady_ms(recipe, root, name, steps, [*extra, *overrides_of(config)], TIMEOUT_S))
    medians = {c: statistics.median(v) for c, v in measured.items()}
    measured_rank = {c: i + 1 for i, c in enumerate(sorted(chosen, key=lambda c: medians[c]))}
    predicted_rank = {c: i + 1 for i, c in enumerate(ranked)}
    best = min(medians.values())
    fastest = {c: min(v) for c, v in measured.items()}
    return {
        "case": name, "pick": label(pick), "gap_pct": (medians[pick] / best - 1.0) * 100 if pick in medians else None,
        "fastest_round_gap_pct": (fastest[pick] / min(fastest.values()) - 1.0) * 100 if pick in fastest else None,
        "round_gaps_pct": [(measured[pick][i] / min(v[i] for v in measured.values()) - 1.0) * 100
                           for i in range(rounds)] if pick in measured else [],
        "rows": [{"config": label(c), "predicted_ms": predicted[c], "predicted_rank": predicted_rank[c],
                  "measured_ms": medians[c], "measured_rank": measured_rank[c], "measured_runs_ms": measured[c],
                  "pick": c == pick} for c in sorted(chosen, key=lambda c: predicted[c])],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--top", type=int, default=4, help="configurations trained per top-k case")
    args = parser.parse_args()
    own_profiles()  # fresh profiles, not copies of an earlier run's
    results = run_cases(args.cases, "pd-bench-regret-", lambda name, root: run_case(name, args.rounds, args.top, root))
    for r in results:
        if "error" in r:
            print(f"\n{r['case']}: failed: {r['error']}")
            continue
        print(f"\n{r['case']}: the planner picks {r['pick']}; measured gap to the best: {r['gap_pct']:+.1f}% "
              f"(medians), {r['fastest_round_gap_pct']:+.1f}% (fastest rounds); within each round: "
              + " ".join(f"{g:+.1f}%" for g in r["round_gaps_pct"]))
        print(tabulate([[("* " if x["pick"] else "") + x["config"], f"{x['predicted_ms']:.2f}", x["predicted_rank"],
                         f"{x['measured_ms']:.2f}", x["measured_rank"],
                         " ".join(f"{v:.2f}" for v in x["measured_runs_ms"])] for x in r["rows"]],
                       headers=["configuration (* = pick)", "predicted ms/mb", "pred rank", "measured ms/mb (median)",
                                "meas rank", "rounds"], disable_numparse=True))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(OUT, {"results": results})
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()

"""Planner benchmark: our search vs PipeDream's optimizer on PipeDream's own profiles.

For every shared profile x cluster (../shared/pipedream-profiles/expected.json): planning
time with `cost_model=pipedream` and `cost_model=pd` (median of a few repeats, after
importing the graph once), our predicted time per minibatch under each, PipeDream's optimum
and the wall time PipeDream's optimizer took. Prints a table and writes
`runs/benchmarks/planner.json`. Nothing is asserted.

    .venv/bin/python benchmarks/bench_planner.py [--repeats N] [--schedule pipedream]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdcli.planner import PlanOptions, Topology, plan_chain  # noqa: E402
from pdcli.profiler.graphtxt import graph_to_chain, load_graph  # noqa: E402
from pdcli.rundir import atomic_write_json  # noqa: E402

PROFILES_DIR = REPO.parent / "shared" / "pipedream-profiles"
OUT = REPO / "runs" / "benchmarks" / "planner.json"
MS_PER_S = 1000.0


def time_plan(chain: Any, topology: Topology, options: PlanOptions, repeats: int) -> tuple[float, float]:
    """(median planning seconds, predicted ms per minibatch)."""
    walls, predicted = [], 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_chain(chain, topology, options)
        walls.append(time.perf_counter() - start)
        predicted = plan.time_per_minibatch_ms
    return statistics.median(walls), predicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--schedule", default="pipedream", help="schedule for the pd cost model")
    parser.add_argument("--num-microbatches", type=int, default=4, help="for the pd cost model")
    args = parser.parse_args()
    if not (PROFILES_DIR / "expected.json").exists():
        sys.exit(f"no profiles at {PROFILES_DIR}")
    expected = json.loads((PROFILES_DIR / "expected.json").read_text())
    rows, records = [], []
    for name, profile in sorted(expected["profiles"].items()):
        start = time.perf_counter()
        chain = graph_to_chain(load_graph(PROFILES_DIR / profile["graph"]))
        import_s = time.perf_counter() - start
        for cluster, case in sorted(profile["optima"].items()):
            topology = Topology.from_levels(case["levels"])
            straight = case["straight_pipeline"]
            ours_s, ours_ms = time_plan(chain, topology, PlanOptions(cost_model="pipedream", straight=straight), args.repeats)
            pd_options = PlanOptions(cost_model="pd", schedule=args.schedule, straight=straight,
                                     num_microbatches=args.num_microbatches)
            pd_s, pd_ms = time_plan(chain, topology, pd_options, args.repeats)
            theirs_ms = case["pipeline_time_s"] * MS_PER_S
            record = {
                "profile": name, "cluster": cluster, "states": len(chain), "import_s": import_s,
                "plan_s_pipedream_model": ours_s, "plan_s_pd_model": pd_s,
                "predicted_ms_pipedream_model": ours_ms, "predicted_ms_pd_model": pd_ms,
                "pipedream_optimum_ms": theirs_ms, "pipedream_wall_s": case["pipedream_wall_s"],
                "relative_error": abs(ours_ms / theirs_ms - 1.0),
                "wall_speedup": case["pipedream_wall_s"] / ours_s if ours_s > 0 else float("inf"),
                "pd_schedule": args.schedule, "pd_num_microbatches": args.num_microbatches,
            }
            records.append(record)
            rows.append([name, cluster, len(chain), f"{ours_s * MS_PER_S:.1f}", f"{pd_s * MS_PER_S:.1f}",
                         f"{ours_ms:.4f}", f"{theirs_ms:.4f}", f"{record['relative_error']:.1e}",
                         f"{case['pipedream_wall_s']:.3f}", f"{record['wall_speedup']:.0f}x", f"{pd_ms:.4f}"])
    headers = ["profile", "cluster", "states", "plan ms (pipedream model)", "plan ms (pd model)",
               "ours ms/minibatch", "PipeDream ms/minibatch", "rel. error", "PipeDream wall s",
               "wall speed-up", f"pd model ms/minibatch ({args.schedule})"]
    print(tabulate(rows, headers=headers, tablefmt="simple"))
    atomic_write_json(OUT, {"benchmark": "planner", "repeats": args.repeats, "results": records})
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()

"""Planner benchmark: our search vs PipeDream's optimizer on PipeDream's own profiles.

For every shared profile x cluster (../shared/pipedream-profiles/expected.json): planning
time with `cost_model=pipedream` and `cost_model=pd` (median of a few repeats, after
importing the graph once), our predicted time per minibatch under each, PipeDream's optimum
and the wall time PipeDream's optimizer took. Then two graphs PipeDream's optimizer cannot
plan as they are, on 4, 16 and 4x4 devices: the shared inception_v3 (221,564 antichain
states: past plan.max_states pd plans over topological prefixes; beside PipeDream's
optimum after its branch compression where expected.json has it) and a deep residual chain
made by `benchmarks/deep_profile.py` (about 1,750 states). Prints a table and writes
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
from typing import Any, Callable

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.deep_profile import deep_graph  # noqa: E402
from pdcli.config.schema import PlanConfig  # noqa: E402
from pdcli.planner import PlanOptions, Topology, plan_chain  # noqa: E402
from pdcli.profiler.graph import Graph  # noqa: E402
from pdcli.profiler.graphtxt import SEARCH_SPACE_META, graph_to_chain, load_graph  # noqa: E402
from pdcli.rundir import atomic_write_json  # noqa: E402

PROFILES_DIR = REPO.parent / "shared" / "pipedream-profiles"
OUT = REPO / "runs" / "benchmarks" / "planner.json"
MS_PER_S = 1000.0
MAX_STATES = PlanConfig().max_states
SLOW_S = 5.0
"""A case slower than this is timed once, not `--repeats` times."""
FLAT_BW, NODE_BW = 1e10, 1e9
EXTRA_CLUSTERS = {
    "flat4": [{"devices": 4, "bandwidth_bytes_per_s": FLAT_BW}],
    "flat16": [{"devices": 16, "bandwidth_bytes_per_s": FLAT_BW}],
    "h4x4": [{"devices": 4, "bandwidth_bytes_per_s": FLAT_BW}, {"devices": 4, "bandwidth_bytes_per_s": NODE_BW}],
}


def time_plan(chain: Any, topology: Topology, options: PlanOptions, repeats: int) -> tuple[float, float]:
    """(median planning seconds, predicted ms per minibatch)."""
    walls, predicted = [], 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_chain(chain, topology, options)
        walls.append(time.perf_counter() - start)
        predicted = plan.time_per_minibatch_ms
        if walls[-1] > SLOW_S:
            break
    return statistics.median(walls), predicted


def imported(load: Callable[[], Graph]) -> tuple[Any, float]:
    """(the chain of the graph `load` reads or makes, seconds to read and linearize it)."""
    start = time.perf_counter()
    chain = graph_to_chain(load(), max_states=MAX_STATES)
    return chain, time.perf_counter() - start


def extra_cases(expected: dict[str, Any]) -> list[tuple[str, Any, float, dict[str, dict[str, Any]]]]:
    """(name, chain, import seconds, cluster -> case) of the graphs beyond expected.json's optima;
    a case has `levels` and, where PipeDream planned it, `pipeline_time_s` and `pipedream_wall_s`."""
    out = []
    inception = expected.get("unplannable_by_pipedream", {}).get("inception_v3")
    graphs = [("deep_resnet", lambda: deep_graph())]
    if inception is not None:
        graphs.insert(0, ("inception_v3", lambda: load_graph(PROFILES_DIR / "inception_v3" / "graph.txt")))
    for name, load in graphs:
        chain, import_s = imported(load)
        cases: dict[str, dict[str, Any]] = {c: {"levels": levels} for c, levels in EXTRA_CLUSTERS.items()}
        if name == "inception_v3":
            compressed = inception["pipedream_compressed"]
            cases["flat4"].update(pipeline_time_s=compressed["flat4_time_per_minibatch_s"],
                                  pipedream_wall_s=compressed["wall_s"])
        out.append((name, chain, import_s, cases))
    return out


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
    profiles = [(name, *imported(lambda: load_graph(PROFILES_DIR / profile["graph"])), profile["optima"])
                for name, profile in sorted(expected["profiles"].items())]
    for name, chain, import_s, optima in profiles + extra_cases(expected):
        space = "prefixes" if chain.meta.get(SEARCH_SPACE_META) else "antichains"
        for cluster, case in sorted(optima.items()):
            topology = Topology.from_levels(case["levels"])
            straight = case.get("straight_pipeline", False)
            ours_s, ours_ms = time_plan(chain, topology, PlanOptions(cost_model="pipedream", straight=straight), args.repeats)
            pd_options = PlanOptions(cost_model="pd", schedule=args.schedule, straight=straight,
                                     num_microbatches=args.num_microbatches)
            pd_s, pd_ms = time_plan(chain, topology, pd_options, args.repeats)
            theirs_ms = case["pipeline_time_s"] * MS_PER_S if "pipeline_time_s" in case else None
            theirs_wall = case.get("pipedream_wall_s")
            record = {
                "profile": name, "cluster": cluster, "states": len(chain), "search_space": space,
                "import_s": import_s,
                "plan_s_pipedream_model": ours_s, "plan_s_pd_model": pd_s,
                "predicted_ms_pipedream_model": ours_ms, "predicted_ms_pd_model": pd_ms,
                "pipedream_optimum_ms": theirs_ms, "pipedream_wall_s": theirs_wall,
                "relative_error": abs(ours_ms / theirs_ms - 1.0) if theirs_ms else None,
                "wall_speedup": theirs_wall / ours_s if theirs_wall and ours_s > 0 else None,
                "pd_schedule": args.schedule, "pd_num_microbatches": args.num_microbatches,
            }
            records.append(record)
            rows.append([name, cluster, f"{len(chain)} {space}", f"{ours_s * MS_PER_S:.1f}", f"{pd_s * MS_PER_S:.1f}",
                         f"{ours_ms:.4f}", f"{theirs_ms:.4f}" if theirs_ms else "-",
                         f"{ours_ms / theirs_ms - 1.0:+.1e}" if theirs_ms else "-",
                         f"{theirs_wall:.3f}" if theirs_wall else "-",
                         f"{theirs_wall / ours_s:.0f}x" if theirs_wall else "-", f"{pd_ms:.4f}"])
    headers = ["profile", "cluster", "positions", "plan ms (pipedream model)", "plan ms (pd model)",
               "ours ms/minibatch", "PipeDream ms/minibatch", "ours/theirs - 1", "PipeDream wall s",
               "wall speed-up", f"pd model ms/minibatch ({args.schedule})"]
    print(tabulate(rows, headers=headers, tablefmt="simple"))
    atomic_write_json(OUT, {"benchmark": "planner", "repeats": args.repeats, "results": records})
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()

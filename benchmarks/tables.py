"""Benchmark tables rendered from `benchmarks/results/*.json` into marked regions of the docs.

A region is two HTML comments in a Markdown file (the README or a page of `docs/`):

    <!-- table:planner -->
    ...rendered here...
    <!-- /table:planner -->

Each region's name is a renderer below (`RENDERERS`); a renderer reads one results file and
returns Markdown. The results files are the benchmarks' own JSON (`runs/benchmarks/...`),
copied here by `--collect` with a `measured` entry: the date, host and command.

    python benchmarks/tables.py                  # rewrite every region
    python benchmarks/tables.py --check          # exit 1 if a region is stale or unknown
    python benchmarks/tables.py --collect planner runs/benchmarks/planner.json
    python benchmarks/tables.py --collect memory runs/benchmarks/memory_*.json
    python benchmarks/tables.py --plots          # redraw the figures (docs/img/) from the same JSON

A renderer takes the results and returns the table; `--check` is what `tests/test_docs.py` runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
REGION = re.compile(r"(<!-- table:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.S)
MS_PER_S = 1000.0


def load(name: str) -> dict[str, Any]:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"{path.relative_to(REPO)} is missing: run the benchmark, then --collect {name} its JSON")
    return json.loads(path.read_text())


def markdown(headers: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def span(values: Iterable[float], fmt: str, unit: str = "") -> str:
    """`1.4-15.9 ms` for a range, `1.4 ms` when it is one value, `-` when there are none."""
    vals = sorted(values)
    if not vals:
        return "-"
    lo, hi = format(vals[0], fmt), format(vals[-1], fmt)
    return (lo if lo == hi else f"{lo}-{hi}") + unit


def measured_line(results: dict[str, Any]) -> str:
    m = results.get("measured", {})
    return f"*{m.get('date', '?')}, {m.get('host', '?')}: `{m.get('command', '?')}`*\n"


# -- planner -------------------------------------------------------------------------------------

PLANNER_ROWS = ("vgg16", "resnet50", "gnmt", "inception_v3", "deep_resnet")


def planner_summary(results: dict[str, Any]) -> str:
    """One row per profile: planning times, PipeDream's optimizer's time, and the optimum's match.
    No date line: the README, which holds no dates, shows this table."""
    by_profile: dict[str, list[dict[str, Any]]] = {}
    for rec in results["results"]:
        by_profile.setdefault(rec["profile"], []).append(rec)
    rows = []
    for name in sorted(by_profile, key=lambda n: (PLANNER_ROWS.index(n) if n in PLANNER_ROWS else len(PLANNER_ROWS), n)):
        recs = by_profile[name]
        planned = [r for r in recs if r["pipedream_wall_s"]]
        errors = [r["relative_error"] for r in planned if r["relative_error"] is not None]
        if not planned:
            theirs, match = "not run", "-"
        elif len(planned) == len(recs):
            theirs = span((r["pipedream_wall_s"] for r in planned), ".2f", " s")
            theirs += f" ({span((r['wall_speedup'] for r in planned), '.0f', 'x')} as long)"
            match = f"the same (rel. error <= {max(errors):.0e})"
        else:  # inception_v3: PipeDream plans it only after compressing its branches by hand
            r = planned[0]
            theirs = f"{r['pipedream_wall_s']:.1f} s after compressing its branches by hand ({r['cluster']} only)"
            ours, optimum = r["predicted_ms_pipedream_model"], r["pipedream_optimum_ms"]
            match = f"{ours:.1f} vs {optimum:.1f} ms/minibatch ({ours / optimum - 1:+.1%})"
        rows.append([
            f"{name} ({recs[0]['states']} {recs[0]['search_space']})",
            ", ".join(sorted(r["cluster"] for r in recs)),
            span((r["plan_s_pipedream_model"] * MS_PER_S for r in recs), ".1f", " ms"),
            span((r["plan_s_pd_model"] * MS_PER_S for r in recs), ".1f", " ms"),
            theirs,
            match,
        ])
    headers = ["profile (positions)", "clusters", "`pd plan`, PipeDream model", "`pd plan`, pd model",
               "PipeDream's optimizer", "time per minibatch vs PipeDream's optimum"]
    return markdown(headers, rows)  # undated: the README shows it (its date is under `planner`)


def planner_cases(results: dict[str, Any]) -> str:
    """Every profile x cluster, as `bench_planner.py` prints it."""
    def opt(v: float | None, fmt: str, suffix: str = "") -> str:
        return "-" if v is None else format(v, fmt) + suffix

    rows = []
    for r in results["results"]:
        rows.append([
            r["profile"], r["cluster"], f"{r['states']} {r['search_space']}",
            f"{r['plan_s_pipedream_model'] * MS_PER_S:.1f}", f"{r['plan_s_pd_model'] * MS_PER_S:.1f}",
            f"{r['predicted_ms_pipedream_model']:.4f}", opt(r["pipedream_optimum_ms"], ".4f"),
            opt(r["predicted_ms_pipedream_model"] / r["pipedream_optimum_ms"] - 1.0 if r["pipedream_optimum_ms"] else None, "+.1e"),
            opt(r["pipedream_wall_s"], ".3f"), opt(r["wall_speedup"], ".0f", "x"),
            f"{r['predicted_ms_pd_model']:.4f}",
        ])
    schedule = results["results"][0]["pd_schedule"] if results["results"] else "?"
    headers = ["profile", "cluster", "positions", "plan ms (PipeDream model)", "plan ms (pd model)",
               "ours ms/minibatch", "PipeDream ms/minibatch", "ours/theirs - 1", "PipeDream wall s",
               "wall speed-up", f"pd model ms/minibatch ({schedule})"]
    return markdown(headers, rows) + "\n" + measured_line(results)


# -- memory --------------------------------------------------------------------------------------

def memory_label(shape: dict[str, Any]) -> str:
    parts = [f"{shape['layers']} x {shape['width']}, batch {shape['batch']}, {shape['microbatches']} microbatches"]
    parts.append("Adam" if shape["optim"] == "adam" else "SGD with momentum")
    parts += [f"`{o}`" for o in shape.get("overrides", [])]
    return ", ".join(parts)


def memory(results: dict[str, Any]) -> str:
    """One row per run (shape and overrides): measured / predicted over every stage of every schedule."""
    rows = []
    for run in results["runs"]:
        got = run["rows"]
        weights = [r[k] for r in got for k in ("ratio_weights_bytes", "ratio_stashed_weights_bytes") if r[k] is not None]
        rows.append([
            memory_label(run["shape"]),
            ", ".join(dict.fromkeys(r["schedule"] for r in got)) + (f"; failed: {', '.join(run['failures'])}" if run["failures"] else ""),
            span(weights, ".2f"),
            span((r["ratio_activations_bytes"] for r in got if r["ratio_activations_bytes"] is not None), ".2f"),
            span((r["ratio_total"] for r in got if r["ratio_total"] is not None), ".2f"),
            span((r["measured_peak_bytes"] / float(1 << 20) for r in got if r["measured_peak_bytes"]), ".2f", " MiB"),
        ])
    headers = ["shape (3 stages)", "schedules", "weights, stashed weights", "activations", "total peak",
               "measured peak per stage"]
    return markdown(headers, rows) + "\n" + measured_line(results)


# -- data parallel -------------------------------------------------------------------------------

DP_ROWS = {"ddp": "torch DDP", "pd_dp": "pd, data parallel", "pd_pipeline": "pd, the recipe's pipeline",
           "pd_pick": "pd, `pd plan`'s pick"}


def _rate_label(rate: dict[str, Any]) -> str:
    return "unshaped" if rate["rate_mbit"] is None else f"{rate['rate_mbit']:g} Mbit/s"


def _predicted_ms(row: dict[str, Any]) -> float | None:
    return row.get("predicted_ms") or (row.get("plan") or {}).get("predicted_ms")


def _plan_label(row: dict[str, Any]) -> str:
    plan = row.get("plan")
    if not plan:
        return "-"
    stages = plan["stages"]
    shape = (f"1 stage x {stages[0]}" if len(stages) == 1 else
             f"{len(stages)} stages" + ("" if all(r == 1 for r in stages) else f" x {stages}"))
    return f"{plan['schedule']}, {shape}, M={plan['num_microbatches']}"


def _to_target(row: dict[str, Any], case: dict[str, Any]) -> str:
    """The time to the case's target accuracy, or that the run never reached it."""
    if not case.get("target_accuracy"):
        return "-"
    if row.get("time_to_target_s") is not None:
        return f"{row['time_to_target_s']:.1f} s"
    final = row.get("final_eval_accuracy")
    return f"not in {case['steps']} minibatches" + (f" ({final:.1%} at the end)" if final is not None else "")


def data_parallel_summary(results: dict[str, Any]) -> str:
    """Per model and rate: DDP beside `pd plan`'s pick. No date line: the README shows it."""
    rows = []
    for name, case in results["cases"].items():
        for rate in case["rates"]:
            ddp, pick = rate["rows"].get("ddp", {}), rate["rows"].get("pd_pick", {})
            if "samples_per_s" not in ddp or "samples_per_s" not in pick:
                continue
            target = case.get("target_accuracy")
            to_target = "-" if target is None else f"{_to_target(ddp, case)} / {_to_target(pick, case)}"
            rows.append([
                name, _rate_label(rate), f"{ddp['samples_per_s']:.0f}",
                f"{pick['samples_per_s']:.0f} ({pick['samples_per_s'] / ddp['samples_per_s']:.1f}x)",
                _plan_label(pick),
                f"{pick['bytes_per_minibatch'] / ddp['bytes_per_minibatch']:.1%}",
                to_target,
            ])
    headers = ["model", "link", "DDP samples/s", "pd's pick samples/s (x DDP)", "the pick",
               "pd's bytes on the link (of DDP's)", "time to 95% held-out accuracy, DDP / pd"]
    return markdown(headers, rows)


def data_parallel(results: dict[str, Any]) -> str:
    """Every model x rate x row: measured beside predicted, bytes per minibatch, time to target."""
    parts = []
    for name, case in results["cases"].items():
        rows = []
        for rate in case["rates"]:
            ddp = rate["rows"].get("ddp", {})
            for key, row in rate["rows"].items():
                label = DP_ROWS.get(key, key)
                if "error" in row:
                    rows.append([_rate_label(rate), label, f"failed: {row['error'][:80]}"] + ["-"] * 7)
                    continue
                pred = _predicted_ms(row)
                rows.append([
                    _rate_label(rate), label, f"{row['samples_per_s']:.0f}",
                    f"{row['samples_per_s'] / ddp['samples_per_s']:.2f}x" if "samples_per_s" in ddp else "-",
                    f"{row['ms_per_minibatch']:.1f}",
                    "-" if pred is None else f"{pred:.1f}",
                    "-" if pred is None else f"{pred / row['ms_per_minibatch'] - 1:+.0%}",
                    f"{row['bytes_per_minibatch'] / 1e3:.1f}"
                    + (f" ({row['bytes_per_minibatch'] / ddp['bytes_per_minibatch']:.1%})"
                       if key != "ddp" and "bytes_per_minibatch" in ddp else ""),
                    _to_target(row, case),
                    _plan_label(row),
                ])
        target = case.get("target_accuracy")
        title = f"**{name}** (`{case['recipe']}`" + "".join(f" `{o}`" for o in case.get("overrides", []))
        title += f", {case['steps']} minibatches" + (f", target {target:.0%} held-out accuracy" if target else "") + ")"
        headers = ["link", "row", "samples/s", "x DDP", "ms/minibatch", "predicted ms", "prediction error",
                   "KB/minibatch on the link (of DDP's)", "time to target", "plan"]
        parts.append(title + "\n\n" + markdown(headers, rows))
    return "\n".join(parts) + "\n" + measured_line(results)


def crossover_mbit(rates: list[dict[str, Any]], a: str, b: str, unshaped_mbit: float | None = None) -> float | None:
    """The rate (Mbit/s, log-interpolated) where row `a` stops beating row `b` or starts to; None
    when neither happens over the rates measured (the unshaped link at `unshaped_mbit`, if given)."""
    import math

    pts = [(unshaped_mbit if r["rate_mbit"] is None else r["rate_mbit"],
            r["rows"][a]["samples_per_s"] / r["rows"][b]["samples_per_s"])
           for r in rates if (r["rate_mbit"] is not None or unshaped_mbit is not None)
           and all("samples_per_s" in r["rows"].get(k, {}) for k in (a, b))]
    pts.sort()
    for (r0, q0), (r1, q1) in zip(pts, pts[1:]):
        if (q0 - 1) * (q1 - 1) <= 0 and q0 != q1:
            f = math.log(q0) / (math.log(q0) - math.log(q1))
            return float(math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0))))
    return None


def plot_data_parallel(results: dict[str, Any], out: Path) -> None:
    """samples/s against the link's rate, one panel per model, one line per row; the rates where
    pd's pick and the recipe's pipeline cross DDP are marked. The unshaped link sits at its
    measured rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unshaped_mbit = results["unshaped_bandwidth_bytes_per_s"] * 8 / 1e6
    cases = results["cases"]
    fig, axes = plt.subplots(1, len(cases), figsize=(5.2 * len(cases), 3.8), squeeze=False)
    for ax, (name, case) in zip(axes[0], cases.items()):
        xs = [unshaped_mbit if r["rate_mbit"] is None else r["rate_mbit"] for r in case["rates"]]
        for key, label in DP_ROWS.items():
            pts = [(x, r["rows"][key]["samples_per_s"]) for x, r in zip(xs, case["rates"])
                   if "samples_per_s" in r["rows"].get(key, {})]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label.replace("`", ""))
        notes = []
        for key, who in (("pd_pick", "pd's pick"), ("pd_pipeline", "the recipe's pipeline")):
            cross = crossover_mbit(case["rates"], key, "ddp", unshaped_mbit)
            if cross is None:
                notes.append(f"{who}: no crossover with DDP")
                continue
            ax.axvline(cross, color="gray", linestyle="--", linewidth=1)
            ax.annotate(f"{who} = DDP\n~{cross:.0f} Mbit/s", (cross, 0.03 + 0.12 * len(notes)),
                        xycoords=("data", "axes fraction"), ha="right", va="bottom", fontsize=8, color="gray")
            notes.append("")
        shown = [n for n in notes if n]
        if shown:
            ax.annotate("\n".join(shown), (0.02, 0.97), xycoords="axes fraction", ha="left", va="top", fontsize=8,
                        color="gray")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(sorted(set(xs)))
        ax.set_xticklabels(["unshaped" if x == unshaped_mbit else f"{x:g}" for x in sorted(set(xs))])
        ax.set_xlabel("link rate, Mbit/s each way")
        ax.set_ylabel("samples/s (steady state)")
        ax.set_title(name)
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="center right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp" + out.suffix)
    fig.savefig(tmp, format=out.suffix.lstrip("."), metadata={"Date": None} if out.suffix == ".svg" else None)
    plt.close(fig)
    tmp.replace(out)


# -- flood ---------------------------------------------------------------------------------------

def _three(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def flood(results: dict[str, Any]) -> str:
    """One row per round: undisturbed beside flooded, and the medians below."""
    rows = results["rows"]
    table = []
    for quiet, flooded in zip(rows[::2], rows[1::2]):
        ratio = (flooded["samples_per_s"] / quiet["samples_per_s"]
                 if quiet["samples_per_s"] and flooded["samples_per_s"] else None)
        table.append([str(quiet["round"]), f"{quiet['samples_per_s']:.0f}" if quiet["samples_per_s"] else "-",
                      f"{flooded['samples_per_s']:.0f}" if flooded["samples_per_s"] else "-",
                      _three(ratio),
                      f"{flooded['connections']} on {flooded['ports']} ports",
                      f"{quiet['most_threads']} / {flooded['most_threads']}",
                      "yes" if quiet["final_loss"] == flooded["final_loss"] else "no"])
    headers = ["round", "undisturbed samples/s", "flooded samples/s", "flooded / undisturbed",
               "junk connections", "most threads (undisturbed / flooded)", "same final loss"]
    summary = (f"\nMedians over {len(table)} rounds of {results['steps']} steps: "
               f"{results['median_undisturbed'] or 0:.0f} samples/s undisturbed, {results['median_flooded'] or 0:.0f} flooded "
               f"(ratio of the medians {_three(results['ratio_of_medians'])}, median of the rounds' ratios "
               f"{_three(results['median_ratio'])}); the same final loss in every run: "
               f"{'yes' if results['same_final_loss'] else 'no'}.\n")
    return markdown(headers, table) + summary + "\n" + measured_line(results)


RENDERERS: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "planner-summary": ("planner", planner_summary),
    "planner": ("planner", planner_cases),
    "memory": ("memory", memory),
    "data-parallel-summary": ("data_parallel", data_parallel_summary),
    "data-parallel": ("data_parallel", data_parallel),
    "flood": ("flood", flood),
}
"""Region name -> (results file under benchmarks/results/ without .json, renderer)."""

PLOTS: dict[str, tuple[str, Callable[[dict[str, Any], Path], None]]] = {
    "docs/img/data-parallel.svg": ("data_parallel", plot_data_parallel),
}
"""Figure (under the repository) -> (results file, drawer); `--plots` redraws them."""



# -- regions -------------------------------------------------------------------------------------

def render_file(text: str, rendered: dict[str, str]) -> tuple[str, list[str]]:
    """`text` with every region's body replaced; and the names of regions with no renderer."""
    unknown: list[str] = []

    def fill(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in RENDERERS:
            unknown.append(name)
            return m[0]
        if name not in rendered:
            results_name, renderer = RENDERERS[name]
            rendered[name] = renderer(load(results_name))
        return m[1] + "\n" + rendered[name] + "\n" + m[4]

    return REGION.sub(fill, text), unknown


def run(check: bool, files: list[Path]) -> int:
    rendered: dict[str, str] = {}
    stale: list[str] = []
    for path in files:
        text = path.read_text()
        new, unknown = render_file(text, rendered)
        rel = path.relative_to(REPO)
        for name in unknown:
            print(f"{rel}: region {name!r} has no renderer (known: {', '.join(RENDERERS)})", file=sys.stderr)
            stale.append(f"{rel}:{name}")
        if new != text:
            if check:
                stale.append(str(rel))
                print(f"{rel}: a table is stale; run `python benchmarks/tables.py`", file=sys.stderr)
            else:
                path.write_text(new)
                print(f"wrote {rel}")
    return 1 if stale else 0


def collect(name: str, sources: list[Path], host: str, command: str) -> None:
    """Copy a benchmark's JSON into benchmarks/results/NAME.json with when, where and how it ran."""
    measured = {"date": datetime.date.today().isoformat(), "host": host, "command": command}
    if name == "memory":  # one file per run (shape, overrides) of bench_memory.py
        data: dict[str, Any] = {"measured": measured, "runs": [json.loads(p.read_text()) for p in sources]}
    elif len(sources) == 1:
        data = {"measured": measured, **json.loads(sources[0].read_text())}
    else:
        raise SystemExit(f"--collect {name} takes one JSON file, got {len(sources)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


def default_host() -> str:
    import os

    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a region is stale; write nothing")
    parser.add_argument("--collect", nargs="+", metavar=("NAME", "JSON"),
                        help="copy a benchmark's JSON into benchmarks/results/NAME.json")
    parser.add_argument("--host", default=None, help="with --collect: where it ran (default: os, machine, cores)")
    parser.add_argument("--command", default="", help="with --collect: the benchmark's command line")
    parser.add_argument("--plots", action="store_true", help="redraw the figures (PLOTS) from benchmarks/results/")
    parser.add_argument("files", nargs="*", type=Path, help="Markdown files (default: README.md and docs/*.md)")
    args = parser.parse_args(argv)
    if args.collect:
        name, *sources = args.collect
        if not sources:
            parser.error("--collect NAME JSON [JSON ...]")
        collect(name, [Path(s) for s in sources], args.host or default_host(), args.command)
        return 0
    if args.plots:
        for rel, (results_name, draw) in PLOTS.items():
            draw(load(results_name), REPO / rel)
            print(f"wrote {rel}")
        return 0
    files = [p.resolve() for p in args.files] or DOCS
    return run(args.check, files)


if __name__ == "__main__":
    sys.exit(main())

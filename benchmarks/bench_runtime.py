"""Runtime throughput on this machine, one run: `pd train` (pipedream, 1f1b, gpipe) vs
torch.distributed.pipelining (Schedule1F1B, ScheduleGPipe) vs single-process training
(1 thread, all threads, and 1 thread accumulating over the same M microbatches), same MLP,
same 2-stage split, against a measured bound (each stage trained alone in a process of its
own, one thread each, both at once: a pipeline without messages or waiting; none on this
split can beat its slower stage), in two sections:

- `small`: the given batch and microbatches (default 256 in 8 microbatches of 32 rows).
  The 1-thread microbatched row shows what the pipeline's smaller matmuls cost on their
  own: on this machine a 32-row microbatch step runs at 60-70% of the full batch's rate,
  so two stages of them top out near 2 x that row, below 2 x the full-batch row.
  It also holds the virtual-stage rows: pd's interleaved, loopedbfs and zbv beside
  torch.pipelining's ScheduleInterleaved1F1B, ScheduleLoopedBFS and ScheduleZBVZeroBubble,
  2 chunks of equal work per rank at the same cuts (a row that fails shows its reason).
- `large`: `--large-microbatches` microbatches of the full batch each (default 4 x 256
  rows, a 1024-sample minibatch), where the microbatch size is not the limit: the
  schedules themselves (flush bubble, split backward, no flush) are compared.

Ratios are to each section's 1-thread full-batch row. Two balanced stages on 2 cores can
at best double single-thread throughput (the `of 2x limit` column); the `bound` row is the
tighter limit of this split on this host (stage 1 also computes its input's gradient and the
loss, and a microbatch's matmuls are smaller than the full batch's). A flush schedule with
M microbatches on P stages is further bounded by its bubble, P * M / (M + P - 1) x
single-thread, unless the backward is split (`pd`'s default for 1f1b and gpipe: the
Linear weight gradients run in the bubble), which the `split_backward=false` rows turn off;
the `merge_weight_grads=true` rows merge each chunk's W's, one matmul per layer over the whole
minibatch's rows (1f1b and gpipe in both sections, interleaved beside torch's); loopedbfs merges
them by default, and its `merge_weight_grads=false` row does not.

The single-process rows train on one fixed batch; pd's rows make every minibatch from the
synthetic data source (about 3 ms of a stage's 80 ms step here), as training does.

    .venv/bin/python benchmarks/bench_runtime.py [--steps N] [--width 1024] [--layers 8]
        [--batch 256] [--microbatches 8] [--large-microbatches 4] [--sections small,large]
        [--rounds 2] [--timeout-s 240] [--out PATH] [--only 'V=2,single process, 1 thread']

Every row's samples/s is the median over its timed steps of batch / step time (pd logs it per
minibatch; the baselines time each step), and with `--rounds R` the median over R rounds run
one after the other (every other round in reverse order). pd's rows beside torch.pipelining's
counterpart (same schedule, split and microbatches) run back to back in every round
(`beside_counterparts`; each torch row twice, on pd's heap and on glibc's defaults,
`TORCH_HEAPS`) and get a paired ratio: pd / torch of each round, the two measured seconds
apart, and their median, which the host's slow spells (lasting minutes, moving single rounds by
25% here) move far less than a ratio of the rows' medians. Prints a table per section, writes
`runs/benchmarks/runtime.json`.
Numbers are printed, never asserted: on a shared host they move with the other load (see
`load before`).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the _helpers beside this script

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from _baselines import (  # noqa: E402
    TORCH_SCHEDULES, TORCH_VIRTUAL_SCHEDULES, run_single, run_stage_bound, run_torch_pipelining,
)
from _bench_common import (  # noqa: E402
    NUM_STAGES, VIRTUAL_STAGES, BenchFailed, BenchShape, chunk_points, paired_ratios, split_point, own_profiles,
)
from _pd_train import run_pd_train, virtual_overrides  # noqa: E402
from pdcli.rundir import atomic_write_json  # noqa: E402
from pdcli.schedule.spec import rules  # noqa: E402

DEFAULT_OUT = Path("runs") / "benchmarks" / "runtime.json"
REFERENCE = "single process, 1 thread"
DEFAULT_ROUNDS = 2
UNAVAILABLE = "unavailable: "
MICROBATCHED_NOTE = "gradient accumulation: the pipeline's matmul sizes on one core"
BOUND_NOTE = "stages alone, at once: {} ms per minibatch; no pipeline on this split beats the slower"
ONE_MICROBATCH = 1
"""The extra pd row of the `small` section: pipedream has no flush, so one microbatch per
minibatch still keeps both stages busy (minibatch t + 1 enters while t is in its backward),
every matmul runs at the full-batch size and there is one update per minibatch, as in the
single-process rows. It shows what the runtime itself costs when the microbatch size is not
the limit."""
SECTIONS = ("small", "large")
DEFAULT_LARGE_MICROBATCHES = 4
UNSPLIT = "schedule.split_backward=false"
MERGED, UNMERGED = "schedule.merge_weight_grads=true", "schedule.merge_weight_grads=false"
"""pd's rows with the weight gradients merged per chunk (`schedule.merge_weight_grads`), or not,
where the schedule's default is the other (`other_merge`)."""
TORCH_PREFIX = "torch pipelining "
SHIPPED_HEAP = ", glibc's default heap"
TORCH_HEAPS = ((True, ""), (False, SHIPPED_HEAP))
"""Each torch.pipelining row twice: on pd's heap (`thread_env`: what pd's workers run on, so the
ratio is of the two runtimes alone) and with glibc's defaults (torch.pipelining as a user starts
it; pd puts its own workers on huge pages itself)."""
PD_PREFIX = "pd train "
PD_NAME_OF_TORCH = {cls.__name__: name for name, cls in {**TORCH_SCHEDULES, **TORCH_VIRTUAL_SCHEDULES}.items()}
"""torch.pipelining's schedule class name -> pd's `schedule.name` for the same schedule."""
MAX_REASON_CHARS = 100
"""An unavailable row shows the last line of its reason, cut to this (the JSON keeps all)."""


@dataclass(frozen=True)
class Row:
    """One variant's result: samples/s (median over rounds), or None and why it is unavailable."""

    variant: str
    samples_per_s: float | None
    note: str = ""
    per_round_samples_per_s: tuple[float | None, ...] = ()
    """Each round's median-over-steps samples/s (None: that round failed); their spread shows
    how noisy the host was."""
    wall_s: float = 0.0
    """Wall time of the variant over all rounds (process start-up, warm-up, timed steps)."""
    load_avg_1min: float = 0.0
    """Mean host load average when the variant started: well above 0 means other work
    shares the cores, and the 2-process rows suffer more from it than the 1-thread one."""


Measure = Callable[[Path], tuple[float, str]]


def section_shape(shape: BenchShape, section: str, large_microbatches: int) -> BenchShape:
    """`small`: the shape as given; `large`: `large_microbatches` microbatches of the given batch each."""
    if section == "small":
        return shape
    return replace(shape, batch_size=shape.batch_size * large_microbatches, num_microbatches=large_microbatches)


def variants(shape: BenchShape, timeout_s: float, section: str) -> list[tuple[str, Measure]]:
    """(name, measure) in the order they run; measure(scratch dir) -> (samples/s, note) or raises."""
    num_threads_all = os.cpu_count() or 1
    cut, chain_length = split_point(shape), 2 * shape.num_layers + 2  # flatten, (linear, relu) x L, classifier
    split = f"[0:{cut}) [{cut}:{chain_length})"
    baseline_split = f"split {split}"
    m = shape.num_microbatches

    def pd_row(schedule_name: str, work_dir: Path, run_shape: BenchShape = shape, extra: Sequence[str] = ()) -> tuple[float, str]:
        result = run_pd_train(run_shape, schedule_name, work_dir, timeout_s, extra)
        differs = "" if result.split == split else " (planner's split, not the baselines')"
        return result.samples_per_s, f"split {result.split}{differs}, median of {result.num_logged_steps} steps"

    def bound_row(_: Path) -> tuple[float, str]:
        samples_per_s, stage_ms = run_stage_bound(shape, timeout_s)
        return samples_per_s, BOUND_NOTE.format(" / ".join(f"{ms:.0f}" for ms in stage_ms))

    rows: list[tuple[str, Measure]] = [(REFERENCE, lambda _: (run_single(shape, 1, timeout_s), ""))]
    if section == "small":
        rows.append((f"single process, {num_threads_all} threads",
                     lambda _: (run_single(shape, num_threads_all, timeout_s), "")))
    rows += [
        (f"single process, 1 thread, {m} microbatches", lambda _: (run_single(shape, 1, timeout_s, m), MICROBATCHED_NOTE)),
        (f"bound: each stage alone, at once, 1 thread each, {m} microbatches", bound_row),
        *[(f"{TORCH_PREFIX}{cls.__name__}, {m} microbatches{suffix}",
           lambda _, name=name, pd_heap=pd_heap: (run_torch_pipelining(shape, name, timeout_s, pd_heap),
                                                   baseline_split))
          for name, cls in TORCH_SCHEDULES.items() for pd_heap, suffix in TORCH_HEAPS],
        (f"{PD_PREFIX}pipedream, {m} microbatches", lambda work_dir: pd_row("pipedream", work_dir)),
        (f"{PD_PREFIX}1f1b, {m} microbatches", lambda work_dir: pd_row("1f1b", work_dir)),
        (f"{PD_PREFIX}1f1b, {m} microbatches, {UNSPLIT}", lambda work_dir: pd_row("1f1b", work_dir, extra=[UNSPLIT])),
        (f"{PD_PREFIX}gpipe, {m} microbatches", lambda work_dir: pd_row("gpipe", work_dir)),
        *[(f"{PD_PREFIX}{name}, {m} microbatches, {MERGED}",
           lambda work_dir, name=name: pd_row(name, work_dir, extra=[MERGED])) for name in ("1f1b", "gpipe")],
    ]
    if section == "small":
        rows.append((f"{PD_PREFIX}pipedream, {ONE_MICROBATCH} microbatch",
                     lambda work_dir: pd_row("pipedream", work_dir, replace(shape, num_microbatches=ONE_MICROBATCH))))
        rows += virtual_rows(shape, timeout_s)
    return rows




def virtual_rows(shape: BenchShape, timeout_s: float) -> list[tuple[str, Measure]]:
    """torch.pipelining's multi-stage schedules and pd's, VIRTUAL_STAGES chunks of equal work per rank
    at the same cuts; a variant that fails (torch's zbv has been seen to fail on CPU/gloo with "Pair
    is not connected") is shown as unavailable with its reason."""
    m, cuts = shape.num_microbatches, chunk_points(shape)
    chunks = f"{NUM_STAGES} x {VIRTUAL_STAGES} chunks, cuts {cuts}"
    bounds = [0, *cuts, 2 * shape.num_layers + 2]
    split = " ".join(f"[{a}:{b})" for a, b in zip(bounds, bounds[1:]))

    def pd_row(name: str, work_dir: Path, extra: Sequence[str] = ()) -> tuple[float, str]:
        result = run_pd_train(shape, name, work_dir, timeout_s, [*virtual_overrides(shape), *extra])
        differs = "" if result.split == split else " (planner's split, not the baselines')"
        return result.samples_per_s, f"chunks {result.split}{differs}, median of {result.num_logged_steps} steps"

    rows: list[tuple[str, Measure]] = []
    for name, cls in TORCH_VIRTUAL_SCHEDULES.items():  # pd's virtual-stage schedules beside torch's
        rows += [(f"{TORCH_PREFIX}{cls.__name__}, V={VIRTUAL_STAGES}, {m} microbatches{suffix}",
                  lambda _, name=name, pd_heap=pd_heap: (run_torch_pipelining(shape, name, timeout_s, pd_heap),
                                                         chunks))
                 for pd_heap, suffix in TORCH_HEAPS]
        rows.append((f"{PD_PREFIX}{name}, V={VIRTUAL_STAGES}, {m} microbatches",
                     lambda work_dir, name=name: pd_row(name, work_dir)))
        if name != "zbv":  # zbv's order places its own W's
            other = other_merge(name)
            rows.append((f"{PD_PREFIX}{name}, V={VIRTUAL_STAGES}, {m} microbatches, {other}",
                         lambda work_dir, name=name, other=other: pd_row(name, work_dir, [other])))
    return rows


def other_merge(schedule: str) -> str:
    """The override of pd's second row of `schedule`: its weight gradients merged per chunk, or
    for a schedule that merges them by default (loopedbfs), not."""
    return UNMERGED if rules(schedule).merges_weight_grads else MERGED


def measure_all(shape: BenchShape, timeout_s: float, num_rounds: int, section: str, only: Sequence[str] = ()) -> list[Row]:
    """Every variant once per round, rounds one after the other, so slow phases of the
    host's other load spread over all variants instead of hitting one. A pd variant keeps
    its run directory over rounds: profile, plan and stages are made once and reused.
    `only`: the variants whose name contains one of these (all when empty)."""
    table = beside_counterparts([(name, measure) for name, measure in variants(shape, timeout_s, section)
                                 if not only or any(part in name for part in only)])
    values: dict[str, list[float | None]] = {name: [] for name, _ in table}
    notes: dict[str, str] = {}
    wall_s: dict[str, float] = {name: 0.0 for name, _ in table}
    loads: dict[str, list[float]] = {name: [] for name, _ in table}
    with tempfile.TemporaryDirectory(prefix="pd-bench-runtime-") as tmp:
        for round_id in range(num_rounds):
            order = list(enumerate(table))
            for variant_id, (name, measure) in order if round_id % 2 == 0 else order[::-1]:
                load = os.getloadavg()[0]
                print(f"{section} round {round_id + 1}/{num_rounds}: {name} (load average {load:.2f}) ...",
                      file=sys.stderr, flush=True)
                start_s = time.perf_counter()
                try:
                    samples_per_s, note = measure(Path(tmp) / f"variant{variant_id}")
                    notes[name] = note
                except BenchFailed as exc:
                    samples_per_s, note = None, f"{UNAVAILABLE}{exc}"
                    notes.setdefault(name, note)
                values[name].append(samples_per_s)
                elapsed_s = time.perf_counter() - start_s
                wall_s[name] += elapsed_s
                loads[name].append(load)
                print(f"  {samples_per_s or note} in {elapsed_s:.1f} s", file=sys.stderr, flush=True)
    return [
        Row(
            name,
            statistics.median(done) if (done := [v for v in values[name] if v is not None]) else None,
            notes[name],
            tuple(values[name]),
            wall_s[name],
            statistics.mean(loads[name]),
        )
        for name, _ in table
    ]


def beside_counterparts(table: Sequence[tuple[str, Measure]]) -> list[tuple[str, Measure]]:
    """`table` with each torch.pipelining row and its pd counterparts (`counterparts`) run back
    to back, seconds apart: the group at its first pd row's place, pd's rows first (in the
    reversed rounds torch's); the other rows keep their order."""
    names = [name for name, _ in table]
    group_of: dict[str, str] = {}  # row -> its group: the torch rows of one schedule and their pd rows
    for pd_name, torch_name in counterparts(names):
        group_of[pd_name] = group_of[torch_name] = group_of.get(pd_name, torch_name)
    rank = {name: (name.startswith(TORCH_PREFIX), i) for i, name in enumerate(names)}  # torch's rows last
    out: list[tuple[str, Measure]] = []
    placed: set[str] = set()  # the groups already in `out`
    for name, measure in table:
        if name not in group_of:
            out.append((name, measure))
        elif group_of[name] not in placed:
            placed.add(group_of[name])
            out += sorted((row for row in table if group_of.get(row[0]) == group_of[name]), key=lambda r: rank[r[0]])
    return out


def counterparts(names: Sequence[str]) -> list[tuple[str, str]]:
    """(pd's row, torch.pipelining's row) for every schedule both measured: the same schedule,
    split and microbatches (pd's split backward on, as by default; and, where measured, with the
    weight gradients merged per chunk or not, the other of the schedule's default)."""
    pairs = []
    for torch_name in names:
        if not torch_name.startswith(TORCH_PREFIX):
            continue
        schedule, _, rest = torch_name.removeprefix(TORCH_PREFIX).partition(", ")
        pd_name = f"{PD_PREFIX}{PD_NAME_OF_TORCH[schedule]}, {rest.removesuffix(SHIPPED_HEAP)}"
        pairs += [(name, torch_name) for name in (pd_name, f"{pd_name}, {MERGED}", f"{pd_name}, {UNMERGED}")
                  if name in names]
    return pairs


def paired(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """pd / torch.pipelining per round and their median, for every pair `counterparts` finds,
    beside the pair's `schedule_ceiling`."""
    by_name = {r.variant: r for r in rows}
    out = []
    for pd_name, torch_name in counterparts(list(by_name)):
        ratios = paired_ratios(by_name[pd_name].per_round_samples_per_s, by_name[torch_name].per_round_samples_per_s)
        out.append({"pd": pd_name, "torch": torch_name, "per_round": ratios,
                    "median": statistics.median(ratios) if ratios else None, "ceiling": ceiling_of(pd_name)})
    return out


CEILING_COSTS = {"fwd_ms": 1.0, "bwd_ms": 2.0, "wgrad_ms": 1.0, "comm_ms": 0.05}
"""Each chunk's costs in `schedule_ceiling`: the MLP's backward is its input and its weight
gradients, each a forward's work; a message a twentieth of it."""
CEILING_STEPS = 8
"""Minibatches each `schedule_ceiling` replay runs (its steady time: the second half)."""


def schedule_ceiling(schedule: str, num_microbatches: int, virtual_stages: int = 1, merged: bool = False) -> float:
    """What pd's lists of `schedule` (split backward, as pd's rows run them) gain over
    torch.pipelining's by their order alone: the replay of the same schedule's lists without a
    split backward (torch's Schedule1F1B, GPipe, Interleaved1F1B and LoopedBFS run the backward
    whole; its ZBVZeroBubble splits it too) over pd's, both on equal chunks (`CEILING_COSTS`)
    and a pd runtime. A pd / torch ratio above it is the runtimes' difference. `merged`: pd's W's
    merged per chunk (each priced as one microbatch's: the order alone, not the merged matmul)."""
    from pdcli.schedule import ScheduleSpec
    from pdcli.schedule.simulator import StageCost, simulate

    def replayed_ms(split: bool) -> float:
        spec = ScheduleSpec.make(schedule, NUM_STAGES, num_microbatches, CEILING_STEPS, split_backward=split,
                                 virtual_stages=virtual_stages, merge_weight_grads=split and merged)
        costs = {**CEILING_COSTS, "wgrad_ms": CEILING_COSTS["wgrad_ms"] if split else 0.0}
        return simulate(spec, [StageCost(**costs)] * spec.num_chunks).time_per_minibatch_ms

    return replayed_ms(schedule == "zbv") / replayed_ms(True)


def ceiling_of(pd_name: str) -> float | None:
    """`schedule_ceiling` of a pd row's schedule, microbatches and chunks (None: a row name
    that does not say them)."""
    merges = "|".join(map(re.escape, (MERGED, UNMERGED)))
    found = re.fullmatch(rf"{PD_PREFIX}(\w+), (?:V=(\d+), )?(\d+) microbatches(?:, ({merges}))?", pd_name)
    if found is None:
        return None
    schedule, virtual, microbatches, merge = found.groups()
    merged = rules(schedule).merges_weight_grads if merge is None else merge == MERGED
    return schedule_ceiling(schedule, int(microbatches), int(virtual or 1), merged)


def flush_bound(shape: BenchShape) -> float:
    """Best speed-up over one thread of a flush schedule: P * M / (M + P - 1) (the bubble)."""
    return NUM_STAGES * shape.num_microbatches / (shape.num_microbatches + NUM_STAGES - 1)


def report(shape: BenchShape, rows: list[Row]) -> dict[str, Any]:
    reference = next((r.samples_per_s for r in rows if r.variant == REFERENCE), None)
    limit = NUM_STAGES * reference if reference else None
    out_rows = []
    for r in rows:
        ratio = r.samples_per_s / reference if r.samples_per_s and reference else None
        of_limit = r.samples_per_s / limit if r.samples_per_s and limit else None
        out_rows.append({**asdict(r), "ratio_to_single_1thread": ratio, "fraction_of_2x_limit": of_limit})
    return {
        "shape": asdict(shape),
        "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "load_avg_1min": os.getloadavg()[0]},
        "reference_samples_per_s": reference,
        "physical_limit_samples_per_s": limit,
        "flush_bubble_bound_ratio": flush_bound(shape),
        "rows": out_rows,
        "paired": paired(rows),
    }


def table(result: dict[str, Any]) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    body = [
        [
            r["variant"],
            num(r["samples_per_s"], ".0f") if r["samples_per_s"] is not None else short_reason(r["note"]),
            num(r["ratio_to_single_1thread"], ".2f"),
            num(r["fraction_of_2x_limit"], ".0%"),
            spread(r["per_round_samples_per_s"]),
            num(r["load_avg_1min"], ".1f"),
            r["note"] if r["samples_per_s"] is not None else "",
        ]
        for r in result["rows"]
    ]
    headers = ["variant", "samples/s", "x 1-thread", "of 2x limit", "rounds min-max", "load before", "notes"]
    return tabulate(body, headers=headers, disable_numparse=True)


def paired_table(result: dict[str, Any]) -> str:
    body = [[p["pd"].removeprefix(PD_PREFIX), p["torch"].removeprefix(TORCH_PREFIX),
             " ".join(f"{x:.2f}" for x in p["per_round"]) or "-",
             "-" if p["median"] is None else f"{p['median']:.2f}x",
             "-" if p.get("ceiling") is None else f"{p['ceiling']:.2f}x"] for p in result["paired"]]
    return tabulate(body, headers=["pd", "torch.pipelining", "pd / torch per round", "median",
                                   "the order's ceiling"], disable_numparse=True)


def spread(values: Sequence[float | None]) -> str:
    done = [v for v in values if v is not None]
    return f"{min(done):.0f}-{max(done):.0f}" if len(done) > 1 else "-"


def short_reason(note: str) -> str:
    """`unavailable: <last line of the reason>`: the exception, not the traceback above it."""
    return (UNAVAILABLE + note.split(" | ")[-1].removeprefix(UNAVAILABLE))[:MAX_REASON_CHARS]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    d = BenchShape()
    p.add_argument("--steps", type=int, default=d.num_steps, help="timed steps (minibatches) per variant")
    p.add_argument("--warmup", type=int, default=d.num_warmup_steps, help="untimed steps first")
    p.add_argument("--width", type=int, default=d.width)
    p.add_argument("--layers", type=int, default=d.num_layers)
    p.add_argument("--batch", type=int, default=d.batch_size)
    p.add_argument("--microbatches", type=int, default=d.num_microbatches)
    p.add_argument("--large-microbatches", type=int, default=DEFAULT_LARGE_MICROBATCHES,
                   help="`large` section: this many microbatches of --batch samples each")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: small, large")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="run every variant this many times; report the median")
    p.add_argument("--timeout-s", type=float, default=240.0, help="per variant; a variant past it is killed")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results")
    p.add_argument("--only", default="", help="comma-separated: run only the rows whose name contains one of these")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    own_profiles()  # fresh profiles, not copies of an earlier run's
    try:
        shape = BenchShape(args.width, args.layers, args.batch, args.microbatches, args.steps, args.warmup)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    if args.rounds < 1 or args.timeout_s <= 0 or args.large_microbatches < 1 or not sections \
            or any(x not in SECTIONS for x in sections):
        print(f"error: --rounds, --large-microbatches must be >= 1, --timeout-s > 0 and --sections a list of "
              f"{', '.join(SECTIONS)}; got {args.rounds}, {args.large_microbatches}, {args.timeout_s}, {args.sections!r}",
              file=sys.stderr)
        return 2
    results: dict[str, Any] = {"num_rounds": args.rounds, "sections": {}}
    for section in sections:
        run_shape = section_shape(shape, section, args.large_microbatches)
        only = [x.strip() for x in args.only.split(",") if x.strip()]
        rows = measure_all(run_shape, args.timeout_s, args.rounds, section, only)
        results["sections"][section] = report(run_shape, rows)
    for section, result in results["sections"].items():
        run_shape = BenchShape(**result["shape"])
        print(
            f"\n[{section}] MLP {run_shape.num_layers} x {run_shape.width}, batch {run_shape.batch_size} in "
            f"{run_shape.num_microbatches} microbatches of {run_shape.batch_size // run_shape.num_microbatches}, "
            f"{NUM_STAGES} stages, {run_shape.num_steps} timed steps after {run_shape.num_warmup_steps} warm-up, "
            f"{args.rounds} round(s); samples/s = median over steps (and rounds); physical limit = "
            f"{NUM_STAGES}x single-thread, unsplit flush-bubble bound = {result['flush_bubble_bound_ratio']:.2f}x"
        )
        print(table(result))
        if result["paired"]:
            print(f"\npaired, pd / torch.pipelining in each round (median of the rounds):\n{paired_table(result)}")
    atomic_write_json(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

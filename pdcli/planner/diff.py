"""`pd plan diff A B`: stage boundaries, replication, ranks, predicted time and memory.

A diff is `changed` when the stages (boundaries, replicas, ranks, any prediction), the
pipeline predictions or what the run executes (RUN_INPUTS: the schedule, its microbatches, split
backward, merged weight gradients) differ. Differences in other `inputs` alone (e.g. another
profile hash that gives the same plan) are listed but do not count as a change.
`regressed(pct)` is true when the predicted throughput of B is more than `pct` percent below A's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

from tabulate import tabulate

from pdcli.planner.plan import PIPELINE_KEYS
from pdcli.planner.render import TABLE_STYLE, format_ranks
from pdcli.profiler.summary import format_bytes
from pdcli.rundir import canonical_json

STAGE_FIELDS = ("start", "end", "replicas", "ranks")
RUN_INPUTS = ("schedule", "num_microbatches", "split_backward", "merge_weight_grads")
"""Inputs the run executes as the plan says (the configuration search chooses them): a
difference in one is a change like a moved boundary."""
RUN_INPUT_DEFAULTS = {"split_backward": False, "merge_weight_grads": False}
"""What a plan without the key means (plans without a split backward, or without merged weight
gradients, omit it)."""
MISSING = "-"


@dataclass(frozen=True)
class PlanDiff:
    stages_a: tuple[dict[str, Any], ...]
    stages_b: tuple[dict[str, Any], ...]
    pipeline_a: dict[str, Any]
    pipeline_b: dict[str, Any]
    changes: tuple[str, ...]
    """One line per difference in stages or pipeline predictions."""
    input_changes: tuple[str, ...] = field(default=())

    @property
    def changed(self) -> bool:
        return bool(self.changes)

    @property
    def throughput_change_pct(self) -> float:
        a = float(self.pipeline_a.get("throughput_samples_per_s", 0.0))
        b = float(self.pipeline_b.get("throughput_samples_per_s", 0.0))
        return 0.0 if a == b else (float("inf") if a == 0 else (b - a) / a * 100.0)

    def regressed(self, threshold_pct: float) -> bool:
        """B's predicted throughput is more than `threshold_pct` percent below A's."""
        return self.throughput_change_pct < -float(threshold_pct)

    def to_json(self) -> dict[str, Any]:
        return {
            "changed": self.changed,
            "throughput_change_pct": round(self.throughput_change_pct, 6),
            "changes": list(self.changes),
            "input_changes": list(self.input_changes),
            "stages": [_pair(a, b) for a, b in zip_longest(self.stages_a, self.stages_b)],
            "pipeline": {k: {"a": self.pipeline_a.get(k), "b": self.pipeline_b.get(k)} for k in PIPELINE_KEYS},
        }


def _pair(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any]:
    def view(s: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if s is None else {**{k: s.get(k) for k in STAGE_FIELDS}, "predicted": s.get("predicted", {})}

    return {"a": view(a), "b": view(b)}


def diff_plans(a: dict[str, Any], b: dict[str, Any]) -> PlanDiff:
    stages_a = tuple(sorted(a.get("stages", []), key=lambda s: s["stage_id"]))
    stages_b = tuple(sorted(b.get("stages", []), key=lambda s: s["stage_id"]))
    changes: list[str] = []
    if len(stages_a) != len(stages_b):
        changes.append(f"number of stages: {len(stages_a)} -> {len(stages_b)}")
    for k, (sa, sb) in enumerate(zip(stages_a, stages_b)):
        for key in STAGE_FIELDS:
            if sa.get(key) != sb.get(key):
                changes.append(f"stage {k} {key}: {sa.get(key)} -> {sb.get(key)}")
        pa, pb = sa.get("predicted", {}), sb.get("predicted", {})
        for key in sorted(set(pa) | set(pb)):
            if pa.get(key) != pb.get(key):
                changes.append(f"stage {k} predicted {key}: {pa.get(key)} -> {pb.get(key)}")
    pipe_a, pipe_b = dict(a.get("pipeline", {})), dict(b.get("pipeline", {}))
    for key in PIPELINE_KEYS:
        if pipe_a.get(key) != pipe_b.get(key):
            changes.append(f"pipeline {key}: {pipe_a.get(key)} -> {pipe_b.get(key)}")
    in_a, in_b = a.get("inputs", {}), b.get("inputs", {})
    for key in RUN_INPUTS:
        if in_a.get(key, RUN_INPUT_DEFAULTS.get(key)) != in_b.get(key, RUN_INPUT_DEFAULTS.get(key)):
            changes.insert(0, f"{key}: {in_a.get(key)} -> {in_b.get(key)}")
    input_changes = tuple(
        f"inputs {key}: {in_a.get(key)} -> {in_b.get(key)}"
        for key in sorted(set(in_a) | set(in_b)) if in_a.get(key) != in_b.get(key)
    )
    return PlanDiff(stages_a, stages_b, pipe_a, pipe_b, tuple(changes), input_changes)


def _cell(a: Any, b: Any) -> str:
    return str(a) if a == b else f"{a} -> {b}"


def _num(s: dict[str, Any] | None, key: str) -> float | None:
    return None if s is None else s.get("predicted", {}).get(key)


def _arrow(a: float | None, b: float | None, fmt: Any = lambda x: f"{x:.4g}") -> str:
    if a is None or b is None:
        return fmt(a) if b is None and a is not None else (fmt(b) if b is not None else MISSING)
    if a == b:
        return fmt(a)
    pct = f" ({(b - a) / a * 100:+.1f}%)" if a else ""
    return f"{fmt(a)} -> {fmt(b)}{pct}"


def render_diff(diff: PlanDiff, fmt: str = "text") -> str:
    if fmt == "json":
        return canonical_json(diff.to_json()).rstrip("\n")
    if fmt not in TABLE_STYLE:
        raise ValueError(f"format {fmt!r} is not one of text, markdown, json")
    rows = []
    for k, (sa, sb) in enumerate(zip_longest(diff.stages_a, diff.stages_b)):
        rng = [f"[{s['start']}, {s['end']})" if s else MISSING for s in (sa, sb)]
        reps = [s["replicas"] if s else MISSING for s in (sa, sb)]
        ranks = [format_ranks(s["ranks"]) if s else MISSING for s in (sa, sb)]
        rows.append([k, _cell(*rng), _cell(*reps), _cell(*ranks),
                     _arrow(_num(sa, "stage_time_ms"), _num(sb, "stage_time_ms")),
                     _arrow(_num(sa, "total_bytes"), _num(sb, "total_bytes"), format_bytes)])
    headers = ["stage", "positions", "replicas", "ranks", "stage ms", "memory"]
    table = tabulate(rows, headers=headers, tablefmt=TABLE_STYLE[fmt])
    pa, pb = diff.pipeline_a, diff.pipeline_b
    lines = [
        "plans are identical" if not diff.changed else f"plans differ ({len(diff.changes)} differences)",
        "",
        table,
        "",
        "time per minibatch: " + _arrow(pa.get("time_per_minibatch_ms"), pb.get("time_per_minibatch_ms")) + " ms",
        "throughput: " + _arrow(pa.get("throughput_samples_per_s"), pb.get("throughput_samples_per_s"))
        + " samples/s",
    ]
    lines += list(diff.input_changes)
    return "\n".join(lines)

"""`train/timeline.png` (the measured schedule as a Gantt chart) and `train/loss.png` (loss and accuracy).

Drawn with matplotlib's Agg backend (no display) and written atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from pdcli.report.measured import COMM, IDLE, WEIGHT_GRADS, RankTrace, completion_times_ms  # noqa: E402
from pdcli.rundir import atomic_save  # noqa: E402

TIMELINE_FILE = "timeline.png"
LOSS_FILE = "loss.png"
DPI = 110
MS_PER_S = 1e3
OTHER_COMPUTE = "other compute"
KIND_COLORS = {
    "Forward": "tab:blue",
    "Backward": "tab:green",
    WEIGHT_GRADS: "tab:olive",
    "OptimizerStep": "tab:purple",
    OTHER_COMPUTE: "tab:gray",
    COMM: "tab:red",
    IDLE: "#dddddd",
}
"""Legend order; actions not named here are drawn by their category."""
OPTIONAL_KINDS = (WEIGHT_GRADS,)
"""In the legend only when the run has them (split backward)."""


def _kind(name: str, category: str) -> str:
    if name in KIND_COLORS:
        return name
    return category if category in (COMM, IDLE) else OTHER_COMPUTE


def timeline_window_ms(done_ms: Sequence[float], start_step: int | None, num_steps: int) -> tuple[float, float, int]:
    """(start, end, first step) of `num_steps` minibatches from `start_step` (default: mid-run, steady state)."""
    if not done_ms:
        return 0.0, float("inf"), 0
    first = len(done_ms) // 2 if start_step is None else max(0, min(start_step, len(done_ms) - 1))
    start_ms = done_ms[first - 1] if first > 0 else 0.0
    end_ms = done_ms[min(first + num_steps, len(done_ms)) - 1]
    return start_ms, end_ms, first


def draw_timeline(ranks: dict[int, RankTrace], num_microbatches: int, stage_ranks: Sequence[Sequence[int]],
                  out: Path, num_steps: int = 3, start_step: int | None = None) -> Path:
    """A Gantt chart of every rank's actions over `num_steps` minibatches; returns `out`."""
    first_stage = [ranks[r] for r in stage_ranks[0] if r in ranks]
    start_ms, end_ms, first = timeline_window_ms(completion_times_ms(first_stage, num_microbatches), start_step, num_steps)
    order = sorted(ranks)
    fig, ax = plt.subplots(figsize=(13, 1.6 + 0.6 * max(len(order), 1)))
    present = {s.name for trace in ranks.values() for s in trace.spans}
    for row, rank in enumerate(order):
        bars: dict[str, list[tuple[float, float]]] = {}
        for s in ranks[rank].spans:
            lo, hi = max(s.start_ms, start_ms), min(s.end_ms, end_ms)
            if hi > lo:
                bars.setdefault(_kind(s.name, s.category), []).append((lo - start_ms, hi - lo))
        for kind, xs in bars.items():
            ax.broken_barh(xs, (row - 0.4, 0.8), facecolors=KIND_COLORS[kind], linewidth=0)
    ax.set_yticks(range(len(order)), [ranks[r].label for r in order])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    last = first + num_steps
    ax.set_title(f"measured timeline, minibatches {first}..{last - 1} (ms from the end of minibatch {first - 1})"
                 if first > 0 else f"measured timeline, minibatches 0..{last - 1}")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in KIND_COLORS.items()
                       if k not in OPTIONAL_KINDS or k in present], loc="center left",
              bbox_to_anchor=(1.01, 0.5), fontsize="small")
    fig.tight_layout()
    _save(fig, out)
    return out


def wall_times_s(metrics: Sequence[dict[str, Any]], batch_size: int) -> list[float]:
    """Wall time (s from the loop start) of each metrics line, from its steps and samples/s."""
    out, clock_s, previous = [], 0.0, 0
    for line in metrics:
        step = int(line["step"])
        rate = float(line.get("samples_per_s") or 0.0)
        clock_s += batch_size * (step - previous) / rate if rate > 0 else 0.0
        out.append(clock_s)
        previous = step
    return out


def draw_loss(metrics: Sequence[dict[str, Any]], minibatch_losses: Sequence[float], batch_size: int, out: Path,
              evals: Sequence[dict[str, Any]] = ()) -> Path:
    """Loss and accuracy over steps (top) and over wall time (bottom), the held-out evaluations
    (`evals`) beside them over steps; returns `out`."""
    steps = [int(line["step"]) for line in metrics]
    wall_s = wall_times_s(metrics, batch_size)
    has_accuracy = any("accuracy" in line for line in metrics)
    fig, axes = plt.subplots(2, 2 if has_accuracy else 1, figsize=(11, 7), squeeze=False)
    per_step = list(range(1, len(minibatch_losses) + 1))
    axes[0][0].plot(per_step, minibatch_losses, color="tab:blue", alpha=0.35, linewidth=0.8, label="per minibatch")
    axes[0][0].plot(steps, [line["loss"] for line in metrics], "o-", color="tab:blue", label="logged mean")
    if evals:
        axes[0][0].plot([e["step"] for e in evals], [e["eval_loss"] for e in evals], "s--", color="tab:green",
                        label="held-out")
    axes[0][0].set(xlabel="step (minibatch)", ylabel="loss", title="loss over steps")
    axes[0][0].legend(fontsize="small")
    if minibatch_losses and wall_s:
        # a minibatch's wall time is interpolated between the logged lines around it
        import numpy as np

        per_step_s = np.interp(per_step, [0, *steps], [0.0, *wall_s])
        axes[1][0].plot(per_step_s, minibatch_losses, color="tab:blue", alpha=0.35, linewidth=0.8)
    axes[1][0].plot(wall_s, [line["loss"] for line in metrics], "o-", color="tab:blue")
    axes[1][0].set(xlabel="wall time (s, training loop)", ylabel="loss", title="loss over wall time")
    if has_accuracy:
        acc = [(s, w, line["accuracy"]) for s, w, line in zip(steps, wall_s, metrics) if "accuracy" in line]
        axes[0][1].plot([a[0] for a in acc], [a[2] for a in acc], "o-", color="tab:orange")
        held_out = [e for e in evals if "eval_accuracy" in e]
        if held_out:
            axes[0][1].plot([e["step"] for e in held_out], [e["eval_accuracy"] for e in held_out], "s--",
                            color="tab:green", label="held-out")
            axes[0][1].legend(fontsize="small")
        axes[0][1].set(xlabel="step (minibatch)", ylabel="accuracy", title="accuracy over steps")
        axes[1][1].plot([a[1] for a in acc], [a[2] for a in acc], "o-", color="tab:orange")
        axes[1][1].set(xlabel="wall time (s, training loop)", ylabel="accuracy", title="accuracy over wall time")
    fig.tight_layout()
    _save(fig, out)
    return out


def _save(fig: Any, out: Path) -> None:
    try:
        atomic_save(out, lambda name: fig.savefig(name, format="png", dpi=DPI))
    finally:
        plt.close(fig)

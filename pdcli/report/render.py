"""`pd report` output: text and Markdown tables, or one JSON object."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tabulate import tabulate

from pdcli.report.compare import Comparison, relative_pct
from pdcli.report.measured import WEIGHT_GRADS, pipeline_bubble
from pdcli.runtime.evaluation import eval_metrics_text
from pdcli.runtime.link import link_text
from pdcli.schedule.spec import rules

TEXT, MARKDOWN, JSON = "text", "markdown", "json"
TABLE_FORMAT = {TEXT: "simple", MARKDOWN: "github"}
MS_PER_S = 1e3
PIPEDREAM_NOTE = ", each its own PipeDream minibatch with its own optimizer step"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0f}%"


def _rate(batch_size: int, time_per_minibatch_ms: float | None) -> str:
    return "-" if not time_per_minibatch_ms else f"{batch_size * MS_PER_S / time_per_minibatch_ms:.0f}"


def _frac(value: float) -> str:
    return f"{value * 100:.1f}%"


def stage_rows(c: Comparison) -> list[list[str]]:
    """One row per stage, predicted / measured (STAGE_HEADERS; with CPU_HEADER after the compute
    and COMM_CPU_HEADER after the comm where the replay shared cores)."""
    rows = []
    shared = c.predicted.shared_cores
    for s in c.stages:
        p, m = s.predicted, s.measured
        cpu = [f"{_ms(p.compute_cpu_ms)} / {_ms(m.compute_cpu_ms)}"] if shared else []
        comm_cpu = [f"{_ms(p.comm_cpu_ms)} / {_ms(m.comm_cpu_ms)}"] if shared else []
        rows.append([
            str(s.stage_id), str(m.replicas), f"{_ms(p.compute_ms)} / {_ms(m.compute_ms)}", *cpu,
            f"{_ms(p.comm_ms)} / {_ms(m.comm_ms)}", *comm_cpu,
            f"{_ms(p.idle_ms)} / {_ms(m.idle_ms)}", f"{_ms(p.stage_time_ms)} / {_ms(m.stage_time_ms)}",
            _pct(s.stage_time_drift_pct) + (" DRIFT" if s.drifted else ""),
            f"{_frac(p.bubble_fraction)} / {_frac(m.bubble_fraction)}",
        ])
    return rows


STAGE_HEADERS = ["stage", "replicas", "compute ms", "comm ms", "idle ms", "stage time ms", "drift", "bubble"]
CPU_HEADER, COMM_CPU_HEADER = "compute CPU ms", "comm CPU ms"
"""The columns shown where the replay ran the workers on shared cores: the drift is judged on them
(`pdcli.report.compare.compute_pair`, `comm_pair`)."""


def stage_headers(c: Comparison) -> list[str]:
    if not c.predicted.shared_cores:
        return STAGE_HEADERS
    return [*STAGE_HEADERS[:3], CPU_HEADER, STAGE_HEADERS[3], COMM_CPU_HEADER, *STAGE_HEADERS[4:]]


MAIN_ACTIONS = ("Forward", "Backward", "OptimizerStep")
SPLIT_ACTIONS = ("Forward", "Backward", WEIGHT_GRADS, "OptimizerStep")
"""MAIN_ACTIONS of a run with a split backward: its Backward leaves the weight gradients to WeightGrads."""


def has_weight_grads(c: Comparison) -> bool:
    """The run traced WeightGrads actions (a split backward)."""
    return any(WEIGHT_GRADS in s.measured.actions_ms for s in c.stages)


def action_rows(c: Comparison) -> list[list[str]]:
    """Where a stage's measured compute goes (ms per minibatch), beside the plan's fwd/bwd (and,
    with WeightGrads, the plan's bwd less its wgrad beside Backward, its wgrad beside WeightGrads)."""
    split = has_weight_grads(c)
    rows = []
    for s in c.stages:
        m, p = s.measured, s.predicted
        main = [m.actions_ms.get(name) for name in (SPLIT_ACTIONS if split else MAIN_ACTIONS)]
        other = m.compute_ms - sum(x or 0.0 for x in main) if m.actions_ms else None
        plan = [p.fwd_ms, p.bwd_ms - p.wgrad_ms, p.wgrad_ms] if split else [p.fwd_ms, p.bwd_ms]
        rows.append([str(s.stage_id), *(_ms(x / p.replicas) for x in plan), _ms(p.optimizer_ms),
                     *map(_ms, main), _ms(other)])
    return rows


ACTION_HEADERS = ["stage", "plan fwd", "plan bwd", "plan optim", "Forward", "Backward", "OptimizerStep", "other compute"]
SPLIT_ACTION_HEADERS = ["stage", "plan fwd", "plan bwd", "plan wgrad", "plan optim", "Forward", "Backward", WEIGHT_GRADS,
                        "OptimizerStep", "other compute"]


def render(c: Comparison, fmt: str, run_dir: Path, charts: dict[str, Path]) -> str:
    if fmt == JSON:
        return json.dumps(to_json(c, run_dir, charts), indent=1, sort_keys=True)
    table_fmt = TABLE_FORMAT[fmt]
    m, p = c.measured, c.predicted
    steady = m.steady_time_per_minibatch_ms
    lines = []
    if fmt == MARKDOWN:
        lines.append(f"## pd report: `{run_dir}`\n")
    lines.append(
        f"{m.schedule}{' with split backward' if p.split_backward or has_weight_grads(c) else ''}"
        f"{' (weight gradients merged per chunk)' if p.merge_weight_grads else ''}, "
        f"{len(c.stages)} stages, {m.num_steps} minibatches of {m.batch_size} samples "
        + (f"(this launch, resumed after minibatch {m.first_step}) " if m.first_step else "") +
        f"({m.num_microbatches} microbatches each{PIPEDREAM_NOTE if rules(m.schedule).step_per_microbatch else ''}); "
        f"final loss {m.final_loss:.4f}" + ("" if m.final_accuracy is None else f", accuracy {m.final_accuracy:.3f}")
        + " (training minibatches)" + ("" if not m.eval_metrics else "; held-out eval: " + ", ".join(
            f"{k.removeprefix('eval_')} {v}" for k, v in eval_metrics_text(m.eval_metrics).items()))
    )
    lines.extend(event_lines(m.events))
    lines.append("")
    lines.append("per stage, predicted / measured, ms per minibatch (of one replica; stage time = compute + comm"
                 + ("; the workers share cores, so the drift is judged on compute CPU + comm CPU):" if p.shared_cores
                    else "):"))
    lines.append(tabulate(stage_rows(c), headers=stage_headers(c), tablefmt=table_fmt, disable_numparse=True))
    lines.append("")
    pipeline = [
        ["time per minibatch (ms)", _ms(p.time_per_minibatch_ms), _ms(steady), _pct(relative_pct(steady, p.time_per_minibatch_ms) if steady else None)],
        ["  whole loop incl. fill/drain (ms)", _ms(p.whole_loop_per_minibatch_ms), _ms(m.time_per_minibatch_ms),
         _pct(relative_pct(m.time_per_minibatch_ms, p.whole_loop_per_minibatch_ms))],
        ["throughput (samples/s)", f"{p.throughput_samples_per_s:.0f}", _rate(m.batch_size, steady),
         _pct(relative_pct(m.batch_size * MS_PER_S / steady, p.throughput_samples_per_s) if steady else None)],
        ["  whole loop (samples/s)", _rate(m.batch_size, p.whole_loop_per_minibatch_ms), f"{m.samples_per_s:.0f}",
         _pct(relative_pct(m.samples_per_s, m.batch_size * MS_PER_S / p.whole_loop_per_minibatch_ms)
              if p.whole_loop_per_minibatch_ms > 0 else None)],
        ["bubble (all ranks)", _frac(p.bubble_fraction), _frac(pipeline_bubble(s.measured for s in c.stages)), ""],
    ]
    lines.append(tabulate(pipeline, headers=["pipeline", "predicted", "measured", "diff"], tablefmt=table_fmt, disable_numparse=True))
    lines.append("")
    split = has_weight_grads(c)
    lines.append("measured compute per action, ms per minibatch (other compute: data loads and weight stashing, beside the plan's fwd, bwd and optimizer steps"
                 + ("; split backward: Backward and plan bwd leave the weight gradients to WeightGrads and plan wgrad" if split else "")
                 + "):")
    lines.append(tabulate(action_rows(c), headers=SPLIT_ACTION_HEADERS if split else ACTION_HEADERS, tablefmt=table_fmt,
                          disable_numparse=True))
    lines.append("")
    lines.extend(host_lines(c))
    lines.extend(link_lines(c))
    if c.drift is None:
        judged = "every stage's compute CPU + comm CPU" if p.shared_cores else "every stage time"
        lines.append(f"no drift: {judged} is within {c.threshold_pct:g}% of the plan")
    else:
        d = c.drift
        why = ("the run's action costs differ from the profile's runtime probe: refit them from this run and re-plan"
               if d.calibrate else
               "compute differs from the profile: re-profile and re-plan" if d.reprofile else
               "communication differs from the plan: check cluster.levels bandwidth_bytes_per_s, then re-plan")
        lines.append(f"WARNING: stage(s) {', '.join(map(str, d.stage_ids))} drifted more than {c.threshold_pct:g}% from the plan ({why}):")
        lines.append(f"  {d.command}" if fmt == TEXT else f"\n```\n{d.command}\n```")
    for name, path in charts.items():
        lines.append(f"{name}: {path}")
    return "\n".join(lines)


HOST_NOTE_PCT = 10.0
"""How far the host's speed after the run may be from the profile's before the report says so."""


def host_lines(c: Comparison) -> list[str]:
    """The host's reference matmul when profiled and after the run, and whether the host was
    slower or faster for the run by more than HOST_NOTE_PCT (none where either is missing)."""
    ratio = c.host_speed_ratio
    if ratio is None:
        return []
    line = (f"host: a one-thread reference matmul took {c.profiled_host_speed_ms:.3f} ms when profiled, "
            f"{c.measured.host_speed_ms:.3f} ms after the run ({ratio:.2f}x)")
    if abs(ratio - 1.0) * 100 > HOST_NOTE_PCT:
        line += (f": the host ran {'slower' if ratio > 1 else 'faster'} than when profiled; that much of any "
                 "difference from the plan is the host's level, not the plan's (re-profile to price this level)")
    return [line]


def link_lines(c: Comparison) -> list[str]:
    """The link measured between hosts beside the configured level, and the warning when they
    are more than 2x apart (none without a measurement)."""
    link = c.measured.link
    if link is None:
        return []
    return [f"link {link_text(link)}", *([c.link_warning] if c.link_warning else [])]


def event_lines(events: tuple[dict[str, Any], ...]) -> list[str]:
    """The run's restarts (`train.max_restarts`) and failures, one line each, root cause named."""
    restarts = [e for e in events if e.get("event") == "restart"]
    if not events:
        return []
    lines = [f"restarts: {len(restarts)}"]
    for e in events:
        where = f"rank {e.get('rank')} (stage {e.get('stage')})"
        then = (f"restarted from checkpoint step {e['resume_step']}" if e.get("resume_step") is not None
                else "restarted from the start" if e.get("event") == "restart" else "the job stopped")
        lines.append(f"  {e.get('event')}: {where}, {e.get('cause')}; {then}")
    return lines


def to_json(c: Comparison, run_dir: Path, charts: dict[str, Path]) -> dict[str, Any]:
    m, p = c.measured, c.predicted
    stages = []
    for s in c.stages:
        stages.append({
            "stage_id": s.stage_id, "replicas": s.measured.replicas,
            "predicted": {"compute_ms": s.predicted.compute_ms, "comm_ms": s.predicted.comm_ms, "idle_ms": s.predicted.idle_ms,
                          "stage_time_ms": s.predicted.stage_time_ms, "fwd_ms": s.predicted.fwd_ms, "bwd_ms": s.predicted.bwd_ms,
                          "wgrad_ms": s.predicted.wgrad_ms, "wall_ms": s.predicted.wall_ms,
                          "compute_cpu_ms": s.predicted.compute_cpu_ms, "comm_cpu_ms": s.predicted.comm_cpu_ms,
                          "bubble_fraction": s.predicted.bubble_fraction},
            "measured": {"compute_ms": s.measured.compute_ms, "comm_ms": s.measured.comm_ms, "idle_ms": s.measured.idle_ms,
                         "stage_time_ms": s.measured.stage_time_ms, "wall_ms": s.measured.wall_ms,
                         "compute_cpu_ms": s.measured.compute_cpu_ms, "comm_cpu_ms": s.measured.comm_cpu_ms,
                         "bubble_fraction": s.measured.bubble_fraction, "actions_ms": s.measured.actions_ms},
            "stage_time_drift_pct": s.stage_time_drift_pct, "compute_drift_pct": s.compute_drift_pct, "drifted": s.drifted,
        })
    return {
        "run": str(run_dir), "schedule": m.schedule, "num_steps": m.num_steps, "unit": "ms per minibatch",
        "stages": stages,
        "pipeline": {
            "predicted": {"time_per_minibatch_ms": p.time_per_minibatch_ms,
                          "simulated_time_per_minibatch_ms": p.simulated_time_per_minibatch_ms,
                          "whole_loop_per_minibatch_ms": p.whole_loop_per_minibatch_ms,
                          "throughput_samples_per_s": p.throughput_samples_per_s, "bubble_fraction": p.bubble_fraction,
                          "split_backward": p.split_backward, "merge_weight_grads": p.merge_weight_grads,
                          "shared_cores": p.shared_cores},
            "measured": {"time_per_minibatch_ms": m.time_per_minibatch_ms,
                         "steady_time_per_minibatch_ms": m.steady_time_per_minibatch_ms,
                         "samples_per_s": m.samples_per_s, "bubble_fraction": pipeline_bubble(s.measured for s in c.stages),
                         "final_loss": m.final_loss, "final_accuracy": m.final_accuracy, **m.eval_metrics,
                         "events": list(m.events)},
            "time_per_minibatch_ratio": c.time_per_minibatch_ratio,
        },
        "link": c.measured.link, "link_warning": c.link_warning,
        "host_speed": {"profiled_ms": c.profiled_host_speed_ms, "run_ms": m.host_speed_ms, "ratio": c.host_speed_ratio},
        "drift_threshold_pct": c.threshold_pct,
        "drift": None if c.drift is None else {"stage_ids": list(c.drift.stage_ids), "reprofile": c.drift.reprofile,
                                                "calibrate": c.drift.calibrate, "command": c.drift.command},
        "charts": {k: str(v) for k, v in charts.items()},
    }

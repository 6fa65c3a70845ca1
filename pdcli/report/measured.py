"""What a training run measured, per minibatch: read `train/summary.json`, `metrics.jsonl`, `trace.json`.

A *minibatch* here is one batch of the data loader (`data.batch_size` samples, one
`train.steps` step), the unit of the plan's predictions, whatever the schedule: for
`pipedream`, whose every microbatch is a minibatch of its own (one optimizer step each),
one of our minibatches is `num_microbatches` PipeDream minibatches.

Totals are the runtime's per-stage totals (mean over a stage's replicas) divided by the
number of minibatches trained. The wall time of a rank is the span of its trace (first
action start to last action end), not the runtime's `wall_ms`, which also counts setup.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterable, Sequence

from pdcli.errors import UserError
from pdcli.runtime.evaluation import EVAL_KEYS, is_eval_line
from pdcli.runtime.events import read_events
from pdcli.runtime.link import read_link
from pdcli.host import HOST_SPEED_META
from pdcli.runtime.metrics import COMM, COMPUTE, IDLE, METRICS_FILE, SUMMARY_FILE, TRACE_FILE, read_metrics
from pdcli.schedule.actions import parse_action
from pdcli.schedule.simulator import drain_start_ms, steady_window

TRAIN_DIR = "train"
BACKWARD = "Backward"  # the action whose end completes a microbatch on the first stage
FORWARD = "Forward"  # the first stage's last one starts the pipeline's drain
WEIGHT_GRADS = "WeightGrads"  # with a split backward, the microbatch's weight gradients come after
US_PER_MS = 1e3


@dataclass(frozen=True)
class Span:
    """One traced action of one rank, ms from the start of the whole trace."""

    name: str
    category: str
    start_ms: float
    dur_ms: float
    chunk: int | None = None
    """With virtual stages: the chunk the action ran (from its text form); None otherwise."""
    microbatch: int | None = None
    """The microbatch a message action (Send*, Recv*) carries (from its text form); None otherwise."""

    @property
    def end_ms(self) -> float:
        return self.start_ms + self.dur_ms


@dataclass(frozen=True)
class RankTrace:
    """The traced actions of one rank (its `pid` in trace.json), in start order."""

    rank: int
    label: str
    spans: tuple[Span, ...]

    @property
    def span_ms(self) -> float:
        """Wall time from its first action's start to its last action's end."""
        if not self.spans:
            return 0.0
        return max(s.end_ms for s in self.spans) - self.spans[0].start_ms

    def total_ms(self, category: str) -> float:
        return sum(s.dur_ms for s in self.spans if s.category == category)


def read_trace(path: Path) -> dict[int, RankTrace]:
    """rank -> its RankTrace; an absent trace gives {}."""
    if not path.exists():
        return {}
    try:
        events = json.loads(path.read_text())["traceEvents"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a Chrome trace written by `pd train` ({e})", hint="re-run `pd train`") from None
    complete = [e for e in events if e.get("ph") == "X"]
    t0_us = min((float(e["ts"]) for e in complete), default=0.0)
    labels = {int(e["pid"]): str(e["args"]["name"]) for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    spans: dict[int, list[Span]] = {}
    for e in complete:
        start_ms = (float(e["ts"]) - t0_us) / US_PER_MS
        label = (e.get("args") or {}).get("action")
        name = str(e["name"])
        spans.setdefault(int(e["pid"]), []).append(Span(name, str(e.get("cat", "")), start_ms,
                                                        float(e["dur"]) / US_PER_MS, chunk_of(label),
                                                        microbatch_of(label) if name.startswith(MESSAGES) else None))
    return {
        rank: RankTrace(rank, labels.get(rank, f"rank {rank}"), tuple(sorted(s, key=lambda x: x.start_ms)))
        for rank, s in sorted(spans.items())
    }


MESSAGES = ("Send", "Recv")
"""The names of message actions start so (SendActivations, RecvGrads, ...)."""


def microbatch_of(text: Any) -> int | None:
    """The microbatch of an action's text form (`RG6<-r0`), None when it is no action."""
    if not isinstance(text, str):
        return None
    try:
        return getattr(parse_action(text), "microbatch_id", None)
    except ValueError:
        return None


def chunk_of(text: Any) -> int | None:
    """The chunk of an action's text form (`F3:c2@v1`), None when it names none or is no action."""
    if not isinstance(text, str) or ":c" not in text:
        return None
    try:
        return getattr(parse_action(text), "chunk", None)
    except ValueError:
        return None


def pipeline_bubble(stages: Iterable[Any]) -> float:
    """Share of all ranks' wall time spent waiting for a peer: the stages' `idle_ms` over their
    `wall_ms`, each stage counted once per replica. `pd report`'s "bubble (all ranks)", the same
    rule for the plan's replayed stages and the run's measured ones."""
    rows = [(s.idle_ms * s.replicas, s.wall_ms * s.replicas) for s in stages]
    wall = sum(w for _, w in rows)
    return sum(i for i, _ in rows) / wall if wall > 0 else 0.0


@dataclass(frozen=True)
class MeasuredStage:
    """One stage, ms per minibatch on one replica (replicas averaged)."""

    stage_id: int
    replicas: int
    compute_ms: float
    comm_ms: float
    idle_ms: float
    wall_ms: float
    """Trace span of its ranks (longest replica) per minibatch, at least compute + comm + idle."""
    actions_ms: dict[str, float]
    """Traced time per action name (Forward, Backward, OptimizerStep, ...), ms per minibatch
    (over the traced minibatches, when the runtime stopped tracing a long run)."""
    compute_cpu_ms: float | None = None
    """The CPU time of its processes inside compute actions (None: a run from before it was
    counted). Where workers share cores, compute_ms also holds the time other workers ran."""
    comm_cpu_ms: float | None = None
    """The same inside comm actions (None: a run from before it was counted)."""

    @property
    def stage_time_ms(self) -> float:
        """Busy time: compute + comm (what the plan's stage_time_ms predicts)."""
        return self.compute_ms + self.comm_ms

    @property
    def bubble_fraction(self) -> float:
        """Share of the wall time spent waiting for a peer."""
        return self.idle_ms / self.wall_ms if self.wall_ms > 0 else 0.0


@dataclass(frozen=True)
class Measured:
    """A finished run's measurements."""

    schedule: str
    num_steps: int
    """Minibatches this launch trained and timed: `train.steps`, less the minibatches before a
    resume (`first_step`)."""
    batch_size: int
    """Samples per minibatch (`data.batch_size`)."""
    num_microbatches: int
    stages: tuple[MeasuredStage, ...]
    time_per_minibatch_ms: float
    """Training loop time / minibatches (start-up fill and final drain included)."""
    steady_time_per_minibatch_ms: float | None
    """From the trace: time between minibatch completions on the first stage over the
    second half of the run (the simulator's definition); None without a trace."""
    samples_per_s: float
    final_loss: float
    final_accuracy: float | None
    minibatch_losses: tuple[float, ...]
    metrics: tuple[dict[str, Any], ...]
    """The live metrics.jsonl lines of training (the `final` line and evaluations excluded)."""
    ranks: dict[int, RankTrace]
    evals: tuple[dict[str, Any], ...] = ()
    """Every evaluation on the held-out split: {"step": minibatches before it, "eval_loss": ...}."""
    eval_metrics: dict[str, float] = field(default_factory=dict)
    """The evaluation at the end (`pdcli.runtime.evaluation.EVAL_KEYS`); empty: none."""
    events: tuple[dict[str, Any], ...] = ()
    """`train/events.jsonl`: the restarts (and failures) of the run (`pdcli.runtime.events`)."""
    first_step: int = 0
    host_speed_ms: float | None = None
    """`pdcli.host.host_speed_ms` measured right after the run (None: not a CPU run, or a run of an older pd)."""
    """Minibatches trained before this launch resumed the run (0: not resumed)."""
    link: dict[str, Any] | None = None
    """The link measured between hosts (`train/link.json`, else the summary's; None: one host,
    or `train.measure_link` off)."""


def _read_json(path: Path, next_step: str) -> Any:
    if not path.exists():
        raise UserError(f"{path} not found: the run has not been trained", hint=f"run `{next_step}` first")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})", hint=f"re-run `{next_step}`") from None


def completion_times_ms(first_stage: Sequence[RankTrace], num_microbatches: int) -> list[float]:
    """When each minibatch completed: the end of the last backward (and, with a split backward,
    the last WeightGrads) of its microbatches on the first stage, as the simulator counts it
    (`num_microbatches`: the backwards a rank runs per minibatch, M x its chunks).
    Every schedule runs a replica's backwards oldest first, and its WeightGrads too, so the
    k-th backward (WeightGrads) to end belongs to microbatch k."""
    per_name = [sorted(s.end_ms for r in first_stage for s in r.spans if s.name == name)
                for name in (BACKWARD, WEIGHT_GRADS)]
    ends_ms = [ends for ends in per_name if ends]
    count = min((len(ends) for ends in ends_ms), default=0) // num_microbatches
    return [max(ends[(t + 1) * num_microbatches - 1] for ends in ends_ms) for t in range(count)]


def steady_completions(first_stage: Sequence[RankTrace], num_microbatches: int) -> tuple[list[float], int, int]:
    """The traced run's completion times and the (first, last) of them whose intervals are
    its steady state, as a replay counts it (`pdcli.schedule.simulator.steady_window`: the
    second half before the drain)."""
    done_ms = completion_times_ms(first_stage, num_microbatches)
    drain_ms = drain_start_ms([s.start_ms for s in r.spans if s.name == FORWARD] for r in first_stage)
    first, last = steady_window(done_ms, drain_ms)
    return done_ms, first, last


def steady_time_per_minibatch_ms(first_stage: Sequence[RankTrace], num_microbatches: int,
                                 evaluated_after: Collection[int] = ()) -> float | None:
    """Mean time between minibatch completions over the steady completions of the traced
    run (`steady_completions`). The run evaluated after each minibatch index (from the
    trace's first) in `evaluated_after`: the interval that holds an evaluation is left out
    (the plan prices training)."""
    done_ms, first, last = steady_completions(first_stage, num_microbatches)
    gaps = [done_ms[i] - done_ms[i - 1] for i in range(first + 1, last + 1) if i not in evaluated_after]
    return sum(gaps) / len(gaps) if gaps else None


def evaluated_after(summary: dict[str, Any]) -> set[int]:
    """The minibatch counts of a run's `summary.json` after which it evaluated, counted from
    the first minibatch its trace holds (a resumed run traces from where it resumed)."""
    first = int(summary.get("first_step", 0))
    return {int(e["step"]) - first for e in summary.get("evals", ())}


def load_measured(train_dir: Path, batch_size: int, num_microbatches: int, stage_ranks: list[list[int]],
                  next_step: str, chunks_per_rank: int = 1) -> Measured:
    """Read a finished run from `train_dir`. `stage_ranks[k]` are the ranks of stage k (from
    the plan); `next_step` is the command named when the run is missing; `chunks_per_rank`:
    virtual stages, each of which backwards every microbatch."""
    summary = _read_json(train_dir / SUMMARY_FILE, next_step)
    first_step = int(summary.get("first_step", 0))
    steps = max(1, int(summary["steps"]) - first_step)  # a resumed launch's totals and loop are its own
    ranks = read_trace(train_dir / TRACE_FILE)
    stage_of_rank = {rank: k for k, group in enumerate(stage_ranks) for rank in group}
    stages = []
    for row in summary["stages"]:
        stage_id = int(row["stage_id"])
        own = [r for rank, r in ranks.items() if stage_of_rank.get(rank) == stage_id]
        totals_ms = float(row["compute_ms"]) + float(row["comm_ms"]) + float(row["idle_ms"])
        # the runtime stops tracing a rank after MAX_TRACE_EVENTS (its totals keep counting):
        # the span then covers part of the run, the totals all of it
        wall_ms = max(max((r.span_ms for r in own), default=0.0), totals_ms)
        traced_ms = sum(s.dur_ms for r in own for s in r.spans) / max(len(own), 1)
        traced_steps = steps * min(1.0, traced_ms / totals_ms) if totals_ms > 0 else steps
        actions: dict[str, float] = {}
        for r in own:
            for s in r.spans:
                actions[s.name] = actions.get(s.name, 0.0) + s.dur_ms / (len(own) * traced_steps)
        stages.append(MeasuredStage(
            stage_id=stage_id, replicas=int(row["replicas"]), compute_ms=float(row["compute_ms"]) / steps,
            comm_ms=float(row["comm_ms"]) / steps, idle_ms=float(row["idle_ms"]) / steps, wall_ms=wall_ms / steps,
            actions_ms=dict(sorted(actions.items())),
            compute_cpu_ms=float(row["compute_cpu_ms"]) / steps if "compute_cpu_ms" in row else None,
            comm_cpu_ms=float(row["comm_cpu_ms"]) / steps if "comm_cpu_ms" in row else None,
        ))
    first = [r for rank, r in ranks.items() if stage_of_rank.get(rank) == 0]
    lines = read_metrics(train_dir / METRICS_FILE)
    accuracy = summary.get("final_accuracy")
    return Measured(
        schedule=str(summary["schedule"]), num_steps=steps, batch_size=batch_size, num_microbatches=num_microbatches,
        stages=tuple(stages),
        time_per_minibatch_ms=float(summary["loop_s"]) * US_PER_MS / steps,
        steady_time_per_minibatch_ms=steady_time_per_minibatch_ms(first, num_microbatches * chunks_per_rank,
                                                                  evaluated_after(summary)),
        samples_per_s=float(summary["samples_per_s"]), final_loss=float(summary["final_loss"]),
        final_accuracy=None if accuracy is None else float(accuracy),
        minibatch_losses=tuple(float(x) for x in summary.get("minibatch_losses", ())),
        metrics=tuple(line for line in lines if not line.get("final") and not is_eval_line(line)), ranks=ranks,
        evals=tuple(summary.get("evals", ())),
        eval_metrics={k: float(summary[k]) for k in EVAL_KEYS if summary.get(k) is not None},
        events=tuple(read_events(train_dir)), first_step=first_step,
        host_speed_ms=float(summary[HOST_SPEED_META]) if summary.get(HOST_SPEED_META) else None,
        link=read_link(train_dir) or summary.get("link"),
    )


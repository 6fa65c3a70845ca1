"""Measured timeline of one rank, per-category totals, metrics lines and the Chrome trace.

Categories (per rank, in ms):
- `compute`: forward, backward (incl. recomputation), loss, optimizer step;
- `comm`: packing and posting sends, unpacking receives, gradient all-reduce;
- `idle`: blocked waiting for a receive to arrive (the pipeline bubble; on one host the
  transfer itself cannot be told apart from waiting for the peer's compute).

Besides the wall time, a rank counts the CPU time it used inside compute and comm actions
(`compute_cpu_ms`, `comm_cpu_ms`: the worker's main thread where torch computes on it alone,
else every thread of the worker): where workers share cores, an action's wall time also holds
the time the kernel ran another worker, and the CPU time is its own work.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdcli import schedule as S

METRICS_FILE = "metrics.jsonl"
TRACE_FILE = "trace.json"
SUMMARY_FILE = "summary.json"
"""What a run leaves in its `train/` directory: a line per logged step, the Chrome trace of
every rank, the run's summary."""
COMPUTE = "compute"
COMM = "comm"
IDLE = "idle"
CATEGORIES = (COMPUTE, COMM, IDLE)
COMM_ACTIONS = (S.SendActivations, S.SendGrads, S.AllReduceGrads)
IDLE_ACTIONS = (S.RecvActivations, S.RecvGrads)


def action_category(action: S.Action) -> str:
    """An action's category: sends and the all-reduce are comm, receives idle, the rest compute."""
    return COMM if isinstance(action, COMM_ACTIONS) else IDLE if isinstance(action, IDLE_ACTIONS) else COMPUTE
MAX_TRACE_EVENTS = 200_000  # per rank; beyond this only the totals keep counting

S_TO_MS = 1e3
S_TO_US = 1e6


TraceSpan = tuple[str, str, float, float, "str | None"]
"""One traced span: (name, category, start us, duration us, label or None). A plain tuple of
atomic values, which the garbage collector stops tracking once it has seen it, so a rank's
trace does not lengthen its collections (`pdcli.runtime.heap`)."""


def chrome_event(span: TraceSpan, rank: int) -> dict[str, Any]:
    """`span` as a Chrome trace event of process `rank`."""
    name, category, ts_us, dur_us, label = span
    return {"name": name, "cat": category, "ph": "X", "ts": ts_us, "dur": dur_us, "pid": rank, "tid": 0,
            **({"args": {"action": label}} if label is not None else {})}


@dataclass
class RankStats:
    """Totals of one rank, gathered to the metrics writer at the end."""

    rank: int
    stage_id: int
    replica_id: int
    compute_ms: float = 0.0
    compute_cpu_ms: float = 0.0
    """CPU time of the worker's process inside compute actions."""
    comm_cpu_ms: float = 0.0
    """CPU time of the worker's process inside comm actions."""
    comm_ms: float = 0.0
    idle_ms: float = 0.0
    wall_ms: float = 0.0
    num_weight_versions_max: int = 0
    memory: dict[str, Any] = field(default_factory=dict)
    """Measured bytes per category (`pdcli.runtime.memory.MemoryTracker.report`)."""
    events: list[TraceSpan] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        del out["events"]
        return out


class Timeline:
    """Records (name, category, start, end) spans on a wall-clock base shared by all ranks."""

    def __init__(self, rank: int, stage_id: int, replica_id: int, compute_threads: int = 0) -> None:
        """`compute_threads`: torch's intra-op threads (`torch.get_num_threads()`); with one, the
        compute runs on the calling thread and `cpu_now` reads that thread's clock."""
        self.stats = RankStats(rank, stage_id, replica_id)
        self._wall0_s = time.time()
        self._perf0_s = time.perf_counter()
        self._cpu_clock = time.thread_time if compute_threads == 1 else time.process_time

    def now(self) -> float:
        return time.perf_counter()

    def cpu_now(self) -> float:
        """CPU time so far, s: the calling thread's where torch computes on it alone (one
        intra-op thread), else the process's (every thread). Read twice per action: the
        process's clock sums its threads in the kernel (gloo's among them), a thread's does not."""
        return self._cpu_clock()

    def add(self, name: str, category: str, start_s: float, end_s: float, label: str | None = None,
            cpu_s: float = 0.0) -> None:
        """A span; `label` (an action's text form, `F3@v1`) goes to the trace event's args;
        `cpu_s`: the process's CPU time inside it (counted for compute and comm spans)."""
        dur_s = end_s - start_s
        attr = f"{category}_ms"
        setattr(self.stats, attr, getattr(self.stats, attr) + dur_s * S_TO_MS)
        if category == COMPUTE:
            self.stats.compute_cpu_ms += cpu_s * S_TO_MS
        elif category == COMM:
            self.stats.comm_cpu_ms += cpu_s * S_TO_MS
        if len(self.stats.events) < MAX_TRACE_EVENTS:
            ts_us = (self._wall0_s + start_s - self._perf0_s) * S_TO_US
            self.stats.events.append((name, category, ts_us, dur_s * S_TO_US, label))

    def finish(self) -> RankStats:
        self.stats.wall_ms = (time.perf_counter() - self._perf0_s) * S_TO_MS
        return self.stats


def chrome_trace(all_stats: list[RankStats]) -> dict[str, Any]:
    """A Chrome/Perfetto trace: one process per rank, named by its stage and replica."""
    events: list[dict[str, Any]] = []
    for s in all_stats:
        label = f"rank {s.rank} (stage {s.stage_id}, replica {s.replica_id})"
        events.append({"name": "process_name", "ph": "M", "pid": s.rank, "tid": 0, "args": {"name": label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": s.rank, "tid": 0, "args": {"sort_index": s.rank}})
        events.extend(chrome_event(span, s.rank) for span in s.events)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def per_stage(all_stats: list[RankStats]) -> list[dict[str, Any]]:
    """Mean compute/comm/idle ms per stage (over its replicas)."""
    rows: dict[int, list[RankStats]] = {}
    for s in all_stats:
        rows.setdefault(s.stage_id, []).append(s)
    out = []
    for stage_id in sorted(rows):
        group = rows[stage_id]
        n = len(group)
        out.append(
            {
                "stage_id": stage_id,
                "replicas": n,
                "compute_ms": sum(s.compute_ms for s in group) / n,
                "compute_cpu_ms": sum(s.compute_cpu_ms for s in group) / n,
                "comm_cpu_ms": sum(s.comm_cpu_ms for s in group) / n,
                "comm_ms": sum(s.comm_ms for s in group) / n,
                "idle_ms": sum(s.idle_ms for s in group) / n,
                "wall_ms": max(s.wall_ms for s in group),
                "weight_versions_max": max(s.num_weight_versions_max for s in group),
                **stage_memory(group),
            }
        )
    return out


def stage_memory(group: list[RankStats]) -> dict[str, Any]:
    """The measured memory fields of a stage: the largest over its replicas."""
    keys = sorted({k for s in group for k, v in s.memory.items() if isinstance(v, (int, float))})
    out: dict[str, Any] = {k: max(s.memory.get(k, 0) for s in group) for k in keys}
    sources = {s.memory["source"] for s in group if "source" in s.memory}
    if sources:
        out["memory_source"] = ", ".join(sorted(sources))
    return out


TENSORBOARD_DIR = "tensorboard"
"""`train/tensorboard/`: the metrics lines as TensorBoard scalars, when the package is installed."""


def tensorboard_available() -> bool:
    """True when the optional `tensorboard` package (`pip install 'pd[tensorboard]'`) is importable."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def open_tensorboard(train_dir: Path, enabled: bool, fresh: bool = False) -> Any:
    """A `torch.utils.tensorboard.SummaryWriter` on `train/tensorboard/` (`fresh`: emptied first),
    or None when `train.tensorboard` is off or the package is not installed."""
    if not enabled or not tensorboard_available():
        return None
    from torch.utils.tensorboard import SummaryWriter

    log_dir = train_dir / TENSORBOARD_DIR
    if fresh:
        shutil.rmtree(log_dir, ignore_errors=True)
    return SummaryWriter(str(log_dir))


def tensorboard_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of a metrics line: `train/loss`, `train/lr`, `train/samples_per_s`, `eval/loss`,
    `eval/accuracy`, ..., and on the final line `stage_<k>/compute_ms` (comm_ms, idle_ms) per stage.
    The final line's loss, accuracy and throughput (of the last minibatch, of the whole run) are
    not on the per-interval curves."""
    out: dict[str, float] = {}
    final = bool(record.get("final"))
    for key, value in record.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or key in ("step", "time"):
            continue
        if key.startswith("eval_"):
            out[f"eval/{key.removeprefix('eval_')}"] = float(value)
        elif not final:
            out[f"train/{key}"] = float(value)
    for stage in record.get("stages", []) if final else []:
        for category in CATEGORIES:
            out[f"stage_{stage['stage_id']}/{category}_ms"] = float(stage[f"{category}_ms"])
    return out


def add_scalars(tensorboard: Any, record: dict[str, Any]) -> None:
    """A metrics line's scalars (`tensorboard_scalars`) into a SummaryWriter, at the line's step."""
    for tag, value in tensorboard_scalars(record).items():
        tensorboard.add_scalar(tag, value, int(record.get("step", 0)))


class MetricsLog:
    """`train/metrics.jsonl`: one JSON object per line, flushed as written, each with the wall
    `time` it was written (Unix seconds, as TensorBoard's `wall_time`) unless it holds one; with a
    TensorBoard writer (`open_tensorboard`) each line's scalars too, at its step."""

    def __init__(self, path: Path, append: bool = False, tensorboard: Any = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a" if append else "w")
        self.tensorboard = tensorboard

    def write(self, record: dict[str, Any]) -> None:
        record = {"time": time.time(), **record}
        self._f.write(json.dumps(record, sort_keys=True) + "\n")
        self._f.flush()
        if self.tensorboard is not None:
            add_scalars(self.tensorboard, record)
            self.tensorboard.flush()

    def close(self) -> None:
        self._f.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a JSON-lines file (metrics.jsonl, events.jsonl; a half-written last
    line is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out

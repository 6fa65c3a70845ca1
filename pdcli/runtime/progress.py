"""Loss bookkeeping on the last stage and the live `train/metrics.jsonl` lines.

The last stage records each microbatch's loss at its forward. When a rank has seen all of
its microbatches of minibatch t, the minibatch is done; every `log_every` minibatches the
metrics writer (last stage, replica 0) appends a line. With a replicated last stage each
replica sees only its own microbatches: live lines then cover replica 0's share, and the
writer rewrites the file at the end from every replica's records (exact).

Evaluations (`record_eval`) during training get a line of their own, `{"step": t, "eval_loss":
...}` after the training line of step t; the evaluation at the end goes into the final line.

Each replica of the last stage also appends every record to its journal
(`train/losses_replica<i>.txt`, `LossJournal`), flushed at each checkpoint: a resumed run
reads the records before its checkpoint from there, so a checkpoint's size does not grow with
the run.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

from pdcli.rundir import atomic_write_text
from pdcli.runtime.metrics import MetricsLog

LossRecord = tuple[float, int, int]
"""(loss, num_correct or -1, num_samples) of one microbatch."""


def journal_path(train_dir: Path, replica_id: int) -> Path:
    return train_dir / f"losses_replica{replica_id}.txt"


def read_journal(path: Path) -> dict[int, LossRecord]:
    """The records in a journal (a line cut short by a crash is left out)."""
    out: dict[int, LossRecord] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        fields = line.split()
        try:
            out[int(fields[0])] = (float(fields[1]), int(fields[2]), int(fields[3]))
        except (IndexError, ValueError):
            continue
    return out


class LossJournal:
    """One last-stage replica's loss records on disk, one line per microbatch (`loss` exact:
    `repr` of the float). A fresh run starts it empty; a run resumed at a checkpoint keeps the
    records of the microbatches before it (`kept`) and drops those the resumed run does again."""

    def __init__(self, path: Path, keep_below: int | None = None) -> None:
        self.path = path
        self._file: TextIO | None = None
        self.restart({mb: r for mb, r in read_journal(path).items() if mb < keep_below} if keep_below is not None else {})

    def restart(self, records: dict[int, LossRecord]) -> None:
        """The journal holds `records` and nothing else (e.g. those a checkpoint of an older pd held)."""
        if self._file is not None:
            self._file.close()
        self.kept = dict(records)
        atomic_write_text(self.path, "".join(_line(mb, r) for mb, r in sorted(self.kept.items())))
        self._file = self.path.open("a")

    def append(self, microbatch_id: int, record: LossRecord) -> None:
        self._file.write(_line(microbatch_id, record))

    def flush(self) -> None:
        """On disk (a checkpoint's records must survive the process)."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def _line(microbatch_id: int, record: LossRecord) -> str:
    loss, correct, samples = record
    return f"{microbatch_id} {loss!r} {correct} {samples}\n"


@dataclass
class LossTracker:
    num_microbatches: int
    num_minibatches: int
    log_every: int
    batch_size: int
    own_per_minibatch: Callable[[int], int]
    """How many microbatches of minibatch t this rank runs."""
    writer: MetricsLog | None = None
    extra: Callable[[int], dict[str, Any]] = lambda t: {}
    """More fields of the line that ends with minibatch t (e.g. the learning rate of its update)."""
    guard: Callable[[int, float], None] | None = None
    """Called with (t, this rank's mean loss of minibatch t) as each minibatch completes
    (the divergence guard); raises to stop the run."""
    records: dict[int, LossRecord] = field(default_factory=dict)
    """The records of the minibatches since the last metrics line (with a journal; else all)."""
    evals: list[dict[str, Any]] = field(default_factory=list)
    """Every evaluation so far: {"step": minibatches trained before it, eval metrics}."""
    _seen: dict[int, int] = field(default_factory=dict)
    _interval: list[int] = field(default_factory=list)
    excluded_s: Callable[[], float] = lambda: 0.0
    """Seconds so far that samples/s leaves out (evaluations)."""
    _last_log_s: float = field(default_factory=time.perf_counter)
    _excluded_at_last_s: float = 0.0
    journal: LossJournal | None = None
    """Every record also goes to disk (a resumed run reads the records before its checkpoint there)."""

    def restart_clock(self) -> None:
        """Start timing samples/s now (after setup, before the first action)."""
        self._last_log_s, self._excluded_at_last_s = time.perf_counter(), self.excluded_s()

    def resume(self, records: dict[int, LossRecord], next_minibatch: int, evals: Sequence[dict[str, Any]] = ()) -> None:
        """Continue a run from a checkpoint: its loss records and evaluations, and the minibatches
        since the last metrics line (they belong to the next line, as in the uninterrupted run)."""
        self.records.update(records)
        self.evals = [dict(e) for e in evals if int(e["step"]) < next_minibatch]  # the one at the cut runs again
        self._interval = list(range(next_minibatch - next_minibatch % self.log_every, next_minibatch))
        if self.guard is not None:  # the guard sees the same losses as in the uninterrupted run
            for t, loss in enumerate(minibatch_losses(self.records, self.num_microbatches)[:next_minibatch]):
                self.guard(t, loss)
        self._forget(self._interval[0] if self._interval else next_minibatch)

    def record(self, microbatch_id: int, loss: float, correct: int, num_samples: int) -> None:
        self.records[microbatch_id] = (loss, correct, num_samples)
        if self.journal is not None:
            self.journal.append(microbatch_id, self.records[microbatch_id])
        t = microbatch_id // self.num_microbatches
        self._seen[t] = self._seen.get(t, 0) + 1
        if self._seen[t] == self.own_per_minibatch(t):
            del self._seen[t]
            self._interval.append(t)
            logged = (t + 1) % self.log_every == 0 or t + 1 == self.num_minibatches
            if logged:
                self._log(t)
            if self.guard is not None:
                self.guard(t, summarize(self.records, self.num_microbatches, [t])["loss"])
            if logged:
                self._forget(t + 1)

    def _forget(self, minibatches: int) -> None:
        """With a journal, the records of the first `minibatches` leave memory (their line is written;
        this rank's microbatches complete in order)."""
        if self.journal is None:
            return
        for mb in [mb for mb in self.records if mb < minibatches * self.num_microbatches]:
            del self.records[mb]

    def all_records(self) -> dict[int, LossRecord]:
        """Every record of the run (the journal's, read back, when records leave memory)."""
        if self.journal is None:
            return dict(self.records)
        self.journal.flush()
        return read_journal(self.journal.path)

    def record_eval(self, after_minibatches: int, metrics: dict[str, Any]) -> None:
        """An evaluation after `after_minibatches` minibatches, at wall `time`; a metrics line unless
        it is the end's."""
        line = {"step": after_minibatches, "time": time.time(), **metrics}
        self.evals.append(line)
        if self.writer is not None and after_minibatches < self.num_minibatches:
            self.writer.write(line)

    def _log(self, t: int) -> None:
        now_s = time.perf_counter()
        line = summarize(self.records, self.num_microbatches, self._interval)
        line["step"] = t + 1
        excluded_s = self.excluded_s()
        elapsed_s = now_s - self._last_log_s - (excluded_s - self._excluded_at_last_s)
        line["samples_per_s"] = self.batch_size * len(self._interval) / max(elapsed_s, 1e-9)
        line.update(self.extra(t))
        self._interval, self._last_log_s, self._excluded_at_last_s = [], now_s, excluded_s
        if self.writer is not None:
            self.writer.write(line)


def summarize(records: dict[int, LossRecord], num_microbatches: int, minibatches: Sequence[int]) -> dict[str, Any]:
    """Mean loss (and accuracy) over the microbatches of `minibatches` present in `records`, in
    microbatch order. Looks up only those microbatches: the last stage calls it as each
    minibatch completes (the divergence guard), so its cost must not grow with the run."""
    picked = [records[mb] for t in sorted(set(minibatches))
              for mb in range(t * num_microbatches, (t + 1) * num_microbatches) if mb in records]
    out: dict[str, Any] = {"loss": sum(r[0] for r in picked) / max(len(picked), 1)}
    if picked and all(r[1] >= 0 for r in picked):
        out["accuracy"] = sum(r[1] for r in picked) / max(sum(r[2] for r in picked), 1)
    return out


def minibatch_losses(records: dict[int, LossRecord], num_microbatches: int) -> list[float]:
    """Loss of each minibatch (mean of its microbatches' losses), in order."""
    per: dict[int, list[float]] = {}
    for mb, (loss, _, _) in sorted(records.items()):
        per.setdefault(mb // num_microbatches, []).append(loss)
    return [sum(v) / len(v) for _, v in sorted(per.items())]

"""Loss bookkeeping on the last stage and the live `train/metrics.jsonl` lines.

The last stage records each microbatch's loss at its forward. When a rank has seen all of
its microbatches of minibatch t, the minibatch is done; every `log_every` minibatches the
metrics writer (last stage, replica 0) appends a line. With a replicated last stage each
replica sees only its own microbatches: live lines then cover replica 0's share, and the
writer rewrites the file at the end from every replica's records (exact).

Evaluations (`record_eval`) during training get a line of their own, `{"step": t, "eval_loss":
...}` after the training line of step t; the evaluation at the end goes into the final line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from pdcli.runtime.metrics import MetricsLog

LossRecord = tuple[float, int, int]
"""(loss, num_correct or -1, num_samples) of one microbatch."""


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
    evals: list[dict[str, Any]] = field(default_factory=list)
    """Every evaluation so far: {"step": minibatches trained before it, eval metrics}."""
    _seen: dict[int, int] = field(default_factory=dict)
    _interval: list[int] = field(default_factory=list)
    excluded_s: Callable[[], float] = lambda: 0.0
    """Seconds so far that samples/s leaves out (evaluations)."""
    _last_log_s: float = field(default_factory=time.perf_counter)
    _excluded_at_last_s: float = 0.0

    def restart_clock(self) -> None:
        """Start timing samples/s now (after setup, before the first action)."""
        self._last_log_s, self._excluded_at_last_s = time.perf_counter(), self.excluded_s()

    def resume(self, records: dict[int, LossRecord], next_minibatch: int, evals: Sequence[dict[str, Any]] = ()) -> None:
        """Continue a run from a checkpoint: its loss records and evaluations, and the minibatches
        since the last metrics line (they belong to the next line, as in the uninterrupted run)."""
        self.records.update({int(k): tuple(v) for k, v in records.items()})  # type: ignore[misc]
        self.evals = [dict(e) for e in evals if int(e["step"]) < next_minibatch]  # the one at the cut runs again
        self._interval = list(range(next_minibatch - next_minibatch % self.log_every, next_minibatch))
        if self.guard is not None:  # the guard sees the same losses as in the uninterrupted run
            for t, loss in enumerate(minibatch_losses(self.records, self.num_microbatches)[:next_minibatch]):
                self.guard(t, loss)

    def record(self, microbatch_id: int, loss: float, correct: int, num_samples: int) -> None:
        self.records[microbatch_id] = (loss, correct, num_samples)
        t = microbatch_id // self.num_microbatches
        self._seen[t] = self._seen.get(t, 0) + 1
        if self._seen[t] == self.own_per_minibatch(t):
            self._interval.append(t)
            if (t + 1) % self.log_every == 0 or t + 1 == self.num_minibatches:
                self._log(t)
            if self.guard is not None:
                self.guard(t, summarize(self.records, self.num_microbatches, [t])["loss"])

    def record_eval(self, after_minibatches: int, metrics: dict[str, Any]) -> None:
        """An evaluation after `after_minibatches` minibatches; a metrics line unless it is the end's."""
        line = {"step": after_minibatches, **metrics}
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

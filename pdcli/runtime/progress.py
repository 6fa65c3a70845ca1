"""Loss bookkeeping on the last stage and the live `train/metrics.jsonl` lines.

The last stage records each microbatch's loss at its forward. When a rank has seen all of
its microbatches of minibatch t, the minibatch is done; every `log_every` minibatches the
metrics writer (last stage, replica 0) appends a line. With a replicated last stage each
replica sees only its own microbatches: live lines then cover replica 0's share, and the
writer rewrites the file at the end from every replica's records (exact).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

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
    extra: Callable[[], dict[str, Any]] = lambda: {}
    guard: Callable[[int, float], None] | None = None
    """Called with (t, this rank's mean loss of minibatch t) as each minibatch completes
    (the divergence guard); raises to stop the run."""
    records: dict[int, LossRecord] = field(default_factory=dict)
    _seen: dict[int, int] = field(default_factory=dict)
    _interval: list[int] = field(default_factory=list)
    _last_log_s: float = field(default_factory=time.perf_counter)

    def restart_clock(self) -> None:
        """Start timing samples/s now (after setup, before the first action)."""
        self._last_log_s = time.perf_counter()

    def resume(self, records: dict[int, LossRecord], next_minibatch: int) -> None:
        """Continue a run from a checkpoint: its loss records, and the minibatches since the
        last metrics line (they belong to the next line, as in the uninterrupted run)."""
        self.records.update({int(k): tuple(v) for k, v in records.items()})  # type: ignore[misc]
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

    def _log(self, t: int) -> None:
        now_s = time.perf_counter()
        line = summarize(self.records, self.num_microbatches, self._interval)
        line["step"] = t + 1
        line["samples_per_s"] = self.batch_size * len(self._interval) / max(now_s - self._last_log_s, 1e-9)
        line.update(self.extra())
        self._interval, self._last_log_s = [], now_s
        if self.writer is not None:
            self.writer.write(line)


def summarize(records: dict[int, LossRecord], num_microbatches: int, minibatches: list[int]) -> dict[str, Any]:
    """Mean loss (and accuracy) over the microbatches of `minibatches` present in `records`."""
    wanted = set(minibatches)
    picked = [r for mb, r in records.items() if mb // num_microbatches in wanted]
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

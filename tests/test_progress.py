"""The last stage's loss bookkeeping (`pdcli.runtime.progress`): its per-minibatch work must
not grow with the run (it runs inside the last stage's forward, as each minibatch completes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from pdcli.runtime.progress import LossTracker, summarize


class NoScan(dict):  # type: ignore[type-arg]
    """Loss records that refuse to be walked whole: only lookups of single microbatches."""

    def __iter__(self) -> Iterator[Any]:
        raise AssertionError("walked every record")

    def items(self) -> Any:
        raise AssertionError("walked every record")

    def values(self) -> Any:
        raise AssertionError("walked every record")

    def keys(self) -> Any:
        raise AssertionError("walked every record")


def test_summarize_reads_only_the_microbatches_of_the_minibatches_asked() -> None:
    m = 4
    records = NoScan({mb: (float(mb), mb % 3, 2) for mb in range(10 * m)})
    del records[13]  # a replica's share: what is absent is left out
    out = summarize(records, m, [3, 1])
    picked = [4, 5, 6, 7, 12, 14, 15]
    assert out["loss"] == pytest.approx(sum(picked) / len(picked))
    assert out["accuracy"] == pytest.approx(sum(mb % 3 for mb in picked) / (2 * len(picked)))
    assert summarize(NoScan({0: (1.0, -1, 2)}), m, [0]) == {"loss": 1.0}  # no accuracy without counts


class Lines:
    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def write(self, line: dict[str, Any]) -> None:
        self.lines.append(line)


def test_the_guard_and_the_metrics_lines_of_a_long_run_never_walk_its_records() -> None:
    m, steps, every = 4, 300, 25
    guarded: list[tuple[int, float]] = []
    writer = Lines()
    tracker = LossTracker(num_microbatches=m, num_minibatches=steps, log_every=every, batch_size=64,
                          own_per_minibatch=lambda t: m, writer=writer,  # type: ignore[arg-type]
                          guard=lambda t, loss: guarded.append((t, loss)), records=NoScan())
    for mb in range(steps * m):
        tracker.record(mb, float(mb % 7), 1, 16)
    expected = [sum(float(mb % 7) for mb in range(t * m, (t + 1) * m)) / m for t in range(steps)]
    assert [t for t, _ in guarded] == list(range(steps))
    assert [loss for _, loss in guarded] == pytest.approx(expected)
    assert [line["step"] for line in writer.lines] == list(range(every, steps + 1, every))
    for line in writer.lines:
        window = expected[line["step"] - every: line["step"]]
        assert line["loss"] == pytest.approx(sum(window) / every)
        assert line["accuracy"] == pytest.approx(1 / 16)


def test_the_loss_journal_keeps_what_a_resumed_run_needs(tmp_path: Path) -> None:
    """Records go to disk exactly; a resumed run keeps those before its checkpoint, a fresh run
    none, and a line a crash cut short is left out."""
    from pdcli.runtime.progress import LossJournal, read_journal

    path = tmp_path / "losses_replica0.txt"
    journal = LossJournal(path)
    records = {mb: (1 / (mb + 3), mb % 2, 8) for mb in range(10)}
    for mb, record in records.items():
        journal.append(mb, record)
    journal.flush()
    assert read_journal(path) == records  # floats round-trip exactly
    with path.open("a") as f:
        f.write("10 0.12")  # a crash in the middle of a line
    assert read_journal(path) == records
    journal.close()
    resumed = LossJournal(path, keep_below=6)
    assert resumed.kept == {mb: r for mb, r in records.items() if mb < 6} and read_journal(path) == resumed.kept
    resumed.append(6, (0.5, 1, 8))
    resumed.flush()
    assert read_journal(path)[6] == (0.5, 1, 8) and len(read_journal(path)) == 7
    resumed.close()
    assert LossJournal(path).kept == {} and read_journal(path) == {}


def test_with_a_journal_only_the_open_lines_records_stay_in_memory(tmp_path: Path) -> None:
    from pdcli.runtime.progress import LossJournal

    m, steps, every = 4, 300, 25
    lines = {}
    held = 0
    for journal in (None, LossJournal(tmp_path / "losses_replica0.txt")):
        writer = Lines()
        tracker = LossTracker(num_microbatches=m, num_minibatches=steps, log_every=every, batch_size=64,
                              own_per_minibatch=lambda t: m, writer=writer, journal=journal)  # type: ignore[arg-type]
        for mb in range(steps * m):
            tracker.record(mb, float(mb % 7) / 3, mb % 2, 16)
            held = max(held, len(tracker.records)) if journal else held
        lines[journal is None] = [{k: v for k, v in line.items() if k != "samples_per_s"} for line in writer.lines]
        assert tracker.all_records() == {mb: (float(mb % 7) / 3, mb % 2, 16) for mb in range(steps * m)}
    assert lines[True] == lines[False]
    assert held == every * m - 1  # records leave memory once their line is written

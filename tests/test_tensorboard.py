"""TensorBoard scalars beside metrics.jsonl (the optional `tensorboard` extra)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcli.runtime.metrics import TENSORBOARD_DIR, MetricsLog, open_tensorboard, tensorboard_available, tensorboard_scalars

needs_tensorboard = pytest.mark.skipif(not tensorboard_available(), reason="the optional tensorboard package is not installed (pip install 'pd[tensorboard]')")


def test_a_metrics_line_names_its_scalars() -> None:
    line = {"step": 25, "loss": 0.5, "accuracy": 0.9, "lr": 0.01, "samples_per_s": 900.0}
    assert tensorboard_scalars(line) == {"train/loss": 0.5, "train/accuracy": 0.9, "train/lr": 0.01, "train/samples_per_s": 900.0}
    assert tensorboard_scalars({"step": 0, "eval_loss": 2.0, "eval_perplexity": 7.4}) == {"eval/loss": 2.0, "eval/perplexity": 7.4}
    final = {"step": 50, "final": True, "loss": 0.4, "eval_accuracy": 0.95, "samples_per_s": 1.0,
             "stages": [{"stage_id": 1, "compute_ms": 3.0, "comm_ms": 0.5, "idle_ms": 1.5}]}
    assert tensorboard_scalars(final) == {"eval/accuracy": 0.95, "stage_1/compute_ms": 3.0, "stage_1/comm_ms": 0.5,
                                          "stage_1/idle_ms": 1.5}


def test_off_or_not_installed_writes_nothing(tmp_path: Path) -> None:
    assert open_tensorboard(tmp_path, enabled=False) is None
    assert not (tmp_path / TENSORBOARD_DIR).exists()


@needs_tensorboard
def test_metrics_lines_become_tensorboard_events(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path / "metrics.jsonl", tensorboard=open_tensorboard(tmp_path, enabled=True))
    for line in ({"step": 0, "eval_loss": 2.5}, {"step": 5, "loss": 1.0, "lr": 0.1}, {"step": 10, "loss": 0.5, "lr": 0.05}):
        log.write(line)
    log.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    events = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/lr")] == [(5, pytest.approx(0.1)), (10, pytest.approx(0.05))]
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(0, 2.5)]
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first.pop("time") > 0 and first == {"eval_loss": 2.5, "step": 0}  # the wall time it was written
    assert "train/time" not in events.Tags()["scalars"]

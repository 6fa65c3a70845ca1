"""Smoke test of the runtime benchmark's helpers: the baselines run at a tiny size, the split
is the whole model, a hung child is killed, pd's metrics are read right. Never asserts speed."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # real processes over torch.distributed

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from _baselines import run_single, run_stage_bound, run_torch_pipelining  # noqa: E402
from _bench_common import BenchFailed, BenchShape, build_mlp, chunk_mlp, run_bounded, run_child, split_mlp  # noqa: E402
from _pd_train import median_samples_per_s, overrides, virtual_overrides, write_recipe  # noqa: E402

from pdcli.config import load_config  # noqa: E402

TINY = BenchShape(width=16, num_layers=4, batch_size=8, num_microbatches=2, num_steps=2, num_warmup_steps=1)
CHILD_TIMEOUT_S = 60.0


@pytest.mark.timeout(90)
def test_single_process_baseline_reports_positive_throughput() -> None:
    assert run_single(TINY, 1, CHILD_TIMEOUT_S) > 0
    assert run_single(TINY, 1, CHILD_TIMEOUT_S, num_microbatches=TINY.num_microbatches) > 0


@pytest.mark.timeout(90)
def test_stage_bound_is_the_slower_stage() -> None:
    samples_per_s, stage_ms = run_stage_bound(TINY, CHILD_TIMEOUT_S)
    assert len(stage_ms) == 2 and min(stage_ms) > 0
    assert samples_per_s == pytest.approx(TINY.batch_size / (max(stage_ms) / 1e3))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule_name", ["1f1b", "interleaved"])
def test_torch_pipelining_baseline_reports_positive_throughput(schedule_name: str) -> None:
    assert run_torch_pipelining(TINY, schedule_name, CHILD_TIMEOUT_S) > 0


def test_split_is_balanced_and_composes_to_the_whole_model() -> None:
    shape = BenchShape(width=8, num_layers=6, batch_size=4, num_microbatches=2)
    model = build_mlp(shape)
    first, second = split_mlp(model, shape)
    x = torch.randn(4, 8)
    torch.testing.assert_close(second(first(x)), model(x))
    linears = [sum(isinstance(m, torch.nn.Linear) for m in part) for part in (first, second)]
    assert linears == [3, 4]  # 3 hidden layers each; the second also holds the classifier


def test_chunks_compose_to_the_whole_model() -> None:
    shape = BenchShape(width=8, num_layers=8, batch_size=4, num_microbatches=2)
    model = build_mlp(shape)
    chunks = chunk_mlp(model, shape)
    x = torch.randn(4, 8)
    out = x
    for chunk in chunks:
        out = chunk(out)
    torch.testing.assert_close(out, model(x))
    assert [sum(isinstance(m, torch.nn.Linear) for m in c) for c in chunks] == [2, 2, 2, 3]


HUNG_CHILD = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "w").write(str(grandchild.pid))
time.sleep(60)
"""


def _running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a zombie has stopped running)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


@pytest.mark.timeout(40)
def test_hung_child_and_its_children_are_killed_at_the_timeout(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    start_s = time.perf_counter()
    with pytest.raises(BenchFailed, match="timed out"):
        run_bounded([sys.executable, "-c", HUNG_CHILD, str(pid_file)], timeout_s=5.0)
    assert time.perf_counter() - start_s < 20
    grandchild_pid = int(pid_file.read_text())
    deadline_s = time.perf_counter() + 5
    while _running(grandchild_pid) and time.perf_counter() < deadline_s:
        time.sleep(0.1)
    assert not _running(grandchild_pid)


def test_failing_child_reason_names_its_error() -> None:
    with pytest.raises(BenchFailed, match="exit status 3: boom"):
        run_child([sys.executable, "-c", "import sys; sys.stderr.write('boom\\n'); sys.exit(3)"], 30.0)


def test_median_skips_start_up_steps_the_final_line_and_half_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    steps = [{"step": i + 1, "samples_per_s": v} for i, v in enumerate([1.0, 10.0, 30.0, 20.0])]
    lines = [json.dumps(r) for r in steps] + [json.dumps({"final": True, "samples_per_s": 5.0}), '{"step": 5, "sam']
    path.write_text("\n".join(lines))
    assert median_samples_per_s(path, num_skip=1) == (20.0, 3)
    assert median_samples_per_s(path, num_skip=2) == (25.0, 2)
    with pytest.raises(BenchFailed):
        median_samples_per_s(path, num_skip=4)
    with pytest.raises(BenchFailed, match="no metrics.jsonl"):
        median_samples_per_s(tmp_path / "missing" / "metrics.jsonl")


@pytest.mark.parametrize("schedule_name", ["pipedream", "1f1b", "zbv"])
def test_pd_recipe_loads_with_the_benchmark_shape(tmp_path: Path, schedule_name: str) -> None:
    shape = BenchShape()
    extra = virtual_overrides(shape) if schedule_name == "zbv" else []
    cfg = load_config(write_recipe(shape, tmp_path), overrides(schedule_name, extra)).config
    if extra:
        assert cfg.schedule.virtual_stages == 2 and cfg.plan.boundaries == [5, 9, 13]
    assert cfg.schedule.name == schedule_name
    assert cfg.num_devices == 2 and cfg.plan.num_stages in ((None,) if extra else (2,))  # the cuts fix the chunks
    assert (cfg.data.batch_size, cfg.schedule.num_microbatches) == (shape.batch_size, shape.num_microbatches)
    assert cfg.model.kwargs["hidden"] == shape.width
    assert cfg.train.steps == shape.num_steps + shape.num_warmup_steps
    assert Path(cfg.run.root).is_relative_to(tmp_path)

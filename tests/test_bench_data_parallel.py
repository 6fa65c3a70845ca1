"""The data-parallel benchmark's measuring (steady window, link bytes, crossover, tables) on made-up
records, and one short shaped run of DDP beside pd's pipeline (slow; needs root and `tc`)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks" / "bench_data_parallel.py"
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_data_parallel as bench  # noqa: E402

from pdcli.testing import netns  # noqa: E402


def _tables() -> Any:
    spec = importlib.util.spec_from_file_location("tables", REPO / "benchmarks" / "tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bytes_at_interpolates_both_directions_between_samples() -> None:
    samples = [(10.0, 0, 0), (11.0, 1000, 500), (12.0, 1000, 2500)]
    assert netns.bytes_at(samples, 10.5) == pytest.approx(750)
    assert netns.bytes_at(samples, 11.5) == pytest.approx(2500)
    assert netns.bytes_at(samples, 9.0) == 0  # before the first sample: its value
    assert netns.bytes_at(samples, 13.0) == pytest.approx(3500)
    with pytest.raises(ValueError):
        netns.bytes_at([], 1.0)


@pytest.mark.timeout(120)
def test_the_link_sampler_keeps_sampling_past_a_pipes_worth_of_samples() -> None:
    """A long run's samples (a pipe holds 64 KiB, about 80 s of them) are all kept."""
    why = netns.available()
    if why:
        pytest.skip(why)
    import os
    import time

    with netns.HostPair() as pair:
        sampler = pair.sample(every_s=0.0)
        deadline = time.monotonic() + 90
        while os.fstat(sampler._out.fileno()).st_size < 256 << 10:
            assert time.monotonic() < deadline, "the sampler stalled"
            time.sleep(0.05)
        samples = sampler.stop()
    assert len(samples) > (256 << 10) // 64
    assert [s[0] for s in samples] == sorted(s[0] for s in samples)


def test_steady_window_is_the_second_half_without_the_intervals_that_evaluate() -> None:
    # 40 minibatches logged every 5, 0.1 s each; the interval after the evaluation at 30 takes 1 s
    # more; the link carries 2000 bytes per minibatch, and 50000 during the evaluation.
    points, t = [(0, 100.0)], 100.0
    samples = [(100.0, 0, 0)]
    moved = 0
    for step in range(5, 45, 5):
        slow = step - 5 == 30
        t += 0.5 + (1.0 if slow else 0.0)
        moved += 5 * 2000 + (50000 if slow else 0)
        points.append((step, t))
        samples.append((t, moved // 2, moved - moved // 2))
    record = bench.Record(points, [(30, 103.0, 0.9)], 100.0, batch_size=32)
    got = bench.steady(record, samples)
    # intervals from 20: 20-25, 25-30, 35-40 (30-35 holds the evaluation): 15 minibatches in 1.5 s
    assert got["ms_per_minibatch"] == pytest.approx(100.0)
    assert got["samples_per_s"] == pytest.approx(32 * 15 / 1.5)
    assert got["bytes_per_minibatch"] == pytest.approx(2000)
    assert math.isnan(bench.steady(record, [])["bytes_per_minibatch"])
    with pytest.raises(bench.RunFailed):
        bench.steady(bench.Record([(0, 1.0), (5, 1.0)], [], 1.0, 32), samples)


def test_accuracy_curve_times_from_the_loops_start_and_finds_the_target() -> None:
    record = bench.Record([], [(10, 101.0, 0.80), (20, 102.5, 0.96), (30, 104.0, 0.97)], 100.0, 32)
    got = bench.accuracy_curve(record, 0.95)
    assert got["time_to_target_s"] == pytest.approx(2.5)
    assert got["final_eval_accuracy"] == pytest.approx(0.97)
    assert bench.accuracy_curve(record, 0.99)["time_to_target_s"] is None


def _results() -> dict[str, Any]:
    def row(samples_per_s: float, kb: float, to_target: float | None, plan: dict[str, Any] | None = None) -> dict[str, Any]:
        r: dict[str, Any] = {"samples_per_s": samples_per_s, "ms_per_minibatch": 32e3 / samples_per_s,
                             "bytes_per_minibatch": kb * 1e3, "time_to_target_s": to_target}
        if plan:
            r["plan"] = plan
        return r

    pipe = {"predicted_ms": 4.0, "stages": [1, 1], "schedule": "pipedream", "num_microbatches": 1}
    dp = {"predicted_ms": 80.0, "stages": [2], "schedule": "1f1b", "num_microbatches": 2}
    rates = []
    for rate, ddp_speed in ((25, 400.0), (50, 700.0), (1000, 9000.0), (None, 20000.0)):
        rates.append({"rate_mbit": rate, "rows": {
            "ddp": {**row(ddp_speed, 1000.0, 10.0), "predicted_ms": 32e3 / ddp_speed},
            "pd_pipeline": row(8000.0, 30.0, 1.0, pipe),
            "pd_pick": row(max(8000.0, ddp_speed), 30.0 if ddp_speed < 8000 else 1000.0, 1.0,
                           pipe if ddp_speed < 8000 else dp),
        }})
    return {"unshaped_bandwidth_bytes_per_s": 1e9, "measured": {"date": "d", "host": "h", "command": "c"},
            "cases": {"mlp": {"recipe": "recipes/quickstart.yaml", "overrides": [], "steps": 150,
                              "target_accuracy": 0.95, "rates": rates}}}


def test_crossover_is_where_the_pipeline_stops_beating_ddp() -> None:
    tables = _tables()
    rates = _results()["cases"]["mlp"]["rates"]
    cross = tables.crossover_mbit(rates, "pd_pipeline", "ddp")
    # 8000/700 at 50, 8000/9000 at 1000: log-interpolated between them, near 1000
    assert 50 < cross < 1000
    assert tables.crossover_mbit(rates[:2], "pd_pipeline", "ddp") is None


def test_tables_show_each_rate_the_ratio_to_ddp_and_the_bytes_share(tmp_path: Path) -> None:
    tables = _tables()
    results = _results()
    summary = tables.data_parallel_summary(results)
    assert summary.count("\n") == 2 + 4  # header, rule, one line per rate
    assert "| mlp | 50 Mbit/s | 700 | 8000 (11.4x) | pipedream, 2 stages, M=1 | 3.0% | 10.0 s / 1.0 s |" in summary
    assert "1f1b, 1 stage x 2, M=2" in summary  # the unshaped pick: data parallel
    full = tables.data_parallel(results)
    assert "| 50 Mbit/s | torch DDP | 700 | 1.00x |" in full
    assert "30.0 (3.0%)" in full and "*d, h: `c`*" in full
    if tables.PLOTS:  # the figure draws from the same results
        out = tmp_path / "dp.svg"
        tables.plot_data_parallel(results, out)
        assert out.read_text().lstrip().startswith("<?xml")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_over_a_shaped_link_pd_pipeline_moves_a_small_share_of_ddps_bytes(tmp_path: Path) -> None:
    """One shaped rate, a few minibatches of DDP and of pd's pipeline: the link's byte counts."""
    why = netns.available()
    if why:
        pytest.skip(why)
    before = set(netns.existing())
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, str(BENCH), "--rates", "50", "--models", "mlp", "--rows", "ddp,pd_pipeline",
                           "--steps", "20", "--set", "profile.runtime_probe=false", "--set", "profile.repeats=2",
                           "--work", str(tmp_path / "work"), "--out", str(out)],
                          capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-2000:]
    assert set(netns.existing()) <= before  # its namespaces are gone
    rows = json.loads(out.read_text())["cases"]["mlp"]["rates"][0]["rows"]
    assert "error" not in rows["ddp"] and "error" not in rows["pd_pipeline"], rows
    from pdcli.config import load_config
    from pdcli.models.registry import build_model

    cfg = load_config(str(REPO / "recipes" / "quickstart.yaml"), []).config
    param_bytes = sum(p.numel() * p.element_size() for p in build_model(cfg.model).parameters())
    ddp, pd = rows["ddp"]["bytes_per_minibatch"], rows["pd_pipeline"]["bytes_per_minibatch"]
    assert ddp >= param_bytes  # an all-reduce of every gradient crossed the link
    assert 0 < pd <= 0.1 * ddp  # activations and their gradients only


def test_a_row_keeps_its_median_round_and_every_rounds_rate() -> None:
    rounds = [{"samples_per_s": 900.0, "tag": "a"}, {"error": "host 1 exited 1"}, {"samples_per_s": 700.0, "tag": "b"},
              {"samples_per_s": 800.0, "tag": "c"}]
    kept = bench.median_round(rounds)
    assert kept["tag"] == "c" and kept["rounds_samples_per_s"] == [900.0, None, 700.0, 800.0]
    assert bench.median_round([{"samples_per_s": 5.0}]) == {"samples_per_s": 5.0}  # one round: as it ran
    assert bench.median_round([{"error": "x"}, {"error": "y"}]) == {"error": "y"}

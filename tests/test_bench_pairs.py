"""The runtime benchmark's paired ratios: pd's row against torch.pipelining's counterpart,
round by round. No process is started."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from _bench_common import paired_ratios, thread_env  # noqa: E402
from bench_runtime import Row, counterparts, paired  # noqa: E402


def test_paired_ratios_take_each_round_in_which_both_ran() -> None:
    assert paired_ratios([200.0, None, 150.0], [100.0, 120.0, 100.0]) == [2.0, 1.5]
    assert paired_ratios([1.0], [None]) == []
    with pytest.raises(ValueError, match="as many rounds"):
        paired_ratios([1.0, 2.0], [1.0])


def test_each_torch_schedule_is_paired_with_pds_same_schedule_and_microbatches() -> None:
    names = ["torch pipelining Schedule1F1B, 8 microbatches", "torch pipelining ScheduleGPipe, 8 microbatches",
             "pd train pipedream, 8 microbatches", "pd train 1f1b, 8 microbatches",
             "pd train 1f1b, 8 microbatches, schedule.split_backward=false",
             "torch pipelining ScheduleZBVZeroBubble, V=2, 8 microbatches", "pd train zbv, V=2, 8 microbatches"]
    assert counterparts(names) == [
        ("pd train 1f1b, 8 microbatches", "torch pipelining Schedule1F1B, 8 microbatches"),
        ("pd train zbv, V=2, 8 microbatches", "torch pipelining ScheduleZBVZeroBubble, V=2, 8 microbatches"),
    ]  # no pd gpipe row in this list: ScheduleGPipe has no pair
    shipped = "torch pipelining Schedule1F1B, 8 microbatches, glibc's default heap"  # torch as a user starts it
    assert ("pd train 1f1b, 8 microbatches", shipped) in counterparts([*names, shipped])
    merged = "pd train 1f1b, 8 microbatches, schedule.merge_weight_grads=true"
    assert counterparts([*names, merged])[:2] == [
        ("pd train 1f1b, 8 microbatches", "torch pipelining Schedule1F1B, 8 microbatches"),
        (merged, "torch pipelining Schedule1F1B, 8 microbatches"),
    ]


def test_each_pair_runs_back_to_back() -> None:
    from bench_runtime import SHIPPED_HEAP, beside_counterparts, variants
    from _bench_common import BenchShape

    table = beside_counterparts(variants(BenchShape(), 1.0, "small"))
    names = [name for name, _ in table]
    assert sorted(names) == sorted(name for name, _ in variants(BenchShape(), 1.0, "small"))  # moved, none lost
    pairs = counterparts(names)
    torch_rows = {torch_name for _, torch_name in pairs}
    assert len(torch_rows) == 10  # 1F1B, GPipe, Interleaved, LoopedBFS, ZBV, on either heap
    for torch_name in torch_rows:
        schedule = torch_name.removesuffix(SHIPPED_HEAP)
        group = sorted({names.index(n) for p, t in pairs if t.removesuffix(SHIPPED_HEAP) == schedule for n in (p, t)})
        assert group == list(range(group[0], group[0] + len(group))), (torch_name, group)  # adjacent
        assert all(names[k].startswith("torch") for k in group[-2:])  # after pd's rows (reversed rounds: before)
        assert not any(names[k].startswith("torch") for k in group[:-2])


def test_the_paired_median_is_of_the_rounds_ratios_not_of_the_rows_medians() -> None:
    # a slow spell in round 2 hits both: the rows' medians say 1.1x, the rounds 1.2x, 1.2x, 1.1x
    rows = [Row("pd train 1f1b, 4 microbatches", 1100.0, per_round_samples_per_s=(1200.0, 600.0, 1100.0)),
            Row("torch pipelining Schedule1F1B, 4 microbatches", 1000.0, per_round_samples_per_s=(1000.0, 500.0, 1000.0))]
    (pair,) = paired(rows)
    assert pair["per_round"] == pytest.approx([1.2, 1.2, 1.1])
    assert pair["median"] == pytest.approx(1.2)


def test_the_orders_ceiling_is_what_pds_lists_gain_by_their_order_alone() -> None:
    """1F1B at 2 stages x 4 microbatches: torch's order idles (S - 1) x (forward + backward)
    per minibatch, pd's split backward only the first forward and its message, the least any
    flush order can (the second stage waits for the first forward), so the ceiling is their
    ratio; zbv is the same order on both sides."""
    from bench_runtime import CEILING_COSTS, ceiling_of, schedule_ceiling

    f, b, c = CEILING_COSTS["fwd_ms"], CEILING_COSTS["bwd_ms"], CEILING_COSTS["comm_ms"]
    m = 4
    least = m * (f + b) + f + c  # the second stage's work after the first forward arrives
    torch_order = m * (f + b) + (f + b) + 2 * c
    assert schedule_ceiling("1f1b", m) == pytest.approx(torch_order / least, rel=0.01)
    assert schedule_ceiling("1f1b", 8) < schedule_ceiling("1f1b", 4)  # the bubble's share shrinks
    assert schedule_ceiling("zbv", 8, 2) == pytest.approx(1.0)
    assert ceiling_of("pd train interleaved, V=2, 8 microbatches") == schedule_ceiling("interleaved", 8, 2)
    assert ceiling_of("pd train 1f1b, 4 microbatches, schedule.split_backward=false") is None


def test_the_ceiling_of_a_row_replays_its_weight_gradients_merged_as_the_row_runs_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """loopedbfs merges its W's by default: its plain row is replayed merged, its second row not."""
    import bench_runtime

    monkeypatch.setattr(bench_runtime, "schedule_ceiling", lambda *args: args)
    assert bench_runtime.ceiling_of("pd train loopedbfs, V=2, 8 microbatches") == ("loopedbfs", 8, 2, True)
    assert bench_runtime.ceiling_of("pd train loopedbfs, V=2, 8 microbatches, schedule.merge_weight_grads=false") == \
        ("loopedbfs", 8, 2, False)
    assert bench_runtime.ceiling_of("pd train interleaved, V=2, 8 microbatches") == ("interleaved", 8, 2, False)
    assert bench_runtime.ceiling_of("pd train 1f1b, 4 microbatches, schedule.merge_weight_grads=true") == \
        ("1f1b", 4, 1, True)


def test_each_schedules_second_pd_row_takes_the_other_merging_of_its_weight_gradients() -> None:
    from bench_runtime import MERGED, UNMERGED, variants
    from _bench_common import BenchShape

    names = [name for name, _ in variants(BenchShape(), 1.0, "small")]
    looped = "pd train loopedbfs, V=2, 8 microbatches"
    assert f"{looped}, {UNMERGED}" in names and f"{looped}, {MERGED}" not in names
    assert "pd train interleaved, V=2, 8 microbatches, " + MERGED in names
    torch_looped = "torch pipelining ScheduleLoopedBFS, V=2, 8 microbatches"
    assert (f"{looped}, {UNMERGED}", torch_looped) in counterparts(names)


def test_baseline_children_run_on_the_heap_pd_workers_run_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdcli.torchutil.allocator import HEAP_HUGE_PAGES, TUNABLES_ENV, huge_page_env
    monkeypatch.delenv(TUNABLES_ENV, raising=False)
    monkeypatch.delenv("PD_TUNE_ALLOCATOR", raising=False)
    env = thread_env(1)
    assert env["OMP_NUM_THREADS"] == "1"
    if huge_page_env({}) is None:
        assert TUNABLES_ENV not in env  # not glibc, or the kernel's THP mode is not madvise
    else:
        assert env[TUNABLES_ENV] == HEAP_HUGE_PAGES
    assert TUNABLES_ENV not in thread_env(1, pd_heap=False)  # torch.pipelining as a user starts it
    monkeypatch.setenv("PD_TUNE_ALLOCATOR", "0")
    assert TUNABLES_ENV not in thread_env(1)

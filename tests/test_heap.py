"""What a worker's garbage collector walks during the loop, and what the steady time leaves out."""

from __future__ import annotations

import gc

from pdcli.report.measured import RankTrace, Span, evaluated_after, steady_time_per_minibatch_ms
from pdcli.runtime.heap import freeze_setup
from pdcli.runtime.metrics import Timeline, chrome_trace


class Node:
    """A tracked object with a reference cycle, like the setup's modules."""

    def __init__(self) -> None:
        self.me = self


def test_freeze_setup_takes_the_setup_out_of_full_collections() -> None:
    setup = [Node() for _ in range(5_000)]
    walked_before = len(gc.get_objects())
    try:
        freeze_setup()
        assert gc.get_freeze_count() >= len(setup)
        # a full collection walks what is not frozen: the setup is no longer among it
        walked_after = len(gc.get_objects())
        assert walked_after < walked_before - len(setup)
        assert setup[0] in setup and not any(o is setup[0] for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is setup[0] for o in gc.get_objects())


def test_trace_spans_leave_the_collector_once_seen() -> None:
    timeline = Timeline(rank=3, stage_id=1, replica_id=0)
    for i in range(10):
        timeline.add("Forward", "compute", float(i), i + 0.5, f"F{i}")
    gc.collect()
    assert not any(gc.is_tracked(span) for span in timeline.stats.events)
    # the Chrome trace keeps its event format
    events = [e for e in chrome_trace([timeline.stats])["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 10 and events[2]["args"] == {"action": "F2"} and events[2]["pid"] == 3
    assert events[2]["dur"] == 0.5e6 and events[2]["name"] == "Forward" and events[2]["cat"] == "compute"


def _first_stage(done_ms: list[float]) -> list[RankTrace]:
    """A one-microbatch rank whose minibatches complete (end their Backward) at `done_ms`."""
    return [RankTrace(0, "rank 0", tuple(Span("Backward", "compute", t - 1.0, 1.0) for t in done_ms))]


def test_the_steady_time_leaves_out_the_intervals_that_evaluated() -> None:
    # 10 ms per minibatch; an evaluation after minibatch 7 added 50 ms before minibatch 7 completed
    done_ms = [10.0 * (i + 1) + (50.0 if i >= 7 else 0.0) for i in range(12)]
    first = _first_stage(done_ms)
    assert steady_time_per_minibatch_ms(first, 1) > 10.0 + 1.0  # the evaluation counted in
    assert steady_time_per_minibatch_ms(first, 1, {7}) == 10.0
    assert steady_time_per_minibatch_ms(first, 1, {0, 12}) == steady_time_per_minibatch_ms(first, 1)
    assert steady_time_per_minibatch_ms(_first_stage([5.0]), 1) is None


def test_the_steady_time_of_a_run_stops_where_its_pipeline_drains() -> None:
    # 10 ms per minibatch; the first stage's last forward starts at 91 ms, after which the
    # last three minibatches complete 3 ms apart
    done_ms = [10.0 * (i + 1) for i in range(9)] + [93.0, 96.0, 99.0]
    first = _first_stage(done_ms)
    assert steady_time_per_minibatch_ms(first, 1) < 10.0  # no forward traced: the whole second half
    forwards = tuple(Span("Forward", "compute", 10.0 * k + 1.0, 1.0) for k in range(10))
    drained = [RankTrace(0, "rank 0", first[0].spans + forwards)]
    assert steady_time_per_minibatch_ms(drained, 1) == 10.0


def test_evaluations_count_from_where_the_trace_starts() -> None:
    summary = {"first_step": 100, "evals": [{"step": 0}, {"step": 150}, {"step": 200}]}
    assert evaluated_after(summary) == {-100, 50, 100}
    assert evaluated_after({"evals": [{"step": 50}]}) == {50}


def test_no_automatic_collection_while_the_collector_is_paused() -> None:
    from pdcli.runtime.heap import collector_paused

    seen: list[int] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    assert gc.isenabled()
    with collector_paused():
        gc.callbacks.append(note)
        try:
            for _ in range(50_000):  # far past the young generation's threshold
                Node()
        finally:
            gc.callbacks.remove(note)
    assert seen == [] and gc.isenabled()


def test_heap_frozen_leaves_what_was_there_out_of_the_blocks_collections_and_unfreezes_after() -> None:
    from pdcli.runtime.heap import heap_frozen

    held = [Node() for _ in range(5_000)]
    with heap_frozen():
        assert gc.get_freeze_count() >= len(held)
        assert not any(o is held[0] for o in gc.get_objects())  # a collection in the block does not walk it
        made = Node()
        assert any(o is made for o in gc.get_objects())  # what the block makes it does
    assert gc.get_freeze_count() == 0 and any(o is held[0] for o in gc.get_objects())

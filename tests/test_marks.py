"""The slow marks are honest: a test that took more than `SLOW_S` in the last recorded run of
the whole suite (`tests/durations.json`, written by `make durations`) is marked slow, so the fast
tier (`make check`) stays fast. Read from the file, never timed here."""

from __future__ import annotations

import json

import pytest

from durations import DURATIONS, node_id

SLOW_S = 5.0


def test_every_test_that_took_over_5_s_is_marked_slow(request: pytest.FixtureRequest) -> None:
    recorded: dict[str, float] = json.loads(DURATIONS.read_text())
    unmarked = {item.nodeid: recorded[item.nodeid] for item in request.session.items
                if item.nodeid in recorded and recorded[item.nodeid] > SLOW_S and item.get_closest_marker("slow") is None}
    assert not unmarked, f"took over {SLOW_S:g} s in {DURATIONS.name}; mark them @pytest.mark.slow: {unmarked}"


def test_the_recorded_ids_are_pytests_ids() -> None:
    assert node_id("tests.test_marks", "test_x[a-b]") == "tests/test_marks.py::test_x[a-b]"
    recorded = json.loads(DURATIONS.read_text())
    assert recorded and all(k.startswith("tests/test_") and ".py::" in k for k in recorded)


def test_every_serial_test_is_slow(request: pytest.FixtureRequest) -> None:
    """The fast tier runs in two processes whatever a test's marks; only the slow tier's serial
    pass runs a test alone."""
    loose = [item.nodeid for item in request.session.items
             if item.get_closest_marker("serial") is not None and item.get_closest_marker("slow") is None]
    assert not loose, f"marked serial but not slow, so they run beside other tests: {loose}"

"""Progress of pd's long steps on stderr (`pdcli.progress`): plain lines off a terminal, nothing when quiet."""

from __future__ import annotations

import threading

import pytest

from pdcli import progress
from pdcli.progress import Reporter, current, mode_for, reporting


def test_lines_say_the_phase_and_keep_saying_it_while_it_lasts(capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "TICK_S", 0.01)
    ticked = threading.Event()
    reporter = Reporter("lines")
    with reporter.phase("profile: runtime probe", total=8) as phase:
        phase.advance(3)
        original = phase.tick

        def tick() -> None:
            original()
            ticked.set()

        phase.tick = tick  # type: ignore[method-assign]
        assert ticked.wait(60)  # returns at the first tick
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "profile: runtime probe (0/8)"
    assert any(line.startswith("profile: runtime probe: 3/8,") and line.endswith(" s") for line in err[1:])


def test_quiet_prints_nothing_and_the_default_reporter_is_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    assert current().mode == "off" and mode_for(True) == "off"
    with reporting("off"):
        with current().phase("plan: searching"):
            current().line("host: reused")
    with current().phase("outside any command"):
        pass
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="progress mode"):
        Reporter("loud")

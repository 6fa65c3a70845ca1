"""What pd's long steps (profile, probes, plan search) are doing, on stderr.

A command picks the reporter (`reporting`); the steps call `phase` and `note` on the current
one. On a terminal a phase is a tqdm bar whose elapsed time keeps moving; elsewhere (a log, CI)
each phase is a line when it starts and another every TICK_S while it lasts, so a reader never
waits long without a word; `--quiet` (or no reporter: a library call, a test) prints nothing.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator, Optional

TICK_S = 2.0
"""Longest silence of a phase in plain lines."""
BAR_REFRESH_S = 0.5
MODES = ("bar", "lines", "off")


class Phase:
    """One running phase: `advance` counts its units done."""

    def __init__(self, reporter: "Reporter", label: str, total: Optional[int]) -> None:
        self.reporter, self.label, self.total = reporter, label, total
        self.done = 0
        self.started_s = time.monotonic()
        self.bar = None
        if reporter.mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"{reporter.prefix}{label}", file=sys.stderr, leave=False,
                            bar_format="{desc}: {n_fmt}/{total_fmt} [{elapsed}]" if total else "{desc} [{elapsed}]")
        elif reporter.mode == "lines":
            reporter.line(f"{label}" + (f" (0/{total})" if total else ""))

    def advance(self, units: int = 1) -> None:
        self.done += units
        if self.bar is not None:
            self.bar.update(units)

    def tick(self) -> None:
        """Called every TICK_S (lines) / BAR_REFRESH_S (bar) while the phase runs."""
        if self.bar is not None:
            self.bar.refresh()
            return
        count = f" {self.done}/{self.total}," if self.total else ""
        self.reporter.line(f"{self.label}:{count} {time.monotonic() - self.started_s:.0f} s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Reporter:
    """Prints a command's progress as `mode` says (MODES), each line prefixed with `prefix`."""

    def __init__(self, mode: str, prefix: str = "") -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode {mode!r}: one of {', '.join(MODES)}")
        self.mode, self.prefix = mode, prefix
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        if self.mode == "off":
            return
        with self._lock:
            if self.mode == "bar":
                from tqdm import tqdm

                tqdm.write(f"{self.prefix}{text}", file=sys.stderr)
            else:
                print(f"{self.prefix}{text}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def phase(self, label: str, total: Optional[int] = None) -> Iterator[Phase]:
        """A phase of `total` units (None: not counted) that lasts the `with` block."""
        if self.mode == "off":
            yield Phase(self, label, total)
            return
        phase = Phase(self, label, total)
        stop = threading.Event()
        every = BAR_REFRESH_S if self.mode == "bar" else TICK_S

        def ticking() -> None:
            while not stop.wait(every):
                phase.tick()

        ticker = threading.Thread(target=ticking, name="pd-progress", daemon=True)
        ticker.start()
        try:
            yield phase
        finally:
            stop.set()
            ticker.join()
            phase.close()


QUIET = Reporter("off")
_current: Reporter = QUIET


def current() -> Reporter:
    """The reporter the running command chose (QUIET when none did)."""
    return _current


def mode_for(quiet: bool) -> str:
    """`off` with --quiet, a bar on a terminal, plain lines elsewhere."""
    if quiet:
        return "off"
    return "bar" if sys.stderr.isatty() else "lines"


@contextlib.contextmanager
def reporting(mode: str, prefix: str = "") -> Iterator[Reporter]:
    """Make a `Reporter(mode, prefix)` the current one for the `with` block."""
    global _current
    previous, _current = _current, Reporter(mode, prefix)
    try:
        yield _current
    finally:
        _current = previous

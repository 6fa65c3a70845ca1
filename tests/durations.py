"""Record how long each test took: `python tests/durations.py JUNIT.xml` (a `pytest
--junitxml` report of the whole suite, one process) writes `tests/durations.json`, test id ->
seconds (setup, call and teardown) for every test of a second or more. `make durations` runs the
suite and records it. `tests/test_marks.py` reads the file: a test over `SLOW_S` there must be
marked slow, so the fast tier stays fast without any test timing itself."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")
RECORDED_FROM_S = 1.0
"""Tests quicker than this are left out of the file."""


def node_id(classname: str, name: str) -> str:
    """pytest's id of a junit test case (`tests.test_x` + `test_y[p]` -> `tests/test_x.py::test_y[p]`)."""
    return f"{classname.replace('.', '/')}.py::{name}"


def read_junit(path: Path) -> dict[str, float]:
    return {node_id(case.get("classname", ""), case.get("name", "")): float(case.get("time", 0.0))
            for case in ET.parse(path).iter("testcase")}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    times = read_junit(Path(argv[0]))
    kept = {k: round(v, 1) for k, v in sorted(times.items()) if v >= RECORDED_FROM_S}
    tmp = DURATIONS.with_suffix(".tmp")
    tmp.write_text(json.dumps(kept, indent=0, sort_keys=True) + "\n")
    tmp.replace(DURATIONS)
    print(f"{DURATIONS}: {len(kept)} of {len(times)} tests took {RECORDED_FROM_S:g} s or more")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What the benchmarks that train through the CLI share: `pd` with a hard timeout, a short
training read back as `pd report` reads it, and a loop over cases that keeps going past a
failed one."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from _bench_common import BenchFailed, run_bounded, stderr_tail

from pdcli.report import ReplanCommands, make_report

PD = Path(sys.executable).parent / "pd"
DRIFT_THRESHOLD_PCT = 25.0
AS_PLANNED = "profile.defer_pipeline_probe=false"
"""The override of a run whose prediction is checked: its profile has the pipeline probe, as the
one `pd plan` prices with (`pd train` defers the probe where the recipe fixes the shape)."""


def pd_command(*args: str, timeout_s: float) -> str:
    """`pd ARGS`'s standard output; BenchFailed with its stderr's tail when it fails."""
    code, out, err = run_bounded([str(PD), *args], timeout_s)
    if code != 0:
        raise BenchFailed(f"pd {args[0]} exit status {code}: {stderr_tail(err)}")
    return out


def steady_ms(recipe: Path, root: Path, name: str, steps: int, overrides: Sequence[str], timeout_s: float) -> float:
    """Train `recipe` for `steps` minibatches as run `name` under `root`; its steady time per
    minibatch (the second half), as `pd report` measures it."""
    args = [f"run.root={root}", f"run.name={name}", f"train.steps={steps}", f"train.log_every={max(1, steps // 4)}",
            AS_PLANNED, *overrides]
    pd_command("train", str(recipe), *args, timeout_s=timeout_s)
    c = make_report(root / name, ReplanCommands(str(recipe), tuple(args)), DRIFT_THRESHOLD_PCT, charts=False).comparison
    return c.measured.steady_time_per_minibatch_ms or c.measured.time_per_minibatch_ms


def run_cases(names: Sequence[str], prefix: str, run_case: Callable[[str, Path], dict[str, Any]]) -> list[dict[str, Any]]:
    """`run_case(name, root)` for each case in one scratch directory; a case that fails gives
    `{"case", "error"}` and the next one runs."""
    results = []
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for name in names:
            try:
                results.append(run_case(name, Path(tmp)))
            except BenchFailed as e:
                results.append({"case": name, "error": str(e)})
    return results

"""Measured timelines of the virtual-stage schedules beside 1f1b, for docs/schedules.md (its measured timelines).

Trains the quickstart (2 devices, 4 microbatches) with `1f1b` and with `interleaved`,
`loopedbfs` and `zbv` at `schedule.virtual_stages=2`, then draws two minibatches of each run's
measured trace (`train/trace.json`) with `pd report`'s timeline chart: two minibatches, one row per device.

    .venv/bin/python benchmarks/virtual_timelines.py [--out docs/timelines] [--steps 12]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from pdcli.report.charts import draw_timeline
from pdcli.report.measured import read_trace

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart.yaml"
SCHEDULES = {"1f1b": [], "interleaved": ["schedule.virtual_stages=2"], "loopedbfs": ["schedule.virtual_stages=2"],
             "zbv": ["schedule.virtual_stages=2"]}
NUM_MICROBATCHES = 4
SHOWN = 2
"""Minibatches each picture shows (steady state, mid-run)."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "docs" / "timelines")
    p.add_argument("--steps", type=int, default=12, help="minibatches trained per schedule")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    pd = Path(sys.executable).parent / "pd"
    with tempfile.TemporaryDirectory(prefix="pd-timelines-") as tmp:
        for name, extra in SCHEDULES.items():
            root = Path(tmp) / name
            subprocess.run([str(pd), "train", str(RECIPE), f"run.root={root}", f"schedule.name={name}", *extra,
                            f"schedule.num_microbatches={NUM_MICROBATCHES}", f"train.steps={args.steps}",
                            "train.eval_every=0", "train.eval_batches=0"], check=True, capture_output=True)
            ranks = read_trace(root / "quickstart" / "train" / "trace.json")
            chunks = 2 if extra else 1  # a device backwards each microbatch once per chunk
            out = draw_timeline(ranks, NUM_MICROBATCHES * chunks, [[0]], args.out / f"{name}.png", num_steps=SHOWN)
            print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

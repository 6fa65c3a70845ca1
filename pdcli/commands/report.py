"""`pd report RUN`: predicted vs measured per stage, drift warning, timeline and loss charts."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from typing_extensions import Annotated

from pdcli.commands.common import FormatOpt, OverridesArg, RunNameOpt, check_format, echo_err, user_errors

RunArg = Annotated[Path, typer.Argument(help="A run directory (runs/NAME) or the recipe YAML it was trained from.", show_default=False)]


@user_errors
def report(
    run: RunArg,
    overrides: OverridesArg = None,
    fmt: FormatOpt = "text",
    run_name: RunNameOpt = None,
    drift_threshold: Annotated[float, typer.Option("--drift-threshold", metavar="PCT", help="Warn when a measured stage time differs from the plan by more than PCT percent.")] = 25.0,
    timeline_steps: Annotated[int, typer.Option("--timeline-steps", help="Minibatches shown in timeline.png.")] = 3,
    timeline_start: Annotated[Optional[int], typer.Option("--timeline-start", help="First minibatch shown in timeline.png (default: mid-run).")] = None,
    charts: Annotated[bool, typer.Option("--charts/--no-charts", help="Write train/timeline.png and train/loss.png.")] = True,
) -> None:
    """Compare a trained run with its plan: compute, comm, idle per stage, time per minibatch, bubble, drift."""
    check_format(fmt)
    from pdcli.report import locate_run, make_report, render

    run_dir, commands = locate_run(run, overrides or [], run_name)
    result = make_report(run_dir, commands, drift_threshold, charts=charts, timeline_steps=timeline_steps, timeline_start=timeline_start)
    typer.echo(render(result.comparison, fmt, run_dir, result.charts))
    if fmt == "json" and result.comparison.drift is not None:  # text and markdown carry it already
        echo_err(f"warning: the plan drifted; re-plan with: {result.comparison.drift.command}")

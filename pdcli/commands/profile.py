"""`pd profile`: measure every layer of the model on one device -> profile.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from typing_extensions import Annotated

from pdcli.commands.common import ForceOpt, FormatOpt, OverridesArg, QuietOpt, RecipeArg, RunNameOpt, check_format, echo_err, load, user_errors


@user_errors
def profile(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    force: ForceOpt = False,
    fmt: FormatOpt = "text",
    run_name: RunNameOpt = None,
    export_graph: Annotated[
        Optional[Path], typer.Option("--export-graph", help="Also write the profile as PipeDream's graph.txt to this file.")
    ] = None,
    recalibrate: Annotated[bool, typer.Option(
        "--recalibrate", help="Measure this host's own figures again (transport, all-reduce; the host file) and the profile.")] = False,
    quiet: QuietOpt = False,
) -> None:
    """Measure forward/backward time and activation/parameter bytes of every layer."""
    check_format(fmt)
    loaded, run = load(recipe, overrides, run_name)
    from pdcli.profiler.measure import summarize
    from pdcli.progress import mode_for, reporting
    from pdcli.steps.profile import ensure_profile

    with reporting(mode_for(quiet)):
        chain, reused = ensure_profile(loaded.config, run, force=force,
                                       recalibrate=recalibrate)
    if export_graph is not None:
        from pdcli.profiler.graphtxt import chain_to_graph, write_graph

        write_graph(chain_to_graph(chain, loaded.config.data.batch_size), export_graph)
        echo_err(f"wrote {export_graph} (PipeDream graph.txt, times of a {loaded.config.data.batch_size}-sample minibatch)")
    if fmt == "json":
        typer.echo(json.dumps(chain.to_json(), indent=1))
        return
    echo_err(f"{'reused' if reused else 'wrote'} {run / 'profile.json'}" + (" (inputs unchanged; --force re-measures)" if reused else ""))
    typer.echo(summarize(chain))

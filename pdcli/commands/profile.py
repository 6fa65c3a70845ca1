"""`pd profile`: measure every layer of the model on one device -> profile.json."""

from __future__ import annotations

import json

import typer

from pdcli.commands.common import ForceOpt, FormatOpt, OverridesArg, RecipeArg, RunNameOpt, check_format, echo_err, is_tty, load, user_errors


@user_errors
def profile(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    force: ForceOpt = False,
    fmt: FormatOpt = "text",
    run_name: RunNameOpt = None,
) -> None:
    """Measure forward/backward time and activation/parameter bytes of every layer."""
    check_format(fmt)
    loaded, run = load(recipe, overrides, run_name)
    from pdcli.profiler.measure import summarize
    from pdcli.profiler.step import ensure_profile

    chain, reused = ensure_profile(loaded.config, run, force=force, progress=is_tty() and fmt != "json")
    if fmt == "json":
        typer.echo(json.dumps(chain.to_json(), indent=1))
        return
    echo_err(f"{'reused' if reused else 'wrote'} {run / 'profile.json'}" + (" (inputs unchanged; --force re-measures)" if reused else ""))
    typer.echo(summarize(chain))

"""`pd config`: show the resolved config, list models and data sets."""

from __future__ import annotations

import typer
from tabulate import tabulate

from pdcli.commands.common import OverridesArg, RecipeArg, user_errors
from pdcli.config import load_config

app = typer.Typer(help="Inspect configs: the resolved recipe, the built-in models and data sets.", no_args_is_help=True)


@app.command("show")
@user_errors
def show(recipe: RecipeArg, overrides: OverridesArg = None, sources: bool = typer.Option(False, "--sources", help="Also list which file set each key.")) -> None:
    """Print the fully resolved config of RECIPE with OVERRIDES applied."""
    loaded = load_config(recipe, list(overrides or []))
    typer.echo(loaded.to_yaml(), nl=False)
    if sources:
        typer.echo("\n# where each key came from")
        for key, src in sorted(loaded.sources.items()):
            typer.echo(f"# {key}: {src}")


@app.command("models")
def models() -> None:
    """List the built-in models (`model.name`)."""
    from pdcli.models import list_models

    typer.echo(tabulate(list_models(), headers=["model.name", "what"]))


@app.command("data")
def data() -> None:
    """List the built-in data sets (`data.name`)."""
    from pdcli.data import list_datasets

    typer.echo(tabulate(list_datasets(), headers=["data.name", "what"]))

"""The `pd` command: wires the subcommands, nothing else."""

from __future__ import annotations

import typer

from pdcli import __version__
from pdcli.commands import compile, config_cmd, plan, profile, report, train
from pdcli.commands import export
from pdcli.commands.common import State

app = typer.Typer(
    name="pd",
    help="PipeDream-style pipeline-parallel training for PyTorch, driven by one YAML recipe.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"pd {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for user errors too."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    State.debug = debug


app.command("profile")(profile.profile)
app.command("plan")(plan.plan)
app.command("compile")(compile.compile)
app.command("train")(train.train)
app.command("export")(export.export)
app.command("report")(report.report)
app.add_typer(config_cmd.app, name="config")


def main() -> None:
    app()

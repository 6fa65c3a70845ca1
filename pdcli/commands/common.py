"""What every subcommand shares: typed option aliases, config loading, user-error handling."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional, TypeVar

import typer
from typing_extensions import Annotated

from pdcli.config import Loaded, load_config, run_dir_path
from pdcli.errors import UserError
from pdcli.rundir import RunDir, atomic_write_text

F = TypeVar("F", bound=Callable[..., Any])

RecipeArg = Annotated[Path, typer.Argument(help="Recipe YAML (e.g. recipes/quickstart.yaml).", show_default=False)]
OverridesArg = Annotated[
    Optional[List[str]],
    typer.Argument(help="Overrides: key=value, ~key to delete, group=name to pick a config group.", show_default=False),
]
ForceOpt = Annotated[bool, typer.Option("--force", help="Redo the step even if its artifact is fresh.")]
FormatOpt = Annotated[str, typer.Option("--format", "-f", help="Output format: text, markdown or json.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output (results and errors only).")]
RunNameOpt = Annotated[Optional[str], typer.Option("--run", help="Run name (overrides run.name).")]


class State:
    debug = False


def echo_err(message: str) -> None:
    typer.echo(message, err=True)


def user_errors(fn: F) -> F:
    """Turn a UserError into `error: ...` on stderr and its exit status, 2 (1 for a RunFailed);
    a traceback with --debug."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            if State.debug:
                raise
            echo_err(f"error: {e.message}")
            if e.hint:
                echo_err(f"hint: {e.hint}")
            raise typer.Exit(e.exit_code) from None

    return wrapper  # type: ignore[return-value]


def check_format(fmt: str) -> str:
    if fmt not in ("text", "markdown", "json"):
        raise UserError(f"--format: {fmt!r} is not one of text, markdown, json")
    return fmt


def load(recipe: Optional[Path], overrides: Optional[List[str]], run_name: Optional[str] = None, extra: Optional[List[str]] = None) -> tuple[Loaded, RunDir]:
    """Load the recipe with overrides, create the run directory, write the resolved config."""
    items = list(overrides or []) + list(extra or [])
    if run_name:
        items.append(f"run.name={run_name}")
    loaded = load_config(recipe, items)
    for note in loaded.notes:
        typer.echo(f"note: {note}", err=True)
    run = RunDir(run_dir_path(loaded.config)).create()
    atomic_write_text(run / "config.yaml", loaded.to_yaml())
    return loaded, run


def is_tty() -> bool:
    return sys.stderr.isatty()

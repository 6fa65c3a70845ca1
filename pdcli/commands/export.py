"""`pd export RUN`: a checkpoint's stages merged into one ordinary state dict of the original model."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from typing_extensions import Annotated

from pdcli.commands.common import echo_err, user_errors
from pdcli.errors import UserError


@user_errors
def export(
    run: Annotated[Path, typer.Argument(help="Run directory (e.g. runs/quickstart).", show_default=False)],
    step: Annotated[Optional[int], typer.Option("--step", help="Checkpoint step (default: the latest complete one).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="File to write (default: RUN/export/step_<N>.pt).")] = None,
) -> None:
    """Write one state dict of the original model (original parameter names) from a checkpoint.

    `torch.load` it and `model.load_state_dict(state, strict=True)`, or train from it under any
    plan with `train.init_from=<file>`."""
    import torch

    from pdcli.rundir import atomic_save
    from pdcli.runtime import checkpoint

    train_dir = run / "train"
    steps = checkpoint.complete_steps(train_dir)
    if not steps:
        raise UserError(f"no complete checkpoint in {train_dir / 'checkpoints'}", hint=f"train first: `pd train RECIPE` writes {run}")
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise UserError(f"no complete checkpoint of step {chosen} in {train_dir / 'checkpoints'}; complete: {steps}")
    state = checkpoint.load_model_state(train_dir, chosen)
    out = output or run / "export" / f"step_{chosen}.pt"
    atomic_save(out, lambda name: torch.save(state, name))
    echo_err(f"exported step {chosen} ({len(state)} tensors, {sum(t.numel() for t in state.values())} values)")
    typer.echo(str(out))

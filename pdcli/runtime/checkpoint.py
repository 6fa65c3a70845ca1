"""Per-stage checkpoints: `train/checkpoints/step_<n>/stage_<k>.pt`, then a COMPLETE marker.

Each stage's first replica writes its weights keyed by the ORIGINAL model's names (so all
stage files together form one ordinary state dict of the model), its optimizer state and
its weight-version count, atomically. After a barrier, rank 0 writes `COMPLETE` last: a
directory without it is an interrupted checkpoint and is never resumed from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pdcli.rundir import atomic_save, atomic_write_json

COMPLETE = "COMPLETE"


def checkpoint_dir(train_dir: Path, step: int) -> Path:
    return train_dir / "checkpoints" / f"step_{step}"


def stage_file(train_dir: Path, step: int, stage_id: int) -> Path:
    return checkpoint_dir(train_dir, step) / f"stage_{stage_id}.pt"


def original_state_dict(module: nn.Module, param_names: dict[str, str]) -> dict[str, torch.Tensor]:
    """The stage's state dict keyed by original model names (stage-local name when unmapped)."""
    return {param_names.get(k, k): v.detach().cpu().clone() for k, v in module.state_dict().items()}


def save_stage(
    train_dir: Path,
    step: int,
    stage_id: int,
    module: nn.Module,
    param_names: dict[str, str],
    optimizer: torch.optim.Optimizer,
    weight_version: int,
    extra: dict[str, Any],
) -> Path:
    path = stage_file(train_dir, step, stage_id)
    payload = {
        "stage_id": stage_id,
        "step": step,
        "model": original_state_dict(module, param_names),
        "param_names": dict(param_names),
        "optimizer": optimizer.state_dict(),
        "weight_version": weight_version,
        **extra,
    }
    atomic_save(path, lambda name: torch.save(payload, name))
    return path


def mark_complete(train_dir: Path, step: int, num_stages: int, keep: int) -> None:
    """Write the COMPLETE marker (after every stage file exists), then prune old checkpoints."""
    d = checkpoint_dir(train_dir, step)
    missing = [k for k in range(num_stages) if not stage_file(train_dir, step, k).exists()]
    if missing:
        raise RuntimeError(f"checkpoint {d} lacks stage files {missing}; not marking it complete")
    atomic_write_json(d / COMPLETE, {"step": step, "num_stages": num_stages})
    for old in complete_steps(train_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(checkpoint_dir(train_dir, old), ignore_errors=True)


def complete_steps(train_dir: Path) -> list[int]:
    """Steps of complete checkpoints, oldest first."""
    root = train_dir / "checkpoints"
    if not root.exists():
        return []
    steps = []
    for d in root.iterdir():
        if d.name.startswith("step_") and (d / COMPLETE).exists():
            try:
                steps.append(int(d.name.removeprefix("step_")))
            except ValueError:
                continue
    return sorted(steps)


def load_model_state(train_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """All stages of a complete checkpoint merged into one state dict of the original model."""
    d = checkpoint_dir(train_dir, step)
    info = json.loads((d / COMPLETE).read_text())
    state: dict[str, torch.Tensor] = {}
    for k in range(int(info["num_stages"])):
        state.update(torch.load(stage_file(train_dir, step, k), map_location="cpu", weights_only=True)["model"])
    return state

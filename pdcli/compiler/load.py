"""Load a generated stage: import its file by path, build it, load its weights by original names."""

from __future__ import annotations

import itertools
import json
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pdcli.errors import UserError

MANIFEST_NAME = "manifest.json"
_counter = itertools.count()


def read_manifest(stages_dir: str | Path) -> dict[str, Any]:
    path = Path(stages_dir) / MANIFEST_NAME
    if not path.exists():
        raise UserError(f"no stage manifest at {path}", hint="run `pd compile` first")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e})", hint="re-run `pd compile --force`") from None
    if not isinstance(manifest, dict):
        raise UserError(f"{path}: not a pd stage manifest (not a mapping)", hint="re-run `pd compile --force`")
    return manifest


def tied_holders(manifest: dict[str, Any]) -> list[dict[int, str]]:
    """Per weight tied between stages (`tied_weights` of the manifest): stage id -> the name that
    stage holds its copy under; only weights held by two stages or more."""
    groups = [{int(k): str(v) for k, v in t["holders"].items()} for t in manifest.get("tied_weights", [])]
    return [g for g in groups if len(g) > 1]


def held_parameter(module: nn.Module, entry: dict[str, Any], name: str) -> nn.Parameter:
    """The parameter of a built stage (`module`, its manifest `entry`) by its original `name`."""
    local = {original: local for local, original in entry["param_names"].items()}.get(name, name)
    return module.get_parameter(local)


def with_tied_names(state: dict[str, torch.Tensor], manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`state` (original names) plus every other name the model gives a tied weight it holds, so
    that the model's own `load_state_dict(strict=True)` finds them all (and keeps the tie)."""
    out = dict(state)
    for tied in manifest.get("tied_weights", []):
        held = [n for n in tied["holders"].values() if n in state]
        for name in tied["names"] if held else []:
            out.setdefault(name, state[held[0]])
    return out


def import_stage_file(path: str | Path) -> types.ModuleType:
    """Execute a stage file as a new module with a unique name.

    The source is compiled directly instead of through importlib's file loader, which would
    write a `__pycache__/` into `stages/` and so change the directory's recorded hash.
    """
    path = Path(path)
    name = f"pd_stage_{path.stem}_{next(_counter)}"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)  # noqa: S102 - our own file
    return module


def stage_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(stage-local name, tensor) of every parameter and buffer, non-persistent ones included."""
    return [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]


def load_weights(module: nn.Module, weights: dict[str, torch.Tensor], param_names: dict[str, str], where: str) -> None:
    """Copy `weights` (original names) into `module` (local names, via `param_names`)."""
    with torch.no_grad():
        for local, tensor in stage_tensors(module):
            original = param_names.get(local, local)
            if original not in weights:
                raise UserError(f"{where} has no weight {original!r}", hint="re-run `pd compile --force`")
            value = weights[original]
            if value.shape != tensor.shape:
                raise UserError(
                    f"{where}: {original!r} has shape {list(value.shape)}, the stage expects {list(tensor.shape)}",
                    hint="re-run `pd compile --force`",
                )
            tensor.copy_(value)


def load_stage(stages_dir: str | Path, stage_id: int) -> tuple[nn.Module, dict[str, Any]]:
    """The stage module with its weights loaded, and its manifest entry (the runtime's one call)."""
    stages_dir = Path(stages_dir)
    manifest = read_manifest(stages_dir)
    entries = {e["stage_id"]: e for e in manifest["stages"]}
    if stage_id not in entries:
        raise UserError(f"{stages_dir} has stages {sorted(entries)}, not {stage_id}")
    entry = entries[stage_id]
    module = import_stage_file(stages_dir / entry["module"]).build()
    weights_path = stages_dir / entry["weights"]
    weights = torch.load(weights_path, map_location="cpu", weights_only=True)
    load_weights(module, weights, entry["param_names"], str(weights_path))
    return module, entry

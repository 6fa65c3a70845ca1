"""Write a split model to a directory: `stage_<k>.py`, `stage_<k>.pt` and `manifest.json`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx

from pdcli.compiler.codegen import fetch, stage_source, stage_tensors
from pdcli.compiler.load import MANIFEST_NAME, import_stage_file
from pdcli.compiler.load import stage_tensors as built_tensors
from pdcli.compiler.split import DATA, StagePart, Wire
from pdcli.rundir import atomic_save, atomic_write_json, atomic_write_text

MANIFEST_VERSION = 1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _wire_json(wire: Wire) -> dict[str, Any]:
    return {"name": wire.name, "shape": list(wire.shape), "dtype": _dtype_name(wire.dtype)}


def tied_weights(parts: Sequence[StagePart], gm: fx.GraphModule, state_keys: set[str]) -> list[dict[str, Any]]:
    """The parameters the model shares (tied embeddings, a layer called twice) that more than
    one stage uses, or that the model's state dict names more than once.

    Each entry: `holders` (stage id as a string -> the name that stage holds it under; each
    holder keeps a copy, and the runtime sums their gradients before every update) and `names`
    (every name of the tensor in the model's state dict, so `pd export` writes them all).
    """
    holders: dict[int, dict[str, str]] = {}
    for part in parts:
        for name, tensor in stage_tensors(part, gm):
            if isinstance(tensor, torch.nn.Parameter):
                holders.setdefault(id(tensor), {}).setdefault(str(part.stage_id), name)
    names: dict[int, list[str]] = {}
    for name, tensor in gm.named_parameters(remove_duplicate=False):
        if name in state_keys:
            names.setdefault(id(tensor), []).append(name)
    return [
        {"holders": held, "names": sorted(names.get(key, []))}
        for key, held in holders.items()
        if len(held) > 1 or len(names.get(key, [])) > 1
    ]


def stage_entry(part: StagePart, param_names: dict[str, str]) -> dict[str, Any]:
    k = part.stage_id
    return {
        "stage_id": k,
        "module": f"stage_{k}.py",
        "weights": f"stage_{k}.pt",
        "class_name": f"Stage{k}",
        "param_names": param_names,
        "inputs": [{**_wire_json(i.wire), "peer": i.peer} for i in part.inputs],
        "outputs": [{**_wire_json(o.wire), "peers": list(o.peers)} for o in part.outputs],
    }


def write_stages(
    parts: Sequence[StagePart],
    gm: fx.GraphModule,
    out_dir: str | Path,
    loss: str,
    state_keys: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Write every stage's module, weights (by original name) and the manifest; return it.

    `state_keys`: the original model's `state_dict()` names (default: `gm`'s, which lists
    root-level non-persistent buffers as persistent). Each .pt holds the stage's part of the
    model's state dict plus any non-persistent buffers it needs (load_stage restores both).
    """
    keys = set(gm.state_dict() if state_keys is None else state_keys)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for part in parts:
        k = part.stage_id
        py_path = out_dir / f"stage_{k}.py"
        atomic_write_text(py_path, stage_source(part, gm, len(parts), keys))
        # Build the written file and fill it from the original: what is saved is exactly what
        # the generated module holds, under the names it holds them.
        built = import_stage_file(py_path).build()
        param_names = {name: name for name, _ in built_tensors(built)}  # paths are kept as is
        weights = {}
        for local, tensor in built_tensors(built):
            value = fetch(gm, param_names[local]).detach()
            if value.shape != tensor.shape or value.dtype != tensor.dtype:
                raise AssertionError(
                    f"stage {k} rebuilt {local} as {list(tensor.shape)} {tensor.dtype}, the model has "
                    f"{list(value.shape)} {value.dtype}"
                )
            weights[param_names[local]] = value.clone()
        atomic_save(out_dir / f"stage_{k}.pt", lambda name, w=weights: torch.save(w, name))
        entries.append(stage_entry(part, param_names))
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    first_inputs = [i for p in parts for i in p.inputs if i.peer == DATA]
    manifest = {
        "version": MANIFEST_VERSION,
        "num_stages": len(parts),
        "microbatch_size": first_inputs[0].wire.shape[0] if first_inputs else None,
        "model_inputs": placeholders,
        "loss": loss,
        "stages": entries,
        "tied_weights": tied_weights(parts, gm, keys),
    }
    atomic_write_json(out_dir / MANIFEST_NAME, manifest)
    return manifest

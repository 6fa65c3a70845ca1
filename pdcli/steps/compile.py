"""The compile step: reuse `<run>/stages/` while the model and the plan's boundaries are unchanged,
else generate and verify it."""

from __future__ import annotations

import dataclasses
import shutil
from typing import Any

import torch

from pdcli.compiler.build import compile_stages
from pdcli.compiler.load import read_manifest
from pdcli.config.schema import Config
from pdcli.errors import UserError
from pdcli.progress import current
from pdcli.rundir import RunDir, hash_obj, replace_dir, temp_dir_beside

STAGES = "stages"
"""Artifact name of the stages directory in the run directory."""
FORMAT_VERSION = 2
"""Bump when the generated code or manifest changes, so old stages are regenerated."""


def plan_boundaries(plan_json: dict[str, Any]) -> list[tuple[int, int]]:
    """[(start, end)] of each stage of a `plan.json`, in stage order."""
    try:
        stages = sorted(plan_json["stages"], key=lambda s: int(s["stage_id"]))
        return [(int(s["start"]), int(s["end"])) for s in stages]
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(
            f"plan.json: stages need stage_id, start and end ({type(e).__name__}: {e})",
            hint="re-run `pd plan`",
        ) from None


def stages_inputs_hash(cfg: Config, plan_json: dict[str, Any]) -> str:
    """What the stages depend on: the model, its init seed, the microbatch (size and data
    shapes), the plan's boundaries, the torch version (fx codegen) and this format."""
    return hash_obj(
        {
            "model": dataclasses.asdict(cfg.model),
            "seed": cfg.train.seed,
            "microbatch_size": cfg.microbatch_size,
            "data": {"name": cfg.data.name, "kwargs": dict(cfg.data.kwargs)},
            "boundaries": plan_boundaries(plan_json),
            "torch": torch.__version__,
            "format": FORMAT_VERSION,
        }
    )


def _check_node_names(plan_json: dict[str, Any], chain_names: list[str]) -> None:
    """A plan listing node names must name this model's chain (else it is stale)."""
    for stage in plan_json["stages"]:
        names = stage.get("node_names")
        if names is None:
            continue
        if list(names) != chain_names[int(stage["start"]) : int(stage["end"])]:
            raise UserError(
                f"plan.json: stage {stage['stage_id']}'s node_names do not match the model's graph "
                f"at positions [{stage['start']}, {stage['end']})",
                hint="the plan was made for another model; re-run `pd profile` and `pd plan`",
            )


def ensure_stages(
    cfg: Config, run: RunDir, plan_json: dict[str, Any], force: bool = False
) -> tuple[dict[str, Any], bool]:
    """(manifest, reused): `run/stages/` generated from the plan and verified, or reused as is.

    A new directory is written beside the old one and renamed into place, so `stages/` is
    never half-written; only then is it registered in the run manifest.
    """
    from pdcli.data import build_data  # lazy: the models and data packages import torch deeply
    from pdcli.models import build_model
    from pdcli.profiler.trace import chain_order, trace_model

    inputs_hash = stages_inputs_hash(cfg, plan_json)
    target = run / STAGES
    if not force and run.fresh(STAGES, inputs_hash):
        return read_manifest(target), True

    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    sample = build_data(cfg.data, cfg.data.batch_size).batch(0).split(cfg.schedule.num_microbatches)[0]
    _check_node_names(plan_json, [n.name for n in chain_order(trace_model(model, sample.inputs))])
    run.create()
    tmp = temp_dir_beside(target)
    try:
        with current().phase(f"compile: writing and verifying {len(plan_json['stages'])} stages"):
            manifest, _ = compile_stages(
                model, sample.inputs, plan_boundaries(plan_json), tmp, loss=cfg.model.loss, seed=cfg.train.seed
            )
        replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    run.register(STAGES, inputs_hash)
    return manifest, False


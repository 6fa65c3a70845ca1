"""Per-stage checkpoints: `train/checkpoints/step_<n>/stage_<k>.pt`, then a COMPLETE marker.

`step_<n>` = the state after the first n minibatches, taken at a drain point (see
`pdcli.schedule`): nothing is in flight, so the stage files form a consistent cut.
Each stage's first replica writes, atomically (temp file + rename), its weights keyed by
the ORIGINAL model's names (all stage files together form one ordinary state dict of the
model), its optimizer state, the data position (the next minibatch index, n), the RNG
state of every replica and, on the last stage, the loss records the metrics continue
from. After a barrier, the first rank of each host writes `COMPLETE` last, for the stages
saved on that host (on one host: rank 0, for all): a directory without it is an
interrupted checkpoint, never resumed from and never counted among the kept ones. The marker
records each of those stage files' SHA-256; a stage file read back is checked against it, so a
file changed, truncated or swapped since it was written is refused by name (`CheckpointCorrupt`)
before any worker starts, not loaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from pdcli.compiler.load import MANIFEST_NAME, read_manifest, with_tied_names
from pdcli.errors import UserError
from pdcli.rundir import atomic_save, atomic_write_json, sha256_file
from pdcli.runtime.divergence import check_finite_state

COMPLETE = "COMPLETE"
RESUME_HINT = (
    "resume with the recipe and plan that wrote it; to continue under another plan or model, "
    "`pd export` it and set train.init_from; or start fresh without --resume"
)


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
    """Write one stage's file; `extra` adds e.g. rng_states, loss_records, num_optimizer_steps."""
    path = stage_file(train_dir, step, stage_id)
    payload = {
        "stage_id": stage_id,
        "step": step,
        "data_position": step,  # the next minibatch index
        "model": original_state_dict(module, param_names),
        "param_names": dict(param_names),
        "optimizer": optimizer.state_dict(),
        "weight_version": weight_version,
        **extra,
    }
    check_finite_state(payload, stage_id, step)  # a NaN checkpoint must never exist, let alone rotate good ones out
    atomic_save(path, lambda name: torch.save(payload, name))
    return path


def mark_complete(train_dir: Path, step: int, num_stages: int, keep: int, meta: dict[str, Any] | None = None,
                  stage_ids: Sequence[int] | None = None) -> None:
    """Write the COMPLETE marker (after every stage file exists: of `stage_ids`, the stages
    this host saves, else all), then prune: keep the last `keep` complete checkpoints and
    drop interrupted ones older than this one."""
    d = checkpoint_dir(train_dir, step)
    stage_ids = range(num_stages) if stage_ids is None else stage_ids
    missing = [k for k in stage_ids if not stage_file(train_dir, step, k).exists()]
    if missing:
        raise RuntimeError(f"checkpoint {d} lacks stage files {missing}; not marking it complete")
    hashes = {str(k): sha256_file(stage_file(train_dir, step, k)) for k in stage_ids}
    atomic_write_json(d / COMPLETE, {"step": step, "num_stages": num_stages, "stage_ids": list(stage_ids),
                                     "sha256": hashes, **(meta or {})})
    for old in complete_steps(train_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(checkpoint_dir(train_dir, old), ignore_errors=True)
    for old, complete in _step_dirs(train_dir):
        if not complete and old < step:
            shutil.rmtree(checkpoint_dir(train_dir, old), ignore_errors=True)


def _step_dirs(train_dir: Path) -> list[tuple[int, bool]]:
    root = train_dir / "checkpoints"
    if not root.exists():
        return []
    out = []
    for d in root.iterdir():
        if d.name.startswith("step_") and d.name.removeprefix("step_").isdigit():
            out.append((int(d.name.removeprefix("step_")), (d / COMPLETE).exists()))
    return sorted(out)


def complete_steps(train_dir: Path) -> list[int]:
    """Steps of complete checkpoints, oldest first."""
    return [step for step, complete in _step_dirs(train_dir) if complete]


def latest_step(train_dir: Path) -> int | None:
    """The newest complete checkpoint's step, or None."""
    steps = complete_steps(train_dir)
    return steps[-1] if steps else None


def last_good(train_dir: Path) -> str:
    """The newest complete checkpoint's directory, or "none" (for messages)."""
    step = latest_step(train_dir)
    return "none" if step is None else str(checkpoint_dir(train_dir, step))


def read_info(train_dir: Path, step: int) -> dict[str, Any]:
    """The COMPLETE marker's record (step, num_stages, schedule, the stage files' sha256, ...);
    UserError naming the marker where it is unreadable or not a marker of this step."""
    path = checkpoint_dir(train_dir, step) / COMPLETE
    hint = f"delete {path.parent} to resume from the previous checkpoint"
    try:
        info = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"checkpoint marker {path} is unreadable ({e})", hint=hint) from None
    hashes = info.get("sha256", {}) if isinstance(info, dict) else None
    if (not isinstance(info, dict) or info.get("step") != step or not _count(info.get("num_stages"))
            or not isinstance(hashes, dict) or not all(isinstance(h, str) for h in hashes.values())):
        raise UserError(f"checkpoint marker {path} is not the COMPLETE marker of step {step} "
                        "(it needs its step, num_stages and each stage file's sha256)", hint=hint)
    return dict(info)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class CheckpointCorrupt(UserError):
    """A stage file that does not hold what its checkpoint's marker recorded."""


def load_stage_file(train_dir: Path, step: int, stage_id: int) -> dict[str, Any]:
    """One stage file of a complete checkpoint, its bytes checked against the sha256 its marker
    recorded (markers written before pd recorded them: not checked); UserError if it is
    missing, changed or corrupt."""
    path = stage_file(train_dir, step, stage_id)
    recorded = read_info(train_dir, step).get("sha256", {}).get(str(stage_id))
    hint = f"delete {path.parent} to resume from the previous checkpoint, or start fresh without --resume"
    try:
        actual = sha256_file(path) if recorded is not None else None
        if actual != recorded:
            raise CheckpointCorrupt(f"checkpoint file {path} is corrupt: changed or damaged after it was written "
                                    f"(sha256 {actual[:12]}, its {COMPLETE} marker recorded {recorded[:12]})", hint=hint)
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"checkpoint {path.parent} has no {path.name}", hint=f"delete {path.parent}") from None
    except CheckpointCorrupt:
        raise
    except Exception as e:  # noqa: BLE001 - torch.load raises many types on garbage
        raise UserError(f"checkpoint file {path} is corrupt ({type(e).__name__}: {str(e)[:120]})", hint=hint) from None
    if not isinstance(payload, dict) or not isinstance(payload.get("model"), dict):
        raise UserError(f"{path} is not a pd stage checkpoint", hint=f"delete {path.parent}")
    return payload


def load_model_state(train_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """All stages of a complete checkpoint merged into one state dict of the original model,
    a weight tied between stages once under each of the model's names for it (the stages'
    copies are equal: `pdcli.runtime.tied`)."""
    info = read_info(train_dir, step)
    state: dict[str, torch.Tensor] = {}
    for k in range(int(info["num_stages"])):
        state.update(load_stage_file(train_dir, step, k)["model"])
    stages_dir = train_dir.parent / "stages"
    return with_tied_names(state, read_manifest(stages_dir)) if (stages_dir / MANIFEST_NAME).exists() else state


def check_weights(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str, hint: str) -> None:
    """`weights` holds every name of `expected` with its shape; UserError naming `where` otherwise."""
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise UserError(f"{where} lacks {len(missing)} weights of this model, e.g. {missing[:3]}", hint=hint)
    wrong = [(n, list(weights[n].shape), list(t.shape)) for n, t in expected.items() if weights[n].shape != t.shape]
    if wrong:
        name, got, want = wrong[0]
        raise UserError(f"{where}: {name!r} has shape {got}, this model's is {want} ({len(wrong)} mismatches)", hint=hint)


def load_weights_by_name(module: nn.Module, param_names: dict[str, str], weights: dict[str, torch.Tensor], where: str, hint: str) -> None:
    """Copy `weights` (original names) into `module`'s state (stage-local names)."""
    own = original_state_dict(module, param_names)
    check_weights(weights, own, where, hint)
    local = {local: weights[param_names.get(local, local)] for local in module.state_dict()}
    module.load_state_dict(local, strict=True)


def restore_stage(
    payload: dict[str, Any], module: nn.Module, param_names: dict[str, str], optimizer: torch.optim.Optimizer, where: str
) -> None:
    """Weights and optimizer state of a stage file into a freshly built stage."""
    load_weights_by_name(module, param_names, payload["model"], where, RESUME_HINT)
    optimizer.load_state_dict(payload["optimizer"])

"""Compile a model into stages in one call: trace, split, write, verify."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from pdcli.compiler.manifest import write_stages
from pdcli.compiler.split import split_graph
from pdcli.compiler.verify import VerificationReport, verify_stages
from pdcli.profiler.trace import trace_model


def compile_stages(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    boundaries: Sequence[tuple[int, int]],
    out_dir: str | Path,
    loss: str = "cross_entropy",
    seed: int = 0,
) -> tuple[dict[str, Any], VerificationReport]:
    """Write `stage_<k>.py/.pt` and `manifest.json` for `model` split at `boundaries` into
    `out_dir`, then check the written stages against the model (CompileVerificationError).

    `example_inputs` is one microbatch: its shapes become the manifest's (fixed) shapes.
    `model` is left as it was (verification runs on copies).
    """
    gm = trace_model(model, example_inputs)
    parts = split_graph(gm, boundaries, example_inputs)
    manifest = write_stages(parts, gm, out_dir, loss, state_keys=model.state_dict().keys())
    report = verify_stages(model, example_inputs, out_dir, seed=seed)
    return manifest, report

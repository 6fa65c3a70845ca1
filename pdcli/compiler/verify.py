"""Check generated stages against the original model: outputs, every gradient, every buffer.

The stages are loaded from disk exactly as the runtime loads them (`load_stage`), chained on
one microbatch with tensors routed by the manifest, each stage's inputs detached as the
runtime receives them, and backward run stage by stage from the last, summing the gradients
of a tensor sent to several stages. Both sides run in the model's own train/eval mode
(BatchNorm uses batch statistics in train mode and updates its running stats on both sides,
which are compared too) and from the same RNG seed: the stages execute the graph's ops in the
same order as the model, so dropout draws the same masks and no layer needs to be disabled.
Backward starts from a seeded random output gradient rather than a loss, so no target is
needed and every output element is checked.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from pdcli.compiler.load import held_parameter, load_stage, read_manifest, tied_holders
from pdcli.compiler.split import DATA, LOSS
from pdcli.models.loss import logits_of
from pdcli.profiler.trace import trace_model

RTOL = 1e-4
ATOL = 1e-5
"""Absolute tolerance relative to the reference's largest magnitude (at least 1)."""


class CompileVerificationError(Exception):
    """The stages do not compute what the model computes: a bug in the compiler, not the user's."""

    def __init__(self, what: str, max_abs_error: float, stage_id: int | None) -> None:
        where = "" if stage_id is None else f", first seen in stage {stage_id}"
        super().__init__(f"{what}: max abs error {max_abs_error:.3g}{where}")
        self.what, self.max_abs_error, self.stage_id = what, max_abs_error, stage_id


@dataclass(frozen=True)
class VerificationReport:
    """How closely the stages reproduced the model (absolute errors)."""

    output_max_abs_error: float
    grad_max_abs_error: float
    num_tensors_checked: int


def _error(got: Tensor, want: Tensor) -> tuple[float, bool]:
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return float("inf"), False
    err = float((got - want).abs().max()) if got.numel() else 0.0
    atol = ATOL * max(1.0, float(want.abs().max()) if want.numel() else 0.0)
    return err, bool(torch.allclose(got, want, rtol=RTOL, atol=atol))


def _run_stages(
    stages: Sequence[tuple[nn.Module, dict[str, Any]]],
    model_inputs: dict[str, Tensor],
    grad_output: Tensor | None,
    seed: int,
) -> dict[tuple[int, str], Tensor]:
    """Forward then backward through the chained stages; returns every stage output by (stage, name)."""
    sent: dict[tuple[int, str], Tensor] = {}
    received: list[list[Tensor]] = []
    torch.manual_seed(seed)
    for module, entry in stages:
        k = entry["stage_id"]
        inputs = []
        for spec in entry["inputs"]:
            src = model_inputs[spec["name"]] if spec["peer"] == DATA else sent[(spec["peer"], spec["name"])]
            t = src.detach().clone()
            inputs.append(t.requires_grad_() if t.is_floating_point() and spec["peer"] != DATA else t)
        outputs = module(*inputs)
        if not isinstance(outputs, tuple) or len(outputs) != len(entry["outputs"]):
            raise CompileVerificationError(f"stage {k} returned {type(outputs).__name__} of the wrong length", 0.0, k)
        for spec, t in zip(entry["outputs"], outputs):
            if list(t.shape) != spec["shape"] or str(t.dtype).removeprefix("torch.") != spec["dtype"]:
                raise CompileVerificationError(
                    f"stage {k} output {spec['name']} is {list(t.shape)} {t.dtype}, the manifest says "
                    f"{spec['shape']} {spec['dtype']}",
                    0.0,
                    k,
                )
            sent[(k, spec["name"])] = t
        received.append(inputs)
    if grad_output is None:
        return sent
    grads: dict[tuple[int, str], Tensor] = {}
    for (module, entry), inputs in reversed(list(zip(stages, received))):
        k = entry["stage_id"]
        pairs = []
        for spec in entry["outputs"]:
            t = sent[(k, spec["name"])]
            g = grad_output if spec["peers"] == [LOSS] else grads.get((k, spec["name"]))
            if t.requires_grad and g is not None:
                pairs.append((t, g))
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        for spec, t in zip(entry["inputs"], inputs):
            if spec["peer"] != DATA and t.grad is not None:
                key = (spec["peer"], spec["name"])
                grads[key] = grads[key] + t.grad if key in grads else t.grad  # sent to several stages
    return sent


def _reference_wires(model: nn.Module, inputs: Sequence[Tensor], seed: int) -> dict[str, Any]:
    """Every fx node's value in the model (train mode, same seed), to locate a forward mismatch."""
    gm = trace_model(copy.deepcopy(model), inputs)
    torch.manual_seed(seed)
    values: dict[str, Any] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            values[n.name] = super().run_node(n)
            return values[n.name]

    with torch.no_grad():
        Recorder(gm).run(*inputs)
    return values


def _wire_reference(values: dict[str, Any], name: str) -> Any:
    node, _, path = name.partition("__")
    value = values.get(node)
    for i in path.split("_") if path else []:
        value = value[int(i)]
    return value


def verify_stages(
    model: nn.Module, example_inputs: Sequence[Tensor], stages_dir: str | Path, seed: int = 0
) -> VerificationReport:
    """Compare the stages in `stages_dir` with `model` on one microbatch; raise on a mismatch.

    The caller's model and global RNG state are left as they were.
    """
    with torch.random.fork_rng(devices=[]):
        manifest = read_manifest(stages_dir)
        pristine = copy.deepcopy(model)  # neither side may disturb the caller's model or each other
        reference = copy.deepcopy(model)
        torch.manual_seed(seed)
        want = logits_of(reference(*example_inputs))
        grad_output = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed), dtype=want.dtype)
        want.backward(grad_output)

        stages = _load_all(stages_dir, model.training)
        named_inputs = dict(zip(manifest["model_inputs"], example_inputs))
        sent = _run_stages(stages, named_inputs, grad_output, seed)
        _sum_tied_grads(stages, manifest)
        out_err, ok = _error(sent[(manifest["num_stages"] - 1, "output")], want)
        if not ok:
            first = _first_forward_mismatch(pristine, example_inputs, stages_dir, named_inputs, seed)
            raise CompileVerificationError("stage outputs differ from the model's", out_err, first)
        grad_err, checked, bad_stages = _compare_state(stages, reference)
    if bad_stages:
        raise CompileVerificationError(
            "gradients or buffers of the stages differ from the model's (stage counted in backward order)",
            grad_err,
            max(bad_stages),
        )
    return VerificationReport(out_err, grad_err, checked)


def _sum_tied_grads(stages: Sequence[tuple[nn.Module, dict[str, Any]]], manifest: dict[str, Any]) -> None:
    """Every holder of a weight tied between stages gets the sum of the holders' gradients (what
    the runtime's all-reduce over the holders gives it): the model's gradient of that weight."""
    for holders in tied_holders(manifest):
        params = [held_parameter(*stages[k], name) for k, name in holders.items()]
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.stack(grads).sum(0) if grads else None
        for p in params:
            p.grad = None if total is None else total.clone()


def _compare_state(
    stages: Sequence[tuple[nn.Module, dict[str, Any]]], reference: nn.Module
) -> tuple[float, int, list[int]]:
    """(max gradient error, tensors checked, stages with a mismatch): every parameter's
    gradient and every buffer (BatchNorm running stats after the forward), by original name."""
    grads = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}
    buffers = dict(reference.named_buffers(remove_duplicate=False))
    grad_err, checked, bad_stages = 0.0, 0, []
    for module, entry in stages:
        names = entry["param_names"]
        for local, p in module.named_parameters(remove_duplicate=False):
            err, ok = _compare_optional(p.grad, grads[names[local]], p)
            grad_err, checked = max(grad_err, err), checked + 1
            bad_stages += [] if ok else [entry["stage_id"]]
        for local, b in module.named_buffers(remove_duplicate=False):
            if names[local] in buffers:  # fx's tensor constants are not the model's buffers
                ok = _error(b, buffers[names[local]])[1]
                checked += 1
                bad_stages += [] if ok else [entry["stage_id"]]
    return grad_err, checked, bad_stages


def _load_all(stages_dir: str | Path, training: bool) -> list[tuple[nn.Module, dict[str, Any]]]:
    stages = [load_stage(stages_dir, k) for k in range(read_manifest(stages_dir)["num_stages"])]
    for module, _ in stages:
        module.train(training)
    return stages


def _compare_optional(got: Tensor | None, want: Tensor | None, like: Tensor) -> tuple[float, bool]:
    """None (never used in backward) counts as zeros on either side."""
    return _error(
        got if got is not None else torch.zeros_like(like), want if want is not None else torch.zeros_like(like)
    )


def _first_forward_mismatch(
    pristine: nn.Module,
    inputs: Sequence[Tensor],
    stages_dir: str | Path,
    named_inputs: dict[str, Tensor],
    seed: int,
) -> int | None:
    """The first stage one of whose outputs differs from the same fx node in the model."""
    values = _reference_wires(pristine, inputs, seed)
    stages = _load_all(stages_dir, pristine.training)
    with torch.no_grad():
        sent = _run_stages(stages, named_inputs, None, seed)
    for _, entry in stages:
        for spec in entry["outputs"]:
            name = spec["name"]
            want = _wire_reference(values, name)  # the model output is fx's node "output"
            if not isinstance(want, Tensor) or not _error(sent[(entry["stage_id"], name)], want)[1]:
                return int(entry["stage_id"])
    return None

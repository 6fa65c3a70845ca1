"""Does a model take a data set's batch? One forward (and the loss) on it, before profiling.

A model and a data set that do not fit each other (`mlp` on 3x32x32 images, a vocabulary
smaller than the token ids, 10 logits for 100 classes) otherwise fail deep inside the
profiler's graph interpreter with a traceback. Here the failure names both config keys,
the data's shapes and, where the failing layer is an `nn.Module`, what that layer takes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from pdcli.config.schema import Config
from pdcli.errors import UserError
from pdcli.models.loss import logits_of

FIT_ERRORS = (RuntimeError, ValueError, TypeError, IndexError)
"""What torch raises for shapes, dtypes, argument counts and index ranges that do not fit."""


def describe_tensors(tensors: tuple[Any, ...]) -> str:
    """`(16, 3, 32, 32) float32, (16,) int64` for the tensors among `tensors`."""
    return ", ".join(
        f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors if isinstance(t, Tensor)
    )


def layer_problem(name: str, module: nn.Module, args: tuple[Any, ...]) -> str:
    """`layer 'fc' (Linear) takes 64 features in the last dimension, got (16, 3072) float32`:
    what a common first layer takes beside what it got."""
    got = describe_tensors(args)
    if isinstance(module, nn.Linear):
        takes = f"takes {module.in_features} features in the last dimension"
    elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        takes = f"takes {module.in_channels} channels in dimension 1"
    elif isinstance(module, nn.Embedding):
        takes = f"takes integer ids below {module.num_embeddings}"
        ids = args[0] if args and isinstance(args[0], Tensor) else None
        if ids is not None and not ids.dtype.is_floating_point and ids.numel():
            got += f" with ids up to {int(ids.max())}"
    else:
        takes = "was called"
    return f"layer {name!r} ({type(module).__name__}) {takes}, got {got}"


def model_key(cfg: Config) -> str:
    """How the config names the model: `model.target=pkg.mod:fn`, `model.hf=gpt2` or `model.name=mlp`."""
    if cfg.model.target:
        return f"model.target={cfg.model.target}"
    return f"model.hf={cfg.model.hf}" if cfg.model.hf else f"model.name={cfg.model.name}"


def check_model_fits_data(
    model: nn.Module, inputs: tuple[Tensor, ...], target: Tensor, cfg: Config,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> None:
    """Run `model` once on `inputs` (eval mode, no grad: no batch-norm statistics or RNG
    draws change) and `loss_fn` on its output and `target`; UserError when they do not fit."""
    entered: list[tuple[str, nn.Module, tuple[Any, ...]]] = []
    finished: set[int] = set()
    leaves = [(name, m) for name, m in model.named_modules() if not any(True for _ in m.children())]
    handles = [m.register_forward_pre_hook(lambda mod, args, name=name: entered.append((name, mod, args)))
               for name, m in leaves]
    handles += [m.register_forward_hook(lambda mod, args, out: finished.add(len(entered) - 1)) for _, m in leaves]
    was_training = model.training
    model.eval()
    stage, output = "model", None
    try:
        with torch.no_grad():
            output = logits_of(model(*inputs))
            if loss_fn is not None:
                stage = "loss"
                loss_fn(output, target)
    except FIT_ERRORS as e:
        raise UserError(_mismatch(cfg, inputs, output, target, stage, e, entered, finished), hint=(
            "pick a data set this model takes (`pd config models`, `pd config data`; configs/ pairs them, "
            "e.g. mlp+digits, resnet18+synthetic_images) or set model.kwargs / data.kwargs to fit"
        )) from e
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)


def _mismatch(cfg: Config, inputs: tuple[Tensor, ...], output: Any, target: Tensor, stage: str, error: Exception,
              entered: list[tuple[str, nn.Module, tuple[Any, ...]]], finished: set[int]) -> str:
    head = f"{model_key(cfg)} does not fit data.name={cfg.data.name}"
    reason = " ".join(str(error).strip().splitlines()[0].split()) or type(error).__name__
    if stage == "loss":
        out = describe_tensors(output if isinstance(output, tuple) else (output,))
        return (f"{head}: model.loss={cfg.model.loss} fails on the model's output {out} and the data's "
                f"target {describe_tensors((target,))}: {reason}")
    where = ""
    if entered and len(entered) - 1 not in finished:  # the last layer entered raised
        where = "; " + layer_problem(*entered[-1])
    return f"{head}: the model fails on the data's inputs {describe_tensors(inputs)}{where}: {reason}"

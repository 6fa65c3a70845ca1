"""Losses applied on the last stage: logits and target in, a scalar out."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch.nn.functional as F
from torch import Tensor

from pdcli.errors import UserError

LossFn = Callable[[Tensor, Tensor], Tensor]


def cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy with classes on the last dim: (N, C) vs (N,), (N, T, C) vs (N, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def mse(output: Tensor, target: Tensor) -> Tensor:
    """Mean squared error; the target is cast to the output's dtype and shape."""
    return F.mse_loss(output, target.to(output.dtype).reshape(output.shape))


def num_correct(logits: Tensor, target: Tensor) -> int:
    """Target elements a classifier gets right: argmax over the last dim (classes) equal to the target."""
    return int((logits.argmax(-1) == target).sum())


LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "mse": mse}


def logits_of(output: Any) -> Any:
    """What the loss takes of a model's output: a tensor as is, the `logits` of a dict or of a
    `transformers` ModelOutput (a dict), the first element of a tuple (`return_dict=False`)."""
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    return output


def build_loss(name: str) -> LossFn:
    """The loss function named `name` (`model.loss`)."""
    if name not in LOSSES:
        raise UserError(f"model.loss: unknown loss {name!r}", hint=f"available: {', '.join(LOSSES)}")
    return LOSSES[name]

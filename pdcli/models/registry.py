"""The model registry: built-in reference models by name, or a user factory by `target`."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from torch import nn

from pdcli.config.schema import ModelConfig
from pdcli.errors import UserError
from pdcli.models.alexnet import alexnet
from pdcli.models.factory import call_factory, check_kwargs, check_kwarg_types, import_target, lookup
from pdcli.models.gnmt import gnmt
from pdcli.models.gpt import gpt
from pdcli.models.inception import inception
from pdcli.models.mlp import mlp
from pdcli.models.resnet import resnet18, resnet50
from pdcli.models.vgg import vgg16

MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": mlp,
    "vgg16": vgg16,
    "resnet18": resnet18,
    "resnet50": resnet50,
    "alexnet": alexnet,
    "gnmt": gnmt,
    "gpt": gpt,
    "inception": inception,
}


def list_models() -> list[tuple[str, str]]:
    """(name, one-line description) of every built-in model, in registry order."""
    return [(name, _first_line(factory)) for name, factory in MODELS.items()]


def _first_line(factory: Callable[..., Any]) -> str:
    return (inspect.getdoc(factory) or "").splitlines()[0] if factory.__doc__ else ""


def build_model(cfg: ModelConfig) -> nn.Module:
    """Build the model `cfg` names, random init from torch's global RNG (seed it first).

    `cfg.target` (`package.module:factory`) or `cfg.hf` (a `transformers` model type, `kwargs`
    overriding its config: `pdcli.models.hf`) win over `cfg.name`; a factory is called with
    `cfg.kwargs`, which are checked against its signature first.
    """
    if cfg.hf is not None:
        from pdcli.models.hf import build_hf  # lazy: importing transformers takes seconds

        return build_hf(cfg.hf, cfg.kwargs)
    if cfg.target is not None:
        factory = import_target(cfg.target, "model.target")
        owner = cfg.target
        check_kwargs(factory, cfg.kwargs, "model.kwargs", owner)
        model = call_factory(factory, cfg.kwargs, "model.target", owner)
    else:
        factory = lookup(MODELS, cfg.name, "model.name", "model")
        owner = cfg.name
        check_kwargs(factory, cfg.kwargs, "model.kwargs", owner)
        check_kwarg_types(factory, cfg.kwargs, "model.kwargs")
        try:
            model = factory(**cfg.kwargs)
        except ValueError as exc:  # built-in factories raise ValueError for bad sizes
            raise UserError(f"model.kwargs: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise UserError(
            f"model.target: {owner} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return model

"""Rebuild a torch.nn leaf module as constructor source text, e.g. `torch.nn.Linear(in_features=4, ...)`.

fx's default tracer keeps only torch.nn's own modules as leaves, so every module a stage
calls is a torch.nn class whose constructor arguments are stored as same-named attributes
(`Linear.in_features`, `Conv2d.padding_mode`); a flag argument named like a parameter
(`bias=`) is whether that parameter exists. A few classes store an argument under another
name; `_SPECIAL` knows them. The text is checked by building it and comparing the new
module's attributes and parameter/buffer shapes with the original: an argument this module
cannot infer is an error that names the class, never a silently different module.
"""

from __future__ import annotations

import ast
import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdcli.errors import UserError

# Arguments never passed: the tensors' placement is the runtime's business.
_SKIPPED = frozenset({"device", "dtype"})
_OMIT = object()
"""A `_SPECIAL` value meaning: do not pass this argument (the class sets it itself)."""
_SPECIAL: dict[tuple[type, str], Callable[[nn.Module], Any]] = {
    (nn.MultiheadAttention, "bias"): lambda m: m.in_proj_bias is not None,
    (nn.MultiheadAttention, "add_bias_kv"): lambda m: m.bias_k is not None,
    (nn.RNNBase, "bias"): lambda m: m.bias,
    (nn.RNNBase, "mode"): lambda m: _OMIT,  # LSTM/GRU/RNN pass their own mode to RNNBase
}
_HINT = (
    "fx keeps torch.nn layers whole; build this one from simpler torch.nn layers in your own "
    "nn.Module (fx traces through those), or report the layer as unsupported"
)
_ACTIVATIONS = {F.relu: "relu", F.gelu: "gelu"}  # what Transformer*Layer accepts as strings


def _transformer_layer(m: Any) -> dict[str, Any]:
    if m.activation not in _ACTIVATIONS:
        raise UserError(
            f"pd compile cannot rebuild {type(m).__name__} with a custom activation {m.activation!r}",
            hint="build the layer from nn.MultiheadAttention, nn.Linear and nn.LayerNorm in your own module",
        )
    return {
        "d_model": m.self_attn.embed_dim,
        "nhead": m.self_attn.num_heads,
        "dim_feedforward": m.linear1.out_features,
        "dropout": m.dropout.p,
        "activation": _ACTIVATIONS[m.activation],
        "layer_norm_eps": m.norm1.eps,
        "batch_first": m.self_attn.batch_first,
        "norm_first": m.norm_first,
        "bias": m.linear1.bias is not None,
    }


# Classes whose constructor arguments are read off their children, not their attributes.
_KWARGS: dict[type, Callable[[Any], dict[str, Any]]] = {
    nn.TransformerEncoderLayer: _transformer_layer,
    nn.TransformerDecoderLayer: _transformer_layer,
}
_EXTRA: dict[type, Callable[[nn.Module], dict[str, Any]]] = {
    nn.RNN: lambda m: {"nonlinearity": m.nonlinearity},
}


def _init_signature(cls: type) -> tuple[type, inspect.Signature]:
    """The first __init__ in the MRO with named parameters (LSTM(*args) -> RNNBase's)."""
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        sig = inspect.signature(vars(klass)["__init__"])
        named = [
            p
            for p in list(sig.parameters.values())[1:]
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        if named or klass is nn.Module:
            return klass, sig
    return nn.Module, inspect.signature(nn.Module.__init__)


def _special(cls: type, name: str) -> Callable[[nn.Module], Any] | None:
    for klass in cls.__mro__:
        if (klass, name) in _SPECIAL:
            return _SPECIAL[(klass, name)]
    return None


def _is_literal(value: Any) -> bool:
    try:
        return ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError):
        return False


def constructor_kwargs(module: nn.Module) -> dict[str, Any]:
    """Keyword arguments that rebuild `module` (before its weights are loaded)."""
    cls = type(module)
    if cls in _KWARGS:
        return _KWARGS[cls](module)
    _, sig = _init_signature(cls)
    kwargs: dict[str, Any] = {}
    for p in list(sig.parameters.values())[1:]:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) or p.name in _SKIPPED:
            continue
        special = _special(cls, p.name)
        if special is not None:
            value = special(module)
            if value is _OMIT:
                continue
        elif p.name in module._parameters or p.name in module._buffers:
            value = getattr(module, p.name) is not None  # `bias=True` <=> a bias exists
        elif hasattr(module, p.name) and not isinstance(getattr(module, p.name), (nn.Module, torch.Tensor)):
            value = getattr(module, p.name)
        elif p.default is not inspect.Parameter.empty:
            continue  # not stored, so it cannot differ from what the check below sees
        else:
            raise UserError(
                f"pd compile cannot rebuild {cls.__module__}.{cls.__qualname__}: its constructor "
                f"argument {p.name!r} is not stored on the module",
                hint=_HINT,
            )
        if p.default is not inspect.Parameter.empty and _same(value, p.default):
            continue  # keep the generated code short: defaults are left out
        kwargs[p.name] = value
    kwargs.update(_EXTRA.get(cls, lambda m: {})(module))
    return kwargs


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - exotic values compare as different
        return False


def constructor_source(module: nn.Module) -> str:
    """`torch.nn.X(arg=value, ...)`: source text that rebuilds `module` (checked)."""
    cls = type(module)
    public = getattr(torch.nn, cls.__name__, None)
    if public is not cls:
        raise UserError(
            f"pd compile cannot rebuild {cls.__module__}.{cls.__qualname__}: only torch.nn's own "
            f"layers can be stage leaves",
            hint=_HINT,
        )
    kwargs = constructor_kwargs(module)
    for name, value in kwargs.items():
        if not _is_literal(value):
            raise UserError(
                f"pd compile cannot write the argument {name}={value!r} of torch.nn.{cls.__name__} "
                f"as a Python literal",
                hint=_HINT,
            )
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    source = f"torch.nn.{cls.__name__}({args})"
    _check(module, eval(source, {"torch": torch}), source)  # noqa: S307 - our own literal text
    return source


def _describe(module: nn.Module) -> dict[str, Any]:
    """What must match between a module and its rebuild: attributes, tensor shapes, children."""
    out: dict[str, Any] = {
        k: v
        for k, v in vars(module).items()
        if not k.startswith("_") and k != "training" and not isinstance(v, torch.Tensor)
    }
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        out[f"tensor:{name}"] = (tuple(t.shape), t.dtype, t.requires_grad)
    out["buffers:non_persistent"] = sorted(module._non_persistent_buffers_set)
    for name, child in module.named_children():
        out[f"child:{name}"] = (type(child), _describe(child))
    return out


def _check(original: nn.Module, rebuilt: nn.Module, source: str) -> None:
    want, got = _describe(original), _describe(rebuilt)
    diff = sorted(k for k in set(want) | set(got) if not _same_value(want.get(k), got.get(k)))
    if diff:
        details = "; ".join(f"{k}: {want.get(k)!r} != {got.get(k)!r}" for k in diff[:4])
        raise UserError(
            f"pd compile rebuilt {type(original).__name__} as `{source}` but it differs: {details}",
            hint=_HINT,
        )


def _same_value(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False

"""Run one fx node alone on recorded inputs, as its forward and backward run in training."""

from __future__ import annotations

import operator
from typing import Any, Mapping

import torch
import torch.fx as fx

# Python's in-place operators; fx records `x[i] = y` as operator.setitem.
INPLACE_FUNCTIONS = frozenset(
    {
        operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
        operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
        operator.ilshift, operator.irshift, operator.imatmul, operator.setitem,
    }
)  # fmt: skip


def call_node(gm: fx.GraphModule, node: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Execute one compute node on concrete arguments (what fx.Interpreter does for it)."""
    if node.op == "call_module":
        return gm.get_submodule(str(node.target))(*args, **kwargs)
    if node.op == "call_function":
        return node.target(*args, **kwargs)  # type: ignore[operator]
    if node.op == "call_method":
        self_obj, *rest = args
        return getattr(self_obj, str(node.target))(*rest, **kwargs)
    raise ValueError(f"{node.name}: op {node.op!r} is not a compute node")


def node_inputs(
    node: fx.Node, values: Mapping[fx.Node, Any], copy: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh arguments for one run of `node` (each input node prepared once, so `x + x` stays one tensor)."""
    local: dict[fx.Node, Any] = {}
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            local[arg] = values[arg]  # weights stay the model's own parameters
        else:
            local[arg] = _fresh(values[arg], requires_grad=arg.op != "placeholder", copy=copy)
    args = fx.node.map_arg(node.args, lambda n: local[n])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: local[n])
    return tuple(args), dict(kwargs)


def _fresh(value: Any, requires_grad: bool, copy: bool) -> Any:
    """`value` with every tensor inside detached (and grad-requiring / copied as asked)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if requires_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_()
        # An in-place op must not write into the recorded value, and on a leaf that requires
        # grad it is an error: it gets a (non-leaf) copy, made outside the timed region.
        return t.clone() if copy else t
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_fresh(v, requires_grad, copy) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_fresh(v, requires_grad, copy) for v in value)
    if isinstance(value, dict):
        return {k: _fresh(v, requires_grad, copy) for k, v in value.items()}
    return value


def is_inplace(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node` writes into one of its inputs (ReLU(inplace=True), `add_`, `x[i] = y`)."""
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_function" and node.target in INPLACE_FUNCTIONS:
        return True
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def used_parameters(gm: fx.GraphModule, node: fx.Node, values: Mapping[fx.Node, Any]) -> list[torch.nn.Parameter]:
    """Every parameter `node` reads: its module's, and those fed to it through get_attr nodes."""
    used: list[torch.nn.Parameter] = []
    if node.op == "call_module":
        used.extend(gm.get_submodule(str(node.target)).parameters())
    for arg in node.all_input_nodes:
        if arg.op == "get_attr" and isinstance(values[arg], torch.nn.Parameter):
            used.append(values[arg])
    return used

"""What a traced graph's values say about a cut: recorded values, liveness, cheap shape
queries, in-place ops, and which parts of a tuple a stage reads."""

from __future__ import annotations

import operator
from typing import Any, Iterator, Sequence

import torch
import torch.fx as fx

from pdcli.errors import UserError

# Queries that read only metadata of a tensor: cheap to redo wherever the tensor is.
_CHEAP_METHODS = frozenset({"size", "dim", "numel", "type_as_dtype"})
_CHEAP_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda"})
_CHEAP_FUNCTIONS = frozenset(
    {operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv, getattr}
)
_LITERAL_TYPES = (int, float, bool, str, type(None), torch.dtype, slice, type(Ellipsis))


def record_values(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> dict[fx.Node, Any]:
    """Every node's value on `example_inputs` (no grad, eval mode so BatchNorm stats stay put)."""
    values: dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n] = super().run_node(n)
            return values[n]

    modes = {m: m.training for m in gm.modules()}
    try:
        gm.eval()
        with torch.no_grad():
            Recorder(gm).run(*example_inputs)
    finally:
        for m, mode in modes.items():
            m.training = mode
    return values


def leaves(value: Any, path: tuple[int, ...] = ()) -> Iterator[tuple[tuple[int, ...], Any]]:
    """(index path, leaf) of a value nested in tuples/lists."""
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from leaves(item, (*path, i))
    else:
        yield path, value


def has_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for _, leaf in leaves(value))


def check_literal(name: str, value: Any) -> None:
    if not all(isinstance(leaf, _LITERAL_TYPES) for _, leaf in leaves(value)):
        raise UserError(
            f"the value {name!r} ({type(value).__name__}) crosses a stage boundary but is neither a "
            f"tensor nor a constant that can be baked into the next stage",
            hint="move the cut (choose other stage boundaries) or compute it from a tensor",
        )


def cheap_roots(node: fx.Node) -> set[fx.Node] | None:
    """Tensor nodes a non-tensor `node` is computed from by cheap metadata queries, or None."""
    if node.op == "call_method" and node.target in _CHEAP_METHODS:
        pass
    elif node.op == "call_function" and node.target in _CHEAP_FUNCTIONS:
        if node.target is getattr and node.args[1] not in _CHEAP_ATTRS:
            return None
    else:
        return None
    roots: set[fx.Node] = set()
    first = node.args[0] if node.args else None
    for arg in node.all_input_nodes:
        if node.op == "call_method" or node.target is getattr:
            if arg is first:
                roots.add(arg)  # the tensor being queried
                continue
        sub = cheap_roots(arg)
        if sub is None:
            return None
        roots |= sub
    return roots


def is_inplace(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Does `node` overwrite its first argument?"""
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    name = getattr(node.target, "__name__", str(node.target))
    return bool(node.kwargs.get("inplace")) or (name.endswith("_") and not name.endswith("__"))


def needed_paths(node: fx.Node, users: Sequence[fx.Node]) -> set[tuple[int, ...]] | None:
    """Index prefixes of `node`'s value that `users` read: {(0,)} when they all do `node[0]`."""
    paths: set[tuple[int, ...]] = set()
    for user in users:
        if user.op == "call_function" and user.target is operator.getitem and user.args[0] is node:
            if isinstance(user.args[1], int):
                paths.add((user.args[1],))
                continue
        return None
    return paths


def live_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value reaches the output or that have side effects (modules count as such:
    a BatchNorm updates its running stats even when its result is unused)."""
    live: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if (
            node.op in ("output", "placeholder", "call_module")
            or node.is_impure()
            or (node.op == "call_method" and str(node.target).endswith("_"))  # in-place
            or any(user in live for user in node.users)
        ):
            live.add(node)
    return live

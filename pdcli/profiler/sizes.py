"""Byte counts of a traced model: nested outputs, saved storages, owned parameters, cuts."""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.fx as fx

# Position of the model inputs (placeholders) in the chain: produced before position 0.
INPUT_POSITION = -1


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside `value`, looking through tuples, lists and dict values (any depth).

    Covers the outputs fx nodes produce besides plain tensors: LSTM's `(out, (h, c))`,
    `getitem` results, `size()` (a tuple of ints: no tensors).
    """
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from iter_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements of `t` (its logical size, not its storage's)."""
    return t.numel() * t.element_size()


def value_bytes(value: Any) -> int:
    """Bytes of all distinct tensors inside `value` (a tensor seen twice counts once)."""
    seen: dict[int, int] = {id(t): tensor_bytes(t) for t in iter_tensors(value)}
    return sum(seen.values())


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of the memory block behind `t`: views of one tensor share it.

    A tensor without a plain storage (sparse, some subclasses) is its own block.
    """
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return ("tensor", id(t))


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the whole storage behind `t` (what keeping `t` alive keeps alive)."""
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return tensor_bytes(t)


def parameters_by_position(gm: fx.GraphModule, order: Sequence[fx.Node]) -> list[list[torch.nn.Parameter]]:
    """The parameters each chain position owns; each parameter is owned once, by its first user.

    A `call_module` position owns its module's parameters (the leaf module and anything
    inside it); a parameter read through a `get_attr` node counts for the position that
    consumes it. A parameter used again later (tied weights, a module called twice) is
    counted at its first position only, so the chain's total equals the model's.
    """
    counted: set[int] = set()
    owned: list[list[torch.nn.Parameter]] = []
    for node in order:
        candidates: list[torch.nn.Parameter] = []
        if node.op == "call_module":
            candidates.extend(gm.get_submodule(str(node.target)).parameters())
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                value = _fetch_attr(gm, str(arg.target))
                if isinstance(value, torch.nn.Parameter):
                    candidates.append(value)
        mine = []
        for p in candidates:
            if id(p) not in counted:
                counted.add(id(p))
                mine.append(p)
        owned.append(mine)
    return owned


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def parameter_bytes(params: Sequence[torch.nn.Parameter]) -> int:
    return sum(tensor_bytes(p) for p in params)


def producer_positions(order: Sequence[fx.Node], graph: fx.Graph) -> dict[fx.Node, int]:
    """Chain position of every value a cut can carry: model inputs at -1, compute nodes at i."""
    positions = {n: INPUT_POSITION for n in graph.nodes if n.op == "placeholder"}
    positions.update({n: i for i, n in enumerate(order)})
    return positions


def cut_bytes(order: Sequence[fx.Node], graph: fx.Graph, values: Mapping[fx.Node, Any]) -> tuple[int, ...]:
    """cut[i]: bytes of every value produced at or before position i and consumed after i.

    Consumers after i include the graph's output node (it sits after the last position),
    so a skip connection is counted at every cut it spans. Within one cut a tensor object
    reachable from two crossing values (a tuple and the `getitem` that picks from it)
    counts once; get_attr values (weights) never cross a cut.
    """
    num_positions = len(order)
    positions = producer_positions(order, graph)
    output_position = num_positions

    def consumer_position(user: fx.Node) -> int:
        return output_position if user.op == "output" else positions[user]

    last_use = {
        node: max((consumer_position(u) for u in node.users), default=pos)
        for node, pos in positions.items()
    }
    tensors = {node: {id(t): tensor_bytes(t) for t in iter_tensors(values[node])} for node in positions}
    produced_at: dict[int, list[fx.Node]] = {}
    for node, pos in positions.items():
        produced_at.setdefault(max(pos, 0), []).append(node)

    live: set[fx.Node] = set()
    cuts: list[int] = []
    for i in range(num_positions - 1):
        live.update(produced_at.get(i, ()))
        live = {n for n in live if last_use[n] > i}
        crossing: dict[int, int] = {}
        for node in live:
            crossing.update(tensors[node])
        cuts.append(sum(crossing.values()))
    return tuple(cuts)


def input_bytes(inputs: Sequence[Any]) -> int:
    """Bytes of the model's inputs."""
    return value_bytes(tuple(inputs))

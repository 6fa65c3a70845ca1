"""Split a traced model into one fx.GraphModule per stage at a plan's chain boundaries.

Stage k owns chain positions [start, end) of `chain_order(gm)`. A value crossing a boundary
goes straight from its producer stage to every consumer stage (a skip over two boundaries is
sent 0 -> 2, never relayed through 1). What crosses:

- tensors: a stage output at the producer, a placeholder (forward argument) at each consumer;
- tuples/lists holding tensors (e.g. an LSTM's `(out, (h, c))`): flattened, each tensor leaf
  sent as `<node>__<i>_<j>`, the structure rebuilt in the consumer from its placeholders;
- non-tensor values of the trace (`x.size(0)`, shapes, dtypes): never sent. A cheap shape/dtype
  query (`size`, `dim`, `.shape`, `.dtype`, `getitem` and int arithmetic on those) whose tensors
  already reach the consumer is *recomputed* there; anything else is *baked in* as the constant
  the sample microbatch gave (shapes are fixed at the microbatch size). `StagePart.recomputed`
  and `StagePart.baked` list which.

get_attr nodes (parameters/buffers used functionally) are copied into every stage that reads
them; leaf modules go with the stage that calls them, so buffers move with their modules.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Sequence, Union

import torch
import torch.fx as fx

from pdcli.compiler.values import (
    check_literal,
    cheap_roots,
    has_tensor,
    is_inplace,
    leaves,
    live_nodes,
    needed_paths,
    record_values,
)
from pdcli.errors import UserError
from pdcli.profiler.trace import chain_order

DATA = "data"
"""Peer of a stage input that the stage reads from its own data loader (a model input)."""
LOSS = "loss"
"""Peer of the model output: the last stage feeds it to the loss."""
OUTPUT_NAME = "output"
"""Wire name of the model output in the last stage's outputs."""

Peer = Union[int, str]


@dataclass(frozen=True)
class Wire:
    """A tensor crossing a stage boundary, with its shape and dtype at the microbatch size."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class StageInput:
    wire: Wire
    peer: Peer
    """Producer stage id, or DATA for a model input."""


@dataclass(frozen=True)
class StageOutput:
    wire: Wire
    peers: tuple[Peer, ...]
    """Consumer stage ids (ascending), or (LOSS,) for the model output."""


@dataclass(frozen=True)
class StagePart:
    """One stage: its graph module (sharing submodules with the traced model) and its wires."""

    stage_id: int
    start: int
    end: int
    module: fx.GraphModule
    inputs: tuple[StageInput, ...]
    outputs: tuple[StageOutput, ...]
    recomputed: tuple[str, ...]
    """Names of cross-stage non-tensor values recomputed in this stage."""
    baked: tuple[str, ...]
    """Names of cross-stage non-tensor values baked into this stage as constants."""


def check_boundaries(boundaries: Sequence[tuple[int, int]], num_positions: int) -> None:
    """Stages must be non-empty, contiguous and cover all `num_positions` chain positions."""
    if not boundaries:
        raise UserError("the plan has no stages")
    expected_start = 0
    for k, (start, end) in enumerate(boundaries):
        if start != expected_start or end <= start:
            raise UserError(
                f"plan stage {k} covers chain positions [{start}, {end}); expected a non-empty "
                f"range starting at {expected_start}",
                hint="re-run `pd plan` for this model",
            )
        expected_start = end
    if expected_start != num_positions:
        raise UserError(
            f"the plan's stages end at chain position {expected_start} but the model has "
            f"{num_positions} positions",
            hint="the plan was made for another model or profile; re-run `pd profile` and `pd plan`",
        )


def _wire_name(node: fx.Node, path: tuple[int, ...]) -> str:
    return node.name if not path else f"{node.name}__{'_'.join(map(str, path))}"


class _StageBuilder:
    """Builds the graph of one stage; wires are decided by `split_graph` beforehand."""

    def __init__(self, gm: fx.GraphModule, values: dict[fx.Node, Any], stage_id: int) -> None:
        self.gm, self.values, self.stage_id = gm, values, stage_id
        self.graph = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.recomputed: list[str] = []
        self.baked: list[str] = []

    def add_placeholders(
        self, node: fx.Node, needed: set[tuple[int, ...]] | None
    ) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """Placeholders for the tensor leaves of `node` under the `needed` index prefixes (None:
        all); env maps `node` to the rebuilt structure, unneeded leaves as None. Returns
        (path, sample tensor) of each placeholder, in order."""
        made: list[tuple[tuple[int, ...], torch.Tensor]] = []

        def rebuild(value: Any, path: tuple[int, ...]) -> Any:
            if needed is not None and path and not any(path[: len(p)] == p for p in needed):
                return None  # e.g. an LSTM's (h, c) when the stage reads only its output
            if isinstance(value, (tuple, list)):  # namedtuples/structseqs become plain tuples
                items = [rebuild(v, (*path, i)) for i, v in enumerate(value)]
                return items if isinstance(value, list) else tuple(items)
            if isinstance(value, torch.Tensor):
                made.append((path, value))
                return self.graph.placeholder(_wire_name(node, path))
            check_literal(node.name, value)
            return value

        self.env[node] = rebuild(self.values[node], ())
        return made

    def protect_inputs(self, local: Sequence[fx.Node]) -> None:
        """Clone a received tensor before an in-place op on it (`ReLU(inplace=True)` right
        after a cut): autograd refuses in-place ops on the leaf tensor a stage receives."""
        for node in local:
            first = node.args[0] if node.args else None
            if not isinstance(first, fx.Node) or not isinstance(self.env.get(first), fx.Node):
                continue
            received = self.env[first]
            if received.op == "placeholder" and is_inplace(node, self.gm):
                self.env[first] = self.graph.call_method("clone", (received,))

    def lookup(self, node: fx.Node) -> Any:
        if node in self.env:
            return self.env[node]
        if node.op == "get_attr":
            self.env[node] = self.graph.node_copy(node, self.lookup)
        elif cheap_roots(node) is not None and all(r in self.env for r in cheap_roots(node) or ()):
            self.env[node] = self.graph.node_copy(node, self.lookup)
            self.recomputed.append(node.name)
        else:
            value = self.values[node]
            check_literal(node.name, value)
            self.env[node] = value
            self.baked.append(node.name)
        return self.env[node]

    def copy(self, node: fx.Node) -> None:
        self.env[node] = self.graph.node_copy(node, self.lookup)

    def leaf_output(self, node: fx.Node, path: tuple[int, ...]) -> fx.Node:
        """The graph node of the leaf at `path` of a local `node`, adding getitem nodes."""
        arg: Any = self.env[node]
        for depth, i in enumerate(path):
            name = _wire_name(node, path) if depth == len(path) - 1 else None
            arg = self.graph.create_node("call_function", operator.getitem, (arg, i), name=name)
        return arg


def _wire(name: str, value: torch.Tensor) -> Wire:
    return Wire(name=name, shape=tuple(value.shape), dtype=value.dtype)


def split_graph(
    gm: fx.GraphModule,
    boundaries: Sequence[tuple[int, int]],
    example_inputs: Sequence[torch.Tensor],
) -> list[StagePart]:
    """One StagePart per (start, end) range of chain positions of `gm`.

    `example_inputs` (one microbatch) give the shapes and dtypes of the wires, tell tensors
    from non-tensor values, and give the constants that are baked in.
    """
    chain = chain_order(gm)
    check_boundaries(boundaries, len(chain))
    values = record_values(gm, example_inputs)
    num_stages = len(boundaries)
    stage_of: dict[fx.Node, Peer] = {}
    for k, (start, end) in enumerate(boundaries):
        for node in chain[start:end]:
            stage_of[node] = k
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in placeholders:
        stage_of[n] = DATA
    (output_node,) = [n for n in gm.graph.nodes if n.op == "output"]
    result = output_node.args[0]
    if not isinstance(result, fx.Node) or not isinstance(values.get(result), torch.Tensor):
        raise UserError(
            f"{type(gm).__name__}.forward must return one tensor (the logits) to be split into "
            f"stages; it returns {type(values.get(result, result)).__name__}"
        )

    # Which values each stage consumes from elsewhere, in order of first use. Dead nodes (an
    # unused `getitem` of an LSTM's state) keep their chain position but are not copied, so
    # nothing is sent just for them.
    live = live_nodes(gm.graph)
    stage_nodes = [[n for n in chain[s:e] if n in live] for s, e in boundaries]
    consumed: list[list[fx.Node]] = []
    for k, nodes in enumerate(stage_nodes):
        users = list(nodes) + ([output_node] if k == num_stages - 1 else [])
        seen: dict[fx.Node, None] = {}
        for user in users:
            for arg in user.all_input_nodes:
                if arg.op != "get_attr" and stage_of.get(arg) != k:
                    seen.setdefault(arg)
        consumed.append(list(seen))

    builders = [_StageBuilder(gm, values, k) for k in range(num_stages)]
    inputs: list[list[StageInput]] = [[] for _ in range(num_stages)]
    leaf_consumers: dict[fx.Node, dict[tuple[int, ...], list[int]]] = {}
    for k, builder in enumerate(builders):
        local = set(stage_nodes[k]) | ({output_node} if k == num_stages - 1 else set())
        for node in consumed[k]:
            if not has_tensor(values[node]):
                continue  # recomputed or baked by `lookup` when a user is copied
            needed = needed_paths(node, [u for u in node.users if u in local])
            for path, leaf in builder.add_placeholders(node, needed):
                inputs[k].append(StageInput(_wire(_wire_name(node, path), leaf), stage_of[node]))
                if stage_of[node] != DATA:
                    leaf_consumers.setdefault(node, {}).setdefault(path, []).append(k)
        builder.protect_inputs(stage_nodes[k])
        for node in stage_nodes[k]:
            builder.copy(node)

    parts = []
    for k, builder in enumerate(builders):
        outputs: list[StageOutput] = []
        returned: list[Any] = []
        for node in stage_nodes[k]:
            for path, leaf in leaves(values[node]):
                peers = leaf_consumers.get(node, {}).get(path)
                if peers:
                    outputs.append(StageOutput(_wire(_wire_name(node, path), leaf), tuple(peers)))
                    returned.append(builder.leaf_output(node, path))
        if k == num_stages - 1:
            outputs.append(StageOutput(_wire(OUTPUT_NAME, values[result]), (LOSS,)))
            returned.append(builder.lookup(result))
        builder.graph.output(tuple(returned))
        builder.graph.lint()
        module = fx.GraphModule(gm, builder.graph, class_name=f"Stage{k}")
        parts.append(
            StagePart(
                stage_id=k,
                start=boundaries[k][0],
                end=boundaries[k][1],
                module=module,
                inputs=tuple(inputs[k]),
                outputs=tuple(outputs),
                recomputed=tuple(builder.recomputed),
                baked=tuple(builder.baked),
            )
        )
    return parts

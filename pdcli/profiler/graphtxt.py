"""PipeDream `graph.txt` profiles: read, write, and linearize into a `Chain` of antichain states.

The linearization follows PipeDream's optimizer (msr-fiddle/pipedream,
`optimizer/optimizer_graph_hierarchical.py` with `graph/graph.py`): sources whose layer
starts with `Input` and sinks whose layer starts with `__getitem__` are dropped, the DAG of
(augmented) antichains is built breadth-first from the first remaining source, and its
states are ordered by PipeDream's depth-first topological sort. Each state is one chain
position. A state "covers" every graph node at or before its augmented antichain.

Because the antichain DAG can branch (ResNet, GNMT), a prefix of the chain is not always a
state's covered set. The exact structure PipeDream's search uses is therefore kept in
`chain.meta["antichain_dag"]` (ancestor and covered-node bit masks, covered totals);
`pdcli.planner.space.SplitSpace` reads it.

A branchy graph (Inception) can have hundreds of thousands of antichain states. Past
`plan.max_states` of them (the enumeration stops there) the positions switch to the prefixes
of one topological order, one per layer (`pdcli.profiler.antichain.prefix_states`); the
chain then says so in `meta["search_space"]`, and so do the plan and its table.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from pdcli.errors import UserError
from pdcli.profiler.antichain import (
    INPUT_PREFIX, UNUSED_SINK_PREFIX, Linearization, TooManyStates, antichain_states, prefix_states,
)
from pdcli.profiler.chain import Chain, ChainNode
from pdcli.profiler.graph import Graph, GraphNode

SOURCE_NAME = "pipedream_graph_txt"
_META_KEYS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")


# -- parse / write --------------------------------------------------------------------------


def _parse_number(text: str, key: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UserError(f"{where}: {key}={text!r} is not a number") from None


def _parse_node(line: str, where: str) -> GraphNode:
    tokens = line.split(" -- ")
    if len(tokens) < 3:
        raise UserError(
            f"{where}: expected `nodeN -- <layer> -- forward_compute_time=..., ...`, got {line[:80]!r}"
        )
    stage_id = None
    if len(tokens) > 3:
        match = re.fullmatch(r"stage_id=(-?\d+)", tokens[3].strip())
        if match is None:
            raise UserError(f"{where}: unexpected 4th field {tokens[3][:40]!r} (expected stage_id=N)")
        stage_id = int(match.group(1))
    values: dict[str, str] = {}
    for item in tokens[2].split(", "):
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"{where}: field {item[:40]!r} is not key=value")
        values[key.strip()] = value.strip()
    missing = [k for k in _META_KEYS if k not in values]
    if missing:
        raise UserError(f"{where}: missing {', '.join(missing)}")
    act_text = values["activation_size"]
    if act_text.startswith("["):
        parts = act_text.strip("[]").split(";")
        acts = tuple(_parse_number(p.strip(), "activation_size", where) for p in parts if p.strip())
    else:
        acts = (_parse_number(act_text, "activation_size", where),)
    return GraphNode(
        node_id=tokens[0].strip(),
        desc=tokens[1],
        fwd_ms=_parse_number(values["forward_compute_time"], "forward_compute_time", where),
        bwd_ms=_parse_number(values["backward_compute_time"], "backward_compute_time", where),
        activation_bytes=acts,
        parameter_bytes=_parse_number(values["parameter_size"], "parameter_size", where),
        stage_id=stage_id,
    )


TRUNCATED_HINT = "the file looks truncated or hand-edited: a graph.txt lists every node, then every edge; export it again"


def parse_graph(text: str, source: str = "<graph.txt>") -> Graph:
    """Parse graph.txt text; `source` names the file in error messages.

    A truncated or inconsistent file is refused with the line to look at (`check_connected`)
    rather than linearized into a part of the model."""
    nodes: dict[str, GraphNode] = {}
    lines: dict[str, int] = {}
    edges: list[tuple[str, str]] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        tokens = line.split(" -- ")
        if len(tokens) == 2 and "=" not in line:
            src, dst = (t.strip() for t in tokens)
            for end in (src, dst):
                if end not in nodes:
                    raise UserError(f"{where}: edge names unknown node {end!r} (nodes come first)", hint=TRUNCATED_HINT)
            edges.append((src, dst))
            continue
        node = _parse_node(line, where)
        if node.node_id in nodes:
            raise UserError(f"{where}: node {node.node_id!r} is defined twice")
        nodes[node.node_id] = node
        lines[node.node_id] = lineno
    if not nodes:
        raise UserError(f"{source}: no nodes found (is this a PipeDream graph.txt?)")
    graph = Graph(nodes=tuple(nodes.values()), edges=tuple(edges))
    check_connected(graph, lines, source)
    return graph


def check_connected(graph: Graph, lines: dict[str, int], source: str) -> None:
    """Every node is part of the model PipeDream's linearization walks, or UserError at its line.

    That walk starts at the first source left once `Input*` sources and then `__getitem__*`
    sinks are dropped, and covers every node reachable from it plus their ancestors; a
    node outside would silently be left out of the plan. Refused: a node without any edge,
    graphs where no layer ends the model (a cycle), and nodes the walk does not cover (an
    edge missing in the middle; the message names the sinks among them)."""
    names = [n.node_id for n in graph.nodes]
    desc = {n.node_id: n.desc for n in graph.nodes}

    def at(name: str) -> str:
        return f"{source}:{lines[name]}: node {name!r} ({desc[name].split('(')[0]})"

    def more(names_left: list[str]) -> str:
        shown = ", ".join(f"{n} (line {lines[n]})" for n in names_left[:5])
        return f"{len(names_left)} such nodes: {shown}{', ...' if len(names_left) > 5 else ''}"

    succ: dict[str, set[str]] = {n: set() for n in names}
    pred: dict[str, set[str]] = {n: set() for n in names}
    for a, b in graph.edges:
        succ[a].add(b)
        pred[b].add(a)
    if len(names) > 1:
        lonely = [n for n in names if not succ[n] and not pred[n]]
        if lonely:
            raise UserError(f"{at(lonely[0])} has no edges: nothing connects it to the model ({more(lonely)})",
                            hint=TRUNCATED_HINT)
    alive = set(names)
    for n in [n for n in names if not pred[n] and desc[n].startswith(INPUT_PREFIX)]:
        alive.discard(n)
    for n in [n for n in names if n in alive and not (succ[n] & alive) and desc[n].startswith(UNUSED_SINK_PREFIX)]:
        alive.discard(n)
    order = [n for n in names if n in alive]
    if not order:
        return  # nothing but inputs and unused outputs: the linearization says so
    sinks = [n for n in order if not (succ[n] & alive)]
    sources = [n for n in order if not (pred[n] & alive)]
    if not sinks or not sources:  # then walking on from any node runs into a cycle
        step = succ if not sinks else pred
        seen: list[str] = []
        n = order[0]
        while n not in seen:
            seen.append(n)
            n = min(step[n] & alive, key=names.index)
        raise UserError(f"{at(n)} is on a cycle, and no layer {'ends' if not sinks else 'starts'} the model",
                        hint=TRUNCATED_HINT)
    first = sources[0]
    reached: set[str] = set()
    stack = [first]
    while stack:
        n = stack.pop()
        if n not in reached:
            reached.add(n)
            stack.extend(succ[n] & alive)
    covered = set(reached)
    stack = list(reached)
    while stack:
        for p in pred[stack.pop()] & alive:
            if p not in covered:
                covered.add(p)
                stack.append(p)
    missed = [n for n in order if n not in covered]
    if missed:
        lost_sinks = [n for n in sinks if n in missed]
        sink_note = (f"; the model's sink {lost_sinks[0]} (line {lines[lost_sinks[0]]}) is missing from it"
                     if lost_sinks else "")
        raise UserError(
            f"{at(missed[0])} is not reachable from the first layer {first} (line {lines[first]}), nor an "
            f"ancestor of a layer that is: the plan would leave it out{sink_note} ({more(missed)})",
            hint=TRUNCATED_HINT,
        )


def load_graph(path: str | Path) -> Graph:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"graph file not found: {path}")
    return parse_graph(path.read_text(), str(path))


def format_graph(graph: Graph) -> str:
    """graph.txt text; numbers are written exactly (repr), so parsing it gives `graph` back."""
    lines = []
    for n in graph.nodes:
        acts = n.activation_bytes
        act = repr(acts[0]) if len(acts) == 1 else "[" + "; ".join(repr(a) for a in acts) + "]"
        stage = "" if n.stage_id is None else f" -- stage_id={n.stage_id}"
        lines.append(
            f"{n.node_id} -- {n.desc} -- forward_compute_time={n.fwd_ms!r}, "
            f"backward_compute_time={n.bwd_ms!r}, activation_size={act}, "
            f"parameter_size={n.parameter_bytes!r}{stage}"
        )
    lines += [f"\t{a} -- {b}" for a, b in graph.edges]
    return "\n".join(lines) + "\n"


def write_graph(graph: Graph, path: str | Path) -> None:
    from pdcli.rundir import atomic_write_text

    atomic_write_text(path, format_graph(graph))


# -- chain <-> graph ------------------------------------------------------------------------


SEARCH_SPACE_META = "search_space"
"""`meta` key present when the chain's positions are a restricted space (`prefix_states`):
what it is and why; absent when they are PipeDream's exact antichain states."""
PREFIXES = "topological_prefixes"


def linearize(graph: Graph, max_states: int | None = None,
              prefixes: bool = False) -> tuple[Linearization, dict[str, Any] | None]:
    """PipeDream's exact antichain states of `graph` when there are at most `max_states` of
    them (None: no limit), else (or with `prefixes`) the prefixes of one topological order
    (`prefix_states`, one state per layer), with the meta that says so; `TooManyStates` when
    even those exceed the limit. The enumeration stops at the limit, so a branchy graph costs
    at most `max_states` states before the switch."""
    reason = "asked for"
    if not prefixes:
        try:
            return antichain_states(graph, max_states), None
        except TooManyStates as e:
            reason = f"more than plan.max_states={e.limit} antichain states"
    lin = prefix_states(graph)
    if max_states is not None and len(lin.states) > max_states:
        raise TooManyStates(max_states, f", and its {len(lin.states)} layers are more positions than that too")
    return lin, {
        "method": PREFIXES,
        "reason": reason,
        "note": "cuts restricted to prefixes of one topological order (each branch run to its join): "
                "the best plan among those, not over every antichain",
    }


def graph_to_chain(graph: Graph, source: str = "", max_states: int | None = None, prefixes: bool = False) -> Chain:
    """Linearize `graph` into chain positions, one per state of `linearize` (PipeDream's
    antichain states, or past `max_states` or with `prefixes` the restricted prefix states,
    recorded in `meta[SEARCH_SPACE_META]`)."""
    lin, restricted = linearize(graph, max_states, prefixes)
    by_id = {n.node_id: n for n in graph.nodes}
    seen: set[str] = set()
    nodes: list[ChainNode] = []
    for i, state in enumerate(lin.states):
        new = [m for m in state.covered if m not in seen]
        seen.update(new)
        members = (tuple(lin.inputs) if i == 0 else ()) + tuple(new)
        shown = new or list(state.antichain)  # a join state adds no layer: name its frontier
        label = ("" if new else "join: ") + ", ".join(by_id[m].desc.split("(")[0] for m in shown)
        nodes.append(
            ChainNode(
                name=state.name,
                label=label if len(label) <= 60 else label[:57] + "...",
                fwd_ms=float(sum(by_id[m].fwd_ms for m in new)),
                bwd_ms=float(sum(by_id[m].bwd_ms for m in new)),
                parameter_bytes=int(round(sum(by_id[m].parameter_bytes for m in new))),
                activation_bytes=int(round(sum(by_id[m].total_activation_bytes for m in new))),
                members=members,
            )
        )
    order = [m for node in nodes for m in node.members]
    bit = {m: b for b, m in enumerate(order)}
    meta: dict[str, Any] = {
        "source": SOURCE_NAME,
        "graph_file": Path(source).name if source else "",
        **({SEARCH_SPACE_META: restricted} if restricted else {}),
        "unused_sinks": list(lin.unused_sinks),
        "antichain_dag": {
            "ancestors_hex": [_mask_hex(s.ancestors) for s in lin.states],
            "covered_hex": [_mask_hex(bit[m] for m in s.covered) for s in lin.states],
            "covered_fwd_ms": [s.fwd_ms for s in lin.states],
            "covered_bwd_ms": [s.bwd_ms for s in lin.states],
            "covered_parameter_bytes": [s.parameter_bytes for s in lin.states],
            "covered_activation_bytes": [s.activation_bytes for s in lin.states],
        },
    }
    return Chain(
        nodes=tuple(nodes),
        cut_bytes=tuple(int(round(s.output_activation_bytes)) for s in lin.states[:-1]),
        input_bytes=int(round(sum(by_id[m].total_activation_bytes for m in lin.inputs))),
        meta=meta,
    )


def _mask_hex(bits: Sequence[int] | Any) -> str:
    """Hex of the integer with these bits set."""
    index = np.fromiter(bits, dtype=np.int64)
    if index.size == 0:
        return "0"
    flags = np.zeros(int(index.max()) + 1, dtype=bool)
    flags[index] = True
    return format(int.from_bytes(np.packbits(flags, bitorder="little").tobytes(), "little"), "x")


def chain_to_graph(chain: Chain, batch_size: int | None = None) -> Graph:
    """One of our chains as a linear graph.txt (an `Input0` node first, then one node per
    position). graph.txt has no field for the batch it was measured at: PipeDream's
    convention, and `pd plan --profile graph.txt`'s, is the minibatch that will be planned,
    so with `batch_size` (that minibatch) times and activation bytes are scaled from the
    batch the chain was profiled at (`meta.batch_size`) to it."""
    profiled = chain.meta.get("batch_size")
    scale = batch_size / float(profiled) if batch_size and profiled else 1.0
    nodes = [GraphNode("node0", "Input0", 0.0, 0.0, (float(chain.input_bytes) * scale,), 0.0)]
    for i, n in enumerate(chain.nodes):
        desc = " ".join(n.label.replace(" -- ", " - ").split()) or n.name
        if desc.startswith((INPUT_PREFIX, UNUSED_SINK_PREFIX)):
            desc = f"layer {desc}"  # these prefixes make PipeDream drop the node
        act = chain.cut_bytes[i] if i < len(chain.cut_bytes) else n.activation_bytes
        nodes.append(
            GraphNode(f"node{i + 1}", desc, float(n.fwd_ms) * scale, float(n.bwd_ms) * scale, (float(act) * scale,),
                      float(n.parameter_bytes))
        )
    edges = tuple((f"node{i}", f"node{i + 1}") for i in range(len(chain.nodes)))
    return Graph(nodes=tuple(nodes), edges=edges)

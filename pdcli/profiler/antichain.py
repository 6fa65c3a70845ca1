"""PipeDream's antichain linearization of a layer DAG (pure Python, no torch).

Semantics follow msr-fiddle/pipedream `graph/graph.py` (`augment_antichain`,
`next_antichains`, `antichain_dag`, `topological_sort`, `all_predecessors`) as used by
`optimizer/optimizer_graph_hierarchical.py`:

- `Input*` sources and then `__getitem__*` sinks are removed (one pass each);
- the antichain DAG is explored breadth-first from the first remaining source; a state is
  an *augmented* antichain (the antichain plus every predecessor with an edge leaving the
  antichain's down-set);
- states are ordered by PipeDream's depth-first topological sort of that DAG;
- a state covers `all_predecessors(augmented antichain)`; its output activation size is
  the sum of the activation sizes of its augmented antichain.

PipeDream iterates a Python `set` when augmenting; we sort instead, which makes the state
names deterministic (the state order and the optimum do not depend on it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdcli.errors import UserError
from pdcli.profiler.graph import Graph

INPUT_PREFIX = "Input"
"""graph.txt: a node whose description starts so is a model input."""
UNUSED_SINK_PREFIX = "__getitem__"
"""graph.txt: a sink whose description starts so is an unused output (dropped)."""


class TooManyStates(UserError):
    """The linearization would make more states than it was allowed (it stops there, before
    the states and their ancestor sets fill the memory)."""

    def __init__(self, limit: int, detail: str = "") -> None:
        super().__init__(f"the graph's antichain linearization has more than {limit} states{detail}")
        self.limit = limit


@dataclass(frozen=True)
class AntichainState:
    """One position of the linearization, with sums over the graph nodes it covers."""

    name: str
    antichain: tuple[str, ...]
    """Augmented antichain (graph node ids)."""
    covered: tuple[str, ...]
    """Every graph node at or before the antichain, in topological order."""
    ancestors: tuple[int, ...]
    """Positions of this state's ancestors in the antichain DAG (valid split points)."""
    fwd_ms: float
    bwd_ms: float
    parameter_bytes: float
    activation_bytes: float
    output_activation_bytes: float


@dataclass(frozen=True)
class Linearization:
    states: tuple[AntichainState, ...]
    inputs: tuple[str, ...]
    """Removed `Input*` sources (PipeDream places them in stage 0)."""
    unused_sinks: tuple[str, ...]
    """Removed `__getitem__*` sinks."""


def _topological_order(alive: list[int], succ: list[list[int]], pred: list[list[int]],
                       names: list[str]) -> list[int]:
    """Kahn's algorithm, ties broken by file order; UserError on a cycle."""
    indeg = {n: len(set(pred[n])) for n in alive}
    ready = sorted(n for n in alive if indeg[n] == 0)
    order: list[int] = []
    while ready:
        n = ready.pop(0)
        order.append(n)
        for s in dict.fromkeys(succ[n]):
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
                ready.sort()
    if len(order) != len(alive):
        stuck = sorted(set(alive) - set(order))
        raise UserError(f"the graph has a cycle through node {names[stuck[0]]!r}")
    return order


class _Dag:
    """The layer graph with ancestor sets and PipeDream's antichain operations."""

    def __init__(self, alive: list[int], succ: list[list[int]], pred: list[list[int]],
                 names: list[str]) -> None:
        self.succ = succ
        self.topo = _topological_order(alive, succ, pred, names)
        self.anc: dict[int, frozenset[int]] = {}
        for n in self.topo:
            acc: set[int] = set()
            for p in pred[n]:
                acc.add(p)
                acc |= self.anc[p]
            self.anc[n] = frozenset(acc)
        self.desc: dict[int, frozenset[int]] = {}
        for n in reversed(self.topo):
            acc = set()
            for s in succ[n]:
                acc.add(s)
                acc |= self.desc[s]
            self.desc[n] = frozenset(acc)
        self._aug: dict[tuple[int, ...], tuple[int, ...]] = {}
        # an ancestor p of n with one successor has it in n's ancestors or n itself: only
        # ancestors with several successors can have an edge leaving n's down-set
        self.forks = frozenset(n for n in self.topo if len(set(succ[n])) > 1)

    def augment(self, antichain: tuple[int, ...]) -> tuple[int, ...]:
        key = tuple(sorted(antichain))
        if key not in self._aug:
            extra = {
                p
                for n in antichain
                for p in self.anc[n] & self.forks
                if any(o not in self.anc[n] and o != n for o in self.succ[p])
            }
            self._aug[key] = tuple(sorted(extra)) + tuple(antichain)
        return self._aug[key]

    def deaugment(self, augmented: list[int]) -> tuple[int, ...]:
        members = set(augmented)
        out: list[int] = []
        for n in augmented:
            if not (self.desc[n] & members) and n not in out:
                out.append(n)
        return tuple(out)

    def next_antichains(self, antichain: tuple[int, ...]) -> list[tuple[int, ...]]:
        augmented = self.augment(antichain)
        in_aug = set(augmented)
        result = []
        for a in augmented:
            for nxt in self.succ[a]:
                if nxt in antichain or (self.desc[nxt] & in_aug):
                    continue
                result.append(self.deaugment([nxt if x == a else x for x in augmented]))
        return result


def _node_costs(graph: Graph) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per node (file order): forward ms, backward ms, parameter bytes, activation bytes."""
    nodes = graph.nodes
    return ([n.fwd_ms for n in nodes], [n.bwd_ms for n in nodes], [n.parameter_bytes for n in nodes],
            [n.total_activation_bytes for n in nodes])


def _dfs_topological(order: list[int], out: dict[int, list[int]]) -> list[int]:
    """PipeDream's depth-first topological sort (reverse post-order, insertion order)."""
    marked: set[int] = set()
    post: list[int] = []
    for root in order:
        if root in marked:
            continue
        stack = [(root, 0)]
        marked.add(root)
        while stack:
            node, i = stack.pop()
            children = out.get(node, [])
            while i < len(children) and children[i] in marked:
                i += 1
            if i < len(children):
                stack.append((node, i + 1))
                marked.add(children[i])
                stack.append((children[i], 0))
            else:
                post.append(node)
    return post[::-1]


def _prune(graph: Graph) -> tuple[list[str], list[list[int]], list[list[int]], set[int], list[int], list[int]]:
    """(names, succ, pred, alive, inputs, unused sinks): the graph without PipeDream's dropped
    `Input*` sources and then `__getitem__*` sinks."""
    names = [n.node_id for n in graph.nodes]
    index = {name: i for i, name in enumerate(names)}
    succ: list[list[int]] = [[] for _ in names]
    pred: list[list[int]] = [[] for _ in names]
    for a, b in graph.edges:
        succ[index[a]].append(index[b])
        pred[index[b]].append(index[a])
    alive = set(range(len(names)))

    def remove(n: int) -> None:
        alive.discard(n)
        for s in succ[n]:
            pred[s].remove(n)
        for p in pred[n]:
            succ[p].remove(n)
        succ[n], pred[n] = [], []

    inputs = [n for n in sorted(alive) if not pred[n] and graph.nodes[n].desc.startswith(INPUT_PREFIX)]
    for n in inputs:
        remove(n)
    sinks = [n for n in sorted(alive) if not succ[n] and graph.nodes[n].desc.startswith(UNUSED_SINK_PREFIX)]
    for n in sinks:
        remove(n)
    if not alive:
        raise UserError("the graph has no layers besides inputs and unused outputs")
    return names, succ, pred, alive, inputs, sinks


def antichain_states(graph: Graph, max_states: int | None = None) -> Linearization:
    """PipeDream's states of `graph`, in its order; TooManyStates past `max_states` (None: no limit)."""
    names, succ, pred, alive, inputs, sinks = _prune(graph)
    dag = _Dag(sorted(alive), succ, pred, names)

    first: tuple[int, ...] = (min(n for n in alive if not pred[n]),)
    ids = {tuple(sorted(first)): 0}
    antichains: list[tuple[int, ...]] = [first]
    out_edges: dict[int, list[int]] = {}
    insertion: dict[int, None] = {}
    expanded: set[int] = set()
    queue: deque[tuple[int, ...]] = deque([first])
    while queue:
        ac = queue.popleft()
        sid = ids[tuple(sorted(ac))]
        if sid in expanded:
            continue
        expanded.add(sid)
        for nxt in dag.next_antichains(ac):
            key = tuple(sorted(nxt))
            if key not in ids:
                ids[key] = len(antichains)
                antichains.append(nxt)
                if max_states is not None and len(antichains) > max_states:
                    raise TooManyStates(max_states)
            out_edges.setdefault(sid, []).append(ids[key])
            insertion.setdefault(sid)
            insertion.setdefault(ids[key])
            queue.append(nxt)
    order = _dfs_topological(list(insertion) or [0], out_edges)
    position = {sid: pos for pos, sid in enumerate(order)}
    dag_pred: dict[int, set[int]] = {sid: set() for sid in order}
    for src, outs in out_edges.items():
        for dst in outs:
            dag_pred[dst].add(src)
    dag_anc: dict[int, set[int]] = {}
    for sid in order:  # topological, so predecessors are done
        acc: set[int] = set()
        for p in dag_pred[sid]:
            acc.add(p)
            acc |= dag_anc[p]
        dag_anc[sid] = acc

    topo_rank = {n: r for r, n in enumerate(dag.topo)}
    fwd, bwd, params, acts = _node_costs(graph)
    states = []
    for sid in order:
        aug = dag.augment(antichains[sid])
        cover: set[int] = set(aug)
        for n in aug:
            cover |= dag.anc[n]
        covered = sorted(cover, key=topo_rank.__getitem__)
        states.append(
            AntichainState(
                name=f"antichain_{sid}",
                antichain=tuple(names[n] for n in aug),
                covered=tuple(names[n] for n in covered),
                ancestors=tuple(sorted(position[a] for a in dag_anc[sid])),
                fwd_ms=float(sum(map(fwd.__getitem__, covered))),
                bwd_ms=float(sum(map(bwd.__getitem__, covered))),
                parameter_bytes=float(sum(map(params.__getitem__, covered))),
                activation_bytes=float(sum(map(acts.__getitem__, covered))),
                output_activation_bytes=float(sum(map(acts.__getitem__, aug))),
            )
        )
    return Linearization(
        states=tuple(states),
        inputs=tuple(names[n] for n in inputs),
        unused_sinks=tuple(names[n] for n in sinks),
    )


def _branch_order(alive: list[int], succ: list[list[int]], pred: list[list[int]], names: list[str]) -> list[int]:
    """A topological order that runs each branch to its join before starting the next:
    depth-first from the first sources, a node is placed once all its predecessors are
    (so a join waits for every branch), children in file order."""
    _topological_order(alive, succ, pred, names)  # refuses a cycle with the node to look at
    waiting = {n: len(set(pred[n])) for n in alive}
    order: list[int] = []
    stack = sorted((n for n in alive if waiting[n] == 0), reverse=True)
    while stack:
        n = stack.pop()
        order.append(n)
        for s in sorted(set(succ[n]), reverse=True):
            waiting[s] -= 1
            if waiting[s] == 0:
                stack.append(s)
    return order


def prefix_states(graph: Graph) -> Linearization:
    """The prefixes of one topological order of `graph` (`_branch_order`) as states: a
    restricted space in which PipeDream's states are the down-sets that are such prefixes.

    Every prefix is a down-set, so every range of positions is a valid stage (no ancestor
    condition); a state's output is what PipeDream sends after that down-set: the sizes of
    its augmented antichain (`_Dag.augment` of the prefix's maximal layers, PipeDream's
    counting included), so a cut costs what it costs among the exact states. The states are
    one per graph node, however many antichains the graph has; a plan over them is the best
    among plans whose cuts are prefixes of this order (every cut between fork-join blocks,
    and, inside a block, cuts that finish the earlier branches)."""
    names, succ, pred, alive, inputs, sinks = _prune(graph)
    dag = _Dag(sorted(alive), succ, pred, names)
    order = _branch_order(sorted(alive), succ, pred, names)
    nodes = graph.nodes
    unplaced = {n: len(set(succ[n])) for n in order}  # successors not yet in the prefix
    maximal: dict[int, None] = {}
    states: list[AntichainState] = []
    fwd = bwd = params = acts = 0.0
    for j, n in enumerate(order):
        for p in set(pred[n]):
            unplaced[p] -= 1
            maximal.pop(p, None)
        maximal[n] = None
        fwd += nodes[n].fwd_ms
        bwd += nodes[n].bwd_ms
        params += nodes[n].parameter_bytes
        acts += nodes[n].total_activation_bytes
        aug = dag.augment(tuple(maximal))
        states.append(
            AntichainState(
                name=f"prefix_{j}",
                antichain=tuple(names[m] for m in aug),
                covered=tuple(names[m] for m in order[: j + 1]),
                ancestors=tuple(range(j)),
                fwd_ms=fwd, bwd_ms=bwd, parameter_bytes=params, activation_bytes=acts,
                output_activation_bytes=float(sum(nodes[m].total_activation_bytes for m in aug)),
            )
        )
    return Linearization(
        states=tuple(states),
        inputs=tuple(names[n] for n in inputs),
        unused_sinks=tuple(names[n] for n in sinks),
    )

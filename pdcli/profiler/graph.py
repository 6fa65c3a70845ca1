"""A PipeDream graph: nodes with their profiled costs and the edges between them, as
graph.txt holds it (`pdcli.profiler.graphtxt` reads and writes it, `pdcli.profiler.antichain`
linearizes it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GraphNode:
    """One `nodeN -- <layer> -- key=value, ...` line of a graph.txt."""

    node_id: str
    desc: str
    fwd_ms: float
    bwd_ms: float
    activation_bytes: tuple[float, ...]
    """One entry per output tensor (graph.txt writes `[a; b]` when there are several)."""
    parameter_bytes: float
    stage_id: int | None = None

    @property
    def total_activation_bytes(self) -> float:
        return float(sum(self.activation_bytes))


@dataclass(frozen=True)
class Graph:
    """A graph.txt: nodes and edges in file order."""

    nodes: tuple[GraphNode, ...]
    edges: tuple[tuple[str, str], ...]

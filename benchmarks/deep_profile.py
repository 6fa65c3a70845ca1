"""A deep synthetic graph.txt for the planner benchmark: a long chain of residual blocks.

Each block is conv -> bn -> relu -> conv -> bn -> add(block input) -> relu, the add also
fed by the block's input (a skip connection), so PipeDream's antichain linearization has a
few states per layer (about 1,500 for the default 250 blocks, the size of the GNMT-large
profile PipeDream reports). Costs are deterministic: they vary smoothly along the depth
(wider layers in the middle), so the optimum is not a trivial even split.

    .venv/bin/python benchmarks/deep_profile.py OUT.txt [--blocks N]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdcli.profiler.graph import Graph, GraphNode  # noqa: E402
from pdcli.profiler.graphtxt import write_graph  # noqa: E402

DEFAULT_BLOCKS = 250
BATCH_ACTIVATION_BYTES = 32 * 256 * 14 * 14 * 4
"""One layer's output at batch 32 (a 256-channel 14x14 fp32 map)."""
CONV_PARAMETER_BYTES = 256 * 256 * 9 * 4


def deep_graph(blocks: int = DEFAULT_BLOCKS) -> Graph:
    nodes: list[GraphNode] = [GraphNode("node0", "Input0", 0.0, 0.0, (float(BATCH_ACTIVATION_BYTES),), 0.0)]
    edges: list[tuple[str, str]] = []

    def add(desc: str, fwd: float, bwd: float, act: float, params: float, *inputs: str) -> str:
        name = f"node{len(nodes)}"
        nodes.append(GraphNode(name, desc, round(fwd, 3), round(bwd, 3), (float(act),), float(params)))
        edges.extend((src, name) for src in inputs)
        return name

    x = add("Conv2d(3, 256, kernel_size=(3, 3))", 1.5, 2.0, BATCH_ACTIVATION_BYTES, 256 * 27 * 4, "node0")
    for b in range(blocks):
        width = 1.0 + 0.5 * math.sin(math.pi * b / max(blocks - 1, 1))  # wider in the middle
        act = BATCH_ACTIVATION_BYTES * width
        params = CONV_PARAMETER_BYTES * width * width
        conv = 0.9 * width * width * (1.0 + 0.1 * math.sin(b))
        a = add(f"Conv2d(block{b}.conv1)", conv, 2.0 * conv, act, params, x)
        a = add(f"BatchNorm2d(block{b}.bn1)", 0.1 * width, 0.15 * width, act, 2048.0 * width, a)
        a = add(f"ReLU(block{b}.relu1)", 0.05 * width, 0.07 * width, act, 0.0, a)
        a = add(f"Conv2d(block{b}.conv2)", conv, 2.0 * conv, act, params, a)
        a = add(f"BatchNorm2d(block{b}.bn2)", 0.1 * width, 0.15 * width, act, 2048.0 * width, a)
        a = add(f"Add(block{b})", 0.05 * width, 0.05 * width, act, 0.0, a, x)
        x = add(f"ReLU(block{b}.relu2)", 0.05 * width, 0.07 * width, act, 0.0, a)
    add("Linear(256, 1000)", 0.3, 0.6, 32 * 1000 * 4, 256 * 1000 * 4, x)
    return Graph(nodes=tuple(nodes), edges=tuple(edges))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS)
    args = parser.parse_args()
    write_graph(deep_graph(args.blocks), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

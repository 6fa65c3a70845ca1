"""PipeDream graph.txt: parsing, writing, and the antichain linearization into a Chain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from typer.testing import CliRunner

from pdcli.cli import app
from pdcli.errors import UserError
from pdcli.profiler.antichain import TooManyStates, antichain_states
from pdcli.planner.space import SplitSpace
from pdcli.profiler.chain import Chain, ChainNode
from pdcli.profiler.graphtxt import (
    chain_to_graph,
    format_graph,
    graph_to_chain,
    load_graph,
    parse_graph,
    write_graph,
)

SHARED = Path(__file__).resolve().parents[2] / "shared" / "pipedream-profiles"
PROFILES = ("vgg16", "resnet50", "gnmt")


def node_line(nid: str, desc: str, fwd: float, bwd: float, act: str, params: float) -> str:
    return (f"{nid} -- {desc} -- forward_compute_time={fwd:.3f}, backward_compute_time={bwd:.3f}, "
            f"activation_size={act}, parameter_size={params:.3f}")


# input -> a -> {b, c} -> d, plus an unused __getitem__ sink hanging off d
DIAMOND = "\n".join([
    node_line("node1", "Input0", 0, 0, "0.0", 0),
    node_line("node2", "Conv2d(a)", 1.0, 2.0, "100.0", 10),
    node_line("node3", "ReLU(b)", 3.0, 4.0, "200.0", 0),
    node_line("node4", "Linear(c)", 5.0, 6.0, "[300.0; 5.0]", 20),
    node_line("node5", "Add(d)", 7.0, 8.0, "400.0", 0),
    node_line("node6", "__getitem__(0)", 0, 0, "1.0", 0),
    "\tnode1 -- node2", "\tnode2 -- node3", "\tnode2 -- node4",
    "\tnode3 -- node5", "\tnode4 -- node5", "\tnode5 -- node6",
]) + "\n"


def test_parse_reads_values_lists_and_stage_ids() -> None:
    text = DIAMOND.replace("parameter_size=10.000", "parameter_size=10.000 -- stage_id=3")
    g = parse_graph(text, "g.txt")
    assert [n.node_id for n in g.nodes] == [f"node{i}" for i in range(1, 7)]
    c = g.nodes[3]
    assert c.activation_bytes == (300.0, 5.0) and c.total_activation_bytes == 305.0
    assert g.nodes[1].stage_id == 3 and g.nodes[1].fwd_ms == 1.0
    assert g.edges[2] == ("node2", "node4")


def test_write_then_parse_round_trips(tmp_path: Path) -> None:
    g = parse_graph(DIAMOND)
    path = tmp_path / "out" / "graph.txt"
    write_graph(g, path)
    assert load_graph(path) == g
    assert parse_graph(format_graph(load_graph(path))) == g


@pytest.mark.parametrize(
    "text, fragment",
    [
        (node_line("node1", "X", 1, 1, "abc", 0), "g.txt:1: activation_size='abc' is not a number"),
        ("node1 -- X -- forward_compute_time=1.0", "g.txt:1: missing backward_compute_time"),
        (node_line("node1", "X", 1, 1, "1.0", 0) + "\n\tnode1 -- node9", "g.txt:2: edge names unknown node 'node9'"),
        ("just some words", "g.txt:1: expected `nodeN -- <layer>"),
        ("", "g.txt: no nodes found"),
    ],
)
def test_bad_files_name_file_and_line(text: str, fragment: str) -> None:
    with pytest.raises(UserError) as err:
        parse_graph(text, "g.txt")
    assert fragment in str(err.value)


# input -> a -> b, c -> d: the edge b -> c is missing, so c and the sink d hang apart
SPLIT = "\n".join([
    node_line("node1", "Input0", 0, 0, "0.0", 0),
    node_line("node2", "Conv2d(a)", 1.0, 2.0, "100.0", 10),
    node_line("node3", "ReLU(b)", 3.0, 4.0, "200.0", 0),
    node_line("node4", "Linear(c)", 5.0, 6.0, "300.0", 20),
    node_line("node5", "Linear(d)", 7.0, 8.0, "400.0", 0),
    "\tnode1 -- node2", "\tnode2 -- node3", "\tnode4 -- node5",
]) + "\n"


@pytest.mark.parametrize(
    "text, fragments",
    [
        (DIAMOND + node_line("node7", "Dropout(e)", 1, 1, "1.0", 0),  # a node whose edges were cut off
         ("g.txt:13: node 'node7' (Dropout) has no edges", "1 such nodes: node7 (line 13)")),
        ("\n".join(DIAMOND.splitlines()[:6]),  # the nodes, but none of the edges
         ("g.txt:1: node 'node1' (Input0) has no edges", "6 such nodes")),
        (SPLIT, ("g.txt:4: node 'node4' (Linear) is not reachable from the first layer node2 (line 2)",
                 "the model's sink node5 (line 5) is missing from it", "2 such nodes: node4 (line 4), node5 (line 5)")),
        (DIAMOND.rsplit("\t", 1)[0] + "\tnode5 -- nod", ("g.txt:12: edge names unknown node 'nod'",)),  # cut mid-edge
        (SPLIT + "\tnode3 -- node2\n\tnode5 -- node4\n",
         ("g.txt:2: node 'node2' (Conv2d) is on a cycle, and no layer ends the model",)),
    ],
)
def test_truncated_or_inconsistent_graphs_are_refused_at_a_line(text: str, fragments: tuple[str, ...]) -> None:
    with pytest.raises(UserError) as err:
        parse_graph(text, "g.txt")
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    assert "truncated" in (err.value.hint or "")


def test_missing_file_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="graph file not found"):
        load_graph(tmp_path / "nope.txt")


def test_diamond_states_follow_pipedream() -> None:
    """Hand-derived with PipeDream's rules: states {a}, {c}, {b}, {b,c}, {d} in DFS order."""
    chain = graph_to_chain(parse_graph(DIAMOND))
    assert [n.members for n in chain.nodes] == [
        ("node1", "node2"), ("node4",), ("node3",), (), ("node5",),
    ]
    assert [n.fwd_ms for n in chain.nodes] == [1.0, 5.0, 3.0, 0.0, 7.0]
    # output activation of a state = its augmented antichain: {a}, {a,c}, {a,b}, {a,b,c}
    assert chain.cut_bytes == (100, 405, 300, 605)
    assert chain.meta["unused_sinks"] == ["node6"]
    space = SplitSpace.from_chain(chain)
    assert not space.split_ok[1, 2]  # {c} is not an ancestor of {b}
    assert space.split_ok[0, 2] and space.split_ok[2, 3] and space.split_ok[1, 3]
    assert space.covered_fwd_ms.tolist() == [1.0, 6.0, 4.0, 9.0, 16.0]
    assert space.stage_members(0, 3) == ["node1", "node2", "node3"]  # state {b} covers a, b
    assert space.stage_members(3, 5) == ["node4", "node5"]  # covered by {d}, not by {b}
    assert space.stage_members(2, 5) == ["node3", "node5"]  # covered by {d}, not by {c}


def test_chain_export_import_round_trip() -> None:
    nodes = tuple(
        ChainNode(name=f"n{i}", label=f"layer {i} -- x", fwd_ms=1.0 + i, bwd_ms=2.0 * i,
                  parameter_bytes=10 * i, activation_bytes=100 + i)
        for i in range(5)
    )
    chain = Chain(nodes=nodes, cut_bytes=(7, 8, 9, 10), input_bytes=64)
    back = graph_to_chain(chain_to_graph(chain))
    assert len(back) == len(chain)
    assert [n.fwd_ms for n in back.nodes] == [n.fwd_ms for n in chain.nodes]
    assert [n.bwd_ms for n in back.nodes] == [n.bwd_ms for n in chain.nodes]
    assert [n.parameter_bytes for n in back.nodes] == [n.parameter_bytes for n in chain.nodes]
    assert back.cut_bytes == chain.cut_bytes and back.input_bytes == 64
    assert " -- " not in format_graph(chain_to_graph(chain)).splitlines()[1].split(" -- ", 2)[1]


@pytest.fixture
def shared() -> Path:
    if not (SHARED / "expected.json").exists():
        pytest.skip("../shared/pipedream-profiles is not beside the repo")
    return SHARED


@pytest.mark.parametrize("name", PROFILES)
def test_shared_profiles_state_counts_and_round_trip(shared: Path, name: str, tmp_path: Path) -> None:
    expected = json.loads((shared / "expected.json").read_text())["profiles"][name]
    graph = load_graph(shared / name / "graph.txt")
    write_graph(graph, tmp_path / "g.txt")
    assert load_graph(tmp_path / "g.txt") == graph
    chain = graph_to_chain(graph, str(shared / name / "graph.txt"))
    assert len(chain) == expected["states"]
    # members partition the graph (minus removed unused sinks); totals are preserved
    members = [m for n in chain.nodes for m in n.members]
    assert len(members) == len(set(members)) == len(graph.nodes) - len(chain.meta["unused_sinks"])
    dropped = set(chain.meta["unused_sinks"]) | {n.node_id for n in graph.nodes if n.desc.startswith("Input")}
    total_ms = sum(n.fwd_ms + n.bwd_ms for n in graph.nodes if n.node_id not in dropped)  # PipeDream zeroes inputs
    assert sum(n.fwd_ms + n.bwd_ms for n in chain.nodes) == pytest.approx(total_ms)
    dag = chain.meta["antichain_dag"]
    last = dag["covered_fwd_ms"][-1] + dag["covered_bwd_ms"][-1]
    assert last == pytest.approx(expected["single_device_time_s"] * 1000.0)
    assert Chain.from_json(json.loads(json.dumps(chain.to_json()))) == chain


@pytest.mark.parametrize("name", PROFILES)
def test_a_truncated_copy_of_a_shared_profile_is_refused_at_a_line(shared: Path, name: str, tmp_path: Path) -> None:
    text = (shared / name / "graph.txt").read_text()
    lines = text.splitlines(keepends=True)
    cuts = ["".join(lines[: int(len(lines) * f)]) for f in (0.25, 0.5, 0.75, 0.9)] + [text[: len(text) // 2]]
    for cut in cuts:
        with pytest.raises(UserError, match=r"^g\.txt:\d+: "):
            parse_graph(cut, "g.txt")
    truncated = tmp_path / "graph.txt"
    truncated.write_text(cuts[2])
    from typer.testing import CliRunner

    from pdcli.cli import app

    result = CliRunner().invoke(app, ["plan", "--profile", str(truncated), "--gpus", "4"])
    assert result.exit_code == 2 and f"error: {truncated}:" in result.output, result.output
    assert "Traceback" not in result.output and "truncated" in result.output


@pytest.mark.skipif(not (SHARED / "inception_v3/graph.txt").exists(), reason="../shared/pipedream-profiles absent")
def test_a_graph_past_the_state_limit_switches_to_prefixes_then_stops_with_exit_2(tmp_path: Path) -> None:
    """inception_v3's linearization has 221,564 states (PipeDream runs out of memory on it): past
    plan.max_states pd plans over the prefixes of a topological order (325, one per layer) and
    says so; when those exceed the limit too it stops with one message naming the limit."""
    profile = SHARED / "inception_v3/graph.txt"
    base = ["plan", "--profile", str(profile), "--gpus", "4", f"run.root={tmp_path}", "plan.cost_model=pipedream"]
    result = CliRunner().invoke(app, [*base, "plan.max_states=300"])
    assert result.exit_code == 2, result.output
    assert "more than 300 states, and its 325 layers" in result.output and "(plan.max_states=300)" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(TooManyStates):
        antichain_states(load_graph(profile), max_states=500)
    result = CliRunner().invoke(app, [*base, "plan.max_states=500", "--out", str(tmp_path / "plan.json")])
    assert result.exit_code == 0, result.output
    assert "search space: cuts restricted to prefixes of one topological order" in result.output
    inputs = json.loads((tmp_path / "plan.json").read_text())["inputs"]
    assert inputs["search_space"]["method"] == "topological_prefixes"
    assert "plan.max_states=500" in inputs["search_space"]["reason"]
    # a graph within the limit plans as before
    vgg = SHARED / "vgg16/graph.txt"
    assert len(antichain_states(load_graph(vgg), max_states=40).states) == 40
    with pytest.raises(TooManyStates):
        antichain_states(load_graph(vgg), max_states=39)

"""The branchy built-in model (`inception`, recipes/inception.yaml) through the whole chain:
`pd profile`, `pd plan`, `pd compile`, `pd train` with stage boundaries between the branches of
a block (several tensors cross each), equal to the single-process reference; and its
`--export-graph` graph.txt plans as its own profile does."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdcli.cli import app

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_steer_train import QUICK, assert_matches_reference  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes/inception.yaml")
SMALL = ("model.kwargs.width=8", "model.kwargs.image_size=16", "data.kwargs.image_size=16", "data.batch_size=8",
         "schedule.num_microbatches=2")
"""The recipe at CPU-test size: 8 images of 16x16 a minibatch, two microbatches of 4."""


def invoke(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def first_position(profile: dict, module: str) -> int:
    """The first chain position the module `module` (or one inside it) made."""
    return next(i for i, n in enumerate(profile["nodes"]) if n["module"] == module or n["module"].startswith(module + "."))


@pytest.mark.slow  # real processes over torch.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_cuts_between_branches_train_equal_to_the_reference(tmp_path: Path, schedule: str) -> None:
    args = (RECIPE, f"run.root={tmp_path}", *QUICK, *SMALL, f"schedule.name={schedule}")
    run = tmp_path / "inception"
    invoke("profile", *args)
    profile = json.loads((run / "profile.json").read_text())
    # stage 1 starts at the second conv of block 0's two-3x3 branch: the block's input (the pool
    # branch still needs it), the 1x1 and 3x3 branches' outputs and that branch's first conv cross;
    # stage 2 starts at block 3's pool branch: its input and three finished branches cross
    cuts = [first_position(profile, "blocks.0.branch5x5.1"), first_position(profile, "blocks.3.branch_pool")]
    steer = (f"plan.boundaries=[{cuts[0]},{cuts[1]}]",)
    invoke("plan", *args, *steer)
    invoke("compile", *args, *steer)
    output = invoke("train", *args, *steer)
    assert "profile: reused" in output and "compile: reused" in output, output  # the steps' artifacts, not new ones
    plan = json.loads((run / "plan.json").read_text())
    assert [(s["start"], s["end"], s["replicas"]) for s in plan["stages"]] == [
        (0, cuts[0], 1), (cuts[0], cuts[1], 1), (cuts[1], len(profile["nodes"]), 1)]
    manifest = json.loads((run / "stages/manifest.json").read_text())
    for stage_id, cut in ((1, cuts[0]), (2, cuts[1])):
        received = manifest["stages"][stage_id]["inputs"]
        assert len(received) == 4, received
        # what the compiled stage receives is what the profile priced the cut at (one microbatch)
        assert sum(4 * math.prod(t["shape"]) for t in received) == profile["cut_bytes"][cut - 1]
    assert {t["name"] for t in manifest["stages"][2]["inputs"]} == {
        "blocks_2", "blocks_3_branch1x1_2", "blocks_3_branch3x3_1_2", "blocks_3_branch5x5_2_2"}
    assert_matches_reference(run, [1, 1, 1])


@pytest.mark.parametrize("cluster", [
    ("plan.straight=true",),  # a straight pipeline over the recipe's 3 devices
    ("cluster.levels.0.devices=4", "cluster.levels.0.bandwidth_bytes_per_s=1e7"),  # replicated stages
], ids=["straight3", "replicated4"])
def test_exported_graph_plans_as_its_profile(tmp_path: Path, cluster: tuple[str, ...]) -> None:
    """graph.txt holds the minibatch's times (8 images; the profile measured microbatches of 4):
    with PipeDream's cost model the export and the profile give the same stages, replicas and
    time per minibatch."""
    graph = tmp_path / "graph.txt"
    args = (RECIPE, f"run.root={tmp_path}", "profile.repeats=2", "profile.warmup=1", "profile.runtime_probe=false",
            *SMALL, "plan.cost_model=pipedream", "~plan.num_stages", *cluster)
    invoke("profile", *args, "--export-graph", str(graph))
    own, exported = tmp_path / "own.json", tmp_path / "exported.json"
    invoke("plan", *args, "-o", str(own))
    invoke("plan", *args, "--profile", str(graph), "-o", str(exported))
    a, b = (json.loads(p.read_text()) for p in (own, exported))
    assert len(a["stages"]) >= 2 or "plan.straight=true" not in cluster, a["stages"]  # 3 stages, cut mid-block
    assert [(s["start"], s["end"], s["replicas"]) for s in a["stages"]] == [
        (s["start"], s["end"], s["replicas"]) for s in b["stages"]]
    assert a["pipeline"]["time_per_minibatch_ms"] == pytest.approx(b["pipeline"]["time_per_minibatch_ms"], rel=1e-9)

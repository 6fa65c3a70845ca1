"""Steering the plan: split points by module name, pipe_split() markers, fixed replicas,
partial constraints (the search over what is left == brute force), the unconstrained best."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from pdcli import pipe_split
from pdcli.cli import app
from pdcli.errors import UserError
from pdcli.planner import PlanOptions, Topology, plan_chain, render_plan
from pdcli.planner.evaluate import batch_scale, evaluate_pd
from pdcli.planner.space import SplitSpace
from pdcli.planner.steer import SplitPoint, cut_names, resolve_split_point
from pdcli.profiler.chain import PIPE_SPLITS_META, Chain, ChainNode
from pdcli.profiler.trace import chain_order, module_path, pipe_split_positions, trace_model

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "recipes/quickstart.yaml")
MODULES = ("stem", "layer1.0.conv", "layer1.0", "layer1.1.conv", "shared", "layer2.0.conv", "layer2.0",
           "shared", "", "fc")
"""Module path of each position of `named_chain`: `shared` runs twice, the pooling op is the model's own."""


def named_chain(rng: random.Random | None = None, modules: tuple[str, ...] = MODULES) -> Chain:
    rng = rng or random.Random(0)
    nodes = tuple(ChainNode(name=f"n{i}", label=f"l{i}", fwd_ms=rng.uniform(0.5, 5), bwd_ms=rng.uniform(1, 9),
                            parameter_bytes=rng.choice([0, rng.randrange(1, 4_000_000)]),
                            activation_bytes=rng.randrange(1, 4_000_000), module=m)
                  for i, m in enumerate(modules))
    return Chain(nodes=nodes, cut_bytes=tuple(rng.randrange(0, 2_000_000) for _ in modules[1:]), meta={})


def test_split_points_resolve_through_module_paths() -> None:
    chain = named_chain()
    assert resolve_split_point(chain, SplitPoint("layer1")) == 1
    assert resolve_split_point(chain, SplitPoint("layer1", "end")) == 4
    assert resolve_split_point(chain, SplitPoint("layer1.1")) == 3
    assert resolve_split_point(chain, SplitPoint.of({"name": "layer2.0", "at": "end"})) == 7
    assert resolve_split_point(chain, SplitPoint.of("fc")) == 9
    names = cut_names(chain)
    # the outermost module starting at a cut names it; a cut only a module's end touches is `name:end`
    assert names[1] == "layer1" and names[3] == "layer1.1" and names[5] == "layer2" and names[9] == "fc"
    assert names[4] == "layer1:end" and names[7] == "layer2:end" and names[2] == "layer1.0.conv:end"
    assert 8 not in names  # only `shared` ends there, and it runs twice
    assert str(SplitPoint.of("layer3:end")) == "layer3:end" and SplitPoint.of(7) == SplitPoint("7")


@pytest.mark.parametrize(("point", "expect"), [
    ("layr2", "no module of that name runs in the model's forward; closest: layer2"),
    ("shared", "cannot cut there: its forward runs at positions 4..7 with other layers in between"),
    ("stem", "before the first layer, so a stage would be empty; nearest cuts: layer1 (position 1)"),
    ("fc:end", "after the last layer"),
])
def test_unknown_and_uncuttable_names_say_why_and_where(point: str, expect: str) -> None:
    with pytest.raises(UserError) as error:
        resolve_split_point(named_chain(), SplitPoint.of(point))
    assert expect in error.value.message and "\n" not in str(error.value)
    if point == "shared":
        assert "nearest cuts: layer1.1 (position 3), layer1:end (position 4), layer2 (position 5)" in error.value.message


def test_a_profile_without_module_names_is_refused() -> None:
    with pytest.raises(UserError, match="records no module names"):
        resolve_split_point(named_chain(modules=("",) * 4), SplitPoint("layer1"))


def partitions(n: int) -> list[list[tuple[int, int]]]:
    out = []
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            edges = [0, *cuts, n]
            out.append(list(zip(edges, edges[1:])))
    return out


def brute_best(chain: Chain, topology: Topology, options: PlanOptions, cuts: tuple[int, ...],
               replicas: tuple[int, ...] | None, num_stages: int | None) -> float:
    """The fastest plan among every split containing `cuts`, with `replicas` (else any) and
    `num_stages` (else any), on all devices (on replicas' sum when fixed)."""
    space, scale, best = SplitSpace.from_chain(chain), batch_scale(chain.meta, options), math.inf
    devices = topology.num_devices
    for part in partitions(len(chain.nodes)):
        starts = {s for s, _ in part}
        if not set(cuts) <= starts or (num_stages is not None and len(part) != num_stages):
            continue
        choices = [replicas] if replicas is not None else itertools.product(range(1, devices + 1), repeat=len(part))
        for reps in choices:
            if replicas is None and sum(reps) != devices or len(reps) != len(part):
                continue
            if any(options.num_microbatches % r for r in reps):
                continue
            ev = evaluate_pd(space, topology, options, scale, [(s, e, r) for (s, e), r in zip(part, reps)])
            best = min(best, ev.time_per_minibatch_ms)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_partial_constraints_search_what_is_left(seed: int) -> None:
    rng = random.Random(seed)
    checked = 0
    for _ in range(12):
        chain = named_chain(rng, tuple(f"m{i}" for i in range(rng.randint(3, 6))))
        n = len(chain.nodes)
        topology = Topology.flat(rng.randint(2, 4), rng.choice([1e9, 1e10]))
        schedule = rng.choice(["1f1b", "gpipe", "pipedream", "2bw"])
        cuts = tuple(sorted(rng.sample(range(1, n), rng.randint(0, min(2, n - 1)))))
        replicas = None
        if len(cuts) + 1 > min(n, topology.num_devices):
            continue
        if rng.random() < 0.5:
            count = rng.randint(len(cuts) + 1, min(n, topology.num_devices))
            replicas = tuple(rng.choice([1, 1, 2]) for _ in range(count))
            if sum(replicas) > topology.num_devices:
                continue
        num_stages = None if replicas is not None or rng.random() < 0.5 else rng.randint(
            len(cuts) + 1, min(n, topology.num_devices))
        if not cuts and replicas is None:
            continue
        options = PlanOptions(schedule=schedule, num_microbatches=4, batch_size=8, use_fewer_devices=False,
                              split_points=tuple(SplitPoint(f"m{c}") for c in cuts), replicas=replicas,
                              num_stages=num_stages)
        plan = plan_chain(chain, topology, options)
        assert {s.start for s in plan.stages} >= set(cuts)
        if replicas is not None:
            assert tuple(s.replicas for s in plan.stages) == replicas
        want = brute_best(chain, topology, options, cuts, replicas, num_stages
                          if num_stages is not None or replicas is not None else None)
        if cuts and num_stages is None and replicas is None:  # the cuts alone fix the stage count
            want = brute_best(chain, topology, options, cuts, None, len(cuts) + 1)
        assert plan.time_per_minibatch_ms == pytest.approx(want, rel=1e-9), (cuts, replicas, num_stages, schedule)
        free = plan_chain(chain, topology, PlanOptions(schedule=schedule, num_microbatches=4, batch_size=8))
        recorded = plan.pipeline["unconstrained"]
        assert recorded["time_per_minibatch_ms"] == pytest.approx(free.time_per_minibatch_ms)
        assert recorded["replicas"] == [s.replicas for s in free.stages]
        assert recorded["faster_pct"] == pytest.approx(
            100 * (plan.time_per_minibatch_ms - free.time_per_minibatch_ms) / plan.time_per_minibatch_ms)
        checked += 1
    assert checked >= 4


def test_plan_json_and_table_name_the_cuts_and_show_the_unconstrained_best() -> None:
    chain = named_chain()
    options = PlanOptions(schedule="1f1b", num_microbatches=4, batch_size=8, split_points=(SplitPoint("layer2"),),
                          use_fewer_devices=True)
    plan = plan_chain(chain, Topology.flat(2), options)
    as_json = plan.to_json()
    assert [s.get("split_point") for s in as_json["stages"]] == [None, "layer2"]
    assert as_json["inputs"]["split_points"] == ["layer2"] and as_json["inputs"]["fixed_cuts"] == [5]
    free = as_json["pipeline"]["unconstrained"]
    text = render_plan(as_json, chain)
    assert f"your split {plan.time_per_minibatch_ms:.4g} ms per minibatch; unconstrained best " \
           f"{free['time_per_minibatch_ms']:.4g} ms" in text
    unsteered = plan_chain(chain, Topology.flat(2), PlanOptions(schedule="1f1b", num_microbatches=4, batch_size=8))
    assert "unconstrained" not in unsteered.to_json()["pipeline"] and "your split" not in render_plan(unsteered, chain)


@pytest.mark.parametrize(("options", "expect"), [
    (dict(replicas=(3, 2)), "plan.replicas: [3, 2] needs 5 devices, the cluster has 4"),
    (dict(replicas=(3, 1), straight=True), "plan.straight=true forbids it"),
    (dict(replicas=(1, 1), num_stages=3), "plan.replicas: 2 entries but plan.num_stages is 3"),
    (dict(replicas=(2, 1), split_points=(SplitPoint("layer1"), SplitPoint("layer2"))),
     "plan.split_points and plan.replicas: 2 fixed cuts make 3 stages but plan.replicas has 2"),
    (dict(split_points=(SplitPoint("layer1"), SplitPoint("layer2")), num_stages=2),
     "plan.split_points: 2 fixed cuts make 3 stages but plan.num_stages is 2"),
    (dict(split_points=(SplitPoint("layer1"),), cost_model="pipedream"), "need cost_model=pd"),
])
def test_constraints_that_do_not_fit_are_user_errors(options: dict, expect: str) -> None:
    with pytest.raises(UserError) as error:
        plan_chain(named_chain(), Topology.flat(4), PlanOptions(num_microbatches=6, **options))
    assert expect in error.value.message


def test_fixed_replicas_across_a_slow_level_are_planned_with_a_warning() -> None:
    topology = Topology.from_levels([{"devices": 2, "bandwidth_bytes_per_s": 1e10},
                                     {"devices": 2, "bandwidth_bytes_per_s": 1e8}])
    plan = plan_chain(named_chain(), topology, PlanOptions(schedule="1f1b", num_microbatches=6, replicas=(3, 1)))
    assert [s.replicas for s in plan.stages] == [3, 1]
    assert len(plan.warnings) == 1 and "stage 0's 3 replicas (ranks 0-2)" in plan.warnings[0]
    assert "warning: plan.replicas: stage 0" in render_plan(plan, None)
    inside = plan_chain(named_chain(), topology, PlanOptions(schedule="1f1b", num_microbatches=6, replicas=(2, 1, 1)))
    assert inside.warnings == ()


def test_pipe_split_markers_are_fixed_cuts() -> None:
    chain = named_chain()
    marked = Chain(chain.nodes, chain.cut_bytes, meta={PIPE_SPLITS_META: [3, 8]})
    plan = plan_chain(marked, Topology.flat(3), PlanOptions(schedule="gpipe", num_microbatches=2))
    assert [(s.start, s.end) for s in plan.stages] == [(0, 3), (3, 8), (8, 10)]
    assert plan.pipeline["unconstrained"]["time_per_minibatch_ms"] > 0
    ignored = plan_chain(marked, Topology.flat(3), PlanOptions(schedule="gpipe", num_microbatches=2, pipe_splits=False))
    assert ignored.to_json() == plan_chain(chain, Topology.flat(3), PlanOptions(schedule="gpipe", num_microbatches=2)).to_json()
    with pytest.raises(UserError, match="pipe_split\\(\\): the model's forward calls it before the first layer"):
        plan_chain(Chain(chain.nodes, chain.cut_bytes, meta={PIPE_SPLITS_META: [0]}), Topology.flat(2), PlanOptions())


class Marked(nn.Module):
    """Two pipe_split() calls: one in the model's forward, one inside a submodule's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.body = Body()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.embed(x))
        pipe_split()
        return self.head(self.body(x))


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x) + 1
        pipe_split()
        return self.b(x)


def test_tracing_turns_pipe_split_calls_into_positions_and_records_module_paths() -> None:
    model = Marked()
    x = torch.randn(3, 4)
    assert torch.equal(model(x), model(x))  # a no-op outside tracing
    gm = trace_model(model, (x,))
    order = chain_order(gm)
    assert [module_path(n) for n in order] == ["embed", "", "body.a", "body", "body.b", "head"]
    assert pipe_split_positions(gm) == [2, 4]
    assert all(n.target is not pipe_split for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), model(x))


class ShapeBranching(nn.Module):
    """torch.fx cannot trace the branch on a shape; torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if x.shape[0] > 1:
            x = x * 2
        pipe_split()
        return self.b(x)


def test_pipe_split_in_a_model_only_torch_export_traces_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError, match="calls pipe_split\\(\\) but only torch.export could trace it"):
        trace_model(ShapeBranching(), (torch.randn(3, 4),))
    monkeypatch.setitem(ShapeBranching.forward.__globals__, "pipe_split", lambda: None)  # the same model, unmarked
    gm = trace_model(ShapeBranching(), (torch.randn(3, 4),))
    assert [module_path(n) for n in chain_order(gm)] == ["a", "", "b"]  # torch.export's module paths


def test_cli_errors_are_one_line_with_exit_2(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(named_chain().to_json()))
    runner = CliRunner()
    for override, expect in [("plan.split_points=[layr2]", "closest: layer2"),
                             ("plan.split_points=[shared]", "nearest cuts"),
                             ("plan.replicas=[3,2]", "needs 5 devices, the cluster has 2")]:
        result = runner.invoke(app, ["plan", QUICKSTART, "--profile", str(profile), f"run.root={tmp_path}",
                                     "schedule.num_microbatches=6", "data.batch_size=60", override])
        assert result.exit_code == 2, result.output
        assert expect in result.output and "Traceback" not in result.output
        assert [line for line in result.output.splitlines() if line.strip()] == [result.output.strip()]


def test_cuts_on_the_command_line_replace_the_recipes_stage_count(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(named_chain().to_json()))
    recipe = tmp_path / "two_stages.yaml"
    recipe.write_text("cluster: {levels: [{devices: 3, bandwidth_bytes_per_s: 1.0e9}]}\n"
                      "plan: {num_stages: 2, straight: true}\n")
    runner = CliRunner()
    common = ["plan", str(recipe), "--profile", str(profile), f"run.root={tmp_path}", "plan.split_points=[layer1,layer2]"]
    result = runner.invoke(app, common)
    assert result.exit_code == 0, result.output
    assert f"note: plan.split_points makes 3 stages: {recipe}'s plan.num_stages: 2 is not used" in result.output
    plan = json.loads((tmp_path / "default/plan.json").read_text())
    assert [s.get("split_point") for s in plan["stages"]] == [None, "layer1", "layer2"]
    # a stage count given on the command line beside the cuts is the user's: the conflict is an error
    result = runner.invoke(app, [*common, "plan.num_stages=2"])
    assert result.exit_code == 2 and "2 fixed cuts make 3 stages but plan.num_stages is 2" in result.output
    assert "Traceback" not in result.output


def test_a_profile_with_more_positions_than_plan_max_states_is_refused(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(named_chain().to_json()))  # 10 positions
    common = ["plan", QUICKSTART, "--profile", str(profile), f"run.root={tmp_path}"]
    result = CliRunner().invoke(app, [*common, "plan.max_states=9"])
    assert result.exit_code == 2 and "the profile has 10 positions, more than plan.max_states=9" in result.output
    assert "Traceback" not in result.output
    assert CliRunner().invoke(app, [*common, "plan.max_states=10"]).exit_code == 0

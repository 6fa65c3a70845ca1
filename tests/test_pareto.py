"""The configuration search (`pdcli.planner.pareto`): the front, the recipe's constraints, the
objectives, the microbatch pricing from batch points, `auto` in a recipe, `pd plan --pareto`."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdcli.cli import app
from pdcli.config.loader import load_config
from pdcli.errors import ConfigError, UserError
from pdcli.planner import PlanOptions, Topology
from pdcli.planner.pareto import (
    ConfigSpace, Point, auto_microbatches, dominates, pareto_front, search_configuration, stage_delays,
)
from pdcli.planner.plan import Plan
from pdcli.profiler.batch_points import BATCH_POINTS_META, chain_at_rows, interpolate, point_rows
from pdcli.profiler.chain import Chain, ChainNode

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "recipes/quickstart.yaml")
ALL = ConfigSpace(("pipedream", "2bw", "1f1b", "gpipe"), (1, 2, 4, 8), (True, False))


def chain(n: int = 8, rows: int = 8, points: dict[int, float] | None = None) -> Chain:
    """n positions profiled at `rows`; `points`: other sizes -> their time as a factor of the
    linear scale (1.0: linear; 2.0 at small sizes: small microbatches run at half the rate)."""
    nodes = tuple(ChainNode(name=f"n{i}", label=f"layer{i}", fwd_ms=1.0 + 0.1 * i, bwd_ms=2.0 + 0.2 * i,
                            parameter_bytes=4_000_000, activation_bytes=800_000, backward_memory_bytes=800_000,
                            optimizer_ms=0.05) for i in range(n))
    meta: dict = {"batch_size": rows}
    if points:
        meta[BATCH_POINTS_META] = {
            "rows": sorted(points),
            **{f: [[getattr(node, f) * r / rows * points[r] for node in nodes] for r in sorted(points)]
               for f in ("fwd_ms", "bwd_ms", "wgrad_ms")}}
    return Chain(nodes=nodes, cut_bytes=(400_000,) * (n - 1), meta=meta)


def search(c: Chain, space: ConfigSpace = ALL, devices: int = 2, **kw: object):  # type: ignore[no-untyped-def]
    base = PlanOptions(batch_size=32, use_fewer_devices=True, **{k: v for k, v in kw.items()
                                                                 if k == "memory_bytes_per_device"})
    rest = {k: v for k, v in kw.items() if k != "memory_bytes_per_device"}
    return search_configuration(c, Topology.flat(devices, 1e9), base, space,
                                **rest)  # type: ignore[arg-type]


def _point(t: float, m: float, s: int) -> Point:
    return Point(config=None, plan=None, time_per_minibatch_ms=t, peak_bytes=m, staleness=s)  # type: ignore[arg-type]


def test_the_front_holds_exactly_the_points_nothing_dominates() -> None:
    rng = random.Random(0)
    for _ in range(50):
        points = [_point(rng.randint(1, 6), rng.randint(1, 6), rng.randint(0, 2)) for _ in range(rng.randint(1, 12))]
        front = pareto_front(points)
        assert all(not dominates(p, f) for f in front for p in points)
        for p in points:  # every point left out is dominated by, or equal to, one on the front
            assert any(dominates(f, p) or f.objectives() == p.objectives() for f in front)
        assert len({f.objectives() for f in front}) == len(front)


def test_search_finds_a_front_and_every_point_is_planned_for_its_configuration() -> None:
    outcome = search(chain())
    assert outcome.searched == len(ALL.configurations()) == 4 * 2 + 2 * 4 * 2
    assert len(outcome.front) >= 2
    for p in outcome.front:
        assert p.plan.inputs["schedule"] == p.config.schedule
        assert p.plan.inputs["num_microbatches"] == p.config.num_microbatches
        assert p.staleness == max(stage_delays(p.config.schedule, p.config.num_microbatches,
                                               [s.replicas for s in p.plan.stages]))
        assert p.peak_bytes == max(s.predicted["total_bytes"] for s in p.plan.stages)
    assert outcome.chosen.time_per_minibatch_ms == min(p.time_per_minibatch_ms for p in outcome.front)


def test_the_recipes_fields_are_constraints() -> None:
    c = chain()
    fixed = search(c, ConfigSpace(("1f1b",), (1, 2, 4, 8), (True,)))
    assert {p.config.schedule for p in fixed.front} == {"1f1b"} and all(p.config.split_backward for p in fixed.front)
    exact = search(c, max_staleness=0)
    assert all(p.staleness == 0 and p.config.schedule in ("1f1b", "gpipe") for p in exact.front)
    free = search(c)
    assert any(p.staleness > 0 for p in free.front)  # the bound above removed something
    peaks = sorted(p.peak_bytes for p in free.front)
    limit = (peaks[0] + peaks[-1]) / 2
    bounded = search(c, memory_bytes_per_device=limit)
    assert bounded.refused > 0 and all(p.peak_bytes <= limit for p in bounded.front)
    smallest = search(c, objective="memory")
    assert smallest.chosen.peak_bytes == min(p.peak_bytes for p in smallest.front) == peaks[0]


def test_nothing_fitting_names_the_limit_and_the_smallest_peak() -> None:
    with pytest.raises(UserError, match=r"cluster.memory_bytes_per_device=1000 bytes.*smallest peak among them") as e:
        search(chain(), memory_bytes_per_device=1000.0)
    assert "train.recompute" in (e.value.hint or "")  # not searched: a lever left
    searched = dataclasses.replace(ALL, recompute=(False, True))
    with pytest.raises(UserError) as e:
        search(chain(), searched, memory_bytes_per_device=1000.0)
    assert "train.recompute" not in (e.value.hint or "")  # searched already
    with pytest.raises(UserError, match="plan.max_staleness=0"):
        search(chain(), ConfigSpace(("pipedream", "2bw"), (2, 4), (False,)), max_staleness=0)


def test_batch_points_interpolate_and_price_each_microbatch_size() -> None:
    assert interpolate([2, 8], [4.0, 10.0], 4) == pytest.approx(6.0)
    assert interpolate([2, 8], [4.0, 10.0], 16) == pytest.approx(20.0)  # beyond: proportional
    assert interpolate([2, 8], [4.0, 10.0], 1) == pytest.approx(2.0)
    linear = chain()
    assert chain_at_rows(linear, 2) is linear  # no batch points: the linear scale as before
    slow_small = chain(points={1: 3.0, 2: 2.0, 4: 1.2, 32: 1.0})
    at2 = chain_at_rows(slow_small, 2)
    assert at2.nodes[3].fwd_ms == pytest.approx(linear.nodes[3].fwd_ms * 2.0)  # per profiled row: 2x the rate
    at3 = chain_at_rows(slow_small, 3)
    assert at3.nodes[0].bwd_ms == pytest.approx((2 * 2.0 * 2 / 8 + (4 * 1.2 * 2 / 8 - 2 * 2.0 * 2 / 8) / 2) * 8 / 3)
    assert chain_at_rows(slow_small, 8).nodes == slow_small.nodes
    # priced linearly, more microbatches only shrink the bubble: the search takes the most;
    # with small microbatches measured slow it takes fewer, bigger ones
    space = ConfigSpace(("1f1b",), (1, 2, 4, 8, 16, 32), (False,))
    assert search(linear, space).chosen.config.num_microbatches == 32
    assert search(slow_small, space).chosen.config.num_microbatches < 32
    assert point_rows(256, auto_microbatches(256), profiled=64) == [8, 32, 256]


def test_auto_in_a_recipe_hands_the_field_to_the_planner() -> None:
    cfg = load_config(QUICKSTART, ["schedule.name=auto", "schedule.num_microbatches=auto"]).config
    assert cfg.plan.search == ["schedule.name", "schedule.num_microbatches"]
    assert cfg.schedule.name == "pipedream" and cfg.data.batch_size % cfg.schedule.num_microbatches == 0
    assert load_config(QUICKSTART).config.plan.search == []
    with pytest.raises(ConfigError, match=r"plan.search.0: 'optim.lr' is not one of"):
        load_config(QUICKSTART, ["plan.search=[optim.lr]"])
    with pytest.raises(ConfigError, match="plan.objective"):
        load_config(QUICKSTART, ["plan.objective=fastest"])
    with pytest.raises(ConfigError, match="needs plan.cost_model=pd"):
        load_config(QUICKSTART, ["schedule.name=auto", "plan.cost_model=pipedream", "~plan.num_stages"])


def test_pd_plan_pareto_prints_the_front_and_plan_json_records_it(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(chain(points={2: 1.6, 32: 0.9}).to_json()))
    runner = CliRunner()
    root, out = f"run.root={tmp_path}", tmp_path / "auto.json"
    shown = runner.invoke(app, ["plan", QUICKSTART, root, "--profile", str(profile), "--pareto", "-o", str(out)])
    assert shown.exit_code == 0, shown.output
    assert "Pareto front:" in shown.output and "<-" in shown.output and "staleness" in shown.output
    plan = json.loads(out.read_text())
    search_block = plan["search"]
    chosen = search_block["front"][search_block["chosen"]]
    assert (chosen["schedule"], chosen["num_microbatches"]) == (plan["inputs"]["schedule"],
                                                               plan["inputs"]["num_microbatches"])
    assert Plan.from_json(plan).search == search_block
    as_json = runner.invoke(app, ["plan", QUICKSTART, root, "--profile", str(profile), "--pareto", "schedule.name=gpipe",
                                  "--format", "json", "-o", str(tmp_path / "gpipe.json")])
    assert as_json.exit_code == 0, as_json.output
    assert {row["schedule"] for row in json.loads(as_json.stdout)["front"]} == {"gpipe"}
    changed = runner.invoke(app, ["plan", "diff", str(out), str(tmp_path / "gpipe.json")])
    assert changed.exit_code == 1 and "schedule: " in changed.output or "plans differ" in changed.output
    diff_json = json.loads(runner.invoke(app, ["plan", "diff", str(out), str(tmp_path / "gpipe.json"),
                                               "--format", "json"]).stdout)
    assert any(line.startswith("schedule: ") for line in diff_json["changes"]) == (chosen["schedule"] != "gpipe")
    plain = runner.invoke(app, ["plan", QUICKSTART, root, "--profile", str(profile), "-o", str(tmp_path / "p.json")])
    assert plain.exit_code == 0 and "search" not in json.loads((tmp_path / "p.json").read_text())


def test_a_search_that_fits_nothing_exits_2_naming_the_limit(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(chain().to_json()))
    result = CliRunner().invoke(app, ["plan", QUICKSTART, f"run.root={tmp_path}", "--profile", str(profile),
                                      "--pareto", "cluster.memory_bytes_per_device=1000"])
    assert result.exit_code == 2
    assert "cluster.memory_bytes_per_device" in result.output and "Traceback" not in result.output


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pd_train_runs_the_configuration_the_plan_chose(tmp_path: Path) -> None:
    """Trained as the plan chose, and the numbers of that configuration's single-process reference."""
    from test_steer_train import assert_matches_reference, train

    plan, run = train(tmp_path, "recipes/quickstart.yaml", "schedule.name=auto", "schedule.num_microbatches=auto")
    resolved = load_config(run / "config.yaml").config
    assert (resolved.schedule.name, resolved.schedule.num_microbatches) == (
        plan["inputs"]["schedule"], plan["inputs"]["num_microbatches"])
    assert resolved.plan.search == ["schedule.name", "schedule.num_microbatches"]
    assert plan["search"]["front"][plan["search"]["chosen"]]["schedule"] == resolved.schedule.name
    assert_matches_reference(run, [s["replicas"] for s in plan["stages"]])


@pytest.mark.parametrize("runtime", [False, True])
def test_recompute_costs_a_second_forward_and_saves_memory(runtime: bool) -> None:
    """`train.recompute` is priced both ways: a Backward that runs the forward again (more time)
    and held microbatches that keep only their inputs (less memory)."""
    from test_runtime_costs import RUNTIME, chain as runtime_chain

    c = runtime_chain(RUNTIME.without("cores"), n=8) if runtime else chain()
    topology = Topology.flat(2, 1e9)
    from pdcli.planner import plan_chain

    options = PlanOptions(schedule="gpipe", num_microbatches=4, batch_size=32, boundaries=(4,))
    plain, again = (plan_chain(c, topology, dataclasses.replace(options, recompute=r)) for r in (False, True))
    assert again.time_per_minibatch_ms > plain.time_per_minibatch_ms * 1.05
    for a, b in zip(plain.stages, again.stages):
        if runtime:  # the Backward action: the backward's line over forward + backward work
            assert b.predicted["actions_ms"]["bwd_ms"] > a.predicted["actions_ms"]["bwd_ms"] * 1.2
        else:
            assert b.predicted["bwd_ms"] == pytest.approx(a.predicted["bwd_ms"] + a.predicted["fwd_ms"])
        assert b.predicted["activations_bytes"] < a.predicted["activations_bytes"]


def test_recompute_is_searched_when_auto() -> None:
    cfg = load_config(QUICKSTART, ["train.recompute=auto"]).config
    assert cfg.plan.search == ["train.recompute"] and cfg.train.recompute is False
    outcome = search(chain(), ConfigSpace(("gpipe",), (4, 8), (False,), (False, True)))
    assert outcome.searched == 4
    on_front = {p.config.recompute for p in outcome.front}
    assert on_front == {False, True}  # recompute: slower, and smaller
    fastest, smallest = outcome.chosen, min(outcome.front, key=lambda p: p.peak_bytes)
    assert not fastest.config.recompute and smallest.config.recompute


def test_chunked_schedules_are_searched_with_two_chunks_per_device() -> None:
    """interleaved, loopedbfs and zbv join the search with 2 chunks a device (zbv only with its
    split backward); a point's peak memory is its busiest device's, all its chunks together."""
    from test_runtime_costs import RUNTIME, chain as runtime_chain

    space = ConfigSpace(("interleaved", "loopedbfs", "zbv"), (2, 4), (True, False))
    configs = space.configurations()
    assert {(c.schedule, c.split_backward) for c in configs} == {
        ("interleaved", True), ("interleaved", False), ("loopedbfs", True), ("loopedbfs", False), ("zbv", True)}
    assert {c.virtual_stages for c in configs} == {2}
    c = runtime_chain(RUNTIME.without("cores"), n=8)
    outcome = search(c, space)
    assert outcome.searched == 10 and outcome.front
    for p in outcome.front:
        assert p.plan.inputs["virtual_stages"] == 2 and len(p.plan.stages) == 4  # 2 devices x 2 chunks
        devices = p.plan.pipeline["devices"]
        assert p.peak_bytes == max(row["total_bytes"] for row in devices)
        assert p.peak_bytes > max(s.predicted["total_bytes"] for s in p.plan.stages)  # two chunks, not one
        assert p.staleness == 0
    cfg = load_config(QUICKSTART, ["schedule.name=auto"]).config
    from pdcli.steps.plan import config_space

    assert "zbv" in config_space(cfg, c).schedules and "zbv" not in config_space(cfg, chain()).schedules


@pytest.mark.slow
def test_the_chosen_configuration_is_planned_as_pd_plan_plans_it_alone() -> None:
    """The search prices every configuration without the replay's refinement, then plans the
    chosen one with it: its plan is the one `pd plan` makes for that configuration."""
    from test_runtime_costs import RUNTIME, chain as runtime_chain

    from pdcli.planner import plan_chain

    c = runtime_chain(RUNTIME, n=12)
    space, topology = ConfigSpace(("pipedream", "1f1b", "2bw"), (2, 4), (True,)), Topology.flat(4, 1e9)
    base = PlanOptions(batch_size=64)
    outcome = search_configuration(c, topology, base, space)
    cfg = outcome.chosen.config
    alone = plan_chain(c, topology, dataclasses.replace(
        base, schedule=cfg.schedule, num_microbatches=cfg.num_microbatches, split_backward=cfg.split_backward))
    assert outcome.chosen.time_per_minibatch_ms == pytest.approx(alone.time_per_minibatch_ms)
    unrefined = search_configuration(c, topology,
                                     dataclasses.replace(base, refine=False), space)
    assert outcome.chosen.time_per_minibatch_ms < unrefined.chosen.time_per_minibatch_ms  # the refinement counted
    assert [(s.start, s.end, s.replicas) for s in outcome.chosen.plan.stages] == [
        (s.start, s.end, s.replicas) for s in alone.stages]


def test_precision_is_searched_when_auto_and_priced_by_the_measured_step() -> None:
    """`train.precision: auto` searches fp32 and bf16; bf16's times are the profiled ones times the
    whole step's measured factor (`meta.precision_time`), its memory the half-width activations."""
    from pdcli.profiler.batch_points import PRECISION_META, chain_at_precision, precision_time_json

    cfg = load_config(QUICKSTART, ["train.precision=auto"]).config
    assert cfg.plan.search == ["train.precision"] and cfg.train.precision == "fp32"
    plain = chain()
    rows = 8  # the search below: 32 samples in 4 microbatches
    assert chain_at_precision(plain, "bf16", rows) is plain  # not measured: as profiled
    old = dataclasses.replace(plain, meta={**plain.meta, PRECISION_META: {"fp32": 1.0, "bf16": 1.5}})
    assert chain_at_precision(old, "bf16", rows) is old  # an older pd's whole-step factor: not read
    heavy = tuple(dataclasses.replace(n, parameter_bytes=10_000, activation_bytes=8_000_000,
                                      backward_memory_bytes=8_000_000) for n in plain.nodes)  # activations dominate
    table = precision_time_json({rows: {"fp32": 1.0, "bf16": 1.5}})
    c = dataclasses.replace(plain, nodes=heavy, meta={**plain.meta, PRECISION_META: table})
    assert chain_at_precision(c, "bf16", rows).nodes[2].fwd_ms == pytest.approx(1.5 * c.nodes[2].fwd_ms)
    outcome = search(c, ConfigSpace(("gpipe",), (4,), (False,), (False,), ("fp32", "bf16")))
    by = {p.config.precision: p for p in outcome.front}
    assert set(by) == {"fp32", "bf16"}  # slower but smaller: both on the front
    assert by["bf16"].time_per_minibatch_ms > by["fp32"].time_per_minibatch_ms
    assert by["bf16"].peak_bytes < by["fp32"].peak_bytes
    assert by["bf16"].plan.inputs["precision"] == "bf16" and outcome.chosen.config.precision == "fp32"


def test_pd_plan_prices_a_run_as_the_search_and_calibration_do() -> None:
    """One pricing of the profile for a run (`chain_of_run`): without a search, `pd plan` prices a
    bf16 run by the profile's measured factor, as the configuration search does, and calibration
    reads the plan's run priced the same."""
    from pdcli.profiler.batch_points import PRECISION_META, chain_at_precision, precision_time_json
    from pdcli.report.calibrate import chain_of_plan
    from pdcli.steps.plan import make_plan

    cfg = load_config(QUICKSTART, ["train.precision=bf16"]).config
    rows = cfg.microbatch_size
    plain = chain(rows=rows)
    c = dataclasses.replace(plain, meta={**plain.meta, PRECISION_META: precision_time_json({rows: {"fp32": 1.0,
                                                                                                   "bf16": 1.5}})})
    priced = chain_at_precision(c, "bf16", rows)
    assert priced.nodes[0].fwd_ms == pytest.approx(1.5 * plain.nodes[0].fwd_ms)
    plan = make_plan(c, cfg, None)

    def time_of(p: dict) -> float:
        return float(p["pipeline"]["time_per_minibatch_ms"])

    assert time_of(plan) == time_of(make_plan(dataclasses.replace(priced, meta=plain.meta), cfg, None))
    assert time_of(plan) > time_of(make_plan(plain, cfg, None))
    assert chain_of_plan(c, plan).nodes == priced.nodes


def test_the_precision_factor_is_priced_at_the_configurations_microbatch_size() -> None:
    """bf16's factor is measured at several microbatch sizes (`meta.precision_time`): a size between
    two is interpolated, one beyond them takes the nearest one's, and the chain is priced at it."""
    from pdcli.profiler.batch_points import PRECISION_META, chain_at_precision, precision_factor, precision_time_json

    table = precision_time_json({32: {"fp32": 1.0, "bf16": 0.9}, 256: {"fp32": 1.0, "bf16": 0.5},
                                 64: {"fp32": 1.0, "bf16": 0.7}})
    assert table["rows"] == [32, 64, 256] and table["factors"]["bf16"] == [0.9, 0.7, 0.5]
    meta = {PRECISION_META: table}
    assert precision_factor(meta, "bf16", 64) == pytest.approx(0.7)
    assert precision_factor(meta, "bf16", 160) == pytest.approx(0.6)  # halfway from 64 to 256
    assert precision_factor(meta, "bf16", 8) == pytest.approx(0.9) and precision_factor(meta, "bf16", 1024) == 0.5
    assert precision_factor(meta, "fp32", 100) == 1.0 and precision_factor(meta, "fp16", 64) is None
    c = dataclasses.replace(chain(), meta={**chain().meta, **meta})
    small, large = chain_at_precision(c, "bf16", 32), chain_at_precision(c, "bf16", 256)
    assert small.nodes[1].bwd_ms == pytest.approx(0.9 * c.nodes[1].bwd_ms)
    assert large.nodes[1].wgrad_ms == pytest.approx(0.5 * c.nodes[1].wgrad_ms)
    assert chain_at_precision(c, "fp32", 256) is c


def test_the_precisions_take_turns_so_a_slower_host_midway_moves_no_factor() -> None:
    """`step_samples` times the variants in turn within each repeat: a host that runs 3x slower
    from the middle of the measurement on leaves each factor exact (timed one after the other,
    the second variant would have run wholly in the slow spell)."""
    import contextlib

    import torch

    from pdcli.profiler.measure import ratios_to_first, step_samples

    class Clock:  # a variant's step takes its own time, times the host's speed at that moment
        def __init__(self) -> None:
            self.variant, self.calls = "", 0

        def sync(self) -> None: ...

        def start(self) -> None:
            self.calls += 1

        def stop(self) -> float:
            return {"fp32": 10.0, "bf16": 4.0, "fp16": 6.0}[self.variant] * (3.0 if self.calls > 9 else 1.0)

    clock = Clock()

    def variant(name: str):  # type: ignore[no-untyped-def]
        @contextlib.contextmanager
        def enter():  # type: ignore[no-untyped-def]
            clock.variant = name
            yield
        return enter

    model = torch.nn.Linear(3, 2)
    samples = step_samples(model, (torch.randn(4, 3),), torch.tensor([0, 1, 0, 1]), torch.nn.CrossEntropyLoss(),
                           clock, 1, 5, {n: variant(n) for n in ("fp32", "bf16", "fp16")})  # type: ignore[arg-type]
    assert len(samples["bf16"]) == 5 and samples["bf16"][-1] == 12.0  # the warm-up round left out; slow at the end
    factors = ratios_to_first(samples)
    assert factors == {"fp32": 1.0, "bf16": pytest.approx(0.4), "fp16": pytest.approx(0.6)}
    assert clock.calls == 18 and model.weight.grad is None  # 6 rounds of 3 steps; no gradient left behind


def test_pd_profile_measures_what_the_search_prices(tmp_path: Path) -> None:
    """With `num_microbatches` and `precision` searched, `pd profile` measures the layers at the
    other microbatch sizes and the whole step under bf16 autocast."""
    result = CliRunner().invoke(app, ["profile", QUICKSTART, f"run.root={tmp_path}", "profile.repeats=1",
                                      "profile.warmup=0", "profile.runtime_probe=false",
                                      "schedule.num_microbatches=auto", "train.precision=auto"])
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "quickstart/profile.json").read_text())["meta"]
    points = meta["batch_points"]
    factors = meta["precision_time"]
    assert factors["rows"] == sorted({meta["batch_size"], *points["rows"]})  # the profiled size and every point's
    assert factors["factors"]["fp32"] == [1.0] * len(factors["rows"])
    assert len(factors["factors"]["bf16"]) == len(factors["rows"]) and all(f > 0 for f in factors["factors"]["bf16"])
    assert points["rows"] and all(len(row) == len(points["fwd_ms"][0]) for row in points["fwd_ms"])
    assert all(t > 0 for row in points["fwd_ms"] for t in row)


def test_pd_profile_measures_under_the_allocator_the_workers_run_with(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`pd profile` tunes glibc's allocator as every worker does (`pdcli.torchutil.allocator`)
    before it times anything: under glibc's default a step pays page faults a worker never pays."""
    import pdcli.profiler.measure as measure
    import pdcli.torchutil.allocator as allocator

    calls: list[str] = []
    tune, profile_model = allocator.tune_allocator, measure.profile_model
    monkeypatch.setattr(allocator, "tune_allocator", lambda: calls.append("tune") or tune())
    monkeypatch.setattr(measure, "profile_model", lambda *a, **k: calls.append("measure") or profile_model(*a, **k))
    result = CliRunner().invoke(app, ["profile", QUICKSTART, f"run.root={tmp_path}", "profile.repeats=1",
                                      "profile.warmup=0", "profile.runtime_probe=false"])
    assert result.exit_code == 0, result.output
    assert calls[:2] == ["tune", "measure"]


def test_a_precision_the_profile_did_not_measure_is_not_searched() -> None:
    from pdcli.profiler.batch_points import PRECISION_META, precision_time_json
    from pdcli.steps.plan import config_space

    cfg = load_config(QUICKSTART, ["train.precision=auto"]).config
    assert config_space(cfg, chain()).precisions == ("fp32",)  # a graph.txt, or a profile made before
    measured = dataclasses.replace(chain(), meta={**chain().meta, PRECISION_META: precision_time_json(
        {4: {"fp32": 1.0, "bf16": 2.0}})})
    assert config_space(cfg, measured).precisions == ("fp32", "bf16")


def test_merged_weight_grads_are_priced_at_the_minibatchs_rate() -> None:
    """With `merge_weight_grads` a minibatch's W's run as one matmul over its rows: the planner
    prices them at the rate `meta.batch_points` measured at the minibatch's rows, not at the
    microbatch's (the linear scale where the profile has no such point)."""
    from pdcli.profiler.batch_points import chain_of_run, with_merged_weight_grads

    def with_wgrad(c: Chain) -> Chain:
        nodes = tuple(dataclasses.replace(n, wgrad_ms=n.bwd_ms / 2) for n in c.nodes)
        meta = dict(c.meta)
        if BATCH_POINTS_META in meta:  # the points' W's: half their backward too
            meta[BATCH_POINTS_META] = {**meta[BATCH_POINTS_META],
                                       "wgrad_ms": [[b / 2 for b in row] for row in meta[BATCH_POINTS_META]["bwd_ms"]]}
        return dataclasses.replace(c, nodes=nodes, meta=meta)

    linear, fast_big = with_wgrad(chain()), with_wgrad(chain(points={32: 0.6}))  # 32 rows at 0.6 of 4 x 8 rows' time
    assert with_merged_weight_grads(linear, chain_at_rows(linear, 32)) is linear
    merged = with_merged_weight_grads(fast_big, chain_at_rows(fast_big, 32))
    for node, was in zip(merged.nodes, fast_big.nodes):
        assert node.wgrad_ms == pytest.approx(was.wgrad_ms * 0.6)
        assert node.fwd_ms == was.fwd_ms  # the Backward's input gradients unchanged, its W's cheaper
        assert node.bwd_ms - node.wgrad_ms == pytest.approx(was.bwd_ms - was.wgrad_ms)
    assert chain_of_run(fast_big, 8, "fp32", 32).nodes == merged.nodes
    assert chain_of_run(fast_big, 8, "fp32").nodes == fast_big.nodes
    # the search prices a configuration that merges with it, and only such a one
    space = ConfigSpace(("1f1b",), (4,), (True,))
    base = PlanOptions(batch_size=32, schedule="1f1b", split_backward=True, use_fewer_devices=True)

    def time_of(c: Chain, merge: bool) -> float:
        options = dataclasses.replace(base, merge_weight_grads=merge)
        return search_configuration(c, Topology.flat(2, 1e9), options,
                                    space).chosen.time_per_minibatch_ms

    assert time_of(fast_big, False) == pytest.approx(time_of(linear, False))  # 8-row microbatches: the same
    assert time_of(fast_big, True) < time_of(linear, True) - 0.1


def test_pd_profile_measures_the_minibatch_a_merge_runs_and_pd_plan_prices_it(tmp_path: Path) -> None:
    from pdcli.profiler.batch_points import with_merged_weight_grads
    from pdcli.steps.plan import make_plan

    items = [f"run.root={tmp_path}", "profile.repeats=1", "profile.warmup=0", "profile.runtime_probe=false",
             "schedule.name=1f1b", "schedule.merge_weight_grads=true"]
    result = CliRunner().invoke(app, ["profile", QUICKSTART, *items])
    assert result.exit_code == 0, result.output
    cfg = load_config(QUICKSTART, items).config
    profiled = Chain.from_json(json.loads((tmp_path / "quickstart/profile.json").read_text()))
    assert profiled.meta["batch_size"] == cfg.microbatch_size
    assert profiled.meta[BATCH_POINTS_META]["rows"] == [cfg.data.batch_size]  # the merged matmul's rows
    plain = dataclasses.replace(profiled, meta={k: v for k, v in profiled.meta.items() if k != BATCH_POINTS_META})
    at_minibatch = chain_at_rows(profiled, cfg.data.batch_size)
    assert [n.wgrad_ms for n in at_minibatch.nodes] != [n.wgrad_ms for n in plain.nodes]
    # the plan of the profile is the plan of its chain with the W's at the minibatch's rate
    priced = with_merged_weight_grads(plain, dataclasses.replace(at_minibatch, meta=plain.meta))
    assert make_plan(profiled, cfg, None)["stages"] == make_plan(priced, cfg, None)["stages"]
    assert make_plan(profiled, cfg, None)["stages"] != make_plan(plain, cfg, None)["stages"]

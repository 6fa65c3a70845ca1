"""The plan step: reuse `plan.json` while the profile and the plan settings are unchanged, else
plan and write it."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdcli.config.schema import Config
from pdcli.errors import UserError
from pdcli.progress import current
from pdcli.profiler.chain import Chain
from pdcli.rundir import RunDir, artifact_inputs_hash, read_json

PLAN = "plan.json"


def plan_options(cfg: Config, profile_sha256: str | None) -> Any:
    """The planner's options for `cfg`. A hand-written schedule (`schedule.orders`) plans one
    device per stage and, unless the config fixes the stages, as many stages as it has lines."""
    from pdcli.planner import PlanOptions
    from pdcli.planner.options import COST_PD
    from pdcli.planner.steer import SplitPoint
    from pdcli.schedule.orders import read_orders
    from pdcli.schedule.spec import rules

    schedule = cfg.schedule
    orders = read_orders(schedule.orders, schedule.num_microbatches, schedule.split_backward_on,
                         schedule.path or "schedule.orders") if schedule.orders and rules(schedule.name).hand_written else ()
    stages_fixed = cfg.plan.num_stages is not None or cfg.plan.boundaries is not None or bool(cfg.plan.split_points)
    return PlanOptions(
        schedule=schedule.name,
        num_microbatches=schedule.num_microbatches,
        batch_size=cfg.data.batch_size,
        memory_bytes_per_device=cfg.cluster.memory_bytes_per_device,
        straight=cfg.plan.straight or not rules(schedule.name).replicable,
        use_fewer_devices=cfg.plan.use_fewer_devices,
        cost_model=cfg.plan.cost_model,
        num_stages=len(orders) if orders and not stages_fixed and cfg.plan.cost_model == COST_PD else cfg.plan.num_stages,
        boundaries=tuple(cfg.plan.boundaries) if cfg.plan.boundaries is not None else None,
        split_points=tuple(SplitPoint.of(item) for item in cfg.plan.split_points or ()),
        pipe_splits=cfg.plan.pipe_splits,
        replicas=tuple(cfg.plan.replicas) if cfg.plan.replicas is not None else None,
        precision=cfg.train.precision,
        recompute=cfg.train.recompute,
        split_backward=cfg.schedule.split_backward_on,
        merge_weight_grads=cfg.schedule.merge_weight_grads,
        vertical_sync=cfg.schedule.vertical_sync,
        max_positions=cfg.plan.max_states,
        profile_sha256=profile_sha256,
        orders=orders,
        virtual_stages=schedule.virtual_stages,
    )


CALIBRATION = "calibration.json"
"""`pd plan --calibrate RUN` writes it (`pdcli.report.calibrate`): the runtime costs refitted
to a run, used instead of the profile's `meta.runtime` while it names the run's profile, and
the link that run measured between hosts (`link`), whose bandwidth replaces its level's."""


def profile_sha256(run: RunDir) -> str:
    """The run's profile.json hash (as its manifest recorded it, else of the file)."""
    record = run.record("profile.json")
    return record.sha256 if record else run.content_hash("profile.json")


def read_calibration(run: RunDir, profile_sha256: str) -> dict[str, Any] | None:
    """The run's calibration.json when it was made for this profile, else None."""
    path = run / CALIBRATION
    if not path.exists():
        return None
    obj = read_json(path, "calibration")
    if not isinstance(obj, dict) or obj.get("profile_sha256") != profile_sha256 or "runtime" not in obj:
        return None
    return obj


def calibrated_chain(chain: Chain, calibration: dict[str, Any] | None) -> Chain:
    """`chain` with the calibration's runtime costs in place of the probe's."""
    if calibration is None:
        return chain
    from pdcli.planner.runtime_costs import RuntimeCosts

    return RuntimeCosts.from_json(calibration["runtime"]).priced(chain)


def calibrated_config(cfg: Config, calibration: dict[str, Any] | None) -> Config:
    """`cfg` with the bandwidth of the calibration's measured link (`calibration["link"]`, from
    a run's `train/link.json`) in place of its cluster level's configured one."""
    link = (calibration or {}).get("link")
    if not link:
        return cfg
    from pdcli.config.schema import ClusterLevel
    from pdcli.runtime.link import adopted_levels

    levels = [ClusterLevel(**level) for level in adopted_levels(cfg.cluster.levels, link)]
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, levels=levels))


def plan_inputs_hash(cfg: Config, profile_sha256: str, calibration: dict[str, Any] | None = None) -> str:
    section = {
        "plan": asdict(cfg.plan),
        "cluster": asdict(cfg.cluster),
        "schedule": asdict(cfg.schedule),
        "batch_size": cfg.data.batch_size,
        "precision": cfg.train.precision,
        "recompute": cfg.train.recompute,
    }
    if calibration is not None:
        section["calibration"] = calibration["runtime"]
    return artifact_inputs_hash(section, profile_sha256)


def make_plan(chain: Chain, cfg: Config, profile_sha256: str | None) -> dict[str, Any]:
    """Plan `chain` for the cluster, schedule and memory budget of `cfg` (pure: no torch)."""
    from pdcli.planner import Topology, plan_chain

    topology = Topology.from_levels(cfg.cluster.levels)
    if cfg.plan.search:
        return search_plan(chain, cfg, profile_sha256, topology).to_json()
    from pdcli.profiler.batch_points import chain_of_run

    options = plan_options(cfg, profile_sha256)
    priced = chain_of_run(chain, cfg.microbatch_size, cfg.train.precision,
                          cfg.data.batch_size if options.merges_weight_grads else None)
    plan = plan_chain(priced, topology, options)
    if options.orders and len(plan.stages) != len(options.orders):
        raise UserError(f"{cfg.schedule.path or 'schedule.orders'} has {len(options.orders)} device lines, but the plan "
                        f"has {len(plan.stages)} stages", hint=f"plan {len(options.orders)} stages "
                        f"(plan.num_stages, plan.boundaries, plan.split_points) or write a line per stage")
    return plan.to_json()


def planned_layout(chain: Chain, cfg: Config) -> list[tuple[int, int, int]] | None:
    """The stages (start, end, replicas) `cfg`'s options plan for `chain`, without the search of
    `plan.search` (its stand-ins' plan): what `pd profile`'s pipeline probe runs (with virtual
    stages: the chunks). None when planning fails (the probe then picks its own layout)."""
    from pdcli.planner import Topology, plan_chain

    try:
        plan = plan_chain(chain, Topology.from_levels(cfg.cluster.levels), plan_options(cfg, None))
    except UserError:
        return None
    return [(stage.start, stage.end, stage.replicas) for stage in plan.stages]


def config_space(cfg: Config, chain: Chain) -> Any:
    """What `plan.search` leaves to the planner: every searched schedule (split backward on and
    off for the flush ones unless `schedule.split_backward` is set; the chunked ones when
    `chain` has the runtime's costs), microbatch count, recompute on and off, and the precisions
    `chain` measured (`meta.precision_time`)."""
    from pdcli.planner.pareto import (
        CHUNKED_SCHEDULES, SEARCHED_PRECISIONS, SEARCHED_SCHEDULES, ConfigSpace, auto_microbatches,
    )
    from pdcli.planner.runtime_costs import RuntimeCosts
    from pdcli.profiler.batch_points import measured_precisions

    searched = set(cfg.plan.search)
    name_free = "schedule.name" in searched
    chunked = CHUNKED_SCHEDULES if RuntimeCosts.from_meta(chain.meta) is not None else ()
    schedules = (*SEARCHED_SCHEDULES, *chunked) if name_free else (cfg.schedule.name,)
    if not name_free:
        splits: tuple[bool, ...] = (cfg.schedule.split_backward_on,)
    else:
        splits = (True, False) if cfg.schedule.split_backward is None else (bool(cfg.schedule.split_backward),)
    microbatches = (auto_microbatches(cfg.data.batch_size) if "schedule.num_microbatches" in searched
                    else (cfg.schedule.num_microbatches,))
    recompute = (False, True) if "train.recompute" in searched else (cfg.train.recompute,)
    precisions: tuple[str, ...] = (cfg.train.precision,)
    if "train.precision" in searched:  # a precision the profile cannot price is not searched
        measured = measured_precisions(chain.meta)
        precisions = tuple(p for p in SEARCHED_PRECISIONS if p in measured) or precisions
    return ConfigSpace(tuple(schedules), microbatches, splits, recompute, precisions)


def search_plan(chain: Chain, cfg: Config, profile_sha256: str | None, topology: Any) -> Any:
    """The Pareto search over `config_space(cfg)` (`pdcli.planner.pareto`): the chosen plan."""
    from pdcli.planner.pareto import search_configuration, searched_plan

    outcome = search_configuration(chain, topology,
                                   plan_options(cfg, profile_sha256), config_space(cfg, chain),
                                   cfg.plan.objective, cfg.plan.max_staleness)
    return searched_plan(outcome, cfg.data.batch_size, cfg.plan.objective, cfg.plan.max_staleness)


def config_of_plan(cfg: Config, plan: dict[str, Any]) -> Config:
    """`cfg` with the fields `plan.search` left to the planner set to the plan's choice."""
    if not cfg.plan.search:
        return cfg
    from pdcli.schedule.spec import PIPEDREAM

    inputs = plan["inputs"]
    name = str(inputs["schedule"])
    schedule = dataclasses.replace(cfg.schedule, name=name, num_microbatches=int(inputs["num_microbatches"]),
                                   split_backward=bool(inputs.get("split_backward", False)),
                                   merge_weight_grads=bool(inputs.get("merge_weight_grads", False)),
                                   vertical_sync=cfg.schedule.vertical_sync and name == PIPEDREAM,
                                   virtual_stages=int(inputs.get("virtual_stages", 1)))
    train = dataclasses.replace(cfg.train, recompute=bool(inputs.get("recompute", False)),
                                precision=str(inputs.get("precision", "fp32")))
    return dataclasses.replace(cfg, schedule=schedule, train=train)


def ensure_plan(cfg: Config, run: RunDir, chain: Chain, force: bool = False) -> tuple[dict[str, Any], bool]:
    """(plan, reused): `run/plan.json` made from the run's profile (priced by the run's
    calibration.json where it has one), or reused as is."""
    profile_sha = profile_sha256(run)
    calibration = read_calibration(run, profile_sha)
    cfg = calibrated_config(cfg, calibration)
    inputs_hash = plan_inputs_hash(cfg, profile_sha, calibration)
    if not force and run.fresh(PLAN, inputs_hash):
        return run.read_json(PLAN), True
    with current().phase("plan: searching stages, replicas and devices"):
        plan = make_plan(calibrated_chain(chain, calibration), cfg, profile_sha)
    run.write_json(PLAN, plan, inputs_hash)
    return plan, False


def load_plan_file(path: Path) -> dict[str, Any]:
    """A plan from a plan.json or a run directory holding one."""
    from pdcli.planner.plan import plan_shape_error

    if path.is_dir():
        path = path / PLAN
    plan = read_json(path, "plan")
    problem = plan_shape_error(plan)
    if problem is not None:
        raise UserError(f"{path}: not a pd plan ({problem})", hint="pass a plan.json written by `pd plan`")
    return plan

"""`pd plan`'s search over the configuration: the schedule, split backward and microbatches per
minibatch jointly with the partition, and the Pareto front of time, memory and staleness.

Every configuration of a `ConfigSpace` is planned by `plan_chain` (the partition and
replication search, with the profile priced for that configuration's run by `chain_of_run`:
its microbatch's rows, its precision, its merged weight gradients), then scored on three
objectives, all minimized: time per minibatch, peak memory of a device, and staleness (how
many optimizer steps older than the latest the weights a minibatch runs on can be,
`ScheduleSpec.update_delay`). Each configuration is represented by its
fastest partition (the one `plan_chain` picks). A configuration that fits nowhere in memory is left out;
when none fits, the error names the limit to raise and the smallest peak that would do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from pdcli.errors import UserError
from pdcli.planner.make import plan_chain
from pdcli.planner.options import PlanOptions
from pdcli.planner.plan import Plan, round_float
from pdcli.planner.search import shared_programs
from pdcli.planner.space import SplitSpace
from pdcli.planner.topology import Topology
from pdcli.profiler.batch_points import chain_of_run
from pdcli.profiler.chain import Chain
from pdcli.schedule import ScheduleSpec
from pdcli.schedule.spec import (
    FLUSH_SCHEDULES, GPIPE, INTERLEAVED, LOOPED_BFS, ONE_F_ONE_B, PIPEDREAM, TWO_BW, ZBV, rules,
    takes_merged_weight_grads, virtual_problems,
)

SEARCHED_SCHEDULES = (PIPEDREAM, TWO_BW, ONE_F_ONE_B, GPIPE)
"""The schedules `schedule.name: auto` searches (a hand-written `file` order is the user's own)."""
CHUNKED_SCHEDULES = (INTERLEAVED, LOOPED_BFS, ZBV)
"""Searched too when the profile has the runtime's costs: their time is the replay of their action
lists (`pdcli.planner.virtual`), which every configuration of such a profile pays anyway; a
PipeDream graph.txt on 16 devices would spend seconds replaying each."""
AUTO_VIRTUAL_STAGES = 2
"""Chunks per device the search gives the chunked schedules (interleaved, loopedbfs, zbv)."""
SEARCHED_PRECISIONS = ("fp32", "bf16")
"""What `train.precision: auto` searches (bf16 priced by `meta.precision_time`)."""
MAX_AUTO_MICROBATCHES = 32
"""`schedule.num_microbatches: auto` searches the divisors of the minibatch up to this many."""


@dataclass(frozen=True)
class Configuration:
    """What the search chooses besides the partition."""

    schedule: str
    num_microbatches: int
    split_backward: bool
    recompute: bool = False
    virtual_stages: int = 1
    precision: str = "fp32"

    def label(self) -> str:
        chunks = f" x{self.virtual_stages} chunks" if self.virtual_stages > 1 else ""
        split = " (split backward)" if self.split_backward else ""
        recompute = ", recompute" if self.recompute else ""
        precision = f", {self.precision}" if self.precision != "fp32" else ""
        return f"{self.schedule}{chunks}{split}, M={self.num_microbatches}{recompute}{precision}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ConfigSpace:
    """The values searched for each field; a field the recipe fixed has one."""

    schedules: tuple[str, ...]
    microbatches: tuple[int, ...]
    split_backward: tuple[bool, ...]
    """Tried for the flush schedules; the others never split."""
    recompute: tuple[bool, ...] = (False,)
    precisions: tuple[str, ...] = ("fp32",)

    def configurations(self) -> list[Configuration]:
        """Every combination the schedules' rules take (`virtual_problems`: zbv splits its backward)."""
        out = []
        for schedule in self.schedules:
            splits = self.split_backward if schedule in FLUSH_SCHEDULES else (False,)
            v = AUTO_VIRTUAL_STAGES if rules(schedule).chunked else 1
            for m in self.microbatches:
                for split in dict.fromkeys(splits):
                    if virtual_problems(schedule, v, split, m):
                        continue
                    for recompute in self.recompute:
                        for precision in self.precisions:
                            out.append(Configuration(schedule, m, split, recompute, v, precision))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"schedules": list(self.schedules), "num_microbatches": list(self.microbatches),
                "split_backward": list(self.split_backward), "recompute": list(self.recompute),
                "precisions": list(self.precisions)}


def auto_microbatches(batch_size: int, limit: int = MAX_AUTO_MICROBATCHES) -> tuple[int, ...]:
    """The microbatch counts `num_microbatches: auto` searches: the divisors of the minibatch."""
    return tuple(m for m in range(1, min(batch_size, limit) + 1) if batch_size % m == 0)


def stage_delays(schedule: str, num_microbatches: int, replicas: Sequence[int]) -> list[int]:
    """Each stage's staleness in steady state (`ScheduleSpec.update_delay`): how many of its own
    optimizer steps the weights a microbatch runs on lack."""
    steps = 2 * sum(replicas) + 2  # the spec's last microbatch is in steady state
    spec = ScheduleSpec.make(schedule, len(replicas), num_microbatches, steps, list(replicas))
    return [spec.update_delay(k) for k in range(len(replicas))]


@dataclass(frozen=True)
class Point:
    """One configuration, planned and scored."""

    config: Configuration
    plan: Plan
    time_per_minibatch_ms: float
    peak_bytes: float
    staleness: int
    """The most any stage's weights lag (`stage_delays`)."""

    def objectives(self) -> tuple[float, float, int]:
        return (self.time_per_minibatch_ms, self.peak_bytes, self.staleness)

    def summary(self, batch_size: int) -> dict[str, Any]:
        """The point as a row of the front (plan.json `search.front`)."""
        time_ms = self.time_per_minibatch_ms
        return {
            **self.config.to_json(),
            "stages": len(self.plan.stages),
            "boundaries": [s.start for s in self.plan.stages[1:]],
            "replicas": [s.replicas for s in self.plan.stages],
            "time_per_minibatch_ms": round_float(time_ms),
            "throughput_samples_per_s": round_float(batch_size * 1000.0 / time_ms) if time_ms > 0 else 0.0,
            "peak_bytes": round_float(self.peak_bytes),
            "staleness": self.staleness,
        }


def dominates(a: Point, b: Point) -> bool:
    """`a` is no worse than `b` on every objective and better on one."""
    x, y = a.objectives(), b.objectives()
    return all(p <= q for p, q in zip(x, y)) and x != y


def pareto_front(points: Sequence[Point]) -> list[Point]:
    """The points no other point dominates (one of each set of equal ones), fastest first."""
    front: list[Point] = []
    for p in sorted(points, key=lambda q: q.objectives()):
        if not any(dominates(f, p) or f.objectives() == p.objectives() for f in front):
            front.append(p)
    return front


def choose(front: Sequence[Point], objective: str, max_staleness: int | None) -> Point | None:
    """The point `plan.objective` picks among those within `plan.max_staleness` (None: none)."""
    allowed = [p for p in front if max_staleness is None or p.staleness <= max_staleness]
    if not allowed:
        return None
    if objective == "memory":
        return min(allowed, key=lambda p: (p.peak_bytes, p.time_per_minibatch_ms, p.staleness))
    return min(allowed, key=lambda p: (p.time_per_minibatch_ms, p.peak_bytes, p.staleness))


def _point(config: Configuration, plan: Plan) -> Point:
    """A planned configuration's objectives: a device's peak (a chunked plan's `devices` rows sum
    its chunks) and the staleness (0 for every flush schedule, `ScheduleSpec.update_delay`)."""
    rows = plan.pipeline.get("devices") or [s.predicted for s in plan.stages]
    peak = max(float(row.get("total_bytes", 0.0)) for row in rows)
    flush = rules(config.schedule).flush
    delays = [0] if flush else stage_delays(config.schedule, config.num_microbatches, [s.replicas for s in plan.stages])
    return Point(config, plan, float(plan.pipeline["time_per_minibatch_ms"]), peak, max(delays))


def config_options(base: PlanOptions, config: Configuration) -> PlanOptions:
    """`base` with what `config` chooses (vertical sync only where pipedream runs, merged weight
    gradients only where the configuration places its W's; left unset, each schedule's default)."""
    merge = base.merge_weight_grads and takes_merged_weight_grads(config.schedule, config.split_backward)
    return dataclasses.replace(base, schedule=config.schedule, num_microbatches=config.num_microbatches,
                               split_backward=config.split_backward, recompute=config.recompute,
                               virtual_stages=config.virtual_stages, precision=config.precision,
                               vertical_sync=base.vertical_sync and config.schedule == PIPEDREAM,
                               merge_weight_grads=merge)


def search_points(chain: Chain, topology: Topology, base: PlanOptions,
                  space: ConfigSpace) -> tuple[list[Point], int]:
    """(every configuration of `space` that has a plan, how many have none: nothing fits in
    memory, or the schedule's rules refuse it, e.g. interleaved's microbatches not a multiple of
    the devices); each priced from the profile `chain` by `chain_of_run`."""
    configs = space.configurations()
    found: dict[int, Point] = {}
    chains: dict[tuple[int, str, bool], tuple[Chain, SplitSpace]] = {}
    # those of one precision and recompute run one after another, by microbatch size, sharing the
    # programs that price alike (`pdcli.planner.search.shared_programs`); the points keep the order
    order = sorted(range(len(configs)), key=lambda k: (
        configs[k].precision, configs[k].recompute, base.batch_size // configs[k].num_microbatches))
    with shared_programs():
        for k in order:
            config = configs[k]
            rows = base.batch_size // config.num_microbatches
            try:
                options = config_options(base, config)
                key = (rows, config.precision, options.merges_weight_grads)
                if key not in chains:
                    priced = chain_of_run(chain, rows, config.precision,
                                          base.batch_size if options.merges_weight_grads else None)
                    # a profile without batch points prices every microbatch size alike: one space
                    same = [pair for pair in chains.values() if pair[0] is priced]
                    chains[key] = same[0] if same else (priced, SplitSpace.from_chain(priced))
                priced, split_space = chains[key]
                found[k] = _point(config, plan_chain(priced, topology, options, split_space))
            except UserError:
                pass
    return [found[k] for k in sorted(found)], len(configs) - len(found)


@dataclass(frozen=True)
class SearchOutcome:
    chosen: Point
    front: tuple[Point, ...]
    space: ConfigSpace
    searched: int
    refused: int

    def to_json(self, batch_size: int, objective: str, max_staleness: int | None) -> dict[str, Any]:
        """plan.json's `search`: the space, the objective, the front and the chosen row."""
        rows = [p.summary(batch_size) for p in self.front]
        return {"space": self.space.to_json(), "objective": objective, "max_staleness": max_staleness,
                "configurations": self.searched, "without_plan": self.refused, "front": rows,
                "chosen": self.front.index(self.chosen)}


def search_configuration(chain: Chain, topology: Topology, base: PlanOptions,
                         space: ConfigSpace, objective: str = "throughput",
                         max_staleness: int | None = None) -> SearchOutcome:
    """The front of `space` (priced from the profile `chain`) and the point `objective` chooses
    within `max_staleness`; a UserError naming the limit when nothing fits. Every configuration
    is priced without the replay's refinement (`PlanOptions.refine`), the chosen one is then
    planned with it."""
    unrefined = dataclasses.replace(base, refine=False)
    points, refused = search_points(chain, topology, unrefined, space)
    if not points:
        raise _nothing_fits(chain, topology, unrefined, space)
    allowed = [p for p in points if max_staleness is None or p.staleness <= max_staleness]
    if not allowed:
        least = min(p.staleness for p in points)
        raise UserError(f"plan.max_staleness={max_staleness}: every configuration that fits is at least {least} "
                        f"updates stale", hint=f"raise plan.max_staleness to {least}, or allow a flush schedule "
                        "(1f1b, gpipe) in schedule.name")
    front = pareto_front(allowed)
    chosen = choose(front, objective, max_staleness)
    assert chosen is not None
    if base.refine:  # the chosen configuration planned as `pd plan` would plan it alone
        refined, _ = search_points(chain, topology, base, dataclasses.replace(
            space, schedules=(chosen.config.schedule,), microbatches=(chosen.config.num_microbatches,),
            split_backward=(chosen.config.split_backward,), recompute=(chosen.config.recompute,),
            precisions=(chosen.config.precision,)))
        if refined and refined[0].time_per_minibatch_ms <= chosen.time_per_minibatch_ms:
            front = [refined[0] if p is chosen else p for p in front]
            chosen = refined[0]
    return SearchOutcome(chosen, tuple(front), space, len(space.configurations()), refused)


def searched_plan(outcome: SearchOutcome, batch_size: int, objective: str, max_staleness: int | None) -> Plan:
    """The chosen point's plan, recording the search (`Plan.search`)."""
    return dataclasses.replace(outcome.chosen.plan, search=outcome.to_json(batch_size, objective, max_staleness))


def _nothing_fits(chain: Chain, topology: Topology, base: PlanOptions,
                  space: ConfigSpace) -> UserError:
    limit = base.memory_bytes_per_device
    if limit is None:
        return UserError(f"no configuration of {space.to_json()} has a plan for {topology.num_devices} devices")
    free, _ = search_points(chain, topology, dataclasses.replace(base, memory_bytes_per_device=None), space)
    smallest = ""
    if free:
        best = min(free, key=lambda p: p.peak_bytes)
        smallest = f"; the smallest peak among them is {best.peak_bytes:.4g} bytes ({best.config.label()})"
    recompute = "" if True in space.recompute else ", or set train.recompute=true (or auto, to search it)"
    return UserError(f"no configuration fits in cluster.memory_bytes_per_device={limit:.4g} bytes per device "
                     f"({len(space.configurations())} searched){smallest}",
                     hint=f"raise cluster.memory_bytes_per_device or add devices{recompute}")

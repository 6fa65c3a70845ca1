"""`plan_chain`: run the search for a chain and a cluster, and write down the plan."""

from __future__ import annotations

import dataclasses
from typing import Any

from pdcli.errors import UserError
from pdcli.planner.evaluate import (
    PlanEval, batch_scale, climb, data_parallel_eval, evaluate_pd, evaluate_pipedream, pipeline_summary, stage_predicted,
)
from pdcli.planner.options import COST_PIPEDREAM, PlanOptions, search_memory_text
from pdcli.planner.pipedream import pipedream_data_parallel_s, pipedream_search
from pdcli.planner.plan import Plan, Stage
from pdcli.planner.search import SearchResult, pd_search
from pdcli.planner.space import SplitSpace, search_space_inputs
from pdcli.planner.steer import Steering, cut_names, steering_of
from pdcli.planner.topology import Topology
from pdcli.planner.virtual import plan_virtual
from pdcli.schedule.spec import rules
from pdcli.profiler.chain import Chain

MS_PER_S = 1000.0


def _steering(chain: Chain, topology: Topology, options: PlanOptions) -> Steering:
    """What the user fixed, checked against the chain, the cluster and the cost model."""
    n, devices = len(chain.nodes), topology.num_devices
    if n == 0:
        raise UserError("the profile has no positions to plan")
    if options.max_positions is not None and n > options.max_positions:
        raise UserError(f"the profile has {n} positions, more than plan.max_states={options.max_positions}",
                        hint=f"raise plan.max_states if this machine has the memory (the search over {n} "
                             f"positions takes about {search_memory_text(n)})")
    if devices < 1:
        raise UserError(f"the cluster has {devices} devices; a plan needs at least 1")
    steer = steering_of(chain, options.boundaries, options.split_points, options.pipe_splits, options.replicas,
                        options.num_stages, options.straight, options.num_microbatches, devices)
    if options.cost_model == COST_PIPEDREAM:
        if options.num_stages is not None:
            raise UserError("plan.num_stages needs cost_model=pd (PipeDream's optimizer has no stage count)")
        if steer.fixed:
            markers = "; plan.pipe_splits=false ignores the model's pipe_split() calls" \
                if "pipe_split()" in steer.sources else ""
            raise UserError(f"{' and '.join(steer.sources) or 'plan.replicas'} need cost_model=pd "
                            f"(PipeDream's optimizer takes no fixed cuts or replicas){markers}")
    return steer


def _infeasible(space: SplitSpace, topology: Topology, options: PlanOptions, scale: float) -> UserError:
    limit = options.memory_bytes_per_device
    if limit is None:
        return UserError(
            f"no plan exists for {topology.num_devices} devices with these options "
            f"(straight={options.straight}, num_stages={options.num_stages})"
        )
    smallest = ""
    if options.cost_model != COST_PIPEDREAM:
        best = pd_search(space, topology, options, scale, minimize="memory")
        if best is not None:
            smallest = f"; the smallest memory that fits a plan is {best.objective:.4g} bytes per device"
    return UserError(
        f"no plan fits in {limit:.4g} bytes per device (schedule={options.schedule}, "
        f"{topology.num_devices} devices){smallest}",
        hint="raise cluster.memory_bytes_per_device, add devices, or pick a schedule that stashes less",
    )




def refine_by_replay(space: SplitSpace, topology: Topology, options: PlanOptions, scale: float,
                     found: PlanEval) -> PlanEval:
    """The search ranks plans by their bottleneck stage; the replay of the action lists also
    sees the waits that messages in flight cause. The search's plan climbed (`climb`) to the
    fastest replay that fits memory."""
    limit = options.memory_bytes_per_device

    def price(moved: list[tuple[int, int, int]]) -> PlanEval | None:
        candidate = evaluate_pd(space, topology, options, scale, moved)
        if limit is not None and any(st.memory.total_bytes > limit for st in candidate.stages):
            return None
        return candidate

    return climb(space, [(st.start, st.end, st.replicas) for st in found.stages], price,
                 lambda e: e.time_per_minibatch_ms, found)


REPLAY_SLACK = 1.25
"""The replay re-ranks the search's best plan of each stage count whose searched time is
within this factor of the overall best's."""


def rank_by_replay(space: SplitSpace, topology: Topology, options: PlanOptions, scale: float,
                   found: SearchResult) -> PlanEval:
    """The search ranks plans by its stage-time model; the replay of the action lists is what
    the plan reports. Among the search's plan and its best plan of every other stage count
    within REPLAY_SLACK (when the stage count is free), each refined by `refine_by_replay`,
    the fastest replay; the search's plan wins ties."""
    candidates = [found]
    if options.num_stages is None and options.replicas is None:
        for count in range(1, min(space.num_positions, topology.num_devices) + 1):
            other = pd_search(space, topology, dataclasses.replace(options, num_stages=count), scale)
            if other is not None and other.objective <= found.objective * REPLAY_SLACK:
                candidates.append(other)
    best: PlanEval | None = None
    seen = set()
    for candidate in candidates:
        partition = tuple((s.start, s.end, s.replicas) for s in candidate.stages)
        if partition in seen:
            continue
        seen.add(partition)
        result = refine_by_replay(space, topology, options, scale, evaluate_pd(space, topology, options, scale,
                                                                                 partition))
        if best is None or result.time_per_minibatch_ms < best.time_per_minibatch_ms:
            best = result
    assert best is not None
    return best


def plan_chain(chain: Chain, topology: Topology, options: PlanOptions, space: SplitSpace | None = None) -> Plan:
    """The best plan for `chain` on `topology` under `options` (UserError if none fits): the
    search places whatever the user did not fix (`pdcli.planner.steer`). When the user fixed a
    cut or the replicas, the plan also records the best plan without any of it. `space`: the
    chain's SplitSpace when the caller plans the same chain several times."""
    if rules(options.schedule).chunked:  # virtual stages: the stages are chunks (pdcli.planner.virtual)
        return plan_virtual(chain, topology, options, space)
    steer = _steering(chain, topology, options)
    space = SplitSpace.from_chain(chain) if space is None else space
    scale = batch_scale(chain.meta, options)
    result, data_parallel_ms = _best(space, topology, options, scale, steer)
    unconstrained = None
    if steer.fixed:
        free = dataclasses.replace(options, boundaries=None, split_points=(), replicas=None, num_stages=None)
        try:
            unconstrained, _ = _best(space, topology, free, scale, Steering())
        except UserError:  # nothing fits without the constraints either: no comparison to make
            unconstrained = None
        if unconstrained is not None and result.time_per_minibatch_ms < unconstrained.time_per_minibatch_ms:
            unconstrained = result  # the user's plan is a plan without constraints too
    return _assemble(chain, space, topology, options, result, data_parallel_ms, steer, unconstrained)


def _best(space: SplitSpace, topology: Topology, options: PlanOptions, scale: float,
          steer: Steering) -> tuple[PlanEval, float]:
    """(the best plan under `steer`, the time of data parallelism on all devices: `data_parallel_eval`)."""
    devices = topology.num_devices
    if options.cost_model == COST_PIPEDREAM:
        found = pipedream_search(space, topology, options, scale)
        if found is None:
            raise _infeasible(space, topology, options, scale)
        best_s, pd_stages = found
        used = sorted(r for st in pd_stages for r in st.ranks)  # compact: ranks 0..used-1
        compact = {r: i for i, r in enumerate(used)}
        pd_stages = [dataclasses.replace(st, ranks=tuple(compact[r] for r in st.ranks)) for st in pd_stages]
        result = evaluate_pipedream(space, topology, options, scale, pd_stages)
        result = dataclasses.replace(result, time_per_minibatch_ms=best_s * MS_PER_S)
        return result, pipedream_data_parallel_s(space, topology, scale) * MS_PER_S
    whole = data_parallel_eval(space, topology, options, scale)
    replicas = steer.replicas
    if replicas is None and options.straight and steer.complete_split:
        replicas = (1,) * (len(steer.cuts) + 1)  # one device per fixed stage, however many the cluster has
    fixed = space.with_cuts(steer.cuts)
    search_options = dataclasses.replace(options, num_stages=steer.num_stages, replicas=replicas)
    found_pd = pd_search(fixed, topology, search_options, scale)
    if found_pd is None:
        raise _infeasible(fixed, topology, search_options, scale)
    if fixed.runtime is not None and options.refine:
        return rank_by_replay(fixed, topology, search_options, scale, found_pd), whole.time_per_minibatch_ms
    result = evaluate_pd(fixed, topology, options, scale, [(s.start, s.end, s.replicas) for s in found_pd.stages])
    return result, whole.time_per_minibatch_ms


def unconstrained_summary(chain: Chain, mine: PlanEval, free: PlanEval) -> dict[str, Any]:
    """UNCONSTRAINED_KEYS of the best plan `free` found without the user's constraints."""
    names = cut_names(chain)
    cuts = [st.start for st in free.stages[1:]]
    mine_ms, free_ms = mine.time_per_minibatch_ms, free.time_per_minibatch_ms
    return {
        "time_per_minibatch_ms": free_ms,
        "faster_pct": 100.0 * (mine_ms - free_ms) / mine_ms if mine_ms > 0 else 0.0,
        "boundaries": cuts,
        "split_points": [names.get(cut) for cut in cuts],
        "replicas": [st.replicas for st in free.stages],
    }


def replica_warnings(topology: Topology, result: PlanEval) -> list[str]:
    """A stage whose fixed replicas span a slower level of the cluster than its innermost."""
    inner_bw = topology.levels[0].bandwidth_bytes_per_s
    out = []
    for k, st in enumerate(result.stages):
        first, last = st.ranks[0], st.ranks[-1]
        bw = topology.span_bandwidth(first, last) if last > first else inner_bw
        if bw < inner_bw:
            out.append(f"plan.replicas: stage {k}'s {st.replicas} replicas (ranks {first}-{last}) span devices joined "
                       f"at {bw:.3g} bytes/s, slower than {inner_bw:.3g} within a node: its gradient all-reduce "
                       f"crosses the slow link every update")
    return out


def _assemble(chain: Chain, space: SplitSpace, topology: Topology, options: PlanOptions,
              result: PlanEval, data_parallel_ms: float, steer: Steering, unconstrained: PlanEval | None) -> Plan:
    names = {**cut_names(chain), **dict(steer.point_names)}
    stages = []
    for k, st in enumerate(result.stages):
        predicted = stage_predicted(st)
        stages.append(Stage(
            stage_id=k, start=st.start, end=st.end,
            first_node=chain.nodes[st.start].name, last_node=chain.nodes[st.end - 1].name,
            node_names=tuple(space.stage_members(st.start, st.end)),
            replicas=st.replicas, ranks=st.ranks, predicted=predicted,
            split_point=names.get(st.start, "") if k > 0 else "",
        ))
    pipeline = pipeline_summary(options.batch_size, result.time_per_minibatch_ms, data_parallel_ms,
                                topology.num_devices, sum(s.replicas for s in stages), result.stages)
    if result.replay is not None:
        pipeline["replay"] = result.replay
    if unconstrained is not None:
        pipeline["unconstrained"] = unconstrained_summary(chain, result, unconstrained)
    inputs: dict[str, Any] = {
        "cost_model": options.cost_model,
        "schedule": options.schedule,
        "num_microbatches": options.num_microbatches,
        "batch_size": options.batch_size,
        "topology": topology.to_json(),
        "memory_bytes_per_device": options.memory_bytes_per_device,
        "straight": options.straight,
        "use_fewer_devices": options.use_fewer_devices,
        "num_stages": options.num_stages,
    }
    if options.precision != "fp32" or options.recompute:  # plans of fp32 runs stay as they were
        inputs["precision"] = options.precision
        inputs["recompute"] = options.recompute
    if options.split_backward:  # plans without it stay as they were; `pd report` reads it
        inputs["split_backward"] = True
    if options.merges_weight_grads:
        inputs["merge_weight_grads"] = True
    if options.vertical_sync:  # the same
        inputs["vertical_sync"] = True
    if options.boundaries is not None:
        inputs["boundaries"] = list(options.boundaries)
    if options.split_points:
        inputs["split_points"] = [str(point) for point in options.split_points]
    if options.replicas is not None:
        inputs["replicas"] = list(options.replicas)
    if steer.cuts:
        inputs["fixed_cuts"] = list(steer.cuts)
    if options.profile_sha256:
        inputs["profile_sha256"] = options.profile_sha256
    inputs.update(search_space_inputs(chain))
    warnings = replica_warnings(topology, result) if steer.replicas is not None else []
    return Plan(inputs=inputs, stages=tuple(stages), pipeline=pipeline, warnings=tuple(warnings))

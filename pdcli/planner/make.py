"""`plan_chain`: run the search for a chain and a cluster, and write down the plan."""

from __future__ import annotations

import dataclasses
from typing import Any

from pdcli.errors import UserError
from pdcli.planner.evaluate import ACTIONS_KEY, PlanEval, batch_scale, evaluate_pd, evaluate_pipedream
from pdcli.planner.options import COST_PIPEDREAM, PlanOptions
from pdcli.planner.pipedream import pipedream_data_parallel_s, pipedream_search
from pdcli.planner.plan import Plan, Stage
from pdcli.planner.search import pd_search
from pdcli.planner.space import SplitSpace
from pdcli.planner.topology import Topology
from pdcli.profiler.chain import Chain

MS_PER_S = 1000.0


def _check_request(chain: Chain, topology: Topology, options: PlanOptions) -> None:
    n, devices = len(chain.nodes), topology.num_devices
    if n == 0:
        raise UserError("the profile has no positions to plan")
    if devices < 1:
        raise UserError(f"the cluster has {devices} devices; a plan needs at least 1")
    k = options.num_stages
    if k is not None and k > n:
        raise UserError(f"cannot split a chain of {n} positions into {k} stages ({k} > {n})")
    if k is not None and k > devices:
        raise UserError(f"{k} stages need at least {k} devices, the cluster has {devices}")
    if k is not None and options.cost_model == COST_PIPEDREAM:
        raise UserError("plan.num_stages needs cost_model=pd (PipeDream's optimizer has no stage count)")
    if options.boundaries is not None:
        _check_boundaries(options.boundaries, n, devices, options)
    elif options.replicas is not None:
        raise UserError("plan.replicas needs plan.boundaries (the stages they replicate)",
                        hint="set plan.boundaries too, e.g. plan.boundaries=[9] plan.replicas=[2,1]")


def _check_boundaries(boundaries: tuple[int, ...], n: int, devices: int, options: PlanOptions) -> None:
    if options.cost_model == COST_PIPEDREAM:
        raise UserError("plan.boundaries needs cost_model=pd")
    if list(boundaries) != sorted(set(boundaries)) or any(not 0 < b < n for b in boundaries):
        raise UserError(
            f"plan.boundaries: {list(boundaries)} must be strictly increasing positions in 1..{n - 1} "
            f"(where stages 1.. start; `pd profile` lists the positions)"
        )
    replicas = stage_replicas(options)
    if len(replicas) != len(boundaries) + 1:
        raise UserError(f"plan.replicas: {len(replicas)} entries for {len(boundaries) + 1} stages",
                        hint="give one replica count per stage")
    if any(r < 1 or options.num_microbatches % r for r in replicas):
        raise UserError(f"plan.replicas: {list(replicas)}: each must be >= 1 and divide "
                        f"schedule.num_microbatches={options.num_microbatches} (microbatches are spread evenly)")
    if sum(replicas) > devices:
        raise UserError(f"plan.boundaries: {len(boundaries) + 1} stages on {sum(replicas)} devices, the cluster has {devices}")
    if options.num_stages is not None and options.num_stages != len(boundaries) + 1:
        raise UserError(f"plan.boundaries gives {len(boundaries) + 1} stages but plan.num_stages is {options.num_stages}")


def stage_replicas(options: PlanOptions) -> tuple[int, ...]:
    """Replicas of each stage of a fixed split (`plan.replicas`, else one each)."""
    assert options.boundaries is not None
    return options.replicas if options.replicas is not None else (1,) * (len(options.boundaries) + 1)


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


REFINE_SHIFTS = (-2, -1, 1, 2)
"""Positions a boundary of the search's plan is moved by when the replay refines it."""


def refine_by_replay(space: SplitSpace, topology: Topology, options: PlanOptions, scale: float,
                     found: PlanEval) -> PlanEval:
    """The search ranks plans by their bottleneck stage; the replay of the action lists also
    sees the waits that messages in flight cause. Among the search's plan and the plans with
    one boundary moved by REFINE_SHIFTS (same replicas), the fastest replay that fits memory."""
    partition = [(st.start, st.end, st.replicas) for st in found.stages]
    valid = space.valid_stages()
    limit = options.memory_bytes_per_device
    best = found
    for k in range(1, len(partition)):
        for shift in REFINE_SHIFTS:
            cut = partition[k][0] + shift
            before, after = partition[k - 1], partition[k]
            if not before[0] < cut < after[1] or not (valid[before[0], cut] and valid[cut, after[1]]):
                continue
            moved = [*partition[: k - 1], (before[0], cut, before[2]), (cut, after[1], after[2]), *partition[k + 1:]]
            candidate = evaluate_pd(space, topology, options, scale, moved)
            if limit is not None and any(st.memory.total_bytes > limit for st in candidate.stages):
                continue
            if candidate.time_per_minibatch_ms < best.time_per_minibatch_ms:
                best = candidate
    return best


def plan_chain(chain: Chain, topology: Topology, options: PlanOptions) -> Plan:
    """The best plan for `chain` on `topology` under `options` (UserError if none fits)."""
    _check_request(chain, topology, options)
    space = SplitSpace.from_chain(chain)
    scale = batch_scale(chain.meta, options)
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
        data_parallel_ms = pipedream_data_parallel_s(space, topology, scale) * MS_PER_S
    elif options.boundaries is not None:
        edges = [0, *options.boundaries, space.num_positions]
        result = evaluate_pd(space, topology, options, scale,
                             [(a, b, r) for a, b, r in zip(edges, edges[1:], stage_replicas(options))])
        whole = evaluate_pd(space, topology, options, scale, [(0, space.num_positions, devices)])
        data_parallel_ms = whole.time_per_minibatch_ms
    else:
        found_pd = pd_search(space, topology, options, scale)
        if found_pd is None:
            raise _infeasible(space, topology, options, scale)
        result = evaluate_pd(space, topology, options, scale,
                             [(s.start, s.end, s.replicas) for s in found_pd.stages])
        if space.runtime is not None:
            result = refine_by_replay(space, topology, options, scale, result)
        whole = evaluate_pd(space, topology, options, scale, [(0, space.num_positions, devices)])
        data_parallel_ms = whole.time_per_minibatch_ms
    return _assemble(chain, space, topology, options, result, data_parallel_ms)


def _assemble(chain: Chain, space: SplitSpace, topology: Topology, options: PlanOptions,
              result: PlanEval, data_parallel_ms: float) -> Plan:
    stages = []
    for k, st in enumerate(result.stages):
        predicted: dict[str, Any] = dict(st.terms)
        predicted.update(dataclasses.asdict(st.memory))
        if st.actions_ms is not None:
            predicted[ACTIONS_KEY] = dict(st.actions_ms)
        stages.append(Stage(
            stage_id=k, start=st.start, end=st.end,
            first_node=chain.nodes[st.start].name, last_node=chain.nodes[st.end - 1].name,
            node_names=tuple(space.stage_members(st.start, st.end)),
            replicas=st.replicas, ranks=st.ranks, predicted=predicted,
        ))
    time_ms = result.time_per_minibatch_ms
    times = [s.terms["stage_time_ms"] for s in result.stages]
    pipeline: dict[str, Any] = {
        "time_per_minibatch_ms": time_ms,
        "throughput_samples_per_s": options.batch_size * MS_PER_S / time_ms if time_ms > 0 else 0.0,
        "data_parallel_time_per_minibatch_ms": data_parallel_ms,
        "speedup_over_data_parallel": data_parallel_ms / time_ms if time_ms > 0 else 1.0,
        "num_devices": topology.num_devices,
        "num_devices_used": sum(s.replicas for s in stages),
        "bottleneck_stage": times.index(max(times)),
    }
    if result.replay is not None:
        pipeline["replay"] = result.replay
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
    if options.boundaries is not None:
        inputs["boundaries"] = list(options.boundaries)
    if options.replicas is not None:
        inputs["replicas"] = list(options.replicas)
    if options.profile_sha256:
        inputs["profile_sha256"] = options.profile_sha256
    return Plan(inputs=inputs, stages=tuple(stages), pipeline=pipeline)

"""Plans for virtual stages (`interleaved`, `loopedbfs`, `zbv`): S devices, S x V chunks.

The partition: the `pd` search for S x V straight stages on S x V devices of the cluster's
innermost bandwidth, priced as the schedule's one-chunk relative (`STAND_INS`: the same
flush and the same order of a chunk's microbatches); each stage is a chunk, placed on its
device by the schedule (`ScheduleSpec.stage_of_chunk`). The prediction: the schedule's real
action lists replayed by the simulator with each chunk's costs (a message between two chunks
of one device costs no transfer), on the profile's measured runtime costs when it has them; on
a cluster of several levels a chunk's messages cross the link between its device and its
neighbour chunk's (`chunk_links`), which the search's partition is climbed against.
A device's memory is the sum of its chunks' weights and optimizer state plus its activations
at their peak: the lowered list of one minibatch walked, each chunk's microbatch held from its
Forward to its Backward (to its WeightGrads with a split backward).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from pdcli.errors import UserError
from pdcli.planner.evaluate import (
    REPLAY_MIN_MINIBATCHES, PlanEval, StageEval, StageLinks, batch_scale, climb, data_parallel_eval, evaluate_pd, pipeline_summary, plan_options_of,
    replay_shown, stage_predicted,
)
from pdcli.planner.options import PlanOptions
from pdcli.planner.plan import Plan, Stage
from pdcli.planner.search import pd_search, runtime_of
from pdcli.planner.space import SplitSpace, search_space_inputs
from pdcli.planner.topology import Topology
from pdcli.profiler.chain import Chain
from pdcli.schedule import ScheduleSpec, build_for
from pdcli.schedule.actions import Backward, Forward, WeightGrads
from pdcli.schedule.simulator import Simulation, StageCost, simulate
from pdcli.schedule.spec import GPIPE, INTERLEAVED, LOOPED_BFS, ONE_F_ONE_B, ZBV

STAND_INS = {INTERLEAVED: ONE_F_ONE_B, ZBV: ONE_F_ONE_B, LOOPED_BFS: GPIPE}
"""The one-chunk schedule whose stage costs price a chunked schedule's chunks in the search."""


def device_spec(options: PlanOptions, num_devices: int, steps: int) -> ScheduleSpec:
    """The schedule of a plan on `num_devices` devices."""
    return ScheduleSpec.make(options.schedule, num_devices, options.num_microbatches, steps,
                             split_backward=options.split_backward, virtual_stages=options.virtual_stages,
                             merge_weight_grads=options.merges_weight_grads)


def chunk_costs(chunks: Sequence[StageEval], num_microbatches: int) -> list[StageCost]:
    """The simulator's cost of each chunk: its measured per-action costs, else its terms per microbatch."""
    out = []
    for st in chunks:
        if st.actions_ms is not None:
            a = st.actions_ms
            out.append(StageCost(**{**a, "load_ms": a.get("load_ms", 0.0) / num_microbatches}))
        else:
            t = st.terms
            out.append(StageCost(fwd_ms=t["fwd_ms"] / num_microbatches, bwd_ms=t["bwd_ms"] / num_microbatches,
                                 wgrad_ms=t.get("wgrad_ms", 0.0) / num_microbatches,  # comm_out: both ways
                                 comm_ms=t["comm_out_ms"] / (2 * num_microbatches), optimizer_ms=t["optimizer_ms"]))
    return out


def device_activation_bytes(spec: ScheduleSpec, device: int, per_microbatch_bytes: Sequence[float]) -> float:
    """The peak of what `device` holds for backwards over one minibatch of its lowered list."""
    held, peak = 0.0, 0.0
    releases = WeightGrads if spec.split_backward else Backward
    for action in build_for(dataclasses.replace(spec, num_steps=1, eval_after=(), num_eval_microbatches=0), device,
                            eager_sends=True):
        chunk = getattr(action, "chunk", None)
        if isinstance(action, Forward) and chunk is not None:
            held += per_microbatch_bytes[chunk]
        elif isinstance(action, releases) and chunk is not None:
            held -= per_microbatch_bytes[chunk]
        peak = max(peak, held)
    return peak


def chunk_links(topology: Topology, spec: ScheduleSpec) -> StageLinks | None:
    """The links between the chunks of `spec` on `topology` (None on one level: every pair of
    devices is joined at the innermost bandwidth, which `chunk_pricing`'s topology gives): two
    chunks on one device at the innermost bandwidth, on two devices at the slowest level between
    them (a V placement's chunk on device 0 hands to device 1 over the slow link both ways)."""
    if len(topology.levels) == 1:
        return None
    num_chunks = spec.num_stages * spec.virtual_stages
    devices = [spec.stage_of_chunk(c) for c in range(num_chunks)]
    between = topology.span_bandwidth_matrix(spec.num_stages)
    inner = topology.levels[0].bandwidth_bytes_per_s
    bandwidth = np.array([[inner if a == b else between[a, b] for b in devices] for a in devices], dtype=float)
    return StageLinks(bandwidth, topology)


def chunk_pricing(topology: Topology, options: PlanOptions, num_chunks: int) -> tuple[Topology, PlanOptions]:
    """How the chunks of a chunked schedule are priced: as `num_chunks` straight stages on as many
    devices of the cluster's innermost bandwidth, under the schedule's one-chunk stand-in."""
    chunk_topology = Topology.flat(num_chunks, topology.levels[0].bandwidth_bytes_per_s)
    stand_in = dataclasses.replace(options, schedule=STAND_INS[options.schedule], num_stages=num_chunks, straight=True,
                                   memory_bytes_per_device=None, use_fewer_devices=False, virtual_stages=1,
                                   merge_weight_grads=options.merges_weight_grads)  # the schedule's, not the stand-in's
    return chunk_topology, stand_in


def replay_chunked_plan(chain: Chain, plan: dict[str, Any]) -> Simulation:
    """A chunked plan.json's schedule replayed with its chunks priced by `chain` (its runtime
    costs), as `plan_virtual` priced them: the same chunks, another profile or cost model."""
    inputs = plan["inputs"]
    options = dataclasses.replace(plan_options_of(plan), virtual_stages=int(inputs["virtual_stages"]))
    space = SplitSpace.from_chain(chain)
    devices = len({int(r) for s in plan["stages"] for r in s["ranks"]})
    topology = Topology.from_levels(inputs["topology"]["levels"])
    chunk_topology, stand_in = chunk_pricing(topology, options, len(plan["stages"]))
    cuts = [(int(s["start"]), int(s["end"]), 1) for s in plan["stages"]]
    spec = device_spec(options, devices, max(REPLAY_MIN_MINIBATCHES, 2 * devices + 2))
    links = chunk_links(topology, spec)
    priced = evaluate_pd(space, chunk_topology, stand_in, batch_scale(chain.meta, options), cuts, replay=False,
                         links=links)
    runtime = runtime_of(space, chunk_topology if links is None else topology)
    return simulate(spec, chunk_costs(priced.stages, options.num_microbatches),
                    cores=runtime.cores if runtime is not None else None)


def refine_by_replay(space: SplitSpace, partition: list[tuple[int, int, int]],
                     replayed: Callable[[Sequence[tuple[int, int, int]]], tuple[PlanEval, Simulation]],
                     best: tuple[PlanEval, Simulation]) -> tuple[PlanEval, Simulation]:
    """The search's chunks climbed (`climb`) to the fastest replay (the search prices each
    chunk as a stage of its own; a device runs several in turn)."""
    return climb(space, partition, replayed, lambda found: found[1].time_per_minibatch_ms, best)


def plan_virtual(chain: Chain, topology: Topology, options: PlanOptions, space: SplitSpace | None = None) -> Plan:
    """The plan of a chunked schedule (module docstring); UserError when it cannot be made."""
    space = SplitSpace.from_chain(chain) if space is None else space
    devices = options.num_stages or topology.num_devices
    v, m = options.virtual_stages, options.num_microbatches
    num_chunks = devices * v
    if devices > topology.num_devices:
        raise UserError(f"plan.num_stages={devices} devices, but the cluster has {topology.num_devices}")
    if space.num_positions < num_chunks:
        raise UserError(f"the profile has {space.num_positions} positions, fewer than the {devices} x {v} = "
                        f"{num_chunks} chunks of schedule.virtual_stages={v} on {devices} devices",
                        hint="use fewer devices (plan.num_stages) or fewer schedule.virtual_stages")
    if options.replicas is not None or options.split_points or options.cost_model != "pd":
        raise UserError(f"schedule.name={options.schedule} plans one device per pipeline position with the pd cost "
                        "model; plan.replicas, plan.split_points and plan.cost_model=pipedream do not apply")
    scale = batch_scale(chain.meta, options)
    chunk_topology, stand_in = chunk_pricing(topology, options, num_chunks)
    if options.boundaries is not None:
        if len(options.boundaries) != num_chunks - 1:
            raise UserError(f"plan.boundaries: {len(options.boundaries)} cuts, but {num_chunks} chunks need "
                            f"{num_chunks - 1}")
        cuts = [0, *options.boundaries, space.num_positions]
        partition = [(a, b, 1) for a, b in zip(cuts, cuts[1:])]
    else:
        found = pd_search(space, chunk_topology, stand_in, scale)
        if found is None:
            raise UserError(f"no partition of the profile into {num_chunks} chunks")
        partition = [(s.start, s.end, 1) for s in found.stages]
    spec = device_spec(options, devices, max(REPLAY_MIN_MINIBATCHES, 2 * devices + 2))
    links = chunk_links(topology, spec)
    runtime = runtime_of(space, chunk_topology if links is None else topology)
    cores = runtime.cores if runtime is not None else None

    def replayed(cuts: Sequence[tuple[int, int, int]]) -> tuple[PlanEval, Simulation]:
        priced = evaluate_pd(space, chunk_topology, stand_in, scale, cuts, replay=False, links=links)
        return priced, simulate(spec, chunk_costs(priced.stages, m), cores=cores)

    chunks, sim = replayed(partition)
    if options.boundaries is None and options.refine:  # the search ranks chunks alone; the replay sees turns
        chunks, sim = refine_by_replay(space, partition, replayed, (chunks, sim))
    held = space.activations(options.precision, scale).held
    per_microbatch = [float(held[st.start, st.end]) / m for st in chunks.stages]
    device_rows = []
    for d in range(devices):
        mine = [chunks.stages[c] for c in spec.chunks_of(d)]
        fixed = sum(st.memory.weights_bytes + st.memory.optimizer_state_bytes for st in mine)
        activations = device_activation_bytes(spec, d, per_microbatch)
        device_rows.append({"rank": d, "chunks": list(spec.chunks_of(d)), "total_bytes": fixed + activations,
                            "activations_bytes": activations,
                            "compute_ms": sum(st.terms["compute_ms"] for st in mine)})
    limit = options.memory_bytes_per_device
    over = [row for row in device_rows if limit is not None and row["total_bytes"] > limit]
    if over:
        worst = max(over, key=lambda row: row["total_bytes"])
        raise UserError(f"no plan fits in {limit:.4g} bytes per device (schedule={options.schedule}, "
                        f"{devices} devices x {v} chunks): device {worst['rank']} needs {worst['total_bytes']:.4g}",
                        hint="raise cluster.memory_bytes_per_device, add devices, or use fewer microbatches")
    whole = data_parallel_eval(space, topology, stand_in, scale)
    slowdown = runtime.slowdown(devices) if runtime is not None else 1.0
    cpu_scale = runtime.cpu_sharing(devices) if runtime is not None else 1.0
    return _assemble(chain, space, topology, options, spec, chunks, sim.time_per_minibatch_ms * slowdown,
                     whole.time_per_minibatch_ms, device_rows, replay_shown(cores, slowdown, sim, cpu_scale))


def _assemble(chain: Chain, space: SplitSpace, topology: Topology, options: PlanOptions, spec: ScheduleSpec,
              chunks: PlanEval, time_ms: float, data_parallel_ms: float, device_rows: list[dict[str, Any]],
              replay: dict[str, Any]) -> Plan:
    stages = []
    for k, st in enumerate(chunks.stages):
        predicted = stage_predicted(st)
        stages.append(Stage(stage_id=k, start=st.start, end=st.end, first_node=chain.nodes[st.start].name,
                            last_node=chain.nodes[st.end - 1].name, node_names=tuple(space.stage_members(st.start, st.end)),
                            replicas=1, ranks=(spec.stage_of_chunk(k),), predicted=predicted))
    pipeline = pipeline_summary(options.batch_size, time_ms, data_parallel_ms, topology.num_devices, spec.num_stages,
                                chunks.stages)
    pipeline.update(replay=replay, devices=device_rows)
    inputs: dict[str, Any] = {
        "cost_model": options.cost_model, "schedule": options.schedule, "num_microbatches": options.num_microbatches,
        "batch_size": options.batch_size, "topology": topology.to_json(),
        "memory_bytes_per_device": options.memory_bytes_per_device, "straight": True,
        "use_fewer_devices": options.use_fewer_devices, "num_stages": options.num_stages,
        "virtual_stages": options.virtual_stages,
    }
    if options.split_backward:
        inputs["split_backward"] = True
    if options.merges_weight_grads:
        inputs["merge_weight_grads"] = True
    if options.boundaries is not None:
        inputs["boundaries"] = list(options.boundaries)
    if options.profile_sha256:
        inputs["profile_sha256"] = options.profile_sha256
    inputs.update(search_space_inputs(chain))
    return Plan(inputs=inputs, stages=tuple(stages), pipeline=pipeline)

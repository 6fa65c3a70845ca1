"""Per-stage memory of each schedule: weights, optimizer state, stashed weights and activations.

For a stage with parameters P bytes, optimizer state S bytes (momentum buffers, Adam's
two moments, as `pd profile` measured them), activations A bytes per minibatch (what its
backward keeps), r replicas, `devices_from` devices from this stage to the end of the pipeline,
`stages_from` stages from this stage to the end, `num_stages` stages in all, and M
microbatches per minibatch:

- weights = 2 P (weights + gradients), optimizer state = S (the live weights' only: a
  stashed version is never stepped);
- stashed weights = (versions - 1) P, versions = ceil(devices_from / r) for `pipedream`
  (one per in-flight minibatch, as PipeDream counts them), 2 for `2bw`, 1 otherwise;
- activations = sets x A / M (one set per microbatch held), sets = ceil(devices_from / r)
  for `pipedream` (one per in-flight microbatch; each microbatch is a PipeDream minibatch
  of its own), min(stages_from, M) for `1f1b` and `2bw`, M for `gpipe`;
- with a split backward (`schedule.split_backward`, gpipe and 1f1b) a microbatch is held
  until its WeightGrads, which trail its Backward by up to `num_stages` microbatches
  (at most min(stages_from + num_stages, M) sets for `1f1b`, the runtime's declared
  `ScheduleSpec.stash_depth`; still M for `gpipe`). A microbatch past its Backward keeps only the Linear layers'
  inputs and output gradients (`pdcli.torchutil.wgrad`), counted as A / M (an upper bound):
  not the half-width weight copy of mixed precision (the Backward's input gradient used
  it), but under recompute all of them, not only its stage input.
- total = weights + S + stashed + activations for `pipedream` and `2bw`, whose gradients
  live while their activation sets are held. A flush schedule (`gpipe`, `1f1b`) holds its
  gradients only from its first Backward (split: WeightGrads) to its OptimizerStep, while
  its activations rise and fall: its peaks (activations alone, and activations with the
  gradients P) are taken over the stage's own action list (`held_points`). `num_stages` is
  the whole pipeline's, which a suffix of the search does not know
  (`pdcli.planner.search` runs once per stage count).

A is what the runtime counts (`pdcli.runtime.memory`): the stage's inputs plus every
tensor autograd saves, each storage once, measured for any stage by `pdcli.profiler.held`
(`SplitSpace.activations`); profiles without that measurement (PipeDream's graph.txt,
older profiles) give the sum of what each position saves alone. Two options every
schedule has change the activation term (`train.precision`, `train.recompute`):

- mixed precision (`bf16`, `fp16`): autocast saves half-width copies of what its matmuls
  and convolutions keep, and each forward casts the weights afresh and its backward keeps
  the half-width copy of each weight whose input needs a gradient: measured by the
  profile's bf16 pass (A and `copy_bytes` C per forward), otherwise A is scaled by
  `HALF_PRECISION_ACTIVATION_FACTOR` (0.5) and C = P / 2. Weights, gradients and
  optimizer state stay fp32.
- recomputation: a held microbatch keeps only its stage inputs (I bytes per minibatch,
  the cut into the stage), and the backward re-runs one microbatch's forward, so
  activations = sets x I / M + A / M (+ C under mixed precision).

Every function works elementwise on numpy arrays (the search) and on floats (reports).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcli.schedule import Backward, Forward, OptimizerStep, ScheduleSpec, WeightGrads, build_for
from pdcli.schedule.spec import rules, stand_in, vertical_sync_versions

HALF_PRECISION_ACTIVATION_FACTOR = 0.5
"""Saved activations (and the weight copy) under bf16/fp16 autocast, relative to fp32."""


@dataclass(frozen=True)
class StageMemory:
    weights_bytes: Any
    stashed_weights_bytes: Any
    activations_bytes: Any
    total_bytes: Any
    optimizer_state_bytes: Any = 0.0


@dataclass(frozen=True)
class VerticalSync:
    """A pipedream run with vertical sync: what a stage's weight versions depend on beyond
    the stage itself (`pdcli.schedule.spec.vertical_sync_versions`)."""

    devices: int
    """Devices of the run (the search: the most it plans for, an upper bound)."""
    first_replicas: tuple[int, ...]
    """Stage 0's replicas; several (the search, before stage 0 is chosen): the most any of them pins."""


def weight_versions(schedule: str, devices_from: Any, replicas: Any, vertical_sync: VerticalSync | None = None) -> Any:
    """Weight versions one replica of a stage holds (live + stashed), as `ScheduleSpec.stash_depth`."""
    buffers = rules(schedule).weight_buffers
    if buffers is not None:
        return np.full(np.shape(devices_from), buffers)
    if vertical_sync is not None:
        return _synced_versions(vertical_sync, devices_from, replicas)
    return _in_flight(devices_from, replicas)  # one per microbatch in flight


def _in_flight(devices_from: Any, replicas: Any) -> Any:
    """Microbatches one replica has in flight in 1F1B order: the devices from its stage to the
    end over its replicas, rounded up (`ScheduleSpec.num_in_flight`)."""
    return -(-np.asarray(devices_from) // np.asarray(replicas))


def _synced_versions(sync: VerticalSync, devices_from: Any, replicas: Any) -> np.ndarray:
    d, r = np.broadcast_arrays(np.asarray(devices_from, dtype=int), np.asarray(replicas, dtype=int))
    pairs, index = np.unique(np.stack([d.ravel(), r.ravel()], axis=1), axis=0, return_inverse=True)
    values = []
    for dev_from, reps in pairs.tolist():
        if not 1 <= reps <= dev_from <= sync.devices:  # cells no plan on these devices uses
            values.append(_in_flight(dev_from, max(reps, 1)))
        elif dev_from == sync.devices:
            values.append(vertical_sync_versions(sync.devices, reps, dev_from, reps))
        else:
            firsts = [r0 for r0 in sync.first_replicas if r0 <= sync.devices - dev_from] or [1]
            values.append(max(vertical_sync_versions(sync.devices, r0, dev_from, reps) for r0 in firsts))
    return np.asarray(values, dtype=float)[np.ravel(index)].reshape(d.shape)


def memory_key(schedule: str, devices_from: int, replicas: int,
               vertical_sync: VerticalSync | None = None) -> tuple[Any, ...]:
    """What of (devices_from, replicas) `stage_memory` reads, for one pair: two pairs with the
    same key give every stage the same memory (the search computes it once per key). Nothing
    for a flush schedule (one weight version; its activations come from its action list, which
    depends on the stages, not the devices); the in-flight microbatches ceil(devices_from /
    replicas) for pipedream and 2bw (versions and sets), with the replicas' share of the
    microbatches where the sets read it; the pair itself under vertical sync."""
    r = rules(schedule)
    if vertical_sync is not None and r.weight_buffers is None:
        return (devices_from, replicas, vertical_sync)
    if r.flush and r.weight_buffers is not None:
        return ()
    in_flight = int(_in_flight(devices_from, replicas))
    return (in_flight,) if r.in_flight == "devices" else (in_flight, replicas)


def split_counts_alike_from(num_microbatches: int) -> int:
    """The stage count K0 from which a 1f1b stage with a split backward holds the same points
    (`held_points`) in a pipeline of any count K >= K0, given the stages from it: the WeightGrads
    lag is K (`ScheduleSpec.weight_grad_lag`), and a stage never queues more than the M
    microbatches of a minibatch, so from K = M on the lag forces no W out; the rest of its list
    depends on the stages after it (1F1B's warmup) and on the RecvGrads it waits at. Checked
    against `held_points` by tests/test_planner_memory_speed.py."""
    return max(1, num_microbatches)


def activation_sets(schedule: str, devices_from: Any, replicas: Any, num_microbatches: int) -> Any:
    """How many microbatch activation sets one replica of a stage holds at its peak, as
    `ScheduleSpec.stash_depth` (without a split backward; the flush schedules' peaks, split
    or not, come from their action lists: `timeline_peaks`)."""
    devices_first = _in_flight(devices_from, replicas)
    share = num_microbatches // np.asarray(replicas)
    in_flight = rules(schedule).in_flight
    if in_flight == "devices":
        return devices_first
    return np.broadcast_to(share, np.shape(devices_first)) if in_flight == "all" else np.minimum(devices_first, share)


@functools.lru_cache(maxsize=4096)
def held_points(schedule: str, num_stages: int, num_microbatches: int, stage_id: int,
                split_backward: bool, eager_sends: bool | None = None,
                merge_weight_grads: bool = False) -> tuple[tuple[int, int, int, int], ...]:
    """(microbatches past Forward before their Backward, past Backward before their
    WeightGrads, 1 while a Backward runs, 1 while the stage holds weight gradients) at each
    point of `stage_id`'s action list of a flush schedule, in the runtime's send order
    (`build_for`'s `eager_sends`; None: either), the points another one covers dropped: the
    peak of any costs of the four kinds is at one of them.

    As the runtime notes its memory (`pdcli.runtime.executor`): a Backward's point still
    holds its microbatch and the gradients it made; gradients live from the first Backward
    (with a split backward, the first WeightGrads: the Linear layers' weights are most of a
    stage's) to the OptimizerStep. `merge_weight_grads`: the WeightGrads run merged per chunk,
    where the lowering puts them (`ScheduleSpec.merge_weight_grads`)."""
    spec = ScheduleSpec.make(stand_in(schedule), num_stages, num_microbatches, 1, split_backward=split_backward,
                             merge_weight_grads=merge_weight_grads)
    seen: set[tuple[int, int, int, int]] = set()
    for eager in (False, True) if eager_sends is None else (eager_sends,):
        before, waiting, grads = 0, 0, 0
        for action in build_for(spec, stage_id, eager_sends=eager):
            if isinstance(action, Forward):
                before += 1
            elif isinstance(action, Backward):
                grads = max(grads, 0 if split_backward else 1)
                seen.add((before, waiting, 1, grads))
                before, waiting = before - 1, waiting + (1 if split_backward else 0)
            elif isinstance(action, WeightGrads):
                grads = 1
                seen.add((before, waiting, 0, grads))
                waiting -= 1
            elif isinstance(action, OptimizerStep):
                grads = 0
            seen.add((before, waiting, 0, grads))
    points = [p for p in seen if not any(q != p and all(x >= y for x, y in zip(q, p)) for q in seen)]
    # a point between two others on a line is never the only peak (the cost is linear)
    return tuple(sorted(p for p in points if not any(_between(p, q, s) for q in points for s in points if q < s)))


def _between(p: tuple[int, ...], q: tuple[int, ...], s: tuple[int, ...]) -> bool:
    """True if p lies strictly inside the segment from q to s."""
    d, e = [b - a for a, b in zip(q, s)], [b - a for a, b in zip(q, p)]
    dot, norm = sum(x * y for x, y in zip(d, e)), sum(x * x for x in d)
    collinear = all(x * e[j] == y * d[j] for x, y in zip(d, e) for j in range(len(d)))
    return p not in (q, s) and collinear and 0 < dot < norm


def _point_counts(schedule: str, num_stages: int, num_microbatches: int, stages_from: Any,
                  split_backward: bool, eager_sends: bool | None = None,
                  merge_weight_grads: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(counts[v, k] = the k-th `held_points` of the v-th distinct stages_from value, padded
    with zeros; index of each stages_from element into v). A `stages_from` past `num_stages`
    (search cells no plan uses) counts as the first stage."""
    stages_from = np.asarray(stages_from)
    values, index = np.unique(stages_from, return_inverse=True)
    tables = [held_points(schedule, num_stages, num_microbatches, max(0, num_stages - int(v)), split_backward,
                          eager_sends, merge_weight_grads) for v in values]
    counts = np.zeros((len(values), max(len(t) for t in tables), 4))
    for row, table in enumerate(tables):
        counts[row, : len(table)] = table
    return counts, index.reshape(stages_from.shape)


def split_sets(schedule: str, num_stages: int, num_microbatches: int, stages_from: Any) -> Any:
    """Most microbatches a split-backward stage holds at once, either kind (on its action list)."""
    counts, index = _point_counts(schedule, num_stages, num_microbatches, stages_from, True)
    return (counts[:, :, 0] + counts[:, :, 1]).max(axis=1)[index]


def timeline_peaks(schedule: str, num_stages: int, num_microbatches: int, stages_from: Any,
                   split_backward: bool, held: Any, saved: Any, running: Any, grads: Any,
                   eager_sends: bool | None = None, static: Any = 0.0,
                   merge_weight_grads: bool = False) -> tuple[Any, Any]:
    """(peak activation bytes, `static` + peak activation + gradient bytes) of a
    flush-schedule stage: `held` per microbatch before its Backward, `saved` per microbatch
    waiting for its WeightGrads, `running` more while a Backward runs (a recomputed
    forward), `grads` while gradients live, counted on the schedule itself (`held_points`);
    `static`: what the stage holds throughout (weights, optimizer state, stashes).

    A stage's points depend on `stages_from` alone and repeat from stage to stage (a 1f1b
    stage holds min(stages from it, microbatches)), so the peaks are taken once per kind of
    points over the four costs' own shape and each element picks its kind's: the search's
    (stages, start, end) arrays are written once, not once per point and term."""
    held, saved, running, grads, static = (np.asarray(c, dtype=float) for c in (held, saved, running, grads, static))
    counts, index = _point_counts(schedule, num_stages, num_microbatches, stages_from, split_backward, eager_sends,
                                  merge_weight_grads)
    kinds, kind_of = np.unique(counts.reshape(len(counts), -1), axis=0, return_inverse=True)
    acts, dynamic = [], []
    for kind in kinds:
        peak, peak_with_grads = np.zeros(()), np.zeros(())
        for count in kind.reshape(-1, 4):
            value = count[0] * held + count[1] * saved + count[2] * running
            peak = np.maximum(peak, value)
            peak_with_grads = np.maximum(peak_with_grads, value + count[3] * grads)
        acts.append(peak)
        dynamic.append(static + peak_with_grads)
    pick = np.reshape(kind_of, -1)[index]
    acts_out, dynamic_out = _pick(pick, acts), _pick(pick, dynamic)
    return (acts_out, dynamic_out) if np.shape(acts_out) else (float(acts_out), float(dynamic_out))


def _pick(pick: np.ndarray, choices: list[np.ndarray]) -> np.ndarray:
    """choices[pick] elementwise, broadcast, in a fresh array. When `pick` varies only along
    leading axes and the choices only along the others (the search: stages x (start, end)),
    whole choices are copied into place."""
    shape = np.broadcast_shapes(pick.shape, *(np.shape(c) for c in choices))
    lead = np.reshape(pick, (1,) * (len(shape) - pick.ndim) + pick.shape)
    trail = np.broadcast_shapes(*((1,) * (len(shape) - np.ndim(c)) + np.shape(c) for c in choices))
    split = next((axis for axis, size in enumerate(trail) if size > 1), len(shape))
    out = np.empty(shape)
    if all(size == 1 for size in lead.shape[split:]):
        rows = out.reshape((-1,) + shape[split:])
        kinds = np.broadcast_to(lead, shape[:split] + lead.shape[split:]).ravel()
        for kind, choice in enumerate(choices):
            padded = (1,) * (len(shape) - np.ndim(choice)) + np.shape(choice)
            rows[kinds == kind] = np.reshape(choice, padded[split:])
        return out
    for kind, choice in enumerate(choices):
        np.copyto(out, choice, where=pick == kind)
    return out


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """What the run's settings say about every stage's memory."""

    schedule: str
    num_microbatches: int
    precision: str = "fp32"
    recompute: bool = False
    split_backward: bool = False
    eager_sends: bool | None = None
    """The runtime's send order (`SplitSpace.eager_sends`); None: the larger peak of either."""
    vertical_sync: VerticalSync | None = None
    """pipedream with vertical sync: its weight versions depend on stage 0's."""
    merge_weight_grads: bool = False
    """A split backward's WeightGrads wait for their chunk's last Backward and run merged."""


@dataclass(frozen=True, kw_only=True)
class StageBytes:
    """A stage's measured sizes (bytes; numbers, or arrays over the search's candidate stages)."""

    parameters: Any
    activations: Any
    """Saved for the backward, per minibatch."""
    optimizer_state: Any = 0.0
    inputs: Any = 0.0
    """The stage's input, per minibatch (what recompute keeps instead of `activations`)."""
    copies: Any = None
    """The half-width weight copies one forward keeps (`pdcli.profiler.held`), per minibatch.
    With it `activations` and `inputs` are measured at the run's precision; without it they are
    fp32 and the precision applies the factor rules above."""
    waiting: Any = None
    """What a split backward keeps from a Backward to its WeightGrads, per minibatch, when measured."""


def stage_memory(settings: MemorySettings, sizes: StageBytes, *, replicas: Any, devices_from: Any, stages_from: Any,
                 num_stages: Any = None) -> StageMemory:
    """A stage's memory under `settings`, of `replicas` with `devices_from` devices and
    `stages_from` stages from it to the last; `num_stages`: the pipeline's (needed by a flush
    schedule with a split backward)."""
    schedule, num_microbatches = settings.schedule, settings.num_microbatches
    params = np.asarray(sizes.parameters, dtype=float)
    weights = 2.0 * params
    state = np.asarray(sizes.optimizer_state, dtype=float)
    versions = weight_versions(schedule, devices_from, replicas, settings.vertical_sync)
    stashed = (versions - 1) * params
    saved = np.asarray(sizes.activations, dtype=float) / num_microbatches
    if sizes.copies is not None:
        per_microbatch = saved + np.asarray(sizes.copies, dtype=float)
    elif settings.precision != "fp32":  # half-width saved tensors, plus the half-width weight copy
        saved = HALF_PRECISION_ACTIVATION_FACTOR * saved
        per_microbatch = saved + HALF_PRECISION_ACTIVATION_FACTOR * params
    else:
        per_microbatch = saved
    recompute, split_backward = settings.recompute, settings.split_backward
    held = np.asarray(sizes.inputs, dtype=float) / num_microbatches if recompute else per_microbatch
    if rules(schedule).flush:
        if num_stages is None:
            if split_backward:
                raise ValueError(f"{schedule} with split_backward: stage_memory needs num_stages")
            num_stages = int(np.max(stages_from))  # without a split, stages_from is all a list depends on
        # the microbatch its Backward recomputes (its input is already held)
        running = np.maximum(per_microbatch - held, 0.0) if recompute else 0.0
        if split_backward and sizes.waiting is not None:
            saved = np.asarray(sizes.waiting, dtype=float) / num_microbatches
        activations, total = timeline_peaks(schedule, int(num_stages), num_microbatches, stages_from, split_backward,
                                            held, saved if split_backward else 0.0, running, params, settings.eager_sends,
                                            params + state + stashed, settings.merge_weight_grads)
        return StageMemory(weights, stashed, activations, total, state)
    sets = activation_sets(schedule, devices_from, replicas, num_microbatches)
    activations = sets * held + (np.maximum(per_microbatch - held, 0.0) if recompute else 0.0)
    return StageMemory(weights, stashed, activations, weights + state + stashed + activations, state)

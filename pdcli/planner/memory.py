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
  inputs and output gradients (`pdcli.runtime.wgrad`), counted as A / M (an upper bound):
  not the half-width weight copy of mixed precision (the Backward's input gradient used
  it), but under recompute all of them, not only its stage input. Since the two kinds of
  held microbatch cost differently, the peak is taken over the stage's own action list
  (`split_held_counts`). `num_stages` is the whole pipeline's, which a suffix of the
  search does not know (`pdcli.planner.search` runs once per stage count).

Two options every schedule has change the activation term (`train.precision`,
`train.recompute`):

- mixed precision (`bf16`, `fp16`): autocast saves half-width copies of what its matmuls
  and convolutions keep, so A is scaled by `HALF_PRECISION_ACTIVATION_FACTOR` (0.5; the
  profile measures fp32); and each forward casts the weights afresh and its backward keeps
  that half-width copy, so every held microbatch also holds P / 2 (measured:
  `benchmarks/bench_memory.py --set train.precision=bf16`). Weights, gradients and
  optimizer state stay fp32.
- recomputation: a held microbatch keeps only its stage inputs (I bytes per minibatch,
  the cut into the stage), and the backward re-runs one microbatch's forward, so
  activations = sets x I / M + A / M (+ P / 2 under mixed precision).

Every function works elementwise on numpy arrays (the search) and on floats (reports).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcli.planner.options import GPIPE, ONE_F_ONE_B, PIPEDREAM, TWO_BW
from pdcli.runtime.schedule import Backward, Forward, ScheduleSpec, WeightGrads, build_for

HALF_PRECISION_ACTIVATION_FACTOR = 0.5
"""Saved activations (and the weight copy) under bf16/fp16 autocast, relative to fp32."""


@dataclass(frozen=True)
class StageMemory:
    weights_bytes: Any
    stashed_weights_bytes: Any
    activations_bytes: Any
    total_bytes: Any
    optimizer_state_bytes: Any = 0.0


def weight_versions(schedule: str, devices_from: Any, replicas: Any) -> Any:
    if schedule == PIPEDREAM:
        return -(-np.asarray(devices_from) // np.asarray(replicas))  # ceil division
    return np.full(np.shape(devices_from), 2 if schedule == TWO_BW else 1)


def activation_sets(schedule: str, devices_from: Any, replicas: Any, stages_from: Any,
                    num_microbatches: int) -> Any:
    """How many microbatch activation sets a stage holds at its peak (without a split
    backward; with one, `split_sets`)."""
    if schedule == PIPEDREAM:
        return weight_versions(schedule, devices_from, replicas)
    if schedule == GPIPE:
        return np.full(np.shape(stages_from), num_microbatches)
    return np.minimum(stages_from, num_microbatches)


@functools.lru_cache(maxsize=4096)
def split_held_counts(schedule: str, num_stages: int, num_microbatches: int,
                      stage_id: int) -> tuple[tuple[int, int, int], ...]:
    """(microbatches past Forward before their Backward, past Backward before their
    WeightGrads, 1 while a Backward runs) at each point of `stage_id`'s split-backward
    list, in either send order (`sends_first`), the triples another one covers dropped:
    the peak of any costs of the three kinds is at one of them."""
    spec = ScheduleSpec.make(schedule, num_stages, num_microbatches, 1, split_backward=True)
    seen: set[tuple[int, int, int]] = set()
    for eager_sends in (False, True):
        before, waiting = 0, 0
        for action in build_for(spec, stage_id, eager_sends=eager_sends):
            if isinstance(action, Forward):
                before += 1
            elif isinstance(action, Backward):
                seen.add((before, waiting, 1))
                before, waiting = before - 1, waiting + 1
            elif isinstance(action, WeightGrads):
                waiting -= 1
            seen.add((before, waiting, 0))
    points = [p for p in seen if not any(q != p and all(x >= y for x, y in zip(q, p)) for q in seen)]
    # a point between two others on a line is never the only peak (the cost is linear)
    return tuple(sorted(p for p in points if not any(_between(p, q, s) for q in points for s in points if q < s)))


def _between(p: tuple[int, ...], q: tuple[int, ...], s: tuple[int, ...]) -> bool:
    """True if p lies strictly inside the segment from q to s."""
    d, e = [b - a for a, b in zip(q, s)], [b - a for a, b in zip(q, p)]
    dot, norm = sum(x * y for x, y in zip(d, e)), sum(x * x for x in d)
    collinear = all(x * e[j] == y * d[j] for x, y in zip(d, e) for j in range(len(d)))
    return p not in (q, s) and collinear and 0 < dot < norm


def _split_counts(schedule: str, num_stages: int, num_microbatches: int,
                  stages_from: Any) -> tuple[np.ndarray, np.ndarray]:
    """(counts[v, k] = the k-th `split_held_counts` triple of the v-th distinct stages_from
    value, padded with zeros; index of each stages_from element into v). A `stages_from`
    past `num_stages` (search cells no plan uses) counts as the first stage."""
    stages_from = np.asarray(stages_from)
    values, index = np.unique(stages_from, return_inverse=True)
    tables = [split_held_counts(schedule, num_stages, num_microbatches, max(0, num_stages - int(v))) for v in values]
    counts = np.zeros((len(values), max(len(t) for t in tables), 3))
    for row, table in enumerate(tables):
        counts[row, : len(table)] = table
    return counts, index.reshape(stages_from.shape)


def split_sets(schedule: str, num_stages: int, num_microbatches: int, stages_from: Any) -> Any:
    """Most microbatches a split-backward stage holds at once, either kind (on its action list)."""
    counts, index = _split_counts(schedule, num_stages, num_microbatches, stages_from)
    return (counts[:, :, 0] + counts[:, :, 1]).max(axis=1)[index]


def split_peak(schedule: str, num_stages: int, num_microbatches: int, stages_from: Any,
               held: Any, saved: Any, running: Any) -> Any:
    """Peak activation bytes of a split-backward stage: `held` per microbatch before its
    Backward, `saved` per microbatch waiting for its WeightGrads, `running` more while a
    Backward runs (a recomputed forward), counted on the schedule itself (`split_held_counts`)."""
    held, saved, running = (np.asarray(c, dtype=float) for c in (held, saved, running))
    counts, index = _split_counts(schedule, num_stages, num_microbatches, stages_from)
    shape = np.broadcast_shapes(index.shape, held.shape, saved.shape, running.shape)
    # the search's arrays are large and a fresh one costs its page faults: one fresh
    # array (the result), the two temporaries reused from call to call
    value, term = _scratch(shape)
    peak = np.zeros(shape)
    recomputes = bool(np.any(running))
    for k in range(counts.shape[1]):
        np.multiply(counts[index, k, 0], held, out=value)
        np.add(value, np.multiply(counts[index, k, 1], saved, out=term), out=value)
        if recomputes:
            np.add(value, np.multiply(counts[index, k, 2], running, out=term), out=value)
        np.maximum(peak, value, out=peak)
    return peak if np.shape(peak) else float(peak)


@functools.lru_cache(maxsize=1)
def _scratch(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    return np.empty(shape), np.empty(shape)


def stage_memory(schedule: str, parameter_bytes: Any, activation_bytes: Any, replicas: Any,
                 devices_from: Any, stages_from: Any, num_microbatches: int,
                 optimizer_state_bytes: Any = 0.0, precision: str = "fp32",
                 recompute: bool = False, input_bytes: Any = 0.0, split_backward: bool = False,
                 num_stages: Any = None) -> StageMemory:
    weights = 2.0 * np.asarray(parameter_bytes, dtype=float)
    state = np.asarray(optimizer_state_bytes, dtype=float)
    versions = weight_versions(schedule, devices_from, replicas)
    stashed = (versions - 1) * np.asarray(parameter_bytes, dtype=float)
    sets = activation_sets(schedule, devices_from, replicas, stages_from, num_microbatches)
    saved = np.asarray(activation_bytes, dtype=float) / num_microbatches
    per_microbatch = saved
    if precision != "fp32":  # half-width saved tensors, plus the half-width weight copy
        saved = HALF_PRECISION_ACTIVATION_FACTOR * saved
        per_microbatch = saved + HALF_PRECISION_ACTIVATION_FACTOR * np.asarray(parameter_bytes, dtype=float)
    held = np.asarray(input_bytes, dtype=float) / num_microbatches if recompute else per_microbatch
    if split_backward and schedule in (GPIPE, ONE_F_ONE_B):
        if num_stages is None:
            raise ValueError(f"{schedule} with split_backward: stage_memory needs num_stages")
        if recompute or precision != "fp32":  # the two kinds of held microbatch cost differently
            running = per_microbatch if recompute else 0.0  # the microbatch its Backward recomputes
            activations = split_peak(schedule, int(num_stages), num_microbatches, stages_from, held, saved, running)
        else:
            activations = split_sets(schedule, int(num_stages), num_microbatches, stages_from) * held
    else:
        activations = sets * held + (per_microbatch if recompute else 0.0)
    return StageMemory(weights, stashed, activations, weights + state + stashed + activations, state)

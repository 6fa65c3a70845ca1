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
  until its WeightGrads, which trail its Backward by up to `num_stages` microbatches:
  sets = min(stages_from + num_stages, M) for `1f1b` (`ScheduleSpec.stash_depth`), still M
  for `gpipe`. A whole set is an upper bound: after the Backward only the Linear layers'
  inputs and output gradients stay (`pdcli.runtime.wgrad`). `num_stages` is the whole
  pipeline's, which a suffix of the search does not know (`pdcli.planner.search` runs once
  per stage count).

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

from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcli.planner.options import GPIPE, ONE_F_ONE_B, PIPEDREAM, TWO_BW

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
                    num_microbatches: int, split_backward: bool = False, num_stages: Any = None) -> Any:
    """How many microbatch activation sets a stage holds at its peak (`num_stages`, the
    pipeline's stage count, is needed by 1f1b with `split_backward`)."""
    if schedule == PIPEDREAM:
        return weight_versions(schedule, devices_from, replicas)
    if schedule == GPIPE:
        return np.full(np.shape(stages_from), num_microbatches)
    if split_backward and schedule == ONE_F_ONE_B:
        if num_stages is None:
            raise ValueError("1f1b with split_backward: activation_sets needs num_stages")
        return np.minimum(np.asarray(stages_from) + np.asarray(num_stages), num_microbatches)
    return np.minimum(stages_from, num_microbatches)


def stage_memory(schedule: str, parameter_bytes: Any, activation_bytes: Any, replicas: Any,
                 devices_from: Any, stages_from: Any, num_microbatches: int,
                 optimizer_state_bytes: Any = 0.0, precision: str = "fp32",
                 recompute: bool = False, input_bytes: Any = 0.0, split_backward: bool = False,
                 num_stages: Any = None) -> StageMemory:
    weights = 2.0 * np.asarray(parameter_bytes, dtype=float)
    state = np.asarray(optimizer_state_bytes, dtype=float)
    versions = weight_versions(schedule, devices_from, replicas)
    stashed = (versions - 1) * np.asarray(parameter_bytes, dtype=float)
    sets = activation_sets(schedule, devices_from, replicas, stages_from, num_microbatches, split_backward, num_stages)
    per_microbatch = np.asarray(activation_bytes, dtype=float) / num_microbatches
    if precision != "fp32":  # half-width saved tensors, plus the half-width weight copy
        per_microbatch = HALF_PRECISION_ACTIVATION_FACTOR * (per_microbatch + np.asarray(parameter_bytes, dtype=float))
    if recompute:
        activations = sets * np.asarray(input_bytes, dtype=float) / num_microbatches + per_microbatch
    else:
        activations = sets * per_microbatch
    return StageMemory(weights, stashed, activations, weights + state + stashed + activations, state)

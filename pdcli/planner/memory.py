"""Per-stage memory of each schedule: weights, optimizer state, stashed weights and activations.

For a stage with parameters P bytes, optimizer state S bytes (momentum buffers, Adam's
two moments, as `pd profile` measured them), activations A bytes per minibatch (what its
backward keeps), r replicas, `devices_from` devices from this stage to the end of the pipeline,
`stages_from` stages from this stage to the end, and M microbatches per minibatch:

- weights = 2 P (weights + gradients), optimizer state = S (the live weights' only: a
  stashed version is never stepped);
- stashed weights = (versions - 1) P, versions = ceil(devices_from / r) for `pipedream`
  (one per in-flight minibatch, as PipeDream counts them), 2 for `2bw`, 1 otherwise;
- activations = sets x A / M (one set per microbatch held), sets = ceil(devices_from / r)
  for `pipedream` (one per in-flight microbatch; each microbatch is a PipeDream minibatch
  of its own), min(stages_from, M) for `1f1b` and `2bw`, M for `gpipe`.

Every function works elementwise on numpy arrays (the search) and on floats (reports).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcli.planner.options import GPIPE, PIPEDREAM, TWO_BW


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
    """How many microbatch activation sets a stage holds at its peak."""
    if schedule == PIPEDREAM:
        return weight_versions(schedule, devices_from, replicas)
    if schedule == GPIPE:
        return np.full(np.shape(stages_from), num_microbatches)
    return np.minimum(stages_from, num_microbatches)


def stage_memory(schedule: str, parameter_bytes: Any, activation_bytes: Any, replicas: Any,
                 devices_from: Any, stages_from: Any, num_microbatches: int,
                 optimizer_state_bytes: Any = 0.0) -> StageMemory:
    weights = 2.0 * np.asarray(parameter_bytes, dtype=float)
    state = np.asarray(optimizer_state_bytes, dtype=float)
    versions = weight_versions(schedule, devices_from, replicas)
    stashed = (versions - 1) * np.asarray(parameter_bytes, dtype=float)
    sets = activation_sets(schedule, devices_from, replicas, stages_from, num_microbatches)
    activations = sets * np.asarray(activation_bytes, dtype=float) / num_microbatches
    return StageMemory(weights, stashed, activations, weights + state + stashed + activations, state)

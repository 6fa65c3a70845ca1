"""Measured memory of one stage, per category, to set beside the planner's prediction.

On CUDA `peak_bytes` is `torch.cuda.max_memory_allocated` (everything the caching allocator
handed out). On CPU there is no allocator counter, so the executor accounts for the
tensors training keeps alive:

- `weights_bytes`: parameters + the peak of their gradients (the planner's `2 P`);
- `optimizer_state_bytes`: the optimizer's state tensors at the end (momentum, Adam moments;
  not in the planner's model);
- `stashed_weights_bytes`: the peak over time of weight versions held besides the live one;
- `activations_bytes`: the peak over time of what the microbatches between their Forward and
  Backward keep: their inputs plus every tensor autograd saves for backward (counted with
  `torch.autograd.graph.saved_tensors_hooks`, once per data pointer, weights excluded),
  released when the microbatch's Backward ends (with a split backward, what its
  WeightGrads needs, the Linear layers' inputs and output gradients, until that ends);
- `peak_bytes` (CPU) = parameters + optimizer state + the peak over time of gradients +
  stashed versions + activations. Temporaries inside one forward/backward (intermediate
  gradients, message buffers) are not counted.

Cost: one Python call per saved tensor and a few integer sums per action.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

CUDA_SOURCE = "torch.cuda.max_memory_allocated"
CPU_SOURCE = "cpu tensor accounting"


def storage_key(t: Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of `t`'s own elements: a tensor saved twice (or a weight's
    transposed view) counts once; a microbatch's slice of a larger batch counts its slice."""
    return t.data_ptr(), t.numel() * t.element_size()


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class MemoryTracker:
    """Live activation bytes per microbatch and the peaks of the dynamic categories."""

    def __init__(self, param_bytes: int) -> None:
        self.param_bytes = param_bytes
        self.held: dict[int, dict[int, int]] = {}
        """microbatch -> {storage data pointer: bytes} it keeps until its Backward."""
        self.activations_bytes = 0
        self.peak_activations_bytes = 0
        self.grads_bytes = 0
        self.peak_grads_bytes = 0
        self.peak_dynamic_bytes = 0

    def _add(self, microbatch_id: int, t: Tensor, exclude: set[int]) -> None:
        try:
            ptr, nbytes = storage_key(t)
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return
        held = self.held.setdefault(microbatch_id, {})
        if ptr in exclude or ptr in held or nbytes == 0:
            return
        held[ptr] = nbytes
        self.activations_bytes += nbytes

    @contextlib.contextmanager
    def saving(self, microbatch_id: int, inputs: Iterable[Tensor], weights: Iterable[Tensor]) -> Iterator[None]:
        """Count `inputs` and every tensor autograd saves inside the block for `microbatch_id`
        (storages of `weights` excluded: they are counted as weights)."""
        exclude = {storage_key(w)[0] for w in weights}
        for t in inputs:
            self._add(microbatch_id, t, exclude)

        def pack(t: Tensor) -> Tensor:
            self._add(microbatch_id, t, exclude)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.peak_activations_bytes = max(self.peak_activations_bytes, self.activations_bytes)

    def hold(self, microbatch_id: int, tensors: Iterable[Tensor], weights: Iterable[Tensor]) -> None:
        """Count `tensors` as held for `microbatch_id` until `released` (storages of `weights` excluded)."""
        exclude = {storage_key(w)[0] for w in weights}
        for t in tensors:
            self._add(microbatch_id, t, exclude)
        self.peak_activations_bytes = max(self.peak_activations_bytes, self.activations_bytes)

    def released(self, microbatch_id: int) -> None:
        """The microbatch's Backward is done: its inputs and saved tensors are gone."""
        self.activations_bytes -= sum(self.held.pop(microbatch_id, {}).values())

    def note(self, grads_bytes: int, stashed_bytes: int) -> None:
        """Record the current gradient and stash sizes; update the peaks."""
        self.grads_bytes = grads_bytes
        self.peak_grads_bytes = max(self.peak_grads_bytes, grads_bytes)
        self.peak_activations_bytes = max(self.peak_activations_bytes, self.activations_bytes)
        dynamic = grads_bytes + stashed_bytes + self.activations_bytes
        self.peak_dynamic_bytes = max(self.peak_dynamic_bytes, dynamic)

    def report(self, optimizer: torch.optim.Optimizer, peak_stashed_bytes: int, device: torch.device) -> dict[str, Any]:
        """The measured fields (bytes) for summary.json; CUDA's peak is the allocator's."""
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
        optimizer_bytes = tensor_bytes(state)
        out: dict[str, Any] = {
            "weights_bytes": self.param_bytes + self.peak_grads_bytes,
            "optimizer_state_bytes": optimizer_bytes,
            "stashed_weights_bytes": peak_stashed_bytes,
            "activations_bytes": self.peak_activations_bytes,
            "peak_bytes": self.param_bytes + optimizer_bytes + self.peak_dynamic_bytes,
            "source": CPU_SOURCE,
        }
        if device.type == "cuda" and torch.cuda.is_available():
            out["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
            out["source"] = CUDA_SOURCE
        return out

"""A minibatch of inputs and target, and its split into microbatches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class Batch:
    """The model's positional inputs and the loss target; dim 0 of every tensor is the sample.

    `==` is identity (tensors have no single truth value); compare contents with `equal`.
    """

    inputs: tuple[Tensor, ...]
    target: Tensor

    def __post_init__(self) -> None:
        sizes = [t.size(0) for t in (*self.inputs, self.target)]
        if len(set(sizes)) != 1:
            raise ValueError(f"batch tensors disagree on the number of samples (dim 0): {sizes}")

    @property
    def num_samples(self) -> int:
        """Samples in this batch (dim 0)."""
        return int(self.target.size(0))

    def split(self, num_microbatches: int) -> list[Batch]:
        """`num_microbatches` equal chunks along dim 0 (the pipeline needs equal shapes)."""
        if num_microbatches < 1 or self.num_samples % num_microbatches:
            raise ValueError(
                f"cannot split a batch of {self.num_samples} samples into "
                f"{num_microbatches} equal microbatches"
            )
        chunks = [torch.chunk(t, num_microbatches) for t in (*self.inputs, self.target)]
        return [
            Batch(inputs=tuple(c[i] for c in chunks[:-1]), target=chunks[-1][i])
            for i in range(num_microbatches)
        ]

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every tensor on `device`."""
        return Batch(inputs=tuple(t.to(device) for t in self.inputs), target=self.target.to(device))

    def equal(self, other: Batch) -> bool:
        """Same number of inputs and bit-identical tensors."""
        return len(self.inputs) == len(other.inputs) and all(
            torch.equal(a, b) for a, b in zip((*self.inputs, self.target), (*other.inputs, other.target))
        )

"""Batch sources: minibatch `index` is a pure function of (seed, index).

Every pipeline stage process builds the same stream on its own, and a resumed run
continues at any position, without sharing state. A finite set is read as a stream of
epochs, each in its own seeded permutation; a synthetic set draws each batch from a
generator seeded by (seed, stream, index).

Held-out splits (`split="eval"` of `pdcli.data.build_data`): a synthetic set's held-out
batches come from their own stream (`EVAL_STREAM`) of the same seed (same class patterns,
other samples); a finite set's held-out examples are read in a fixed order, unshuffled.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Protocol

import numpy as np
import torch
from torch import Tensor

from pdcli.data.batch import Batch

# Domain separators, so the streams drawn from one seed are independent.
ORDER_STREAM = 0
BATCH_STREAM = 1
FIXED_STREAM = 2
EVAL_STREAM = 3


def rng_for(seed: int, stream: int, *index: int) -> np.random.Generator:
    """A numpy generator for (seed, stream, index...); stable across torch versions."""
    return np.random.default_rng([seed, stream, *index])


class BatchSource(Protocol):
    """What the trainer and profiler read minibatches from."""

    batch_size: int
    num_examples: int | None

    def batch(self, index: int, with_inputs: bool = True) -> Batch:
        """Minibatch `index`; `with_inputs=False` may leave `inputs` empty (a last stage
        needs only the target), never changes the target."""
        ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class Examples:
    """A finite data set: `take(rows)` gathers the examples at `rows` (int64) into a Batch."""

    num_examples: int
    take: Callable[[Tensor], Batch]
    description: str


def in_memory(inputs: tuple[Tensor, ...], target: Tensor, description: str) -> Examples:
    """A finite set of tensors held in memory; dim 0 indexes examples."""

    def take(rows: Tensor) -> Batch:
        return Batch(inputs=tuple(t[rows] for t in inputs), target=target[rows])

    return Examples(num_examples=int(target.size(0)), take=take, description=description)


def subset(examples: Examples, rows: Tensor, what: str) -> Examples:
    """The examples at `rows` (int64) of `examples`, renumbered 0 .. len(rows) - 1."""

    def take(picked: Tensor) -> Batch:
        return examples.take(rows[picked])

    return Examples(num_examples=int(rows.numel()), take=take, description=f"{examples.description}, {what}")


MakeBatch = Callable[[int, int, int, int], Batch]
"""make_batch(seed, index, batch_size, stream) -> Batch, a pure function of its arguments
(stream: BATCH_STREAM for training, EVAL_STREAM for the held-out split)."""
MakeTarget = Callable[[int, int, int, int], Tensor]
"""make_target(seed, index, batch_size, stream) -> make_batch(...).target, without making the inputs."""


@dataclass(frozen=True)
class Synthetic:
    """An infinite synthetic set: batches are generated, not stored."""

    make_batch: MakeBatch
    description: str
    make_target: MakeTarget | None = None
    """Where the inputs cost more than the target to draw (images: the noise)."""


class ExampleSource:
    """Minibatches over a finite set, epoch after epoch, each epoch a seeded permutation."""

    def __init__(self, examples: Examples, batch_size: int, seed: int, shuffle: bool = True) -> None:
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        """False: every epoch reads the examples in their order (a held-out split)."""
        self.num_examples: int | None = examples.num_examples
        self._permutation = lru_cache(maxsize=4)(self._make_permutation)

    def _make_permutation(self, epoch: int) -> Tensor:
        assert self.num_examples is not None
        if not self.shuffle:
            return torch.arange(self.num_examples)
        return torch.from_numpy(rng_for(self.seed, ORDER_STREAM, epoch).permutation(self.num_examples))

    def batch(self, index: int, with_inputs: bool = True) -> Batch:
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        assert self.num_examples is not None
        positions = torch.arange(index * self.batch_size, (index + 1) * self.batch_size)
        epochs = positions // self.num_examples
        offsets = positions % self.num_examples
        rows = torch.empty_like(positions)
        for epoch in torch.unique(epochs).tolist():
            in_epoch = epochs == epoch
            rows[in_epoch] = self._permutation(epoch)[offsets[in_epoch]]
        return self.examples.take(rows)

    def describe(self) -> str:
        order = f"reshuffled each epoch (seed {self.seed})" if self.shuffle else "in order"
        return f"{self.examples.description}; {self.num_examples} examples, batch {self.batch_size}, {order}"


class SyntheticSource:
    """Minibatches of an infinite synthetic set."""

    def __init__(self, synthetic: Synthetic, batch_size: int, seed: int, stream: int = BATCH_STREAM) -> None:
        self.synthetic = synthetic
        self.batch_size = batch_size
        self.seed = seed
        self.stream = stream
        self.num_examples: int | None = None

    def batch(self, index: int, with_inputs: bool = True) -> Batch:
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        if not with_inputs and self.synthetic.make_target is not None:
            return Batch(inputs=(), target=self.synthetic.make_target(self.seed, index, self.batch_size, self.stream))
        return self.synthetic.make_batch(self.seed, index, self.batch_size, self.stream)

    def describe(self) -> str:
        split = " (held-out stream)" if self.stream == EVAL_STREAM else ""
        return f"{self.synthetic.description}; infinite stream{split}, batch {self.batch_size} (seed {self.seed})"

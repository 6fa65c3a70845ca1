"""The data set registry: `data.name` + `data.kwargs` -> a BatchSource of its training or
held-out split.

Every data set has a held-out split: a synthetic set draws it from its own stream; `digits`
evaluates on its `test` split when it trains on `train`; `tensor_file`/`token_file` read
`data.eval_path` (a file of the same kind) when it is set; any other finite set holds out
`data.eval_fraction` of its examples, fixed rows that training then never reads.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable

import torch

from pdcli.config.schema import Config, DataConfig
from pdcli.data.digits import digits
from pdcli.data.files import tensor_file, token_file
from pdcli.data.source import (
    EVAL_STREAM, BatchSource, Examples, ExampleSource, Synthetic, SyntheticSource, rng_for, subset,
)
from pdcli.data.synthetic import synthetic_images, synthetic_seq2seq, synthetic_tokens
from pdcli.errors import UserError
from pdcli.models.factory import check_kwarg_types, check_kwargs, lookup

DATASETS: dict[str, Callable[..., Examples | Synthetic]] = {
    "synthetic_images": synthetic_images,
    "synthetic_tokens": synthetic_tokens,
    "synthetic_seq2seq": synthetic_seq2seq,
    "digits": digits,
    "tensor_file": tensor_file,
    "token_file": token_file,
}
SPLITS = ("train", "eval")
FILE_SETS = ("tensor_file", "token_file")
HOLDOUT_SEED = 4817
"""Seed of the held-out rows of a finite set; independent of `data.seed`, so they never move."""
SYNTHETIC_EVAL_BATCHES = 8
"""Held-out minibatches per evaluation of an infinite (synthetic) set when `train.eval_batches` is null."""


def list_datasets() -> list[tuple[str, str]]:
    """(name, one-line description) of every data set, in registry order."""
    return [(name, (inspect.getdoc(f) or "").splitlines()[0]) for name, f in DATASETS.items()]


def _own_held_out_kwargs(cfg: DataConfig) -> dict[str, object] | None:
    """The factory kwargs that build the held-out split itself, or None (hold out a fraction)."""
    if cfg.eval_path is not None:
        if cfg.name not in FILE_SETS:
            raise UserError(f"data.eval_path: {cfg.name} has no held-out file to read; only "
                            f"{' and '.join(FILE_SETS)} take one", hint="set data.eval_path=null")
        if cfg.name == "tensor_file":  # the held-out file holds {inputs, target} itself
            return {**cfg.kwargs, "path": cfg.eval_path, "target_path": None}
        return {**cfg.kwargs, "path": cfg.eval_path}
    if cfg.name == "digits" and cfg.kwargs.get("split", "train") == "train":
        return {**cfg.kwargs, "split": "test"}
    return None


def held_out_rows(num_examples: int, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, held-out rows) of a finite set: round(fraction x n) fixed rows held out."""
    order = torch.from_numpy(rng_for(HOLDOUT_SEED, 0).permutation(num_examples))
    num_held_out = int(round(fraction * num_examples))
    return order[num_held_out:].sort().values, order[:num_held_out].sort().values


def build_data(cfg: DataConfig, batch_size: int, split: str = "train") -> BatchSource:
    """The minibatch stream of `split` (`train`, or `eval`: the held-out split) that `cfg`
    describes, in batches of `batch_size` samples.

    `batch_size` is passed apart from `cfg.batch_size` so that a caller (the profiler)
    can read microbatches of the same stream.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    factory = lookup(DATASETS, cfg.name, "data.name", "data set")
    check_kwargs(factory, cfg.kwargs, "data.kwargs", cfg.name)
    check_kwarg_types(factory, cfg.kwargs, "data.kwargs")
    if batch_size < 1:
        raise UserError(f"data.batch_size: must be > 0, got {batch_size}")
    if cfg.seed < 0:
        raise UserError(f"data.seed: must be >= 0, got {cfg.seed}")

    def make(kwargs: dict[str, object]) -> Examples | Synthetic:
        try:
            return factory(**kwargs)
        except ValueError as exc:  # the factories raise ValueError for bad sizes
            raise UserError(f"data.kwargs: {exc}") from exc

    made = make(cfg.kwargs)
    if isinstance(made, Synthetic):
        return SyntheticSource(made, batch_size, cfg.seed, EVAL_STREAM) if split == "eval" \
            else SyntheticSource(made, batch_size, cfg.seed)
    own = _own_held_out_kwargs(cfg)
    if own is not None:
        if split == "train":
            return ExampleSource(made, batch_size, cfg.seed)
        held_out = make(own)
        assert isinstance(held_out, Examples)
        return ExampleSource(held_out, batch_size, cfg.seed, shuffle=False)
    train_rows, eval_rows = held_out_rows(made.num_examples, cfg.eval_fraction)
    what = f"data.eval_fraction={cfg.eval_fraction:g} held out"
    if split == "train":
        return ExampleSource(subset(made, train_rows, f"training rows ({what})"), batch_size, cfg.seed)
    return ExampleSource(subset(made, eval_rows, f"held-out rows ({what})"), batch_size, cfg.seed, shuffle=False)


def num_eval_batches(source: BatchSource, requested: int | None) -> int:
    """Minibatches of the held-out `source` one evaluation reads: `requested` (train.eval_batches),
    or every full minibatch of a finite split (the rest is left out: all microbatches have one
    shape), SYNTHETIC_EVAL_BATCHES of an infinite one."""
    if requested is not None:
        return requested
    if source.num_examples is None:
        return SYNTHETIC_EVAL_BATCHES
    return source.num_examples // source.batch_size


def steps_for_epochs(source: BatchSource, epochs: float) -> int:
    """Minibatches in `epochs` passes over the finite training `source` (the last one may be partial)."""
    if source.num_examples is None:
        raise UserError("train.epochs: the data set is an infinite synthetic stream and has no epochs",
                        hint="set train.steps instead (and train.epochs=null)")
    return max(1, math.ceil(epochs * source.num_examples / source.batch_size))


def resolve_steps(cfg: Config) -> None:
    """`train.epochs`, when set, replaces `train.steps` by the minibatches of that many passes
    over the training split (every process of a run resolves it the same way)."""
    if cfg.train.epochs is not None:
        cfg.train.steps = steps_for_epochs(build_data(cfg.data, cfg.data.batch_size), cfg.train.epochs)

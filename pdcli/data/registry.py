"""The data set registry: `data.name` + `data.kwargs` -> a BatchSource."""

from __future__ import annotations

import inspect
from typing import Callable

from pdcli.config.schema import DataConfig
from pdcli.data.digits import digits
from pdcli.data.files import tensor_file, token_file
from pdcli.data.source import BatchSource, Examples, ExampleSource, Synthetic, SyntheticSource
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


def list_datasets() -> list[tuple[str, str]]:
    """(name, one-line description) of every data set, in registry order."""
    return [(name, (inspect.getdoc(f) or "").splitlines()[0]) for name, f in DATASETS.items()]


def build_data(cfg: DataConfig, batch_size: int) -> BatchSource:
    """The minibatch stream `cfg` describes, in batches of `batch_size` samples.

    `batch_size` is passed apart from `cfg.batch_size` so that a caller (the profiler)
    can read microbatches of the same stream.
    """
    factory = lookup(DATASETS, cfg.name, "data.name", "data set")
    check_kwargs(factory, cfg.kwargs, "data.kwargs", cfg.name)
    check_kwarg_types(factory, cfg.kwargs, "data.kwargs")
    if batch_size < 1:
        raise UserError(f"data.batch_size: must be > 0, got {batch_size}")
    if cfg.seed < 0:
        raise UserError(f"data.seed: must be >= 0, got {cfg.seed}")
    try:
        made = factory(**cfg.kwargs)
    except ValueError as exc:  # the factories raise ValueError for bad sizes
        raise UserError(f"data.kwargs: {exc}") from exc
    if isinstance(made, Synthetic):
        return SyntheticSource(made, batch_size, cfg.seed)
    return ExampleSource(made, batch_size, cfg.seed)

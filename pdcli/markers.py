"""`pipe_split()`: a call in a model's forward that marks a pipeline stage boundary."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

_recorders: list[Callable[[], None]] = []


def pipe_split() -> None:
    """Cut the pipeline here: the layers the forward runs after this call start a new stage.

    A no-op when the model runs normally (training, evaluation, the compiled stages). While
    `pd profile` and `pd compile` trace the model, each call becomes a fixed boundary of the
    plan (`pdcli.profiler.trace.trace_model`), as torch.distributed.pipelining's does."""
    if _recorders:
        _recorders[-1]()


@contextmanager
def recording_pipe_splits(record: Callable[[], None]) -> Iterator[None]:
    """Call `record()` for every `pipe_split()` the model runs inside the block."""
    _recorders.append(record)
    try:
        yield
    finally:
        _recorders.pop()

"""Torch's intra-op thread count, set for a block."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """Run the block with `num_threads` intra-op threads (None: leave torch's setting)."""
    before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)

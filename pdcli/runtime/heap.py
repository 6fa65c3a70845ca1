"""The worker's Python heap during the training loop.

Python's cyclic garbage collector walks every tracked object of the process in a full
(generation 2) collection, and runs one whenever enough new objects have survived. A worker
holds hundreds of thousands of them before its first action (torch's modules, the stage's
modules and their compiled code, the action lists), so a full collection stops that worker,
and the pipeline behind it, for a time that grows with all of that rather than with what the
loop allocates. `freeze_setup` moves what the setup built out of the collector's reach
(`gc.freeze`): the loop's collections walk only what the loop made.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


def freeze_setup() -> int:
    """Collect what the setup left behind, then freeze every surviving object (it stays alive
    and is never walked again); how many are frozen. Call once, right before the training loop."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextmanager
def heap_frozen() -> Iterator[None]:
    """What the process holds when the block starts frozen out of the collector for the block
    (one full collection first): inside it, a collection (`collector_paused`) walks only what
    the block made. Unfrozen after it, so what the block's caller held can be collected again."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside the block (a short timed loop in a process whose heap is
    not frozen: a full collection there would land in one action's time); one collection
    before it, and automatic collection back on after."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()

"""glibc's allocator as pd's workers run it, and as `pd profile` measures them.

glibc's default trims freed memory and unmaps freed blocks above its mmap threshold, so every
microbatch page-faults its weight copies, gradients and activations in again. pd keeps freed
blocks of up to 32 MiB in the heap instead, in the workers and while profiling (a step timed under
the default pays page faults the workers never pay: a bf16 step's fresh fp32 gradients most of all).
"""

from __future__ import annotations

import ctypes
import os

# glibc mallopt parameters
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum
TRIM_THRESHOLD_BYTES = 1 << 30

ALLOCATOR_ENV = "PD_TUNE_ALLOCATOR"  # "0" leaves glibc's defaults (to measure what this buys)


def tune_allocator() -> bool:
    """Stop glibc from returning freed tensor memory to the kernel; False where it cannot."""
    if os.environ.get(ALLOCATOR_ENV) == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
        )
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return False

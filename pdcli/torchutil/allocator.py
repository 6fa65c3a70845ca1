"""glibc's allocator as pd's workers run it, and as `pd profile` measures them.

glibc's default trims freed memory and unmaps freed blocks above its mmap threshold, so every
microbatch page-faults its weight copies, gradients and activations in again. pd keeps freed
blocks of up to 32 MiB in the heap instead, in the workers and while profiling (a step timed under
the default pays page faults the workers never pay: a bf16 step's fresh fp32 gradients most of all).

Where the kernel gives transparent huge pages on request (THP mode `madvise`), pd's processes
also run glibc's heap on them (`glibc.malloc.hugetlb=1` in `GLIBC_TUNABLES`). The loader reads it,
so it is set for a new process: in the workers' environment, and for the `pd` command, which starts
itself again under it. On 4 KiB pages, where a process's tensors land in physical memory can move
its compute from one process to the next.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

# glibc mallopt parameters
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum
TRIM_THRESHOLD_BYTES = 1 << 30

ALLOCATOR_ENV = "PD_TUNE_ALLOCATOR"  # "0" leaves glibc's defaults (to measure what this buys)
TUNABLES_ENV = "GLIBC_TUNABLES"
HEAP_HUGE_PAGES = "glibc.malloc.hugetlb=1"  # glibc >= 2.35: madvise(MADV_HUGEPAGE) on what malloc maps
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MAPPING_LINE = re.compile(r"[0-9a-f]+-[0-9a-f]+ ")  # a mapping's first line in /proc/<pid>/smaps


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


def thp_mode(path: Path = THP_MODE) -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise`, `never`); None without THP."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def huge_page_env(environ: Mapping[str, str], mode: str | None = None) -> dict[str, str] | None:
    """`environ` with glibc's heap on transparent huge pages (`HEAP_HUGE_PAGES` added to
    `GLIBC_TUNABLES`) for a process started under it; None where that changes nothing: not
    glibc, the kernel's THP mode other than `madvise` (`mode`: the kernel's, by default; glibc
    acts on the tunable in that mode only), the tunable already set, or `PD_TUNE_ALLOCATOR=0`."""
    if environ.get(ALLOCATOR_ENV) == "0" or platform.libc_ver()[0] != "glibc":
        return None
    if (thp_mode() if mode is None else mode) != "madvise":
        return None
    tunables = environ.get(TUNABLES_ENV, "")
    if HEAP_HUGE_PAGES.split("=")[0] in tunables:
        return None
    return {**environ, TUNABLES_ENV: f"{tunables}:{HEAP_HUGE_PAGES}" if tunables else HEAP_HUGE_PAGES}


def heap_on_huge_pages(smaps: Path = Path("/proc/self/smaps")) -> bool:
    """Whether this process's heap asked for huge pages (a `[heap]` mapping flagged `hg`,
    MADV_HUGEPAGE); False where the kernel does not say."""
    try:
        text = smaps.read_text()
    except OSError:
        return False
    in_heap = False
    for line in text.splitlines():
        if MAPPING_LINE.match(line):
            in_heap = line.rstrip().endswith("[heap]")
        elif in_heap and line.startswith("VmFlags:") and "hg" in line.split()[1:]:
            return True
    return False


@contextmanager
def children_on_huge_pages() -> Iterator[None]:
    """Processes started inside run under `huge_page_env` (the workers: `GLIBC_TUNABLES` set in
    this process's environment meanwhile, which they inherit)."""
    env = huge_page_env(os.environ)
    if env is None:
        yield
        return
    before = os.environ.get(TUNABLES_ENV)
    os.environ[TUNABLES_ENV] = env[TUNABLES_ENV]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TUNABLES_ENV, None)
        else:
            os.environ[TUNABLES_ENV] = before


def restart_on_huge_pages() -> None:
    """Start this process again under `huge_page_env` where it changes something (the `pd`
    command, before it imports torch: `pd profile` then measures under the heap the workers
    run on); a no-op otherwise, and after the restart."""
    env = huge_page_env(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)

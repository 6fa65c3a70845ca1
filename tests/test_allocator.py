"""The heap pd's processes run on: glibc's heap on transparent huge pages where the kernel gives
them on request, set for new processes (the workers, and `pd` itself, which starts again)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from pdcli.torchutil.allocator import (
    ALLOCATOR_ENV,
    HEAP_HUGE_PAGES,
    TUNABLES_ENV,
    children_on_huge_pages,
    heap_on_huge_pages,
    huge_page_env,
    thp_mode,
)

REPO = Path(__file__).resolve().parents[1]
GLIBC = platform.libc_ver()[0] == "glibc"
needs_madvise = pytest.mark.skipif(not GLIBC or thp_mode() != "madvise",
                                   reason="needs glibc and the kernel's THP mode `madvise`")


@pytest.mark.skipif(not GLIBC, reason="glibc's tunable")
def test_the_tunable_is_added_where_the_kernel_gives_huge_pages_on_request() -> None:
    assert huge_page_env({"A": "1"}, mode="madvise") == {"A": "1", TUNABLES_ENV: HEAP_HUGE_PAGES}
    # other tunables are kept; one the user set for huge pages is theirs
    kept = huge_page_env({TUNABLES_ENV: "glibc.malloc.arena_max=2"}, mode="madvise")
    assert kept is not None and kept[TUNABLES_ENV] == f"glibc.malloc.arena_max=2:{HEAP_HUGE_PAGES}"
    assert huge_page_env({TUNABLES_ENV: "glibc.malloc.hugetlb=0"}, mode="madvise") is None
    assert huge_page_env({TUNABLES_ENV: HEAP_HUGE_PAGES}, mode="madvise") is None  # already under it: no restart
    # glibc acts on the tunable in `madvise` mode only; PD_TUNE_ALLOCATOR=0 keeps glibc's defaults
    assert huge_page_env({}, mode="always") is None and huge_page_env({}, mode="never") is None
    assert huge_page_env({ALLOCATOR_ENV: "0"}, mode="madvise") is None


def test_thp_mode_reads_the_kernels_choice(tmp_path: Path) -> None:
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    assert thp_mode(mode) == "madvise"
    mode.write_text("[always] madvise never\n")
    assert thp_mode(mode) == "always"
    assert thp_mode(tmp_path / "absent") is None


def test_heap_on_huge_pages_reads_the_heaps_flags(tmp_path: Path) -> None:
    def smaps(heap_flags: str) -> Path:
        path = tmp_path / "smaps"
        path.write_text(
            "55d0c1a2b000-55d0c1a4c000 r--p 00000000 08:01 123  /usr/bin/python3\n"
            "VmFlags: rd mr mw me hg\n"  # not the heap
            "55d0c1c00000-55d0c2000000 rw-p 00000000 00:00 0                          [heap]\n"
            "Size:               4096 kB\n"
            f"VmFlags: {heap_flags}\n"
            "7f0000000000-7f0000200000 rw-p 00000000 00:00 0\n"
            "VmFlags: rd wr mr mw me ac\n")
        return path

    assert heap_on_huge_pages(smaps("rd wr mr mw me ac hg"))
    assert not heap_on_huge_pages(smaps("rd wr mr mw me ac"))
    assert not heap_on_huge_pages(tmp_path / "absent")


CHILD = ("from pdcli.torchutil.allocator import heap_on_huge_pages, restart_on_huge_pages, tune_allocator\n"
         "restart_on_huge_pages()\n"
         "import torch\n"
         "tune_allocator()\n"
         "held = [torch.ones(1 << 20) for _ in range(16)]\n"
         "print(heap_on_huge_pages())\n")


@pytest.mark.slow
@needs_madvise
@pytest.mark.timeout(60)
@pytest.mark.parametrize("switch", ["on", "off"])
def test_a_process_restarts_itself_onto_huge_pages(switch: str) -> None:
    """`pd` starts itself again under the tunable; its heap then asks for huge pages (and with
    PD_TUNE_ALLOCATOR=0 it neither restarts nor asks)."""
    env = {k: v for k, v in os.environ.items() if k != TUNABLES_ENV}
    if switch == "off":
        env[ALLOCATOR_ENV] = "0"
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == (["True"] if switch == "on" else ["False"])


@needs_madvise
def test_children_started_inside_get_the_tunable() -> None:
    before = os.environ.get(TUNABLES_ENV)
    with children_on_huge_pages():
        seen = subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get({TUNABLES_ENV!r}))"],
                              capture_output=True, text=True, timeout=30).stdout
    assert HEAP_HUGE_PAGES in seen
    assert os.environ.get(TUNABLES_ENV) == before  # this process's environment as it was


def test_the_console_script_restarts_before_the_heavy_imports() -> None:
    """`pd` (`pdcli.entry:main`) starts itself again before it imports the commands or torch:
    the restart costs a bare interpreter's start, not a second import of torch."""
    code = ("import sys, pdcli.entry, pdcli.torchutil.allocator\n"
            "print(sorted(m for m in ('torch', 'typer', 'pdcli.cli') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
    assert 'pd = "pdcli.entry:main"' in (REPO / "pyproject.toml").read_text()

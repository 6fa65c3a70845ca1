"""Shared pieces of the runtime benchmark: the problem shape, the MLP and its 2-stage split,
and a subprocess runner with a hard timeout that leaves nothing running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from pdcli.config.schema import ModelConfig
from pdcli.models import build_model
from pdcli.torchutil.allocator import huge_page_env

def own_profiles() -> Path:
    """Make this benchmark's `pd` runs measure their own profiles: `$PD_CACHE_DIR` becomes a
    fresh directory for this process and its children, its `hosts/` the user's host file
    (`pdcli.probe.hostfile`), its profiles none (`pdcli.probe.profile_cache` would otherwise
    copy a profile an earlier run measured for the same inputs). Removed at exit."""
    import atexit
    import shutil
    import tempfile

    from pdcli.probe.hostfile import cache_root
    from pdcli.probe.profile_cache import without_profiles

    user = cache_root("")
    assert user is not None
    own = Path(tempfile.mkdtemp(prefix="pd-bench-cache-"))
    without_profiles(own, user)
    atexit.register(shutil.rmtree, own, True)
    os.environ["PD_CACHE_DIR"] = str(own)
    return own


NUM_CLASSES = 10
NUM_STAGES = 2
RESULT_PREFIX = "BENCH_RESULT "
"""A child prints exactly one line `BENCH_RESULT {json}`; everything else is log."""
KILL_GRACE_S = 5.0
STDERR_TAIL_LINES = 3
BOX_CHARS = " \t│╭╮╰╯─"


class BenchFailed(RuntimeError):
    """A variant could not produce a number; the message is the reason shown in the table."""


@dataclass(frozen=True)
class BenchShape:
    """The one problem every variant trains: an MLP of `num_layers` x `width` on `batch_size`."""

    width: int = 1024
    num_layers: int = 8
    batch_size: int = 256
    num_microbatches: int = 8
    num_steps: int = 15
    """Timed optimizer steps (minibatches of `batch_size`)."""
    num_warmup_steps: int = 3
    """Untimed steps before the clock starts (allocator, thread pools, gloo connections)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.width, self.num_layers, self.batch_size, self.num_microbatches, self.num_steps) < 1:
            raise ValueError(f"every size must be >= 1, got {self}")
        if self.num_warmup_steps < 0:
            raise ValueError(f"num_warmup_steps must be >= 0, got {self.num_warmup_steps}")
        if self.batch_size % self.num_microbatches:
            raise ValueError(
                f"batch_size {self.batch_size} is not divisible by num_microbatches {self.num_microbatches}"
            )
        if self.num_layers < NUM_STAGES:
            raise ValueError(f"num_layers {self.num_layers} < {NUM_STAGES} stages: nothing to split")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "BenchShape":
        return cls(**json.loads(text))


def model_kwargs(shape: BenchShape) -> dict[str, int]:
    """kwargs of `pdcli.models.mlp` for `shape` (input = `width` features)."""
    return {"in_features": shape.width, "hidden": shape.width, "num_layers": shape.num_layers, "num_classes": NUM_CLASSES}


def build_mlp(shape: BenchShape) -> nn.Sequential:
    """The benchmark MLP through pd's own model registry, seeded."""
    torch.manual_seed(shape.seed)
    model = build_model(ModelConfig(name="mlp", kwargs=model_kwargs(shape)))
    assert isinstance(model, nn.Sequential), type(model)
    return model


def split_point(shape: BenchShape) -> int:
    """Index into the Sequential where stage 1 starts.

    The Sequential is [Flatten, (Linear, ReLU) x num_layers, Linear classifier]; stage 0
    gets Flatten + the first num_layers // 2 Linear+ReLU pairs, stage 1 the rest and the
    (width x 10, negligible) classifier, so both stages do the same matmul work.
    """
    return 1 + 2 * (shape.num_layers // NUM_STAGES)


VIRTUAL_STAGES = 2
"""Chunks per rank of the virtual-stage rows (interleaved, loopedbfs, zbv)."""


def chunk_points(shape: BenchShape, num_chunks: int = NUM_STAGES * VIRTUAL_STAGES) -> list[int]:
    """Indices into the Sequential where chunks 1.. start: `num_chunks` chunks of (about) equal
    matmul work, the classifier with the last; chain positions of pd's profile alike."""
    return [1 + 2 * (k * shape.num_layers // num_chunks) for k in range(1, num_chunks)]


def chunk_mlp(model: nn.Sequential, shape: BenchShape) -> list[nn.Sequential]:
    cuts = [0, *chunk_points(shape), len(model)]
    return [model[a:b] for a, b in zip(cuts, cuts[1:])]


def split_mlp(model: nn.Sequential, shape: BenchShape) -> tuple[nn.Sequential, nn.Sequential]:
    cut = split_point(shape)
    return model[:cut], model[cut:]


def fixed_batch(shape: BenchShape) -> tuple[torch.Tensor, torch.Tensor]:
    """One minibatch reused every step (data loading is not what this benchmark measures)."""
    gen = torch.Generator().manual_seed(shape.seed + 1)
    x = torch.randn(shape.batch_size, shape.width, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (shape.batch_size,), generator=gen)
    return x, y


def thread_env(num_threads: int, pd_heap: bool = True) -> dict[str, str]:
    """Environment for a child that must use `num_threads` threads from its first import, on the
    heap pd's workers run on (`huge_page_env`: glibc's heap on transparent huge pages where the
    kernel's mode is `madvise`), so no row wins by its heap; `pd_heap=False`: the environment as
    it is (glibc's defaults, as a program started by hand runs)."""
    env = (huge_page_env(os.environ) if pd_heap else None) or dict(os.environ)
    env["OMP_NUM_THREADS"] = str(num_threads)
    env["MKL_NUM_THREADS"] = str(num_threads)
    return env


def paired_ratios(a: Sequence[float | None], b: Sequence[float | None]) -> list[float]:
    """a / b of each round in which both were measured (None: a round that failed). Rounds
    are aligned by position: a[i] and b[i] ran in the same round, minutes apart at most, so a
    slow spell of the host that lasts longer than that moves both alike."""
    if len(a) != len(b):
        raise ValueError(f"paired rounds need as many rounds of each: {len(a)} and {len(b)}")
    return [x / y for x, y in zip(a, b) if x is not None and y is not None and y > 0]


def emit_result(obj: dict[str, Any]) -> None:
    """Child side: print the one result line the parent parses."""
    print(RESULT_PREFIX + json.dumps(obj, sort_keys=True), flush=True)


def run_bounded(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `argv` run in its own session; its whole group is
    killed when it exits or times out, so nothing it started is left running.

    Raises BenchFailed on timeout.
    """
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise BenchFailed(f"timed out after {timeout_s:.0f} s") from None
    except BaseException:  # Ctrl-C: leave nothing running
        _kill_group(proc)
        raise
    _kill_group(proc)  # children the child may have left behind (it has exited already)
    return proc.returncode, out, err


def stderr_tail(err: str) -> str:
    """The last few non-empty lines of `err` on one line, rich's box drawing removed."""
    lines = [line.strip(BOX_CHARS) for line in err.splitlines()]
    return " | ".join([line for line in lines if line][-STDERR_TAIL_LINES:]) or "no output"


def run_child(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a child that prints a result line (`emit_result`); return that result.

    Raises BenchFailed with a short reason (timeout, or exit status + the tail of stderr).
    """
    returncode, out, err = run_bounded(argv, timeout_s, env)
    if returncode == 0:
        for line in reversed(out.splitlines()):
            if line.startswith(RESULT_PREFIX):
                return dict(json.loads(line[len(RESULT_PREFIX):]))
    raise BenchFailed(f"exit status {returncode}: {stderr_tail(err)}")


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM then SIGKILL the process group this benchmark started (only that one)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        # then SIGKILL whatever may remain of the group (grandchildren ignoring SIGTERM)


def python_argv(script: Path, *args: str) -> list[str]:
    return [sys.executable, str(script), *args]

"""Baselines of the runtime benchmark, each in a fresh process so thread settings don't leak:
single-process training (1 thread / all threads) and torch.distributed.pipelining on 2 ranks.

Parent side: `run_single(shape, num_threads, timeout_s, num_microbatches=1)`,
`run_stage_bound(shape, timeout_s)` and `run_torch_pipelining(shape, schedule_name, timeout_s)`
return samples/s (and the bound its stage times) or raise BenchFailed.
Child side: `python _baselines.py single|stages|pipelining <shape json> <arg> [arg]` prints one
result line.

Every child applies the same glibc allocator settings as pd's workers (`tune_allocator`, and the
heap on huge pages through `thread_env`), and the 2-process rows pin each process to its own
share of the cores as pd's workers are by default (`train.bind_cores`), so no row wins by the
allocator or the pinning alone.
"""

from __future__ import annotations

import socket
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import (
    PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleZBVZeroBubble,
)
from torch.nn import functional as F

from pdcli.host import core_share, pin_process
from pdcli.torchutil.allocator import tune_allocator

from _bench_common import (
    NUM_STAGES,
    BenchFailed,
    BenchShape,
    build_mlp,
    chunk_mlp,
    emit_result,
    fixed_batch,
    python_argv,
    run_child,
    split_mlp,
    thread_env,
)

LR = 0.01
LOCALHOST = "127.0.0.1"
TORCH_SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
TORCH_VIRTUAL_SCHEDULES = {"interleaved": ScheduleInterleaved1F1B, "loopedbfs": ScheduleLoopedBFS,
                           "zbv": ScheduleZBVZeroBubble}
"""torch's multi-stage schedules by pd's name: VIRTUAL_STAGES chunks per rank (`chunk_mlp`), placed
in loops (rank r: chunks r, r + 2, ...) or, for zbv, as a V (rank r: chunks r and 2 x 2 - 1 - r)."""
PIPELINING_THREADS_PER_RANK = 1
GLOO_TIMEOUT_FRACTION = 0.8
"""The ranks' gloo timeout is this part of the variant's timeout, so a hung peer is reported by
gloo (with its message) before the parent kills the group."""
DEFAULT_GLOO_TIMEOUT_S = 120.0
SINGLE, STAGES, PIPELINING = "single", "stages", "pipelining"


# ---- parent side --------------------------------------------------------------------------


def run_single(shape: BenchShape, num_threads: int, timeout_s: float, num_microbatches: int = 1) -> float:
    """samples/s of plain single-process training with `num_threads` torch threads; with
    `num_microbatches` > 1 it accumulates gradients over microbatches: the pipeline's
    arithmetic (matmuls of batch / M rows) on one core."""
    argv = python_argv(Path(__file__), SINGLE, shape.to_json(), str(num_threads), str(num_microbatches))
    result = run_child(argv, timeout_s, env=thread_env(num_threads))
    return float(result["samples_per_s"])


def run_stage_bound(shape: BenchShape, timeout_s: float) -> tuple[float, list[float]]:
    """(samples/s of the slower stage, each stage's ms per minibatch), every stage training
    alone in a process of its own, 1 thread, all at once.

    Each stage runs its M microbatches: forward, backward (stage 1 also computes its input's
    gradient, as in the pipeline; stage 0 does not) and one optimizer step per minibatch.
    It is a pipeline without messages and without waiting, on the same cores at the same
    time (so sharing the cache and memory bandwidth as the pipeline's processes do): no
    pipeline on this split beats its slower stage."""
    argvs = [python_argv(Path(__file__), STAGES, shape.to_json(), str(stage_id)) for stage_id in range(NUM_STAGES)]
    with ThreadPoolExecutor(max_workers=NUM_STAGES) as pool:
        results = list(pool.map(lambda argv: run_child(argv, timeout_s, env=thread_env(1)), argvs))
    stage_ms = [float(r["ms_per_minibatch"]) for r in results]
    return shape.batch_size / (max(stage_ms) / 1e3), stage_ms


def run_torch_pipelining(shape: BenchShape, schedule_name: str, timeout_s: float, pd_heap: bool = True) -> float:
    """samples/s of torch.distributed.pipelining (`1f1b`, `gpipe`, or with VIRTUAL_STAGES chunks per
    rank `interleaved`, `loopedbfs`, `zbv`), 2 gloo ranks of 1 thread, on pd's heap or (`pd_heap=False`)
    glibc's defaults (`thread_env`)."""
    if schedule_name not in {**TORCH_SCHEDULES, **TORCH_VIRTUAL_SCHEDULES}:
        raise ValueError(f"schedule {schedule_name!r} is not one of {', '.join([*TORCH_SCHEDULES, *TORCH_VIRTUAL_SCHEDULES])}")
    result = run_child(
        python_argv(Path(__file__), PIPELINING, shape.to_json(), schedule_name, str(timeout_s * GLOO_TIMEOUT_FRACTION)),
        timeout_s,
        env=thread_env(PIPELINING_THREADS_PER_RANK, pd_heap),
    )
    return float(result["samples_per_s"])


# ---- child side: single process -----------------------------------------------------------


def single_main(shape: BenchShape, num_threads: int, num_microbatches: int = 1) -> None:
    torch.set_num_threads(num_threads)
    model = build_mlp(shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = fixed_batch(shape)
    chunks = list(zip(x.chunk(num_microbatches), y.chunk(num_microbatches)))

    def step() -> None:
        optimizer.zero_grad()
        for xc, yc in chunks:
            (F.cross_entropy(model(xc), yc) / num_microbatches).backward()
        optimizer.step()

    for _ in range(shape.num_warmup_steps):
        step()
    step_s = timed_steps(step, shape.num_steps)
    emit_result({"samples_per_s": median_samples_per_s(shape, step_s), "threads": torch.get_num_threads()})


def pin_like_pd(rank: int) -> None:
    """This process on its own share of the cores, as pd pins a worker (`train.bind_cores`)."""
    share = core_share(rank, NUM_STAGES)
    if share is not None:
        pin_process(share)


def stages_main(shape: BenchShape, stage_id: int) -> None:
    pin_like_pd(stage_id)
    torch.set_num_threads(1)
    m = shape.num_microbatches
    x, y = fixed_batch(shape)
    modules = split_mlp(build_mlp(shape), shape)
    inputs = list(x.chunk(m))
    with torch.no_grad():
        for earlier in modules[:stage_id]:
            inputs = [earlier(xc) for xc in inputs]  # this stage's inputs
    module = modules[stage_id]
    # a later stage's input is an activation: its gradient is part of the backward
    inputs = [xc.detach().requires_grad_(stage_id > 0) for xc in inputs]
    targets = list(y.chunk(m))
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    is_last = stage_id == NUM_STAGES - 1

    def step() -> None:
        optimizer.zero_grad()
        for xc, yc in zip(inputs, targets):
            out = module(xc)
            if is_last:
                F.cross_entropy(out, yc).backward()
            else:
                out.backward(torch.ones_like(out))  # the gradient a next stage would send
        optimizer.step()

    for _ in range(shape.num_warmup_steps):
        step()
    step_s = timed_steps(step, shape.num_steps)
    emit_result({"ms_per_minibatch": 1e3 * statistics.median(step_s)})


def timed_steps(step: Callable[[], None], num_steps: int) -> list[float]:
    """Wall seconds of each of `num_steps` calls of `step`."""
    durations_s = []
    for _ in range(num_steps):
        start_s = time.perf_counter()
        step()
        durations_s.append(time.perf_counter() - start_s)
    return durations_s


def median_samples_per_s(shape: BenchShape, step_s: list[float]) -> float:
    """Median over steps of batch / step time: robust to another process stealing a core for a
    moment, and the same statistic the pd rows use (pd logs samples/s per minibatch)."""
    return statistics.median(shape.batch_size / s for s in step_s)


# ---- child side: torch.distributed.pipelining -------------------------------------------


def pipelining_main(shape: BenchShape, schedule_name: str, timeout_s: float) -> None:
    """Spawn 2 ranks; rank 0 writes samples/s to a file this process turns into the result line."""
    with tempfile.TemporaryDirectory(prefix="pd-bench-pp-") as tmp:
        result_path = Path(tmp) / "result.txt"
        port = _free_port()
        # join=True raises as soon as one rank fails and terminates the other
        mp.spawn(
            _pipelining_rank,
            args=(shape.to_json(), schedule_name, port, str(result_path), timeout_s),
            nprocs=NUM_STAGES,
            join=True,
        )
        if not result_path.exists():
            raise BenchFailed("rank 0 finished without writing a result")
        emit_result({"samples_per_s": float(result_path.read_text())})


def _pipelining_rank(rank: int, shape_json: str, schedule_name: str, port: int, result_path: str, timeout_s: float) -> None:
    pin_like_pd(rank)
    torch.set_num_threads(PIPELINING_THREADS_PER_RANK)
    shape = BenchShape.from_json(shape_json)
    # the gloo timeout bounds every collective and send/recv: a dead peer -> an error, not a hang
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{LOCALHOST}:{port}",
        rank=rank,
        world_size=NUM_STAGES,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        x, y = fixed_batch(shape)
        if schedule_name in TORCH_VIRTUAL_SCHEDULES:
            chunks = chunk_mlp(build_mlp(shape), shape)
            last = len(chunks) - 1
            mine = [rank, last - rank] if schedule_name == "zbv" else list(range(rank, len(chunks), NUM_STAGES))
            stages = [PipelineStage(chunks[k], k, len(chunks), torch.device("cpu")) for k in mine]
            schedule = TORCH_VIRTUAL_SCHEDULES[schedule_name](stages, n_microbatches=shape.num_microbatches,
                                                              loss_fn=F.cross_entropy)
            params = [p for k in mine for p in chunks[k].parameters()]
            first_rank, last_rank = 0 in mine, last in mine
        else:
            module = split_mlp(build_mlp(shape), shape)[rank]
            stage = PipelineStage(module, rank, NUM_STAGES, torch.device("cpu"))
            schedule = TORCH_SCHEDULES[schedule_name](stage, n_microbatches=shape.num_microbatches, loss_fn=F.cross_entropy)
            params = list(module.parameters())
            first_rank, last_rank = rank == 0, rank == NUM_STAGES - 1
        optimizer = torch.optim.SGD(params, lr=LR)

        def step() -> None:
            optimizer.zero_grad()
            if first_rank and last_rank:
                schedule.step(x, target=y, losses=[])
            elif first_rank:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=[])
            optimizer.step()

        for _ in range(shape.num_warmup_steps):
            step()
        dist.barrier()
        # rank 0 times the steps: with a flush per minibatch its step ends with the last
        # backward of the minibatch, so its step time is the pipeline's minibatch time
        step_s = timed_steps(step, shape.num_steps)
        dist.barrier()
        if rank == 0:
            Path(result_path).write_text(repr(median_samples_per_s(shape, step_s)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOCALHOST, 0))
        return int(s.getsockname()[1])


def main(argv: list[str]) -> None:
    kind, shape_json, arg = argv[:3]
    shape = BenchShape.from_json(shape_json)
    tune_allocator()
    if kind == SINGLE:
        single_main(shape, int(arg), int(argv[3]) if len(argv) > 3 else 1)
    elif kind == STAGES:
        stages_main(shape, int(arg))
    elif kind == PIPELINING:
        timeout_s = float(argv[3]) if len(argv) > 3 else DEFAULT_GLOO_TIMEOUT_S
        pipelining_main(shape, arg, timeout_s)
    else:
        raise SystemExit(f"unknown baseline {kind!r}; expected {SINGLE}, {STAGES} or {PIPELINING}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Start the workers through PyTorch's elastic launcher (the engine behind torchrun).

One process per device of the plan on this host (or `nproc = world / nnodes` per host,
meeting in the store node 0 serves on `master_addr:master_port`: `rendezvous.py`). When one
worker dies, the elastic agent stops its siblings and `launch_workers` raises `TrainingFailed`
with a message naming the rank, its stage and its last action; with `max_restarts=N` the agent
first restarts them all up to N times (`pdcli.runtime.restarts`), each failure an event of the run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed import DistNetworkError
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous, create_rdzv_handler
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from pdcli.errors import UserError
from pdcli.host import host_cores
from pdcli.runtime.placement import Placement
from pdcli.runtime.events import append_event
from pdcli.runtime.restarts import NO_RESTART_KINDS, prepare_restart, restarting_agent
from pdcli.runtime.rendezvous import DEFAULT_MASTER_PORT, NODES_RDZV_BACKEND, listen_store
from pdcli.runtime.watchdog import read_error, read_status
from pdcli.torchutil.allocator import children_on_huge_pages

WORKER_MODULE = "pdcli.runtime.worker"
LOCALHOST = "127.0.0.1"
PORT_ATTEMPTS = 3


CPU_PROCESSES_PER_CORE = 4
"""On CPU, "available devices" = worker processes one host may run: this many per core
(at least MIN_CPU_PROCESSES). Pipeline stages mostly wait on each other, so a few per
core still train; far more only thrash."""
MIN_CPU_PROCESSES = 8


class TrainingFailed(RuntimeError):
    """A worker crashed, was killed or hung; the message names rank, stage and last action."""


class TrainingInterrupted(TrainingFailed):
    """The launcher got SIGINT/SIGTERM/...; every worker was stopped. `signal_number` says which."""

    def __init__(self, message: str, signal_number: int) -> None:
        super().__init__(message)
        self.signal_number = signal_number


@dataclass(frozen=True)
class Hosts:
    """Where the workers run: `nnodes` hosts, this one is `node_rank`."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_id: str | None = None
    """Explicit rendezvous id (`--rdzv-id`); else `rendezvous.rendezvous_id` derives one."""


def first_slurm_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list: `gpu[03-06,9],login1` -> `gpu03`."""
    m = re.match(r"\s*([^\[,\s]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        return None
    prefix, ranges = m.group(1), m.group(2)
    return prefix if ranges is None else prefix + re.split(r"[-,]", ranges, maxsplit=1)[0]


def hosts_from_env(nnodes: int | None, node_rank: int | None, master_addr: str | None, master_port: int | None,
                   env: Mapping[str, str], rdzv_id: str | None = None) -> Hosts:
    """The command line wins; then torchrun's variables (`PET_NNODES`, `PET_NODE_RANK`,
    `MASTER_ADDR`, `MASTER_PORT`), then SLURM's (`SLURM_NNODES`, `SLURM_NODEID`, the first
    host of `SLURM_JOB_NODELIST`); else one host."""
    def number(value: int | None, *names: str) -> int | None:
        if value is not None:
            return value
        for name in names:
            text = env.get(name, "").strip()
            if text:
                if not text.isdigit():
                    raise UserError(f"environment variable {name}={text!r} is not a whole number",
                                    hint=f"unset {name} or pass the value on the command line")
                return int(text)
        return None

    addr = master_addr or env.get("MASTER_ADDR") or env.get("PET_MASTER_ADDR") or (
        first_slurm_host(env.get("SLURM_JOB_NODELIST", "")) if env.get("SLURM_JOB_NODELIST") else None)
    return Hosts(
        nnodes=number(nnodes, "PET_NNODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1,
        node_rank=number(node_rank, "PET_NODE_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_NODEID") or 0,
        master_addr=addr or None,
        master_port=number(master_port, "MASTER_PORT", "PET_MASTER_PORT"),
        rdzv_id=rdzv_id,
    )


def job_endpoint(hosts: Hosts) -> tuple[str, int]:
    """(master address, port) of a job on several hosts: both the same on every node."""
    if not hosts.master_addr:
        raise UserError(f"--nnodes {hosts.nnodes}: every node needs node 0's address",
                        hint="pass --master-addr HOST (node 0's address, the same on every node), or set $MASTER_ADDR")
    return hosts.master_addr, hosts.master_port or DEFAULT_MASTER_PORT


def check_devices(world_size: int, hosts: Hosts, device: str) -> None:
    """The plan's ranks fit the launch: divisible by --nnodes, and per host no more processes
    than devices (CUDA: GPUs; CPU: CPU_PROCESSES_PER_CORE per core)."""
    if hosts.nnodes < 1 or not 0 <= hosts.node_rank < hosts.nnodes:
        raise UserError(f"--node-rank {hosts.node_rank} is not in 0..{hosts.nnodes - 1} (--nnodes {hosts.nnodes})")
    if world_size % hosts.nnodes:
        raise UserError(
            f"the plan has {world_size} ranks, which --nnodes {hosts.nnodes} hosts cannot share evenly",
            hint=f"use --nnodes dividing {world_size}, or re-plan for {hosts.nnodes} hosts (cluster.levels)",
        )
    per_host = world_size // hosts.nnodes
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        available, what = torch.cuda.device_count(), "GPUs (torch.cuda.device_count())"
    else:
        cores = host_cores()
        available = max(MIN_CPU_PROCESSES, CPU_PROCESSES_PER_CORE * cores)
        what = f"CPU worker processes ({CPU_PROCESSES_PER_CORE} per core x {cores} cores, at least {MIN_CPU_PROCESSES})"
    if per_host > available:
        raise UserError(
            f"the plan needs {per_host} devices on this host, but only {available} {what} are available",
            hint="plan for fewer devices (cluster.levels, plan.num_stages) or spread over hosts with --nnodes",
        )


LOCAL_RDZV_BACKEND = "pd-local"
"""The rendezvous of a one-host run: torch's static TCP rendezvous, listening on LOCALHOST only."""


class LocalRendezvous(StaticTCPRendezvous):
    """torch's static rendezvous for a run whose every rank is on this host.

    torch's TCPStore server listens on every interface whatever address it is given, so
    anyone who can reach this host could talk to the job's store. Here the store gets a
    socket bound to LOCALHOST (`master_listen_fd`), on the port asked for, else one the OS
    picks at bind time (no race with other jobs for a port chosen earlier); the workers
    learn it from the rendezvous (`bootstrap_store_info`), as with the static backend."""

    def get_backend(self) -> str:
        return LOCAL_RDZV_BACKEND

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            store = listen_store(LOCALHOST, self.master_port, self.timeout.total_seconds(),
                                 "pick another port, or leave --master-port out to get a free one")
            self.master_addr, self.master_port, self._store = LOCALHOST, store.port, store
        return super().next_rendezvous()


def _create_local_rendezvous(params: RendezvousParameters) -> RendezvousHandler:
    static = create_rdzv_handler(params)
    assert isinstance(static, StaticTCPRendezvous)
    return LocalRendezvous(LOCALHOST, static.master_port, static.rank, static.world_size, static.run_id,
                           int(static.timeout.total_seconds()))


rendezvous_handler_registry.register(LOCAL_RDZV_BACKEND, _create_local_rendezvous)


def launch_config(world_size: int, hosts: Hosts, log_dir: Path, rdzv_timeout_s: float, max_restarts: int = 0,
                  run_id: str | None = None) -> LaunchConfig:
    """One host: the store listens on LOCALHOST only (`LocalRendezvous`); several hosts: the
    store node 0 opened on `master_addr:master_port` (`rendezvous.open_job_store`), under the
    job's rendezvous id `run_id`, torch's static rendezvous otherwise."""
    if world_size % hosts.nnodes:
        raise ValueError(f"world size {world_size} is not divisible by nnodes={hosts.nnodes}")
    local = hosts.nnodes == 1
    addr, port = (LOCALHOST, hosts.master_port or 0) if local else job_endpoint(hosts)
    return LaunchConfig(
        min_nodes=hosts.nnodes,
        max_nodes=hosts.nnodes,
        nproc_per_node=world_size // hosts.nnodes,
        run_id=run_id or f"pd-{uuid.uuid4().hex[:8]}",
        rdzv_endpoint=f"{addr}:{port}",
        # static: node_rank fixes the global ranks (node_rank * nproc + local_rank), as torchrun does.
        rdzv_backend=LOCAL_RDZV_BACKEND if local else NODES_RDZV_BACKEND,
        rdzv_configs={"rank": hosts.node_rank, "timeout": int(rdzv_timeout_s)},
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL),  # worker output: train/elastic/
    )


def launch_workers(run_dir: Path, placement: Placement, hosts: Hosts, timeout_s: float, max_restarts: int = 0,
                   num_steps: int = 0, run_id: str | None = None) -> None:
    """Run `python -m pdcli.runtime.worker --run-dir run_dir` on every rank of this host
    (several hosts: in the job `run_id` whose store `open_job_store` opened); after a failure,
    restart them all from the newest complete checkpoint of the run's `num_steps` up to
    `max_restarts` times (each failure logged in `train/events.jsonl`)."""
    train_dir = run_dir / "train"
    log_dir = train_dir / "elastic"
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # TrainingFailed says it better
    # --launcher-pid: a worker whose parent is no longer this process exits (see die_with_parent)
    args = ("-u", "-m", WORKER_MODULE, "--run-dir", str(run_dir), "--launcher-pid", str(os.getpid()))
    try:
        for attempt in range(PORT_ATTEMPTS):
            config = launch_config(placement.world_size, hosts, log_dir, rdzv_timeout_s=max(60.0, timeout_s * 2),
                                   max_restarts=max_restarts, run_id=run_id)
            events = FailureEvents(train_dir, placement, num_steps)
            try:
                # the workers start on the heap `pd profile` measured under (torchutil.allocator)
                with restarting_agent(events.on_failure, events.before_restart), children_on_huge_pages(), \
                        secret_for_workers(one_host=hosts.nnodes == 1):
                    elastic_launch(config, sys.executable)(*args)
                return
            except DistNetworkError as e:
                # The free port we picked was taken before the agent bound it (another job); pick again.
                if "EADDRINUSE" not in str(e):
                    raise
                if hosts.master_port is not None:
                    raise UserError(
                        f"--master-port {hosts.master_port} is already in use on this host",
                        hint="pick another port, or leave --master-port out to get a free one",
                    ) from None
                if attempt == PORT_ATTEMPTS - 1:
                    raise
    except ChildFailedError as e:
        raise TrainingFailed(diagnose(train_dir, placement, e, log_dir)) from None
    except SignalException as e:  # Ctrl-C / SIGTERM on the launcher: the agent stopped the workers
        raise TrainingInterrupted(f"interrupted by {e.sigval.name}; all workers were stopped", int(e.sigval)) from None


@contextlib.contextmanager
def secret_for_workers(one_host: bool = True) -> Iterator[None]:
    """The workers started inside get the job's secret in their environment
    (`handshake.SECRET_ENV`): the one given (several hosts: the same on every node, `pd train`
    checked it), else, `one_host`, a new one for this host's workers, never put in the store
    (several hosts without one: `--insecure-network`, the workers share one through the store)."""
    from pdcli.runtime.handshake import SECRET_ENV, new_secret, secret_given

    if secret_given() or not one_host:
        yield
        return
    os.environ[SECRET_ENV] = new_secret()
    try:
        yield
    finally:
        os.environ.pop(SECRET_ENV, None)


@dataclass
class FailureEvents:
    """Each failure of the job as an event of `train/events.jsonl` (`restart` when the agent
    restarts the workers, with the checkpoint step they resume from; `failure` when the job
    stops), named by its root cause: rank, stage and how (signal, exit code, silence...)."""

    train_dir: Path
    placement: Placement
    num_steps: int
    pending: dict | None = None

    def on_failure(self, exit_codes: Mapping[int, int], restarts_left: int) -> bool:
        causes = failure_causes(self.train_dir, self.placement, exit_codes)
        root = causes[0] if causes else Cause(-1, "unknown", "a worker failed")
        event = {"rank": root.rank, "stage": self.placement.of(root.rank)[0] if root.rank >= 0 else None,
                 "cause": root.how, "message": root.line}
        curable = root.how not in NO_RESTART_KINDS
        if curable and restarts_left > 0:
            self.pending = {"event": "restart", **event, "restarts_left": restarts_left - 1}
        else:
            append_event(self.train_dir, {"event": "failure", **event})
        return curable

    def before_restart(self) -> None:
        step = prepare_restart(self.train_dir, self.num_steps)
        append_event(self.train_dir, {**(self.pending or {"event": "restart"}), "resume_step": step})
        self.pending = None


def describe_rank(placement: Placement, rank: int) -> str:
    stage_id, replica_id = placement.of(rank)
    return f"rank {rank} (stage {stage_id}, replica {replica_id})"


@dataclass(frozen=True)
class Cause:
    """One failed rank as the diagnosis sees it: `how` is its error report's kind (`silent`,
    `diverged`, `error`, `hang`, ...) or, without a report, `signal <NAME>` / `exit code <n>`."""

    rank: int
    how: str
    line: str


def failure_causes(train_dir: Path, placement: Placement, exit_codes: Mapping[int, int]) -> list[Cause]:
    """The failed ranks, root cause first: a rank that went silent, one that died without a
    report, one that raised, one that hung, then those that waited on a peer."""
    reports = {r: read_error(train_dir, r) for r in range(placement.world_size)}

    def severity(rank: int) -> tuple[int, float]:
        report = reports[rank]
        if report is None:
            if rank not in exit_codes or exit_codes[rank] == -signal.SIGTERM:
                return (4, 0.0)  # stopped by the agent after another rank failed
            return (0, 0.0)  # died without a word (os._exit, SIGKILL, segfault): the likely cause
        return ({"silent": -1, "diverged": 1, "error": 1, "hang": 2, "waiting": 3, "peer": 3}.get(report["kind"], 1), report["time_s"])

    causes = []
    for rank in sorted(set(exit_codes) | {r for r, rep in reports.items() if rep}, key=severity):
        report = reports[rank]
        if report is not None:
            causes.append(Cause(rank, str(report["kind"]), report["message"] if not causes else _shorten(report["message"])))
            continue
        code = exit_codes.get(rank)
        if code is not None and code < 0:
            how, said = f"signal {_signal_name(-code)}", f"was killed by signal {-code}"
        else:
            how, said = f"exit code {code}", f"died with exit code {code}"
        status = read_status(train_dir, rank) or "no action started"
        causes.append(Cause(rank, how, f"{describe_rank(placement, rank)} {said}; last: {status}"))
    return causes


def diagnose(train_dir: Path, placement: Placement, error: ChildFailedError, log_dir: Path) -> str:
    """The root cause first: a rank that went silent, died without a report, raised or hung."""
    lines = [c.line for c in failure_causes(train_dir, placement, {int(r): f.exitcode for r, f in error.failures.items()})]
    head = lines[0] if lines else str(error)
    rest = "".join(f"\n  then: {line}" for line in lines[1:])
    return f"{head}{rest}\n  worker logs: {train_dir}/rank<r>.log and {log_dir}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _shorten(text: str, max_chars: int = 240) -> str:
    """One line of at most `max_chars` (gloo's errors are long; the first rank's is kept whole)."""
    line = " ".join(text.split())
    return line if len(line) <= max_chars else line[: max_chars - 3] + "..."

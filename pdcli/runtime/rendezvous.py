"""The rendezvous of a job on several hosts: one id every node derives, node 0's store.

Every node of one job must use the same rendezvous id (torch's agents prefix their store
keys with it). It is `--rdzv-id`, else `$PET_RDZV_ID` (torchrun's), else `$SLURM_JOB_ID`,
else derived from the master port: one port on node 0 serves one job at a time.

Node 0's `pd train` opens the job's store itself before anything else (profiling takes a
while and the other nodes wait for its plan there): a TCPStore whose socket listens on the
master address only (torch's own listens on every interface), and whose port is the
rendezvous endpoint. The elastic agent of node 0 is handed that store (backend
`NODES_RDZV_BACKEND`); the other nodes' agents and every worker connect to it as clients.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous, create_rdzv_handler

from pdcli.errors import UserError

DEFAULT_MASTER_PORT = 29500
"""The rendezvous port of several hosts when none is given (torchrun's default)."""
JOIN_TIMEOUT_S = 600.0
"""How long a node waits for node 0: its store, then its plan (node 0 may be profiling)."""
NODES_RDZV_BACKEND = "pd-nodes"
JOB_KEY = "pd-job"
"""Unprefixed key in node 0's store: its rendezvous id and number of nodes (a node of another job is told)."""
RDZV_ID_ENV = ("PET_RDZV_ID", "SLURM_JOB_ID")

_stores: dict[str, Store] = {}
"""run id -> the store this process opened for it (the agent's rendezvous takes it from here)."""


def rendezvous_id(explicit: str | None, master_port: int, env: Mapping[str, str]) -> str:
    """The id every node of the job derives alike: explicit, torchrun's, SLURM's, else the port's."""
    chosen = explicit or next((env[name].strip() for name in RDZV_ID_ENV if env.get(name, "").strip()), None)
    if chosen is None:
        return f"pd-port{master_port}"
    if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", chosen):
        raise UserError(f"rendezvous id {chosen!r} (--rdzv-id, $PET_RDZV_ID or $SLURM_JOB_ID) is not 1-64 letters, digits or _.:-",
                        hint="pass --rdzv-id with a plain name, the same on every node")
    return f"pd-{chosen}"


def listen_store(addr: str, port: int, timeout_s: float, hint: str) -> TCPStore:
    """A store server whose socket listens on `addr:port` only (port 0: one the OS picks).
    `hint`: what to do when it cannot listen there."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UserError(f"--master-addr {addr}: not a known host ({e.strerror})", hint="pass node 0's address or name") from None
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(sockaddr)
    except OSError as e:
        listener.close()
        raise UserError(f"--master-port {port}: cannot listen on {addr}:{port} ({e.strerror or e})", hint=hint) from None
    listener.listen(socket.SOMAXCONN)
    bound = int(listener.getsockname()[1])
    return TCPStore(addr, bound, None, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                    multi_tenant=True, master_listen_fd=listener.detach())  # the store owns the socket now


def open_job_store(run_id: str, master_addr: str, master_port: int, node_rank: int, nnodes: int) -> Store:
    """Node 0: serve the job's store on `master_addr:master_port`; other nodes: connect to it
    (waiting up to JOIN_TIMEOUT_S for node 0) and check they are in the same job of as many
    nodes. Kept for the agent's rendezvous of `run_id`."""
    job = f"{run_id} of {nnodes} nodes"
    if node_rank == 0:
        store: Store = listen_store(master_addr, master_port, JOIN_TIMEOUT_S,
                                    "pick another port, or check that --master-addr is this host's (node 0's) address")
        store.set(JOB_KEY, job)
    else:
        try:
            store = TCPStore(master_addr, master_port, None, False, timedelta(seconds=JOIN_TIMEOUT_S), wait_for_workers=False)
            store.wait([JOB_KEY])
        except (RuntimeError, OSError) as e:  # DistNetworkError / DistStoreError: nobody there in time
            raise UserError(f"node 0's rendezvous at {master_addr}:{master_port} did not answer within {JOIN_TIMEOUT_S:g} s ({type(e).__name__})",
                            hint="start `pd train ... --node-rank 0` there, with the same --master-addr/--master-port") from None
        theirs = store.get(JOB_KEY).decode()
        if theirs != job:
            raise UserError(f"node 0 at {master_addr}:{master_port} runs job {theirs}, this node {job}",
                            hint="pass the same --nnodes and --rdzv-id (or none) on every node")
    _stores[run_id] = store
    return store


def job_prefix(store: Store, run_id: str) -> Store:
    """`store` under pd's own keys of the job `run_id` (apart from the agents')."""
    return PrefixStore(f"{run_id}/pd", store)


class NodesRendezvous(StaticTCPRendezvous):
    """torch's static rendezvous over the store `open_job_store` opened in this process."""

    def get_backend(self) -> str:
        return NODES_RDZV_BACKEND

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._store = _stores.get(self.run_id)
        return super().next_rendezvous()


def _create_nodes_rendezvous(params: RendezvousParameters) -> RendezvousHandler:
    static = create_rdzv_handler(params)
    assert isinstance(static, StaticTCPRendezvous)
    return NodesRendezvous(static.master_addr, static.master_port, static.rank, static.world_size, static.run_id,
                           int(static.timeout.total_seconds()))


rendezvous_handler_registry.register(NODES_RDZV_BACKEND, _create_nodes_rendezvous)

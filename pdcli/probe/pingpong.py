"""The socket transport between two processes of this host, measured: a ping-pong.

`measure_socket_transport` forks a process that echoes messages over pd's own socket transport
(`pdcli.runtime.sockets`) and times round trips at two sizes: the latency and bandwidth of a
message, and the sender's `isend` call in its bytes. One of the host's own figures
(`pdcli.probe.hostfile`): measured once per host.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from typing import Sequence

import torch

from pdcli.planner.runtime_costs import Affine, fit_affine, steady_mean
from pdcli.runtime.sockets import SocketTransport, _Peer

PINGPONG_BYTES = (4 << 10, 1 << 20)
PINGPONG_REPEATS = 40
PINGPONG_TIMEOUT_S = 20.0


def _echo(sock: socket.socket, sizes: Sequence[int], repeats: int) -> None:
    transport = SocketTransport({0: _Peer(0, sock)}, PINGPONG_TIMEOUT_S)
    for size in sizes:
        buf = torch.empty(size, dtype=torch.uint8)
        for i in range(repeats):
            transport.irecv(buf, 0, i).wait()
            transport.isend(buf, 0, i).wait()
    os._exit(0)


def measure_socket_transport() -> tuple[float, float, Affine] | None:
    """(latency ms, bandwidth bytes/s, the sender's `isend` call in its message bytes) of the
    socket transport between two processes of this host, from ping-pong means at two sizes;
    None where it cannot run (no fork)."""
    if os.name != "posix" or "fork" not in multiprocessing.get_all_start_methods():
        return None
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = multiprocessing.get_context("fork").Process(target=_echo, args=(theirs, PINGPONG_BYTES, PINGPONG_REPEATS),
                                                        daemon=True)
    child.start()
    theirs.close()
    transport = SocketTransport({1: _Peer(1, ours)}, PINGPONG_TIMEOUT_S)
    one_way_ms, call_ms = [], []
    try:
        for size in PINGPONG_BYTES:
            buf = torch.zeros(size, dtype=torch.uint8)
            back = torch.empty(size, dtype=torch.uint8)
            samples, calls = [], []
            for i in range(PINGPONG_REPEATS):
                start = time.perf_counter()
                transport.isend(buf, 1, i)
                calls.append((time.perf_counter() - start) * 1e3)
                transport.irecv(back, 1, i).wait()
                samples.append((time.perf_counter() - start) * 1e3 / 2)
            one_way_ms.append(steady_mean(samples))
            call_ms.append(steady_mean(calls))
    finally:
        transport.close()
        child.join(timeout=PINGPONG_TIMEOUT_S)
        if child.is_alive():
            child.kill()
    (small, large), (t_small, t_large) = PINGPONG_BYTES, one_way_ms
    per_byte_ms = max(t_large - t_small, 1e-9) / (large - small)
    return (max(t_small - small * per_byte_ms, 0.0), 1e3 / per_byte_ms,
            fit_affine(list(PINGPONG_BYTES), call_ms))

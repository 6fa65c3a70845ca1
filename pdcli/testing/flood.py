"""Junk connections to a job's listening ports, as a stranger on the host would open them.

`listening_tcp_ports(pids)` finds the TCP ports processes listen on (/proc: their sockets'
inodes in /proc/net/tcp and tcp6, state LISTEN), reached through loopback; `open_junk` opens
`count` connections spread over them and holds them: a third silent, a third sending a few
random bytes, a third filling the socket's buffer with 0xff; `threads_of(pid)` reads a
process's thread count. Used by the flood test (`tests/test_multihost.py`) and
`benchmarks/bench_flood.py`. Linux only (/proc).
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path
from typing import Iterable

FILL_BYTES = 65536
"""What the third kind of connection sends at once, without waiting: what fits its buffer."""


def socket_inodes(pids: Iterable[int]) -> set[str]:
    """Inodes of the sockets processes `pids` hold open (/proc/<pid>/fd); a process gone is skipped."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
        except OSError:
            continue
    return inodes


def listening_tcp_ports(pids: Iterable[int]) -> list[tuple[str, int]]:
    """(loopback address, port) of each TCP socket listening in processes `pids`."""
    inodes = socket_inodes(pids)
    found = set()
    for table, loopback in (("/proc/net/tcp", "127.0.0.1"), ("/proc/net/tcp6", "::1")):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) >= 10 and fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.add((loopback, int(fields[1].rsplit(":", 1)[1], 16)))
    return sorted(found)


def threads_of(pid: int) -> int:
    """The number of threads of process `pid` (/proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise ValueError(f"/proc/{pid}/status has no Threads line")


def open_junk(ports: list[tuple[str, int]], count: int, seed: int = 0, timeout_s: float = 5.0) -> list[socket.socket]:
    """`count` connections over `ports` in turn, each kept open (the caller closes them): silent,
    a few random bytes, or a buffer of 0xff. A connection the listener refuses or closes is kept
    as it is; one that cannot be opened at all raises (OSError)."""
    if not ports:
        raise ValueError("no ports to connect to")
    rng = random.Random(seed)
    opened: list[socket.socket] = []
    try:
        for i in range(count):
            s = socket.create_connection(ports[i % len(ports)], timeout=timeout_s)
            opened.append(s)
            try:
                if i % 3 == 1:
                    s.sendall(rng.randbytes(rng.randrange(1, 256)))
                elif i % 3 == 2:
                    s.setblocking(False)
                    s.send(b"\xff" * FILL_BYTES)
            except OSError:
                pass  # refused and closed by the listener
    except BaseException:
        for s in opened:
            s.close()
        raise
    return opened

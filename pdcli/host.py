"""What this host offers its workers: the CPU cores this process may run on, and where it
sits on the network (which peers share its namespace, the address that reaches them)."""

from __future__ import annotations

import os


def host_cores() -> int:
    """Cores this process may run on (its affinity where the OS has one, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def core_share(local_rank: int, local_workers: int) -> list[int] | None:
    """The cores worker `local_rank` of `local_workers` on this host gets to itself: an equal,
    contiguous share of the cores this process may run on. None when there are fewer cores
    than workers or the OS cannot pin."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // max(local_workers, 1)
    if share == 0 or not 0 <= local_rank < local_workers:
        return None
    return cores[local_rank * share:(local_rank + 1) * share]


def pin_process(cores: list[int]) -> None:
    """Every thread of this process (those already started too; threads started later
    inherit it) on `cores` only."""
    from pathlib import Path

    tasks = Path("/proc/self/task")
    for tid in [int(t.name) for t in tasks.iterdir()] if tasks.exists() else [0]:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # a thread that has just ended
            pass


def network_host_id() -> str:
    """Which workers can reach each other through an abstract Unix socket: those of one
    kernel (its boot id) in one network namespace (its inode). Hostnames alone do not tell:
    two network namespaces of one machine share it."""
    import socket
    from pathlib import Path

    boot = Path("/proc/sys/kernel/random/boot_id")
    kernel = boot.read_text().strip() if boot.exists() else ""
    try:
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}/{kernel}/{namespace}"


def reach_address(peer_host: str) -> str:
    """This host's address on the interface that routes to `peer_host` (asks the kernel's
    routing table through an unconnected UDP socket; no packet is sent)."""
    import socket

    family, _, _, _, sockaddr = socket.getaddrinfo(peer_host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return str(s.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The name of the network interface holding `address` (None when none does)."""
    import fcntl
    import ipaddress
    import socket
    import struct
    from pathlib import Path

    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        table = Path("/proc/net/if_inet6")
        for line in table.read_text().splitlines() if table.exists() else []:
            fields = line.split()
            if ipaddress.ip_address(bytes.fromhex(fields[0])) == ip:
                return fields[-1]
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue  # an interface without an IPv4 address
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


HOST_SPEED_META = "host_speed_ms"
"""Where a profile (`meta`) and a run (`train/summary.json`) record `host_speed_ms()`."""
HOST_SPEED_SECONDS = 0.2
HOST_SPEED_SHAPE = (128, 512, 512)
"""The reference matmul: (rows, inner, columns), float32, one thread: about 34 MFLOP, a
millisecond or two on one core."""


def host_speed_ms(seconds: float = HOST_SPEED_SECONDS) -> float:
    """This CPU's speed at the moment: the median time (ms) of a fixed one-thread float32
    matmul (`HOST_SPEED_SHAPE`) repeated for `seconds`. A profile and a run each record it, so
    a report can tell a host that ran slower during training (a busy machine, a lower clock)
    from a plan that priced the work wrong."""
    import statistics
    import time

    import torch

    rows, inner, cols = HOST_SPEED_SHAPE
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, inner, generator=generator), torch.randn(inner, cols, generator=generator)
    samples: list[float] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(3):  # warm-up
            torch.mm(a, b)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(samples) < 5:
            start = time.perf_counter()
            torch.mm(a, b)
            samples.append((time.perf_counter() - start) * 1e3)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(samples)

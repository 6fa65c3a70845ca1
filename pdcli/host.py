"""What this host offers its workers: the CPU cores this process may run on."""

from __future__ import annotations

import os


def host_cores() -> int:
    """Cores this process may run on (its affinity where the OS has one, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1

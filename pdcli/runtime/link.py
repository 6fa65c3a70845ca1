"""The link between two hosts, measured once at the start of a multi-node run (`train/link.json`).

Rank 0 (node 0) and the first rank of node 1 exchange a few tiny messages (their round trip
is the latency) and then one message at a time growing from START_BYTES until one takes at
least GROW_UNTIL_S (or reaches MAX_BYTES): bandwidth = bytes / (its time - the tiny round
trip). On a 25 Mbit/s link that is 64 KiB .. 1 MiB, about 0.7 s in all. Beside the
measurement the record keeps what the plan assumed: the bandwidth of the outermost cluster
level the two ranks span (`pdcli.planner.topology` numbers ranks so a level's group is an
aligned block). The arithmetic and the warning are pure; only `measure` touches
torch.distributed.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from pdcli.rundir import atomic_write_json, read_json

if TYPE_CHECKING:
    import torch

LINK_FILE = "link.json"
START_BYTES = 64 << 10
MAX_BYTES = 32 << 20
GROW_UNTIL_S = 0.2
"""A message that took this long measures the bandwidth; a faster one is doubled and sent again."""
NUM_TINY = 5
"""Round trips of an 8-byte message whose median is the latency (both ways)."""
MISMATCH_FACTOR = 2.0
"""Measured and configured bandwidth further apart than this factor (either way) get a warning."""
_STOP = -1
_TINY = 0


def next_size(size_bytes: int, elapsed_s: float) -> int | None:
    """The next message to time after one of `size_bytes` took `elapsed_s`; None: that one measures."""
    if elapsed_s >= GROW_UNTIL_S or size_bytes >= MAX_BYTES:
        return None
    return min(2 * size_bytes, MAX_BYTES)


def grow_until_measured(time_message: Callable[[int], float]) -> tuple[int, float]:
    """(bytes, seconds) of the message that measures the link: `time_message(n)` sends n bytes
    and returns how long they took with their acknowledgement, from START_BYTES up (`next_size`)."""
    size_bytes = START_BYTES
    while True:
        elapsed_s = time_message(size_bytes)
        grown = next_size(size_bytes, elapsed_s)
        if grown is None:
            return size_bytes, elapsed_s
        size_bytes = grown


def bandwidth_bytes_per_s(size_bytes: int, elapsed_s: float, round_trip_s: float) -> float:
    """Bytes over the time the message took beyond a tiny one's round trip (its acknowledgement
    comes back the same way); at least half of `elapsed_s` counts as transfer, so noise in the
    round trip cannot make the rate unbounded."""
    return size_bytes / max(elapsed_s - round_trip_s, elapsed_s / 2, 1e-9)


def spanned_level(levels: Sequence[Any], rank_a: int, rank_b: int) -> int:
    """The index of the innermost cluster level whose group holds both ranks (the outermost
    one when they are beyond the cluster's devices). `levels`: dicts or objects with `devices`."""
    group = 1
    for index, level in enumerate(levels):
        group *= int(level["devices"] if isinstance(level, dict) else level.devices)
        if rank_a // group == rank_b // group:
            return index
    return len(levels) - 1


def level_bandwidth(levels: Sequence[Any], index: int) -> float:
    level = levels[index]
    return float(level["bandwidth_bytes_per_s"] if isinstance(level, dict) else level.bandwidth_bytes_per_s)


def link_record(size_bytes: int, elapsed_s: float, round_trips_s: Sequence[float], levels: Sequence[Any],
                ranks: tuple[int, int], nodes: tuple[int, int]) -> dict[str, Any]:
    """`train/link.json`: the measurement (its last, largest message and the tiny round trips)
    beside the bandwidth of the level the plan priced between `ranks` (on `nodes`)."""
    round_trip_s = statistics.median(round_trips_s)
    level = spanned_level(levels, *ranks)
    return {
        "measured_bandwidth_bytes_per_s": bandwidth_bytes_per_s(size_bytes, elapsed_s, round_trip_s),
        "latency_ms": round_trip_s / 2 * 1e3,
        "configured_bandwidth_bytes_per_s": level_bandwidth(levels, level),
        "level": level,
        "between": list(nodes),
        "ranks": list(ranks),
        "message_bytes": size_bytes,
        "message_s": elapsed_s,
    }


def rate_text(bytes_per_s: float) -> str:
    """`6.25 MB/s (50 Mbit/s)`."""
    return f"{bytes_per_s / 1e6:.3g} MB/s ({bytes_per_s * 8 / 1e6:.3g} Mbit/s)"


def mismatched(link: dict[str, Any]) -> bool:
    """Measured and configured bandwidth differ by more than MISMATCH_FACTOR."""
    measured, configured = float(link["measured_bandwidth_bytes_per_s"]), float(link["configured_bandwidth_bytes_per_s"])
    return max(measured, configured) > MISMATCH_FACTOR * min(measured, configured)


def level_key(link: dict[str, Any]) -> str:
    return f"cluster.levels.{int(link['level'])}.bandwidth_bytes_per_s"


def link_text(link: dict[str, Any]) -> str:
    """The measured link beside the configured level: `between node 0 and node 1: measured ...`."""
    a, b = link["between"]
    return (f"between node {a} and node {b}: measured {rate_text(link['measured_bandwidth_bytes_per_s'])}, "
            f"latency {link['latency_ms']:.3g} ms; {level_key(link)} is {rate_text(link['configured_bandwidth_bytes_per_s'])}")


def link_warning(link: dict[str, Any], calibrate_command: str) -> str | None:
    """The warning line when the measured link is more than MISMATCH_FACTOR off the configured
    one, naming the key, both numbers and the fixes (`calibrate_command`: the `pd plan ...
    --calibrate RUN` that adopts the measurement); None when they agree."""
    if not mismatched(link):
        return None
    measured, configured = float(link["measured_bandwidth_bytes_per_s"]), float(link["configured_bandwidth_bytes_per_s"])
    return (f"warning: the link between node {link['between'][0]} and node {link['between'][1]} measured "
            f"{rate_text(measured)}, {measured / configured:.3g}x the {rate_text(configured)} of {level_key(link)} "
            f"the plan priced; adopt the measurement with `{calibrate_command}`, or set "
            f"{level_key(link)}={measured:.3g}")


def read_link(train_dir: Path) -> dict[str, Any] | None:
    """The run's `link.json`, or None where the run measured none."""
    path = train_dir / LINK_FILE
    return read_json(path, "link measurement") if path.exists() else None


def adopted_levels(levels: Sequence[Any], link: dict[str, Any]) -> list[dict[str, Any]]:
    """`levels` as dicts with the measured bandwidth in place of the configured one at the
    link's level (unchanged where that level is not in `levels`)."""
    out = [{"devices": int(lv["devices"] if isinstance(lv, dict) else lv.devices),
            "bandwidth_bytes_per_s": level_bandwidth(levels, i)} for i, lv in enumerate(levels)]
    index = int(link["level"])
    if 0 <= index < len(out):
        out[index]["bandwidth_bytes_per_s"] = float(link["measured_bandwidth_bytes_per_s"])
    return out


def measure(peer: int, measurer: bool, device: "torch.device") -> tuple[int, float, list[float]] | None:
    """The link's two ends call it, no other rank: the measurer returns (bytes, seconds) of the
    message that measured the link and the tiny round trips (s); the other end answers and returns None.
    The first message of each exchange is an int64 saying what comes next (its size,
    _TINY or _STOP), so the answering end needs no timing of its own."""
    import torch
    import torch.distributed as dist

    control = torch.zeros(1, dtype=torch.int64, device=device)
    ack = torch.zeros(1, dtype=torch.uint8, device=device)

    def done() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NCCL's send/recv return before the transfer ends

    if not measurer:
        while True:
            dist.recv(control, peer)
            announced = int(control.item())
            if announced == _STOP:
                return None
            if announced > 0:
                dist.recv(torch.empty(min(announced, MAX_BYTES), dtype=torch.uint8, device=device), peer)
            dist.send(ack, peer)
    round_trips = []
    for _ in range(NUM_TINY):
        start_s = time.perf_counter()
        control.fill_(_TINY)
        dist.send(control, peer)
        dist.recv(ack, peer)
        done()
        round_trips.append(time.perf_counter() - start_s)

    def time_message(size_bytes: int) -> float:
        control.fill_(size_bytes)
        dist.send(control, peer)
        payload = torch.zeros(size_bytes, dtype=torch.uint8, device=device)
        done()
        start_s = time.perf_counter()
        dist.send(payload, peer)
        dist.recv(ack, peer)
        done()
        return time.perf_counter() - start_s

    size_bytes, elapsed_s = grow_until_measured(time_message)
    control.fill_(_STOP)
    dist.send(control, peer)
    return size_bytes, elapsed_s, round_trips


def planned_levels(plan: dict[str, Any], fallback_levels: Sequence[Any]) -> Sequence[Any]:
    """The cluster levels `plan` was made for (`inputs.topology.levels`), else `fallback_levels`."""
    return ((plan.get("inputs") or {}).get("topology") or {}).get("levels") or fallback_levels


def measure_in_run(train_dir: Path, plan: dict[str, Any], rank: int, world_size: int, local_world_size: int,
                   device: "torch.device", fallback_levels: Sequence[Any]) -> dict[str, Any] | None:
    """In a worker of a job on several hosts: rank 0 and node 1's first rank measure their link;
    rank 0 writes `train/link.json` and returns the record; every other rank returns None at once.
    The configured levels are the plan's topology (else `fallback_levels`, the config's)."""
    nnodes = world_size // max(local_world_size, 1)
    if nnodes < 2:
        return None
    peer = local_world_size  # node 1's first rank: ranks fill nodes in blocks
    if rank not in (0, peer):
        return None
    measured = measure(peer if rank == 0 else 0, rank == 0, device)
    if measured is None:
        return None
    levels = planned_levels(plan, fallback_levels)
    record = link_record(*measured, levels, (0, peer), (0, 1))
    atomic_write_json(train_dir / LINK_FILE, record)
    return record

"""Hierarchical cluster topology: levels innermost first, each with a device count and bandwidth.

Ranks are numbered so that a level-L group is a contiguous, aligned block of ranks: with
levels `[{devices: 8, bw0}, {devices: 4, bw1}]`, ranks 0-7 share a node (bw0) and ranks 8-15
the next one; two ranks in different nodes talk at bw1. A set of ranks communicates at the
bandwidth of the outermost level it spans (normally its slowest link).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from pdcli.errors import UserError


@dataclass(frozen=True)
class Level:
    devices: int
    """Groups of the previous level (devices for the innermost) joined at this level."""
    bandwidth_bytes_per_s: float
    """Bandwidth between two devices that first meet at this level."""


@dataclass(frozen=True)
class Topology:
    levels: tuple[Level, ...]

    def __post_init__(self) -> None:
        if not self.levels:
            raise UserError("the cluster needs at least one level, e.g. [{devices: 2}]")
        for i, level in enumerate(self.levels):
            if int(level.devices) != level.devices or level.devices < 1:
                raise UserError(f"cluster.levels.{i}.devices must be an integer >= 1, got {level.devices}")
            if not level.bandwidth_bytes_per_s > 0:
                raise UserError(
                    f"cluster.levels.{i}.bandwidth_bytes_per_s must be > 0, got {level.bandwidth_bytes_per_s}"
                )

    @classmethod
    def from_levels(cls, levels: Iterable[Any]) -> "Topology":
        """From dicts (`{"devices", "bandwidth_bytes_per_s"}`) or objects with those attributes."""
        out = []
        for level in levels:
            if isinstance(level, Mapping):
                out.append(Level(int(level["devices"]), float(level["bandwidth_bytes_per_s"])))
            else:
                out.append(Level(int(level.devices), float(level.bandwidth_bytes_per_s)))
        return cls(tuple(out))

    @classmethod
    def flat(cls, num_devices: int, bandwidth_bytes_per_s: float = 10e9) -> "Topology":
        return cls((Level(num_devices, bandwidth_bytes_per_s),))

    def to_json(self) -> dict[str, Any]:
        return {
            "levels": [
                {"devices": lv.devices, "bandwidth_bytes_per_s": lv.bandwidth_bytes_per_s}
                for lv in self.levels
            ]
        }

    @property
    def num_devices(self) -> int:
        n = 1
        for level in self.levels:
            n *= level.devices
        return n

    @property
    def group_sizes(self) -> tuple[int, ...]:
        """Ranks per level-L group: (d0, d0*d1, ...)."""
        sizes, n = [], 1
        for level in self.levels:
            n *= level.devices
            sizes.append(n)
        return tuple(sizes)

    @property
    def alignment(self) -> int:
        """Shifting every rank by a multiple of this keeps all bandwidths unchanged."""
        sizes = self.group_sizes
        return sizes[-2] if len(sizes) > 1 else 1

    @property
    def is_uniform(self) -> bool:
        """True when every pair of ranks talks at the same bandwidth."""
        return len({lv.bandwidth_bytes_per_s for lv in self.levels if lv.devices > 1}) <= 1

    def span_bandwidth(self, first_rank: int, last_rank: int) -> float:
        """Bandwidth of the outermost level spanned by ranks first..last (inclusive)."""
        return float(self.span_bandwidth_matrix(max(first_rank, last_rank) + 1)[first_rank, last_rank])

    def span_bandwidth_matrix(self, num_ranks: int | None = None) -> np.ndarray:
        """B[a, b] = bandwidth spanned by ranks a..b (symmetric; inf on the diagonal)."""
        n = self.num_devices if num_ranks is None else num_ranks
        ranks = np.arange(n)
        out = np.full((n, n), np.inf)
        # Walk outward: pairs in the same level-L group but not the same level-(L-1) group.
        inner = np.ones((n, n), dtype=bool) & (ranks[:, None] == ranks[None, :])
        for size, level in zip(self.group_sizes, self.levels):
            same = (ranks[:, None] // size) == (ranks[None, :] // size)
            out[same & ~inner] = level.bandwidth_bytes_per_s
            inner = same
        out[~inner] = self.levels[-1].bandwidth_bytes_per_s  # beyond the cluster (not used)
        return out

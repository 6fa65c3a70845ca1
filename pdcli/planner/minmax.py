"""The (min, max) update that fills PipeDream's tables, exact, over the splits a compute bound leaves.

`pdcli.planner.pipedream` builds A[i, j, m] (positions i..j on m + 1 machines) from
A[i, j, m] = min over a split k and the last stage's replicas mp of max(A[i, k, m - mp],
last(k, j)): about positions^3 / 3 triples (i, k, j) per (m, mp) when done densely. Where
`ComputeBound` holds, every split has a lower bound from the compute alone, so only a narrow
window of k around the point where the two sides balance can reach the best value; the
update tries only those k, and its result (ties going to the smallest k) is the dense one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np

MAX_CHUNK_ELEMENTS = 2_000_000
"""Most (i, k, j) triples held at once."""
PAIRS_PER_BLOCK = 1 << 17
"""(i, j) pairs whose windows are found at once."""
DENSE_FRACTION = 0.25
"""A block of rows whose windows hold more than this share of its dense triples runs dense."""
BOUND_SLACK = 1e-9
"""Relative widening of every bound against rounding (the bound holds in exact arithmetic)."""

Improvement = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""(local rows, ends j, new values, splits k) of the entries an update lowers."""


class LastStage(Protocol):
    """The cost of a last stage (k, j]: at index arrays, or as the [k, j] matrix of the splits k
    that can have a finite cost (`splits`, ascending)."""

    @property
    def splits(self) -> np.ndarray: ...

    def at(self, k: np.ndarray, j: np.ndarray) -> np.ndarray: ...

    def matrix(self) -> np.ndarray: ...


@dataclass(frozen=True)
class ComputeBound:
    """A lower bound on every entry of a level's table from the compute alone.

    When the covered compute C and the covered parameter bytes never decrease along the
    positions (our chains; antichain DAGs whose states only grow), every range's compute
    C[j] - C[i-1] and all-reduce are >= 0, so a stage on r replicas costs at least its
    compute / r (at an outer level, its inner table entry / r: at least its compute over
    the devices under it), and a plan of positions i..j on d devices at least
    (C[j] - C[i-1]) / d, since its slowest stage costs at least the mediant of all. So a
    split at k can reach a value U only if C[k] <= C[i-1] + U x (devices before it) and
    C[k] >= C[j] - U x (devices of the last stage): a window of k, found by bisection."""

    covered_s: np.ndarray
    """C[k]: compute seconds of everything at or before position k (nondecreasing)."""
    devices_per_machine: int
    """Devices one machine of the level stands for (the product of the inner levels')."""

    @classmethod
    def of(cls, covered_s: np.ndarray, parameter_bytes: np.ndarray, devices_per_machine: int) -> "ComputeBound | None":
        """The bound, or None when a range could cost less than its compute (C or the
        parameters decrease somewhere, so a row starting after a non-ancestor has a
        negative compute or all-reduce)."""
        if np.all(np.diff(covered_s) >= 0) and np.all(np.diff(parameter_bytes) >= 0):
            return cls(covered_s, devices_per_machine)
        return None

    def widen(self, limit: np.ndarray | float) -> np.ndarray | float:
        with np.errstate(invalid="ignore"):
            return limit * (1.0 + BOUND_SLACK) + BOUND_SLACK * abs(float(self.covered_s[-1]))

    def starts(self, machines: int, limit: float) -> np.ndarray:
        """The rows (range starts) where a plan of all positions on `machines` machines of
        the level costing at most `limit` can start a stage: 0, and each k + 1 such that the
        positions up to k fit on some p machines and the rest on the other machines - p."""
        c, d = self.covered_s, self.devices_per_machine
        widened = self.widen(limit)
        p = np.arange(1, machines)[:, None]
        head, tail = c[None, :-1], c[-1] - c[None, :-1]
        fits = ((head <= p * d * widened) & (tail <= (machines - p) * d * widened)).any(axis=0)
        return np.concatenate(([0], 1 + np.flatnonzero(fits)))

    def even_starts(self, machines: int, around: int = 2) -> np.ndarray:
        """0 and the starts within `around` positions of where the compute splits evenly over
        `machines` machines: the rows of a quick plan whose cost bounds the optimum."""
        c = self.covered_s
        k = np.searchsorted(c, c[-1] * np.arange(1, machines) / machines)
        near = (k[:, None] + np.arange(-around, around)[None, :]).ravel()
        near = near[(near >= 0) & (near <= len(c) - 2)]
        return np.unique(np.concatenate(([0], near + 1)))


def minmax_update(prev: np.ndarray, current: np.ndarray, rows: np.ndarray, later: np.ndarray,
                  last_stage: LastStage, bound: ComputeBound | None, before: int, last: int) -> Iterator[Improvement]:
    """The entries min_k max(prev[r, k], cost[k, j]) lowers below current[r, j], j > rows[r],
    with the smallest such k on ties, block of rows by block of rows (apply each block before
    asking for the next). prev and current are (len(rows), n) over the global range starts
    `rows`; `before` and `last` are the machines before the split and of the last stage. With
    a bound, each (r, j) tries only its window of k against U = min(current, the value at the
    two k where the bound balances); a block whose windows are wide runs dense."""
    num_rows, n = prev.shape
    block = max(1, PAIRS_PER_BLOCK // n)
    for a in range(0, num_rows, block):
        b = min(num_rows, a + block)
        if bound is not None:
            pairs = _windows(prev, current, rows, a, b, later, last_stage, bound, before, last)
            if pairs is None:
                continue
            k0 = min(int(rows[a]), n - 1)
            if pairs[3].sum() <= DENSE_FRACTION * (b - a) * (n - k0) ** 2 / 2:
                yield from _gather(prev, current, *pairs, last_stage)
                continue
        yield from _dense(prev, current, rows, a, b, later, last_stage.splits, last_stage.matrix())


def _windows(prev: np.ndarray, current: np.ndarray, rows: np.ndarray, a: int, b: int, later: np.ndarray,
             last_stage: LastStage, bound: ComputeBound, before: int,
             last: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """(local rows, ends j, window starts, window widths) of the pairs of rows a..b-1 whose
    window of k is not empty; None when none is."""
    n = prev.shape[1]
    starts = rows[a:b]
    j0 = min(int(starts[0]) + 1, n)
    cols = np.arange(j0, n)
    if not len(cols):
        return None
    c = bound.covered_s
    start = np.concatenate(([0.0], c))[starts][:, None]  # C[i - 1]
    end = c[cols][None, :]
    devices_before, devices_last = bound.devices_per_machine * before, bound.devices_per_machine * last
    first_k = np.broadcast_to(np.minimum(starts, n - 1)[:, None], (b - a, len(cols)))  # k >= i
    last_k = np.maximum(cols[None, :] - 1, first_k)  # k < j
    ends = np.broadcast_to(cols[None, :], first_k.shape)
    flat, base = prev.ravel(), (np.arange(a, b) * n)[:, None]
    balance = np.searchsorted(c, (devices_last * start + devices_before * end) / (devices_before + devices_last))
    limit = current[a:b, j0:]
    for k in (balance - 1, balance):
        k = np.clip(k, first_k, last_k)
        limit = np.minimum(limit, np.maximum(flat[base + k], last_stage.at(k, ends)))
    widened = bound.widen(limit)
    with np.errstate(invalid="ignore"):
        lo = np.maximum(np.searchsorted(c, (end - devices_last * widened).ravel()).reshape(limit.shape), first_k)
        hi = np.minimum(np.searchsorted(c, (start + devices_before * widened).ravel(), side="right")
                        .reshape(limit.shape), ends)
    r, j = np.nonzero(later[a:b, j0:] & (hi > lo))
    if not len(r):
        return None
    return a + r, cols[j], lo[r, j], (hi - lo)[r, j]


def _gather(prev: np.ndarray, current: np.ndarray, r: np.ndarray, j: np.ndarray, lo: np.ndarray,
            width: np.ndarray, last_stage: LastStage) -> Iterator[Improvement]:
    """The update of the pairs (r, j) over k in [lo, lo + width), in pieces of at most
    MAX_CHUNK_ELEMENTS triples."""
    n = prev.shape[1]
    flat = prev.ravel()
    total = np.cumsum(width)
    cuts = np.searchsorted(total, np.arange(MAX_CHUNK_ELEMENTS, int(total[-1]), MAX_CHUNK_ELEMENTS), side="right")
    for s, e in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [len(r)]))):
        if s == e:
            continue
        w = width[s:e]
        first = np.cumsum(w) - w
        owner = np.repeat(np.arange(e - s), w)
        k = lo[s:e][owner] + np.arange(int(w.sum())) - first[owner]
        rows, ends = r[s:e], j[s:e]
        value = np.maximum(flat[rows[owner] * n + k], last_stage.at(k, ends[owner]))
        best = np.minimum.reduceat(value, first)
        arg = np.minimum.reduceat(np.where(value == best[owner], k, n), first)
        better = best < current[rows, ends]
        yield rows[better], ends[better], best[better], arg[better]


def _dense(prev: np.ndarray, current: np.ndarray, rows: np.ndarray, a: int, b: int, later: np.ndarray,
           splits: np.ndarray, cost: np.ndarray) -> Iterator[Improvement]:
    """The update of rows a..b-1 over every k of `splits` (cost: their rows of the [k, j]
    matrix), as (rows, k, j) blocks. prev[r, k] is inf for k < rows[r] and cost[k, j] for
    j <= k, so a block of rows starting at row k0 only needs k, j >= k0: the work is about
    n^3 / 3, not n^3, with every k a split."""
    n = prev.shape[1]
    lo = a
    while lo < b:
        k0 = min(int(rows[lo]), n - 1)
        first = int(np.searchsorted(splits, k0))
        ks = splits[first:]
        hi = min(b, lo + max(1, MAX_CHUNK_ELEMENTS // max(len(ks) * (n - k0), 1)))
        if len(ks):
            total = np.maximum(prev[lo:hi, ks][:, :, None], cost[None, first:, k0:])  # (rows, k, j)
            arg = total.argmin(axis=1)
            cand = np.take_along_axis(total, arg[:, None, :], axis=1)[:, 0, :]
            r, j = np.nonzero(later[lo:hi, k0:] & (cand < current[lo:hi, k0:]))
            yield lo + r, k0 + j, cand[r, j], ks[arg[r, j]]
        lo = hi

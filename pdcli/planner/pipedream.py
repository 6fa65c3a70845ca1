"""PipeDream's cost model and hierarchical search (`cost_model="pipedream"`), vectorized.

Reproduces `compute_partitioning` / `analyze_partitioning` of msr-fiddle/pipedream
`optimizer/optimizer_graph_hierarchical.py` with activation compression ratio 1:
A[i, j, m] is the best time per minibatch (seconds) of the positions i..j (row i = start
right after position i-1) on m + 1 machines of one level. One stage on m + 1 replicas costs
(compute + 4 m P / (bw (m + 1)) / machines_per_machine) / (m + 1); adding a last stage
(k, j] on m' replicas after a split at k (a DAG ancestor of j) costs
max(A[i, k, m - m'], (compute + 4 (m' - 1) P / (bw m')) / m', 2 out_k / (bw m'),
2 out_j / (bw m')). Levels are solved innermost first; a level's best time with all its
machines becomes the compute time of the next level. PipeDream's quirks are kept (the
first stage of a range pays no transfers; the outer levels divide only the one-stage
all-reduce by the inner machine count), since the point is to reproduce its optimum.
The loop over (i, k, j) is `pdcli.planner.minmax`'s update: only the splits k a compute
bound leaves where it holds, every k otherwise; with that bound the level under the
outermost one holds only the rows (range starts) an outermost stage can use.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from pdcli.planner.minmax import MAX_CHUNK_ELEMENTS, ComputeBound, minmax_update
from pdcli.planner.options import POSITION_PAIR_BYTES, PlanOptions, check_table
from pdcli.planner.space import SplitSpace
from pdcli.planner.topology import Topology

ACTIVATION_COMPRESSION_RATIO = 1.0
ALLREDUCE_FACTOR = 4.0
"""PipeDream charges 4 (m - 1) / m * P / bw for the all-reduce of P bytes over m replicas."""
TRANSFER_FACTOR = 2.0


@dataclass(frozen=True, eq=False)
class LevelTable:
    rows: np.ndarray
    """The range starts the table holds (ascending): all, or those an outer stage can use."""
    time_s: np.ndarray
    """(machines, len(rows), n): best time of rows[r]..j on m + 1 machines; inf = impossible."""
    split_k: np.ndarray
    """Position before the last stage, or -1 when the range is one stage."""
    split_m: np.ndarray
    machines: np.ndarray
    """Replicas of the last stage."""

    def row(self, start: int) -> int:
        return int(np.searchsorted(self.rows, start))

    def compute_of_next_level(self) -> np.ndarray:
        """(n + 1, n): the best time of each range on all machines, inf for rows not held."""
        n = self.time_s.shape[2]
        out = np.full((n + 1, n), np.inf)
        out[self.rows] = self.time_s[-1]
        return out


@dataclass(frozen=True)
class PdStage:
    """One stage of a PipeDream plan, with the level-by-level stages that contain it."""

    start: int
    end: int
    ranks: tuple[int, ...]
    path: tuple[tuple[int, int, int, int, bool], ...]
    """(level, start, end, machines, first stage of its range) from the top level down."""


@dataclass(frozen=True, eq=False)
class _LastStage:
    """PipeDream's cost of a last stage (k, j] (positions k+1..j) on `mp` replicas:
    max((compute + 4 (mp - 1) P / (bw mp)) / mp, 2 out_k / (bw mp), 2 out_j / (bw mp)); inf
    unless k is a DAG ancestor of j and, under a memory limit, the stage's weights and
    activations times `stash` fit."""

    ct: np.ndarray
    psz: np.ndarray
    asz: np.ndarray
    comm_in: np.ndarray
    comm_out: np.ndarray
    split_ok: np.ndarray
    splits: np.ndarray
    """The k whose last stages can have a cost (the next row holds a finite compute)."""
    bw: float
    mem: float | None
    matrices: dict[int, np.ndarray]
    """`matrix()` before the memory rule, per mp (the same for every m)."""
    mp: int = 1
    stash: int = 1

    def _cost(self, ct: np.ndarray, psz: np.ndarray, comm_in: np.ndarray, comm_out: np.ndarray,
              ok: np.ndarray) -> np.ndarray:
        mp = self.mp
        last = (ct + ALLREDUCE_FACTOR * (mp - 1) * psz / (self.bw * mp)) / mp
        cost = np.maximum(np.maximum(last, comm_in / mp), comm_out / mp)
        return np.where(ok & np.isfinite(last), cost, np.inf)

    def _fits(self, cost: np.ndarray, asz: np.ndarray, psz: np.ndarray) -> np.ndarray:
        """PipeDream's stash rule: it depends on the machines used so far, so it is applied per m."""
        return cost if self.mem is None else np.where((asz + psz) * self.stash <= self.mem, cost, np.inf)

    def at(self, k: np.ndarray, j: np.ndarray) -> np.ndarray:
        i = k + 1
        cost = self._cost(self.ct[i, j], self.psz[i, j], self.comm_in[k], self.comm_out[j], self.split_ok[k, j])
        return self._fits(cost, self.asz[i, j], self.psz[i, j])

    def matrix(self) -> np.ndarray:
        """[k, j] for the splits k and every j."""
        i = self.splits + 1
        if self.mp not in self.matrices:
            self.matrices[self.mp] = self._cost(self.ct[i], self.psz[i], self.comm_in[self.splits, None],
                                                self.comm_out[None, :], self.split_ok[self.splits])
        return self._fits(self.matrices[self.mp], self.asz[i], self.psz[i])


def _level(ct: np.ndarray, psz: np.ndarray, asz: np.ndarray, oas: np.ndarray, split_ok: np.ndarray,
           machines: int, bw: float, within: int, options: PlanOptions, rows: np.ndarray,
           bound: ComputeBound | None) -> LevelTable:
    """The level's table over the range starts `rows` (the outermost level needs row 0 alone)."""
    n = ct.shape[1]
    mem = options.memory_bytes_per_device
    shape = (machines, len(rows), n)
    time = np.full(shape, np.inf)
    split_k = np.full(shape, -1, dtype=np.int32)
    split_m = np.zeros(shape, dtype=np.int32)
    reps = np.zeros(shape, dtype=np.int32)
    ct_rows, psz_rows, asz_rows = ct[rows], psz[rows], asz[rows]
    for m in range(1 if options.straight else machines):
        dp = ALLREDUCE_FACTOR * m * psz_rows / (bw * (m + 1)) / within
        value = (ct_rows + dp) / (m + 1)
        if mem is not None:
            value = np.where(math.ceil((machines - (m + 1)) / (m + 1)) * (asz_rows + psz_rows) > mem, np.inf, value)
        time[m], reps[m] = value, m + 1
    later = np.arange(n)[None, :] > rows[:, None]  # the search only updates j > i
    comm_in = TRANSFER_FACTOR * oas / bw / ACTIVATION_COMPRESSION_RATIO
    comm_out = np.where(np.arange(n) < n - 1, comm_in, 0.0)
    splits = np.flatnonzero(np.isfinite(ct[1:, :]).any(axis=1))
    last_stage = _LastStage(ct, psz, asz, comm_in, comm_out, split_ok, splits, bw, mem, {})
    for m in range(1, machines):
        if options.use_fewer_devices:
            carry = later & (time[m - 1] < time[m])
            for arr in (time, split_k, split_m, reps):
                arr[m] = np.where(carry, arr[m - 1], arr[m])
        for mp in (1,) if options.straight else range(1, m + 1):
            stage = dataclasses.replace(last_stage, mp=mp, stash=math.ceil((machines - (m + 1)) / mp))
            for r, j, value, k in minmax_update(time[m - mp], time[m], rows, later, stage, bound, m - mp + 1, mp):
                time[m, r, j], split_k[m, r, j], split_m[m, r, j], reps[m, r, j] = value, k, m - mp, mp
    return LevelTable(rows, time, split_k, split_m, reps)


def level_table_bytes(num_rows: int, n: int, machines: int, straight: bool) -> float:
    """About what `_level` allocates for `num_rows` rows: its four (machines, rows, n) tables
    (8 + 3 x 4 bytes), the last-stage costs it may keep per replica count (n^2 x 8 bytes
    each) and a chunk's temporaries."""
    return num_rows * n * machines * 20.0 + n * n * 8.0 * (1 if straight else machines) + MAX_CHUNK_ELEMENTS * 8.0 * 4


PARAMETRIC_MACHINES = 64
"""The outermost level with more machines than this (and no memory limit, replicas allowed)
is solved by `_top_level_parametric` instead of the (machines^2 n^2) table."""


def _replicas_needed(ct: np.ndarray, allreduce: np.ndarray, comm: np.ndarray, limit: float,
                     machines: int) -> np.ndarray:
    """Fewest replicas r <= machines with max((ct + allreduce (r - 1) / r) / r, comm / r) <= limit,
    elementwise (machines + 1 where none). Past r = 2 the cost never grows with r (the
    all-reduce term (r - 1) / r^2 shrinks from r = 2 on), so r = 1 is tried, then a bisection
    over [2, machines]."""
    def cost(r: np.ndarray) -> np.ndarray:
        return np.maximum((ct + allreduce * (r - 1) / r) / r, comm / r)

    with np.errstate(invalid="ignore"):
        one = cost(np.ones_like(ct)) <= limit
        if machines < 2:
            return np.where(one, 1, machines + 1)
        lo = np.full(ct.shape, 1)  # cost(lo) > limit (or lo = 1)
        hi = np.full(ct.shape, machines)
        ok_max = cost(hi.astype(float)) <= limit
        while True:
            open_ = hi - lo > 1
            if not open_.any():
                break
            mid = (lo + hi) // 2
            fits = cost(mid.astype(float)) <= limit
            hi = np.where(open_ & fits, mid, hi)
            lo = np.where(open_ & ~fits, mid, lo)
    return np.where(one, 1, np.where(ok_max, hi, machines + 1))


def _top_level_parametric(ct: np.ndarray, psz: np.ndarray, oas: np.ndarray, split_ok: np.ndarray,
                          machines: int, bw: float, within: int,
                          options: PlanOptions) -> tuple[float, list[tuple[int, int, int]]] | None:
    """The outermost level's best partition of every position on its machines, by bisection
    on the bottleneck T instead of the table: a stage's cost is
    `_level`'s (the first stage pays no transfers, only its all-reduce is divided by `within`),
    which past 2 replicas never grows with them, so for a given T each stage needs a fewest
    replicas and the fewest machines of a whole plan is a shortest path over the positions
    (n^2 per T). The smallest T (bisected over the doubles' bit patterns, so exact) whose
    plan needs at most `machines` is the optimum with at most that many; spare machines join a
    stage that has 2 or more replicas (its cost does not grow). (optimum, stages) or None when
    the plan needs all machines but spares cannot join without slowing a stage: the table
    then decides."""
    n = ct.shape[1]
    first_ct, first_ar = ct[0], ALLREDUCE_FACTOR * psz[0] / bw / within
    last_ct = ct[1:, :]  # [k, j]: positions k+1..j
    last_ar = ALLREDUCE_FACTOR * psz[1:, :] / bw
    comm_in = TRANSFER_FACTOR * oas / bw / ACTIVATION_COMPRESSION_RATIO
    comm_out = np.where(np.arange(n) < n - 1, comm_in, 0.0)
    comm = np.maximum(comm_in[:, None], comm_out[None, :])
    later = np.triu(np.ones((n, n), dtype=bool), k=1) & split_ok
    last_ct = np.where(later, last_ct, np.inf)

    def plan(limit: float) -> tuple[int, list[tuple[int, int, int]]]:
        first = _replicas_needed(first_ct, first_ar, np.zeros(n), limit, machines)
        last = _replicas_needed(last_ct, last_ar, comm, limit, machines)
        best = first.astype(np.int64)
        parent = np.full(n, -1)
        for j in range(1, n):
            via = best[:j] + last[:j, j]
            k = int(via.argmin())
            if via[k] < best[j]:
                best[j], parent[j] = via[k], k
        stages, j = [], n - 1
        while parent[j] >= 0:
            k = int(parent[j])
            stages.append((k + 1, j + 1, int(last[k, j])))
            j = k
        stages.append((0, j + 1, int(first[j])))
        return int(best[n - 1]), stages[::-1]

    def as_float(bits: int) -> float:
        return float(np.array(bits, dtype=np.int64).view(np.float64))

    def as_bits(value: float) -> int:
        return int(np.array(value, dtype=np.float64).view(np.int64))

    whole = float((first_ct[n - 1] + first_ar[n - 1] * (machines - 1) / machines) / machines)
    if not np.isfinite(whole):
        return None
    lo, hi = 0, as_bits(whole)  # plan(whole) fits: one stage on every machine
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if plan(as_float(mid))[0] <= machines:
            hi = mid
        else:
            lo = mid
    used, stages = plan(as_float(hi))
    spare = machines - used
    if spare and not options.use_fewer_devices:
        wide = [i for i, st in enumerate(stages) if st[2] >= 2]
        if not wide:
            return None
        s, e, r = stages[wide[0]]
        stages[wide[0]] = (s, e, r + spare)
    costs = []
    for s, e, r in stages:
        if s == 0:
            costs.append((first_ct[e - 1] + first_ar[e - 1] * (r - 1) / r) / r)
        else:
            costs.append(max((last_ct[s - 1, e - 1] + last_ar[s - 1, e - 1] * (r - 1) / r) / r,
                             comm[s - 1, e - 1] / r))
    return float(max(costs)), stages


def _partition(table: LevelTable, start: int, end: int, machines: int) -> list[tuple[int, int, int]]:
    """(start, end, machines) of each stage of rows start..end-1 on all machines (in order)."""
    stages, j, m, r = [], end - 1, machines - 1, table.row(start)
    while table.split_k[m, r, j] >= 0:
        k = int(table.split_k[m, r, j])
        stages.append((k + 1, j + 1, int(table.machines[m, r, j])))
        j, m = k, int(table.split_m[m, r, j])
    stages.append((start, j + 1, int(table.machines[m, r, j])))
    return stages[::-1]


def _matrices(space: SplitSpace, covered_s: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PipeDream's compute_times (s, of the covered compute `covered_s`), parameter_sizes,
    activation_sizes as (n + 1, n) rows."""
    def rows(covered: np.ndarray) -> np.ndarray:
        r = space.range_matrix(covered)[:, 1:]  # [i, j] = positions i..j
        return np.concatenate((r, np.full((1, space.num_positions), np.nan)))

    ct = rows(covered_s)
    psz = rows(space.covered_parameter_bytes)
    asz = rows(space.covered_activation_bytes * scale)
    return np.nan_to_num(ct, nan=np.inf), np.nan_to_num(psz), np.nan_to_num(asz)


def pipedream_search(space: SplitSpace, topology: Topology, options: PlanOptions,
                     scale: float) -> tuple[float, list[PdStage]] | None:
    """PipeDream's optimum (seconds per minibatch) and its stages; None when infeasible.

    With a `ComputeBound` the level under the outermost one holds only the rows (range
    starts) an outermost stage can use: a quick plan over the rows near even splits bounds
    the optimum, and a stage can start only where the compute before it and after it fit
    their machines within that bound (`ComputeBound.starts`). Rows are independent, so the
    rows it holds are exactly those of the whole table."""
    covered_s = (space.covered_fwd_ms + space.covered_bwd_ms) * scale / 1000.0
    ct, psz, asz = _matrices(space, covered_s, scale)
    oas = space.cut_bytes * scale
    n, levels, top = space.num_positions, topology.levels, topology.levels[-1]
    unit = [1]
    for level in levels[:-1]:
        unit.append(unit[-1] * level.devices)
    bounds = [ComputeBound.of(covered_s, space.covered_parameter_bytes, u) for u in unit]
    budget = options.max_positions ** 2 * POSITION_PAIR_BYTES if options.max_positions is not None else np.inf

    def outermost(ct: np.ndarray, within: int) -> tuple[float, list[tuple[int, int, int]]]:
        found = None
        top_bytes = level_table_bytes(1, n, top.devices, options.straight)
        if (top.devices > PARAMETRIC_MACHINES or top_bytes > budget) and options.memory_bytes_per_device is None \
                and not options.straight:
            found = _top_level_parametric(ct, psz, oas, space.split_ok, top.devices, top.bandwidth_bytes_per_s,
                                          within, options)
        if found is not None:
            return found
        check_table(top_bytes, f"PipeDream's model: the table of the outermost cluster level ({top.devices} machines, "
                               f"{n} positions)", options)
        table = _level(ct, psz, asz, oas, space.split_ok, top.devices, top.bandwidth_bytes_per_s, within,
                       options, np.zeros(1, dtype=int), bounds[-1])
        best = float(table.time_s[-1, 0, n - 1])
        return best, _partition(table, 0, n, top.devices) if np.isfinite(best) else []

    def table(index: int, rows: np.ndarray, ct: np.ndarray, within: int) -> LevelTable:
        level = levels[index]
        check_table(level_table_bytes(len(rows), n, level.devices, options.straight),
                    f"PipeDream's model: the table of cluster level {index} ({level.devices} machines, {n} positions)",
                    options)
        return _level(ct, psz, asz, oas, space.split_ok, level.devices, level.bandwidth_bytes_per_s, within,
                      options, rows, bounds[index])

    tables: list[LevelTable] = []
    within = 1
    for index, level in enumerate(levels[:-1]):
        rows = np.arange(n + 1)
        if index == len(levels) - 2 and bounds[-1] is not None and top.devices <= PARAMETRIC_MACHINES:
            quick = table(index, bounds[-1].even_starts(top.devices), ct, within).compute_of_next_level()
            rows = bounds[-1].starts(top.devices, outermost(quick, level.devices)[0])
        tables.append(table(index, rows, ct, within))
        ct, within = tables[-1].compute_of_next_level(), level.devices
    best, top_stages = outermost(ct, within)
    if not np.isfinite(best):
        return None
    stages: list[PdStage] = []

    def expand(lv: int, start: int, end: int, bases: list[int], path: tuple) -> None:
        offset = 0
        parts = top_stages if lv == len(levels) - 1 else _partition(tables[lv], start, end, levels[lv].devices)
        for first, (s, e, nm) in enumerate(parts):
            new_bases = [b + (offset + q) * unit[lv] for b in bases for q in range(nm)]
            step = path + ((lv, s, e, nm, first == 0),)
            if lv == 0:
                stages.append(PdStage(s, e, tuple(sorted(new_bases)), step))
            else:
                expand(lv - 1, s, e, new_bases, step)
            offset += nm

    expand(len(levels) - 1, 0, n, [0], ())
    return best, stages


def pipedream_data_parallel_s(space: SplitSpace, topology: Topology, scale: float) -> float:
    """PipeDream's data-parallel time per minibatch on every device of the cluster."""
    total = float(space.covered_fwd_ms[-1] + space.covered_bwd_ms[-1]) * scale / 1000.0
    params = float(space.covered_parameter_bytes[-1])
    within = 1
    for level in topology.levels:
        m = level.devices
        total = (total + ALLREDUCE_FACTOR * (m - 1) * params / (level.bandwidth_bytes_per_s * m) / within) / m
        within = m
    return total

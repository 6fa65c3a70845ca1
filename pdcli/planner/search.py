"""The `pd` partition search: PipeDream's dynamic program over (chain suffix, devices, stages).

The program runs over suffixes: V[t, i, d] is the smallest bottleneck stage time of the
chain positions [i, n) split into t + 1 stages on d devices whose ranks are the last d
ranks [E - d, E) of the plan. A suffix knows what follows each stage, so the schedule's
memory (devices and stages from a stage to the end) is exact, and so are the bandwidths
(the ranks are known). The stage-count axis is kept only when something depends on it
(the bubble of flush schedules, 1F1B/2BW activation memory, a forced stage count);
otherwise all counts share one layer. Every transition is vectorized over (start, end)
pairs: the Python loops run over devices, replicas and nothing else. A stage has r
replicas only when r divides the microbatches per minibatch (the runtime spreads them
evenly over the replicas).

A plan on fewer than all devices is shifted to start at rank 0; that is exact when the
shift is a multiple of the topology's alignment, so a non-uniform cluster is searched with
one anchor E per residue class (the anchors share their stage costs).

What keeps big clusters cheap, without changing the optimum: only the replica counts the
runtime can run are tried (`replica_choices`); a flush schedule's stage-count axis holds only
the counts whose bubble can still beat the best plan (`_flat_bound`, `_count_cap`, with
`bubble_factor_floor` for a split backward; under a memory limit the counts deepen as plans are
found), and a layer of t + 1 stages only the devices they can fill. Under a memory limit a
stage's memory is computed once per `memory_key` (what of the devices and replicas it reads:
nothing for a flush schedule), and the layers whose stages fit alike are held once
(`LayerCosts`): a flush schedule's memory repeats from a few stages on.

With a split backward, 1f1b's memory depends on the pipeline's whole stage count (a
microbatch is held until its WeightGrads, see planner.memory), which a suffix does not
know: when memory counts (a limit, or the memory search) the program runs once per stage
count below `split_counts_alike_from` (M), and once for all the counts from M on, whose
stages hold alike whatever the count. The flush bubble of a split backward is replayed
(`pdcli.planner.costs.bubble_factor`); a stage count whose bottleneck alone is already
slower than the best plan so far is not replayed (the factor is at least 1).

Searches run inside `shared_programs` (the configuration search, `pdcli.planner.pareto`)
share their stage times and value tables when they price the same space alike
(`pricing_key`): without the runtime's costs and a memory limit, 2bw, 1f1b and gpipe price a
stage the same at every microbatch count, so their programs differ only in the replica
counts the microbatches allow and, for the flush schedules, the stage counts searched.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import numpy as np

from pdcli.planner.costs import (
    SplitShares, backward_work, bubble_factor, bubble_factor_floor, compute_calibration, pd_stage_terms,
    runtime_action_costs, runtime_stage_terms, split_shares,
)
from pdcli.planner.memory import (MemorySettings, StageBytes, VerticalSync, memory_key, split_counts_alike_from,
                                  stage_memory)
from pdcli.planner.options import PlanOptions, check_table
from pdcli.planner.runtime_costs import RuntimeCosts
from pdcli.planner.space import SplitSpace
from pdcli.planner.topology import Topology
from pdcli.schedule.simulator import shares_cores
from pdcli.schedule.spec import FLUSH_SCHEDULES, ONE_F_ONE_B, rules, stand_in


@dataclass(frozen=True)
class LayerCosts:
    """The cost of every stage [i, e) on each layer t of the stage-count axis, the layers that
    price alike held once: layer t's (n, n + 1) matrix is values[kind[t]] (kind None: values[0]
    on every layer). Under a memory limit a flush schedule's stage fits or not by how many
    stages follow it, and its memory repeats from a few stages on (`timeline_peaks`): a few
    matrices stand for hundreds of layers."""

    values: np.ndarray
    """(K, n, n + 1)."""
    kind: np.ndarray | None = None
    """(L,) ints into values; None: every layer is values[0]."""

    def layer(self, t: int) -> np.ndarray:
        return self.values[0 if self.kind is None else int(self.kind[t])]

    def groups(self, start: int, stop: int) -> Iterator[tuple[np.ndarray, slice | np.ndarray]]:
        """(values[k:k + 1], the layers of [start, stop) of kind k) for each kind there."""
        if self.kind is None:
            yield self.values[:1], slice(start, stop)
            return
        kinds = self.kind[start:stop]
        for k in np.unique(kinds):
            at = np.flatnonzero(kinds == k) + start
            run = at[-1] - at[0] + 1 == at.size  # a slice reads the value table without a copy
            yield self.values[k:k + 1], slice(int(at[0]), int(at[-1]) + 1) if run else at

    def masked(self, keep: np.ndarray) -> "LayerCosts":
        """inf on the layers where `keep` (one bool per layer) is False."""
        inf = np.full((1,) + self.values.shape[1:], np.inf)
        kind = np.zeros(keep.shape, dtype=int) if self.kind is None else self.kind
        return LayerCosts(np.concatenate([self.values, inf]), np.where(keep, kind, self.values.shape[0]))


def distinct_layers(array: np.ndarray) -> LayerCosts:
    """`array` (L, n, n + 1) as LayerCosts, equal layers held once."""
    seen: dict[bytes, int] = {}
    kind = np.array([seen.setdefault(layer.tobytes(), len(seen)) for layer in array], dtype=int)
    firsts = np.unique(kind, return_index=True)[1]
    return LayerCosts(array[firsts], kind)


StageCost = Callable[[int, int], LayerCosts]
"""(suffix devices d, replicas r) -> cost of [i, e) as first stage on each layer; inf unless
i < e (and wherever [i, e) is not a valid stage)."""
MEMORY_CACHE = 32
"""(devices, replicas) memory keys whose memory, and stage times under the limit, `PdCosts`
keeps (the least recently used go first): a flush schedule has one key, pipedream and 2bw one
per count of in-flight microbatches."""
ROW_BLOCK = 64
"""Start positions `min_over_ends` takes at once (each block reads only the ends after its first)."""
SHARED_PRICINGS = 2
"""How many pricings' stage times and value tables `shared_programs` keeps (the least recently
used go first; each holds a few dozen (n, n + 1) matrices): the configuration search visits a
precision's and recompute's configurations by microbatch size, where pipedream's pricing (its
updates per minibatch) and the other schedules' alternate."""

_SHARED: ContextVar["OrderedDict[Hashable, dict[str, Any]] | None"] = ContextVar("pd_shared_programs", default=None)


@contextlib.contextmanager
def shared_programs() -> Iterator[None]:
    """Inside this block, searches that price the same space alike (`pricing_key`) share their
    stage times and value tables."""
    token = _SHARED.set(OrderedDict())
    try:
        yield
    finally:
        _SHARED.reset(token)


def pricing_key(space: SplitSpace, topology: Topology, options: PlanOptions, scale: float) -> Hashable | None:
    """What `PdCosts.time` reads besides (d, r): the space, the links, the batch scale, recompute
    (`backward_work`) and the optimizer steps and all-reduces per minibatch (`updates_per_minibatch`:
    the microbatch count decides them only when every microbatch steps). None: not shared (the
    runtime's costs depend on the schedule and the microbatches throughout, a memory limit on
    most of the options)."""
    if space.runtime is not None or options.memory_bytes_per_device is not None:
        return None
    per_microbatch = rules(options.schedule).step_per_microbatch
    return (space, topology, scale, options.recompute, options.num_microbatches if per_microbatch else None)


def _shared_store(key: Hashable | None) -> dict[str, Any] | None:
    """The store of `key`'s pricing inside `shared_programs` (None: outside, or not shared)."""
    stores = _SHARED.get()
    if stores is None or key is None:
        return None
    if key in stores:
        stores.move_to_end(key)
    else:
        stores[key] = {"times": {}, "tables": {}}
        if len(stores) > SHARED_PRICINGS:
            stores.popitem(last=False)
    return stores[key]


@dataclass(frozen=True)
class StageChoice:
    start: int
    end: int
    replicas: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class SearchResult:
    stages: tuple[StageChoice, ...]
    objective: float
    """Time per minibatch (ms) for the time search; peak stage memory for the memory search."""


def needs_stage_axis(options: PlanOptions) -> bool:
    return options.schedule in FLUSH_SCHEDULES or options.num_stages is not None


def covered_or_zeros(space: SplitSpace, covered: np.ndarray | None) -> np.ndarray:
    """A SplitSpace's optional covered totals (None: not measured) as an array."""
    return np.zeros(space.num_positions) if covered is None else covered


def backward_split(space: SplitSpace, options: PlanOptions) -> SplitShares | None:
    """The whole chain's work shares for a split backward's bubble (None: unsplit, or no W).
    Shares of the calibrated, batch-scaled totals: both factors cancel out."""
    if not options.split_backward or options.schedule not in FLUSH_SCHEDULES or space.num_positions == 0:
        return None
    wgrad_ms = covered_or_zeros(space, space.covered_wgrad_ms)[-1]
    return split_shares(float(space.covered_fwd_ms[-1]), float(space.covered_bwd_ms[-1]), float(wgrad_ms),
                        options.merges_weight_grads)


def memory_needs_stage_count(options: PlanOptions, minimize: str) -> bool:
    """1f1b with a split backward under a memory limit (or the memory search): a stage's memory
    depends on the pipeline's stage count, so the search runs once per count (not with merged
    weight gradients: every stage then holds every microbatch until the flush)."""
    memory_counts = minimize == "memory" or options.memory_bytes_per_device is not None
    # 1f1b holds its in-flight microbatches until their WeightGrads, a lag of the stage count
    # (`ScheduleSpec.weight_grad_lag`); gpipe holds all of them anyway
    lag_counts = rules(options.schedule).in_flight == "devices_upto_all" and not options.merges_weight_grads
    return options.split_backward and lag_counts and options.num_stages is None and memory_counts


def runtime_of(space: SplitSpace, topology: Topology) -> RuntimeCosts | None:
    """The runtime costs the `pd` model prices with: the measured transport on a one-level
    cluster (one host); on several, each host's own cores (no bound shared by all) and links
    priced with the cluster's bandwidths (`RuntimeCosts.cluster_links`): the measured latency
    and all-reduce floor kept, a message's bytes and a ring all-reduce at the level's nominal
    bandwidth where that is slower."""
    if space.runtime is None or len(topology.levels) == 1:
        return space.runtime
    return dataclasses.replace(space.runtime.without("cores"), cluster_links=True)


def oversubscription_of(cores: int | None, devices: int, slowdown: float = 1.0) -> float:
    """How much slower every stage runs when `devices` workers share `cores` (None: a device
    each): devices / cores times `slowdown` (`RuntimeCosts.shared_slowdown`) when that is
    above 1."""
    return devices / cores * slowdown if cores is not None and shares_cores(devices, cores) else 1.0


def compute_scale_of(space: SplitSpace, scale: float) -> float:
    """Factor on the profiled forward/backward: the batch scale, calibrated by the profile's
    whole-step ratio only when the runtime's own costs were not measured."""
    return scale if space.runtime is not None else scale * compute_calibration(space.calibration_ratio)


def optimizer_step_matrix(space: SplitSpace) -> np.ndarray:
    """O[i, e]: one optimizer step of stage [i, e) (its positions' steps + the fixed cost once)."""
    covered = covered_or_zeros(space, space.covered_optimizer_ms)
    return space.range_matrix(covered) + space.optimizer_step_overhead_ms


def search_vertical_sync(options: PlanOptions, devices: int) -> VerticalSync | None:
    """What the search counts a vertical-sync stage's weight versions with before stage 0 is
    chosen: the most any stage-0 replication it may choose pins, on `devices` devices."""
    if not options.vertical_sync:  # PlanOptions takes it for pipedream only
        return None
    if options.replicas is not None:
        firsts: tuple[int, ...] = (options.replicas[0],)
    elif options.straight:
        firsts = (1,)
    else:
        firsts = tuple(r for r in range(1, devices + 1) if options.num_microbatches % r == 0)
    return VerticalSync(devices, firsts)


@dataclass(frozen=True)
class StageMatrices:
    """A space's totals over every stage [i, e) (nan unless i < e) as the `pd` model prices
    them: F and B calibrated and scaled (B with recompute's forward), the weight gradients W,
    parameter bytes, one optimizer step, the optimizer state; the valid stages, and the cut
    bytes into and out of each."""

    fwd: np.ndarray
    bwd: np.ndarray
    wgrad: np.ndarray
    params: np.ndarray
    optimizer: np.ndarray
    optimizer_state: np.ndarray
    valid: np.ndarray
    cut_in: np.ndarray
    """(n, 1): into a stage starting at i."""
    cut_out: np.ndarray
    """(1, n + 1): out of a stage ending at e."""
    position_factor: np.ndarray
    """`SplitSpace.position_factor` of every stage (1 without factors)."""

    @classmethod
    def of(cls, space: SplitSpace, scale: float, recompute: bool) -> "StageMatrices":
        n = space.num_positions
        compute_scale = compute_scale_of(space, scale)
        fwd = space.range_matrix(space.covered_fwd_ms) * compute_scale
        cut = space.cut_bytes * scale
        return cls(
            fwd=fwd,
            bwd=backward_work(fwd, space.range_matrix(space.covered_bwd_ms) * compute_scale, recompute),
            wgrad=space.range_matrix(covered_or_zeros(space, space.covered_wgrad_ms)) * compute_scale,
            params=space.range_matrix(space.covered_parameter_bytes),
            optimizer=optimizer_step_matrix(space),
            optimizer_state=space.range_matrix(covered_or_zeros(space, space.covered_optimizer_state_bytes)),
            valid=space.valid_stages() & ~np.isnan(fwd),
            cut_in=np.concatenate(([0.0], cut[: n - 1]))[:, None],
            cut_out=np.concatenate(([0.0], cut[: n - 1], [0.0]))[None, :],
            position_factor=np.broadcast_to(space.position_factor_matrix(), fwd.shape).copy(),
        )


class PdCosts:
    """Stage costs of the `pd` model for every (start, end) at once, for one anchor."""

    def __init__(self, space: SplitSpace, topology: Topology, options: PlanOptions,
                 scale: float, anchor: int, num_layers: int) -> None:
        n = space.num_positions
        self.options, self.anchor, self.num_layers = options, anchor, num_layers
        store = _shared_store(pricing_key(space, topology, options, scale))
        m = store["matrices"] if store is not None and "matrices" in store else None
        if m is None:
            m = StageMatrices.of(space, scale, options.recompute)
            if store is not None:
                for shared in vars(m).values():
                    shared.flags.writeable = False
                store["matrices"] = m
        self.fwd, self.bwd, self.wgrad, self.params = m.fwd, m.bwd, m.wgrad, m.params
        self.position_factor = m.position_factor
        self.optimizer, self.optimizer_state, self.valid = m.optimizer, m.optimizer_state, m.valid
        self.cut_in, self.cut_out = m.cut_in, m.cut_out
        self.runtime = runtime_of(space, topology)
        self.first = (np.arange(n) == 0)[:, None]
        self.last = (np.arange(n + 1) == n)[None, :]
        self.acts = space.activations(options.precision, scale)
        self.eager_sends = space.eager_sends
        self.bw = topology.span_bandwidth_matrix()
        self.stages_from = np.arange(1, num_layers + 1, dtype=float)[:, None, None]
        self._time_cache: dict[tuple[float, ...], np.ndarray] = store["times"] if store is not None else {}
        self._tables: dict[Hashable, np.ndarray] | None = store["tables"] if store is not None else None
        self.vertical_sync = search_vertical_sync(options, anchor)
        self._memory_cache: OrderedDict[Hashable, LayerCosts] = OrderedDict()
        self._fits_cache: OrderedDict[Hashable, LayerCosts] = OrderedDict()

    def for_anchor(self, anchor: int) -> "PdCosts":
        """These costs for another anchor, sharing the matrices and the cached stage times (a
        time depends on the replicas and the links, not on where the plan ends)."""
        other = copy.copy(self)
        other.anchor, other.vertical_sync = anchor, search_vertical_sync(self.options, anchor)
        return other

    def _link(self, a: int, b: int) -> float:
        return float(self.bw[a, b]) if 0 <= a and b < self.bw.shape[0] else np.inf

    def _memory_key(self, d: int, r: int) -> Hashable:
        return memory_key(self.options.schedule, d, r, self.vertical_sync)

    def _memory(self, d: int, r: int) -> LayerCosts:
        """Every stage's memory on each layer, once per `memory_key` (kept in an LRU)."""
        key = self._memory_key(d, r)
        return _cached(self._memory_cache, key, lambda: self._stage_memory(d, r))

    def _stage_memory(self, d: int, r: int) -> LayerCosts:
        o = self.options
        # the stage count matters to 1f1b with split backward only, and `pd_search` fixes it
        # there, or searches the counts whose stages hold alike (`split_counts_alike_from`) on
        # num_layers of them
        total_stages = o.num_stages if o.num_stages is not None else self.num_layers
        settings = MemorySettings(schedule=o.schedule, num_microbatches=o.num_microbatches, precision=o.precision,
                                  recompute=o.recompute, split_backward=o.split_backward, eager_sends=self.eager_sends,
                                  vertical_sync=self.vertical_sync, merge_weight_grads=o.merges_weight_grads)
        sizes = StageBytes(parameters=self.params, activations=self.acts.held, optimizer_state=self.optimizer_state,
                           inputs=self.acts.inputs, copies=self.acts.copies, waiting=self.acts.waiting)
        total = stage_memory(settings, sizes, replicas=r, devices_from=d, stages_from=self.stages_from,
                             num_stages=total_stages).total_bytes
        total = np.broadcast_to(total, np.broadcast_shapes(np.shape(total), self.valid.shape))
        return LayerCosts(total[None]) if total.ndim == 2 else distinct_layers(total)

    def runnable(self, r: int) -> bool:
        """The runtime spreads a minibatch's microbatches evenly over a stage's replicas."""
        return self.options.num_microbatches % r == 0

    def time(self, d: int, r: int) -> LayerCosts:
        if not self.runnable(r):
            return LayerCosts(np.full((1,) + self.valid.shape, np.inf))
        a = self.anchor - d
        links = (self._link(a, a + r - 1), self._link(a - 1, a), self._link(a + r - 1, a + r))
        key = (r,) + links  # on a uniform cluster most (d, r) share their bandwidths
        if key not in self._time_cache:
            o = self.options
            if self.runtime is not None:
                actions = runtime_action_costs(self.runtime, o.schedule, o.num_microbatches, self.fwd, self.bwd,
                                               self.wgrad, self.optimizer, self.cut_in, self.cut_out, self.first,
                                               self.last, links[1], links[2], self.position_factor)
                terms = runtime_stage_terms(actions, self.params, r, links[0], o.schedule, o.num_microbatches)
            else:
                terms = pd_stage_terms(self.fwd, self.bwd, self.params, self.cut_in, self.cut_out, r,
                                       *links, o.schedule, o.num_microbatches, self.optimizer)
            self._time_cache[key] = np.where(self.valid, terms.stage_time_ms, np.inf)[None]
        out = self._time_cache[key]
        limit = self.options.memory_bytes_per_device
        if limit is None:
            return LayerCosts(out)

        def fitting() -> LayerCosts:
            memory = self._memory(d, r)
            return LayerCosts(np.where(memory.values <= limit, out, np.inf), memory.kind)
        return _cached(self._fits_cache, (key, self._memory_key(d, r)), fitting)

    def memory(self, d: int, r: int) -> LayerCosts:
        memory = self._memory(d, r)
        return LayerCosts(np.where(self.valid & self.runnable(r), memory.values, np.inf), memory.kind)

    def time_minmax(self, num_layers: int, layered: bool, straight: bool, runnable: tuple[int, ...]) -> np.ndarray:
        """`suffix_minmax` over `time` on this anchor, shared inside `shared_programs` (read only)."""
        n = self.valid.shape[0]
        if self._tables is None:
            return suffix_minmax(n, self.anchor, num_layers, layered, straight, self.time, runnable)
        key = (self.anchor, num_layers, layered, straight, runnable)
        if key not in self._tables:
            value = suffix_minmax(n, self.anchor, num_layers, layered, straight, self.time, runnable)
            value.flags.writeable = False
            self._tables[key] = value
        return self._tables[key]


def _cached(cache: "OrderedDict[Hashable, LayerCosts]", key: Hashable, make: Callable[[], LayerCosts]) -> LayerCosts:
    """cache[key], made if missing; the cache keeps the MEMORY_CACHE most recently used."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    cache[key] = value = make()
    if len(cache) > MEMORY_CACHE:
        cache.popitem(last=False)
    return value


def replica_choices(d: int, straight: bool, runnable: tuple[int, ...]) -> tuple[int, ...]:
    """The replica counts a stage on a suffix of `d` devices may take: 1 for a straight
    pipeline, else the `runnable` counts up to d (any other count costs inf everywhere, so
    the search skips it: on 1,024 devices and 4 microbatches, 3 counts instead of 1,024)."""
    return (1,) if straight else tuple(r for r in runnable if r <= d)


def suffix_minmax(n: int, anchor: int, num_layers: int, layered: bool, straight: bool,
                  cost: StageCost, runnable: tuple[int, ...]) -> np.ndarray:
    """V[t, i, d] = min over splits of the max stage cost (inf when impossible); a stage's
    replicas are among `runnable`.

    With the stage-count axis, t + 1 stages of at most max(runnable) replicas each fill at
    most num_layers * max(runnable) devices: larger d stay inf without being computed.
    Only values are kept; `trace_back` recomputes the argmin along the chosen path, which
    is cheaper than carrying argmin tables through every transition."""
    value = np.full((num_layers, n + 1, anchor + 1), np.inf)
    widest = 1 if straight else max(runnable, default=1)
    for d in range(1, min(anchor, num_layers * widest) + 1 if layered else anchor + 1):
        for r in replica_choices(d, straight, runnable):
            c = cost(d, r)
            if r == d:  # the suffix is one stage [i, n)
                value[0, :n, d] = np.minimum(value[0, :n, d], c.layer(0)[:, n])
                continue
            if layered:  # t + 1 stages on d devices need t + 1 <= d
                top = min(num_layers, d - r + 1)
                if top < 2:
                    continue
                start, shift = 1, 1
            else:
                top, start, shift = 1, 0, 0
            for stage, dst in c.groups(start, top):
                # rest[t, e]: the suffix after the stage starts at e (one stage less when layered)
                src = slice(dst.start - shift, dst.stop - shift) if isinstance(dst, slice) else dst - shift
                rest = value[src, :n, d - r]
                value[dst, :n, d] = np.minimum(value[dst, :n, d], min_over_ends(stage[:, :, :n], rest))
    return value


def min_over_ends(stage: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """out[t, i] = min over e of max(stage[t or 0, i, e], rest[t, e]): the best first stage [i, e)
    before a rest that starts at e. A stage is inf unless i < e (`StageCost`), so the rows from
    i0 on read only the ends after i0, in blocks of ROW_BLOCK rows (about half the square)."""
    n = stage.shape[1]
    out = np.full((rest.shape[0], n), np.inf)
    for i0 in range(0, n - 1, ROW_BLOCK):
        i1 = min(i0 + ROW_BLOCK, n)
        out[:, i0:i1] = np.maximum(stage[:, i0:i1, i0 + 1:], rest[:, None, i0 + 1:]).min(axis=2)
    return out


def trace_back(value: np.ndarray, layered: bool, straight: bool, cost: StageCost, runnable: tuple[int, ...],
               layer: int, devices: int) -> list[tuple[int, int, int, int]]:
    """(start, end, replicas, devices of the suffix) of each stage of the plan V[layer, 0, devices]."""
    n = value.shape[1] - 1
    stages, i, t, d = [], 0, layer, devices
    while i < n:
        target = value[t, i, d]
        for r in replica_choices(d, straight, runnable):
            row = cost(d, r).layer(t)[i]
            if r == d:
                if t == 0 and row[n] == target:
                    stages.append((i, n, r, d))
                    return stages
                continue
            prev = value[t - 1 if layered else t, :n, d - r] if (t > 0 or not layered) else None
            if prev is None:
                continue
            total = np.maximum(row[:n], prev)
            hits = np.flatnonzero(total == target)
            if hits.size:
                e = int(hits[0])
                stages.append((i, e, r, d))
                i, d, t = e, d - r, (t - 1 if layered else t)
                break
        else:
            raise AssertionError(f"trace_back: no choice reproduces V[{t}, {i}, {d}] = {target}")
    return stages


def _anchors(topology: Topology, options: PlanOptions) -> list[int]:
    total = topology.num_devices
    if not (options.use_fewer_devices or options.replicas is not None) or topology.is_uniform:
        return [total]
    return [total - s for s in range(min(topology.alignment, total))]


def _devices_allowed(d: int, total: int, options: PlanOptions) -> bool:
    """Whether a plan on `d` of `total` devices is wanted: fixed replicas use their sum."""
    if options.replicas is not None:
        return d == sum(options.replicas)
    return d == total or options.use_fewer_devices


def fixed_replicas(cost: StageCost, replicas: tuple[int, ...]) -> StageCost:
    """`cost` where a stage may only have the replicas fixed for its index: layer t of the
    stage-count axis is the stage with t stages after it, stage len(replicas) - 1 - t."""
    allowed = np.asarray(replicas[::-1])  # layer t -> replicas of its stage

    def masked(d: int, r: int) -> LayerCosts:
        return cost(d, r).masked(allowed == r)
    return masked


def pd_search(space: SplitSpace, topology: Topology, options: PlanOptions, scale: float,
              minimize: str = "time") -> SearchResult | None:
    """Best plan under the `pd` model (minimize="time"), or the plan with the smallest peak
    stage memory (minimize="memory"); None when nothing is feasible."""
    split = backward_split(space, options)
    if memory_needs_stage_count(options, minimize):
        most = min(space.num_positions, topology.num_devices)
        # 1f1b's stages hold alike in every pipeline of K0 or more stages: one program for them all
        alike = split_counts_alike_from(options.num_microbatches) if stand_in(options.schedule) == ONE_F_ONE_B \
            else most + 1
        runs = [_search(space, topology, dataclasses.replace(options, num_stages=k), scale, minimize, split)
                for k in range(1, min(alike, most + 1))]
        if alike <= most:
            runs.append(_search(space, topology, options, scale, minimize, split, fewest_stages=alike))
    else:
        runs = [_search(space, topology, options, scale, minimize, split)]
    found = [run for run in runs if run is not None]
    if not found:
        return None
    return min(found, key=lambda run: run[0])[1]


SearchKey = tuple[float, int, int, int]
"""(objective, devices used, stage count - 1, -anchor): the smallest wins."""


def value_table_bytes(n: int, anchor: int, layers: int, layered: bool, options: PlanOptions) -> float:
    """About what one anchor's program holds: its value table and the kept one (8 bytes a
    value), and under a memory limit on the stage-count axis the per-layer stage costs and
    memory (a few (layers, n, n + 1) arrays)."""
    table = 2.0 * layers * (n + 1) * (anchor + 1) * 8
    per_layer = 4.0 * layers * n * (n + 1) * 8 if layered and options.memory_bytes_per_device is not None else 0.0
    return table + per_layer


def _flat_bound(anchor: int, allowed: list[int], options: PlanOptions, costs: PdCosts,
                runnable: tuple[int, ...], cores: int | None, slowdown: float) -> tuple[float, int] | None:
    """(L, S0): no plan on this anchor has a smaller bottleneck than L, the best over every stage
    count with `costs.time` (no memory limit: a lower bound under one too), found by the program
    without the stage-count axis (about 1/S of its cost); S0 is that plan's stage count.
    None when no plan exists."""
    flat = costs.time_minmax(1, False, options.straight, runnable)
    times = {d: float(flat[0, 0, d]) * oversubscription_of(cores, d, slowdown) for d in allowed}
    d_best = min(times, key=times.__getitem__, default=None)
    if d_best is None or not np.isfinite(times[d_best]):
        return None
    return times[d_best], len(trace_back(flat, False, options.straight, costs.time, runnable, 0, d_best))


def _count_cap(lower: float, upper: float, max_stages: int, options: PlanOptions, split: SplitShares | None) -> int:
    """The most stages a flush-schedule plan can have and still beat `upper`: its time is its
    bottleneck (>= lower) times the bubble factor, at least `bubble_factor_floor`, which grows
    with S."""
    cap = 0
    while cap < max_stages and lower * bubble_factor_floor(options.schedule, options.num_microbatches,
                                                           cap + 1, split) <= upper:
        cap += 1
    return cap


def _search(space: SplitSpace, topology: Topology, options: PlanOptions, scale: float, minimize: str,
            split: SplitShares | None, fewest_stages: int = 1) -> tuple[SearchKey, SearchResult] | None:
    """The best plan of `fewest_stages` or more stages (a split 1f1b under a memory limit: the
    stages' memory is that of any pipeline of so many stages or more, `pd_search`)."""
    n, total = space.num_positions, topology.num_devices
    layered = needs_stage_axis(options)
    max_stages = min(n, total) if options.num_stages is None else options.num_stages
    num_layers = max_stages if layered else 1
    align = 1 if topology.is_uniform else topology.alignment
    runtime = runtime_of(space, topology)
    best: SearchKey | None = None
    kept = None  # the DP of the best anchor so far, for the trace back
    # a flush schedule runs only the stage counts whose bubble can still win (`_count_cap`);
    # under a memory limit the bound comes from the plans found, so the counts deepen
    # (a split backward's memory depends on the pipeline's stage count: under a memory limit the
    # counts deepen only over the counts whose stages hold alike, `fewest_stages` on)
    limited = options.memory_bytes_per_device is not None
    cap_layers = (layered and minimize == "time" and options.num_stages is None and options.replicas is None
                  and not (options.split_backward and limited and fewest_stages == 1))
    cores = runtime.cores if runtime is not None else None
    slowdown = runtime.shared_slowdown if runtime is not None else 1.0
    shared: PdCosts | None = None
    free: PdCosts | None = None  # the costs without the memory limit, for the lower bound
    for anchor in _anchors(topology, options):
        if shared is None:
            shared = PdCosts(space, topology, options, scale, anchor, num_layers)
        allowed = [d for d in range(1, anchor + 1) if _devices_allowed(d, total, options) and not (anchor - d) % align]
        layers_here, lower = num_layers, 0.0
        if cap_layers:
            if free is None:
                free = PdCosts(space, topology, dataclasses.replace(options, memory_bytes_per_device=None), scale,
                               anchor, 1) if limited else shared
            free_costs = free.for_anchor(anchor)
            free_runnable = tuple(r for r in range(1, anchor + 1) if free_costs.runnable(r))
            bound = _flat_bound(anchor, allowed, options, free_costs, free_runnable, cores, slowdown)
            if bound is None:
                continue
            lower, count = bound
            upper = best[0] if best is not None else np.inf
            if not limited:  # the unlimited plan is a plan: its time bounds the best
                plan_ms = lower * float(bubble_factor(options.schedule, options.num_microbatches, count, split))
                upper = min(upper, plan_ms)
            layers_here = _count_cap(lower, upper, max_stages, options, split)
            if layers_here < fewest_stages:
                continue  # no stage count on this anchor can beat the best plan so far
            if limited:
                layers_here = min(layers_here, max(count, fewest_stages))
        while True:
            base = PdCosts(space, topology, options, scale, anchor, layers_here) if cap_layers and limited else shared
            costs = base.for_anchor(anchor)
            runnable = tuple(r for r in range(1, anchor + 1) if costs.runnable(r))
            fn: StageCost = costs.time if minimize == "time" else costs.memory
            if options.replicas is not None:  # plan_chain fixes num_stages = len(replicas): layered
                fn = fixed_replicas(fn, options.replicas)
            check_table(value_table_bytes(n, anchor, layers_here, layered, options),
                        f"the pd search over {layers_here} stage counts, {n} positions and {anchor} devices", options)
            if minimize == "time" and options.replicas is None:
                value = costs.time_minmax(layers_here, layered, options.straight, runnable)
            else:
                value = suffix_minmax(n, anchor, layers_here, layered, options.straight, fn, runnable)
            before = best
            for d in allowed:
                layers = range(fewest_stages - 1, layers_here) if options.num_stages is None \
                    else [options.num_stages - 1]
                for t in layers:
                    if not layered and t > 0:
                        break
                    v = float(value[t, 0, d])
                    if minimize == "time":
                        v *= oversubscription_of(cores, d, slowdown)
                    if minimize == "time" and layered:
                        if best is not None and v > best[0]:
                            continue  # the bubble factor is >= 1: this count cannot win
                        v *= float(bubble_factor(options.schedule, options.num_microbatches, t + 1, split))
                    key = (v, d, t, -anchor)
                    if np.isfinite(v) and (best is None or key < best):
                        best = key
            if best != before:
                kept = (value, fn, runnable)
            if not (cap_layers and limited) or layers_here >= max_stages:
                break
            need = _count_cap(lower, best[0] if best is not None else np.inf, max_stages, options, split)
            if need <= layers_here:
                break
            layers_here = min(2 * layers_here, need)
    if best is None:
        return None
    v, d_used, t, neg_anchor = best
    assert kept is not None, "the best plan comes from a DP that was kept"
    value, fn, runnable = kept
    stages = []
    for start, end, r, d in trace_back(value, layered, options.straight, fn, runnable, t, d_used):
        first = d_used - d
        stages.append(StageChoice(start, end, r, tuple(range(first, first + r))))
    return best, SearchResult(tuple(stages), v)

"""The search space a chain offers: cost of every stage range, valid split points, cut sizes.

A stage is a range [start, end) of chain positions. For a chain from our profiler every
range is valid and its cost is a difference of prefix sums. For a chain imported from a
PipeDream graph.txt the positions are antichain states and the antichain DAG can branch:
a stage ending at position j may only start right after one of j's DAG ancestors, and it
holds the graph nodes covered by state j but not by the state before it
(`chain.meta["antichain_dag"]`, written by `pdcli.profiler.graphtxt`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from pdcli.planner.runtime_costs import RuntimeCosts
from pdcli.profiler.chain import HELD_META, Chain, ChainNode
from pdcli.profiler.graphtxt import SEARCH_SPACE_META


def held_activation_bytes(nodes: tuple[ChainNode, ...]) -> list[float]:
    """What each position keeps for its backward, per minibatch: the tensors its backward
    saved (`backward_memory_bytes`, measured by `pd profile`), or, for a profile without
    that measurement (PipeDream's graph.txt), its output activation as PipeDream counts it.

    A tensor saved by two neighbours (a ReLU's output is also the next Linear's input) is
    counted by both, so this is an upper bound: `benchmarks/bench_memory.py` measures it."""
    if any(x.backward_memory_bytes for x in nodes):
        return [float(x.backward_memory_bytes) for x in nodes]
    return [float(x.activation_bytes) for x in nodes]

ANTICHAIN_META = "antichain_dag"


def search_space_inputs(chain: Chain) -> dict[str, Any]:
    """What a plan's `inputs` record about a restricted search space: `search_space` (the
    chain's `meta["search_space"]`, see `pdcli.profiler.graphtxt.linearize`) when its
    positions are not every split point, else nothing (plans of exact chains stay as they were)."""
    restricted = chain.meta.get(SEARCH_SPACE_META) if isinstance(chain.meta, dict) else None
    return {SEARCH_SPACE_META: dict(restricted)} if restricted else {}


class Activations(NamedTuple):
    """What stages keep for their backward, per minibatch (`SplitSpace.activations`)."""

    held: np.ndarray
    """Inputs and saved tensors, without the weight copies."""
    copies: np.ndarray | None
    """Half-width weight copies one forward keeps (not per minibatch: per forward); None =
    not measured (`pdcli.planner.memory.stage_memory` applies its factor rules)."""
    inputs: np.ndarray
    """The stage's inputs."""
    waiting: np.ndarray | None = None
    """What a split backward keeps from a Backward to its WeightGrads; None = not measured
    (`held` stands for it)."""


@dataclass(frozen=True, eq=False)
class SplitSpace:
    """Covered totals per position and the valid (start, end) pairs, as numpy arrays."""

    num_positions: int
    covered_fwd_ms: np.ndarray
    """covered_fwd_ms[j]: forward time of everything at or before position j."""
    covered_bwd_ms: np.ndarray
    covered_parameter_bytes: np.ndarray
    covered_activation_bytes: np.ndarray
    """Bytes a stage keeps for its backward per minibatch (activations + saved tensors)."""
    cut_bytes: np.ndarray
    """cut_bytes[j]: bytes crossing a cut right after position j (0 after the last)."""
    split_ok: np.ndarray
    """split_ok[k, j]: a stage ending at j may start right after k (k < j)."""
    covered_masks: tuple[int, ...] | None
    """Imported chains: bit b set when member b (chain member order) is covered."""
    member_order: tuple[str, ...]
    position_members: tuple[tuple[str, ...], ...]
    """Per position, what a plan lists in `node_names`: the chain node's name (our chains,
    which the compiler checks), or the graph nodes it merges (imported chains)."""
    covered_optimizer_ms: np.ndarray | None = None
    """Optimizer step time of the parameters at or before j: each position's own step less
    the fixed cost of a step (which a stage pays once); None = not measured (0)."""
    covered_optimizer_state_bytes: np.ndarray | None = None
    optimizer_step_overhead_ms: float = 0.0
    """Fixed cost of one optimizer step (`meta.optimizer.step_overhead_ms`), once per stage."""
    calibration_ratio: float | None = None
    """Whole fwd+bwd step / sum of the positions' (`meta.calibration.ratio`); None = unknown.
    What the cost model makes of it: `pdcli.planner.costs.compute_calibration`."""
    covered_wgrad_ms: np.ndarray | None = None
    """Of covered_bwd_ms, the weight gradients a split backward defers (each position's
    `wgrad_ms`, at most its `bwd_ms`); None = not measured (0: PipeDream graphs)."""
    runtime: RuntimeCosts | None = None
    """The runtime's measured costs (`meta.runtime`); None = not measured (PipeDream graphs,
    older profiles, `profile.runtime_probe=false`)."""
    held: dict[str, dict[str, Any]] | None = None
    """`meta.held_memory` (`pdcli.profiler.held`): per precision ("fp32", "half") the
    bytes each position holds, its tail, weight copies, the loss's and the cuts; None =
    not measured."""
    input_bytes: float = 0.0
    """The model inputs of one profiled batch (what stage 0 receives)."""
    eager_sends: bool | None = None
    """The runtime's send order on the profiled device (`pdcli.schedule.build_for`):
    sends first everywhere but over NCCL (CUDA); None = unknown (PipeDream graphs)."""
    fixed_cuts: tuple[int, ...] = ()
    """Positions every plan cuts at (the user's, `pdcli.planner.steer`): no stage spans one."""
    covered_unfactored_ms: np.ndarray | None = None
    """Forward + backward at or before j without the runtime's position factors
    (`RuntimeCosts.position_scale`); None: there are none (all 1)."""

    def with_cuts(self, cuts: tuple[int, ...]) -> "SplitSpace":
        """This space with `cuts` fixed (itself when those are its cuts already)."""
        if tuple(cuts) == self.fixed_cuts:
            return self
        return dataclasses.replace(self, fixed_cuts=tuple(cuts))

    @classmethod
    def from_chain(cls, chain: Chain) -> "SplitSpace":
        n = len(chain.nodes)
        position_members: tuple[tuple[str, ...], ...] = tuple((node.name,) for node in chain.nodes)
        member_order: tuple[str, ...] = tuple(node.name for node in chain.nodes)
        cut = np.zeros(n)
        cut[: n - 1] = np.asarray(chain.cut_bytes, dtype=float)
        dag = chain.meta.get(ANTICHAIN_META) if isinstance(chain.meta, dict) else None
        if dag:  # members are exactly the graph nodes, so bit b of a mask is member b
            position_members = tuple(tuple(node.members) for node in chain.nodes)
            member_order = tuple(m for members in position_members for m in members)
            split_ok = np.zeros((n, n), dtype=bool)
            for j, mask in enumerate(dag["ancestors_hex"]):
                bits = np.unpackbits(np.frombuffer(int(mask, 16).to_bytes((n + 7) // 8, "little"), dtype=np.uint8),
                                     bitorder="little")
                split_ok[:j, j] = bits[:j].astype(bool)
            return cls(
                num_positions=n,
                covered_fwd_ms=np.asarray(dag["covered_fwd_ms"], dtype=float),
                covered_bwd_ms=np.asarray(dag["covered_bwd_ms"], dtype=float),
                covered_parameter_bytes=np.asarray(dag["covered_parameter_bytes"], dtype=float),
                covered_activation_bytes=np.asarray(dag["covered_activation_bytes"], dtype=float),
                cut_bytes=cut,
                split_ok=split_ok,
                covered_masks=tuple(int(m, 16) for m in dag["covered_hex"]),
                member_order=member_order,
                position_members=position_members,
                covered_optimizer_ms=np.zeros(n),
                covered_optimizer_state_bytes=np.zeros(n),
            )

        def cum(values: list[float]) -> np.ndarray:
            return np.cumsum(np.asarray(values, dtype=float))

        nodes = chain.nodes
        meta = chain.meta if isinstance(chain.meta, dict) else {}
        overhead_ms = float((meta.get("optimizer") or {}).get("step_overhead_ms", 0.0))
        ratio = (meta.get("calibration") or {}).get("ratio")
        runtime = RuntimeCosts.from_meta(meta)
        # the layers' times as a real run refitted them, region by region (1 without a run)
        factor = runtime.position_factors(n) if runtime is not None else [1.0] * n
        return cls(
            num_positions=n,
            covered_fwd_ms=cum([x.fwd_ms * f for x, f in zip(nodes, factor)]),
            covered_bwd_ms=cum([x.bwd_ms * f for x, f in zip(nodes, factor)]),
            covered_parameter_bytes=cum([x.parameter_bytes for x in nodes]),
            covered_activation_bytes=cum(held_activation_bytes(nodes)),
            cut_bytes=cut,
            split_ok=np.triu(np.ones((n, n), dtype=bool), k=1),
            covered_masks=None,
            member_order=member_order,
            position_members=position_members,
            covered_optimizer_ms=cum([max(x.optimizer_ms - overhead_ms, 0.0) if x.optimizer_ms > 0 else 0.0
                                      for x in nodes]),
            covered_optimizer_state_bytes=cum([x.optimizer_state_bytes for x in nodes]),
            optimizer_step_overhead_ms=overhead_ms,
            calibration_ratio=float(ratio) if ratio is not None else None,
            covered_wgrad_ms=cum([min(max(x.wgrad_ms, 0.0), x.bwd_ms) * f for x, f in zip(nodes, factor)]),
            runtime=runtime,
            covered_unfactored_ms=(cum([x.fwd_ms + x.bwd_ms for x in nodes]) if any(f != 1.0 for f in factor)
                                   else None),
            held=meta.get(HELD_META) if isinstance(meta.get(HELD_META), dict) else None,
            input_bytes=float(chain.input_bytes),
            eager_sends={"cpu": True, "cuda": False}.get(str(meta.get("device_type"))),
        )

    # -- ranges ---------------------------------------------------------------------------
    def range_matrix(self, covered: np.ndarray) -> np.ndarray:
        """R[i, e] = total over stage [i, e) (covered[e-1] - covered[i-1]); nan unless i < e."""
        n = self.num_positions
        before = np.concatenate(([0.0], covered[:-1]))  # before[i] = covered[i-1]
        out = covered[None, :] - before[:, None]  # (start i, last position e-1)
        out = np.concatenate((np.full((n, 1), np.nan), out), axis=1)  # column e = last+1
        start, end = np.arange(n)[:, None], np.arange(n + 1)[None, :]
        return np.where(end > start, out, np.nan)

    @functools.lru_cache(maxsize=8)
    def activations(self, precision: str, scale: float) -> Activations:
        """What every stage [i, e) keeps for its backward per minibatch, as matrices [i, e]
        (nan unless i < e), at the run's precision where the profile measured it."""
        n = self.num_positions
        kind = "fp32" if precision == "fp32" else "half"
        measured = (self.held or {}).get(kind)
        start = np.arange(n)[:, None]
        # a stage receives its inputs as the compiled wires carry them (fp32, the model's dtype)
        cut_in = np.concatenate(([self.input_bytes], self.cut_bytes[: n - 1]))[:, None]
        if measured is None or len(measured["held"]) != n:
            held = self.range_matrix(self.covered_activation_bytes) * scale
            return Activations(held, None, np.broadcast_to(cut_in * scale, held.shape))
        # under autocast, what a stage holds for receiving fp32 (`pdcli.profiler.held._fp32_start`)
        cast_in = np.asarray(measured["start"], dtype=float)[:, None] if "start" in measured else 0.0
        copies = self.range_matrix(np.cumsum(np.asarray(measured["copies"], dtype=float)))
        held = self.range_matrix(np.cumsum(np.asarray(measured["held"], dtype=float))) - copies
        tail = np.concatenate(([np.nan], np.asarray(measured["tail"], dtype=float)))[None, :]  # ending at e
        loss = np.where(np.arange(n + 1) == n, float(measured["loss"]), 0.0)[None, :]
        head = np.asarray(measured.get("head", [0.0] * n), dtype=float)[:, None]  # starting at i
        held = (held + cut_in + cast_in + head - tail + loss) * scale
        waiting = self.range_matrix(np.cumsum(np.asarray(measured["waiting"], dtype=float))) * scale \
            if "waiting" in measured else None
        return Activations(np.where(np.arange(n + 1)[None, :] > start, held, np.nan), copies,
                           np.broadcast_to(cut_in * scale, held.shape), waiting)

    def valid_stages(self) -> np.ndarray:
        """V[i, e]: [i, e) is a valid stage (starts at 0 or right after an ancestor of e-1, and
        spans no fixed cut)."""
        n = self.num_positions
        out = np.zeros((n, n + 1), dtype=bool)
        out[0, 1:] = True
        out[1:, 1:] = self.split_ok[: n - 1, :]  # out[i, e] = split_ok[i-1, e-1]
        for cut in self.fixed_cuts:
            out[:cut, cut + 1:] = False  # start < cut < end
        return out

    def range_total(self, covered: np.ndarray, start: int, end: int) -> float:
        return float(covered[end - 1] - (covered[start - 1] if start > 0 else 0.0))

    def position_factor(self, start: int, end: int) -> float:
        """Stage [start, end)'s position factor: its positions' factors weighted by their
        profiled forward + backward time (1 without factors). What the stage's forward and
        backward cost beyond their layers (an action's fixed cost) runs at this factor too."""
        if self.covered_unfactored_ms is None:
            return 1.0
        unfactored = self.range_total(self.covered_unfactored_ms, start, end)
        factored = self.range_total(self.covered_fwd_ms, start, end) + self.range_total(self.covered_bwd_ms, start, end)
        return factored / unfactored if unfactored > 0 else 1.0

    def position_factor_matrix(self) -> np.ndarray | float:
        """`position_factor` of every stage [i, e) (as `range_matrix`); 1.0 without factors."""
        if self.covered_unfactored_ms is None:
            return 1.0
        unfactored = self.range_matrix(self.covered_unfactored_ms)
        factored = self.range_matrix(self.covered_fwd_ms + self.covered_bwd_ms)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(unfactored > 0, factored / unfactored, 1.0)

    def stage_members(self, start: int, end: int) -> list[str]:
        """Graph nodes (or chain positions) that a stage [start, end) holds, in order."""
        if self.covered_masks is None:
            return [m for members in self.position_members[start:end] for m in members]
        last = self.covered_masks[end - 1]
        before = self.covered_masks[start - 1] if start > 0 else 0
        if start == 0:  # inputs PipeDream removed sit in no covered set: stage 0 owns them
            before = 0
            last |= ((1 << len(self.member_order)) - 1) & ~self.covered_masks[-1]
        bits = last & ~before
        return [m for b, m in enumerate(self.member_order) if (bits >> b) & 1]

"""What the runtime pays per action, as measured by `pd profile`'s runtime probe (pure, no torch).

The per-layer profile times each position alone. The runtime runs a stage's positions as
one Forward, one Backward (and, split, one WeightGrads) per microbatch, through its own
machinery (weight versions, memory accounting, the interpreter), steps the optimizer with
its bookkeeping, loads data, computes the loss, packs and unpacks messages, and moves them
over a transport. `pdcli.probe.runtime` runs real stages of the model with the
runtime's own executor and fits, per action, `ms = scale * profiled_ms + fixed_ms`
(`Affine`); this module holds the fit (`profile.json` `meta.runtime`) and prices a stage's
actions with it. `pdcli.planner.costs` sums the prices into a stage's time and
`pdcli.schedule.simulator` replays the action lists with them.

Every term can be switched off (`RuntimeCosts.without`), which the tests use to see each one
matter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from pdcli.schedule.simulator import shares_cores
from pdcli.schedule.spec import rules

STASHED, DIRECT = "stashed", "direct"
"""Weight modes: `pipedream`/`2bw` run forwards on stashed versions (functional_call),
`gpipe`/`1f1b` on the live module."""
TERMS = ("layers", "fixed", "loss", "load", "messages", "transport", "cores", "interpreter", "positions", "sharing")
"""What `without` can switch off: the layer scales (1 instead), the fixed costs per action,
the loss, data loading, packing/unpacking messages, the measured transport (latency,
bandwidth and the all-reduce: the cluster's nominal bandwidth instead), the core count bound, the
interpreter's time between actions, the per-position factors a real run refitted, what workers
sharing cores pay beyond the replay's queue (the slowdown and the compute's CPU factor)."""
RUNTIME_META = "runtime"
"""`profile.json` meta key."""


def weight_mode(schedule: str) -> str:
    """STASHED for the schedules that stash weight versions (`pipedream`, `2bw`), else DIRECT."""
    return STASHED if rules(schedule).stashes_weights else DIRECT


def steady(values: Sequence[float]) -> list[float]:
    """The second half of a run's samples (the first half warms up)."""
    return list(values[len(values) // 2:]) or list(values)


def steady_mean(values: Sequence[float]) -> float:
    """The mean of the steady half: a run's time is the sum of its actions, so the mean, not
    the median, is what a prediction must match. 0 for no samples."""
    tail = steady(values)
    return float(sum(tail)) / len(tail) if tail else 0.0


@dataclass(frozen=True)
class Affine:
    """`scale * x + fixed_ms`."""

    scale: float = 1.0
    fixed_ms: float = 0.0

    def __call__(self, x: Any) -> Any:
        return self.scale * x + self.fixed_ms

    def to_json(self) -> dict[str, float]:
        return {"scale": self.scale, "fixed_ms": self.fixed_ms}

    @staticmethod
    def from_json(obj: Any) -> "Affine":
        return Affine(float(obj.get("scale", 1.0)), float(obj.get("fixed_ms", 0.0)))


def fit_affine(xs: Sequence[float], ys: Sequence[float], single: str = "scale") -> Affine:
    """Least squares `y = scale * x + fixed` with scale >= 0 and fixed >= 0. With one distinct
    x: `single="scale"` gives y / x, `"fixed"` gives the mean of y."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if x.size == 0:
        return Affine(1.0, 0.0) if single == "scale" else Affine(0.0, 0.0)
    if np.ptp(x) <= 1e-12 * max(1.0, float(np.abs(x).max())):
        if single == "fixed" or not x.mean() > 0:
            return Affine(0.0, max(float(y.mean()), 0.0))
        return Affine(max(float(y.mean() / x.mean()), 0.0), 0.0)
    scale, fixed = np.polyfit(x, y, 1)
    if fixed < 0:  # through the origin
        return Affine(max(float((x @ y) / (x @ x)), 0.0), 0.0)
    if scale < 0:
        return Affine(0.0, max(float(y.mean()), 0.0))
    return Affine(float(scale), float(fixed))


@dataclass(frozen=True)
class ModeCosts:
    """One weight mode's actions, each affine in the profiled time of the stage's positions."""

    forward: Affine
    """Forward of one microbatch, x = the positions' profiled forward (loss excluded)."""
    backward: Affine
    """Backward of one microbatch, x = the profiled backward (unsplit; the loss excluded)."""
    wgrad: Affine
    """WeightGrads of one microbatch (split backward), x = the profiled `wgrad_ms`; the split
    Backward is `backward(B) - wgrad(W)`."""
    update: Affine
    """One optimizer step with its weight-version bookkeeping (StashWeights, FreeWeights),
    x = the positions' profiled optimizer time."""

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k).to_json() for k in ("forward", "backward", "wgrad", "update")}

    @staticmethod
    def from_json(obj: Any) -> "ModeCosts":
        return ModeCosts(*(Affine.from_json(obj.get(k, {})) for k in ("forward", "backward", "wgrad", "update")))


@dataclass(frozen=True)
class RuntimeCosts:
    """The runtime's measured costs on this host (`meta.runtime` of a profile)."""

    modes: dict[str, ModeCosts]
    loss_fwd_ms: float = 0.0
    """The loss on the last stage's output, forward, per microbatch."""
    loss_bwd_ms: float = 0.0
    load_inputs_ms: float = 0.0
    """Making one minibatch of data with its inputs (the first stage), per minibatch."""
    load_target_ms: float = 0.0
    """The target only (the last stage), per minibatch."""
    send: Affine = Affine(0.0, 0.0)
    """Packing and posting one message, x = its bytes."""
    recv: Affine = Affine(0.0, 0.0)
    """Unpacking one message that has arrived, x = its bytes."""
    latency_ms: float | None = None
    """One message's time in flight on the measured transport, beside its bytes / bandwidth;
    None: not measured (nominal cluster bandwidth only)."""
    bandwidth_bytes_per_s: float | None = None
    transport: str = ""
    """The transport measured (`socket`)."""
    cores: int | None = None
    """CPU cores the workers share (None: no bound, e.g. GPUs)."""
    allreduce: Affine | None = None
    """One AllReduceGrads of a stage's gradients between two processes of this host (gloo),
    x = their bytes (`pdcli.probe.allreduce`); None: not measured (the ring over the
    cluster's bandwidth only)."""
    gap_ms: float = 0.0
    """The interpreter's own time per action, outside every action (heartbeat, posting
    receives ahead, the timeline)."""
    position_scale: tuple[float, ...] | None = None
    """A factor per profiled position on its forward, backward and weight-gradient times,
    refitted from a real run (`pdcli.report.calibrate`): a stage of the run took its factor
    times what the affine costs of its positions' profiled times say (a region of the model
    that runs slower or faster among workers sharing the host than alone). None: all 1."""
    shared_slowdown: float = 1.0
    """How much slower than its replay a plan runs whose workers outnumber `cores`, beyond the
    core queue the replay models (context switches, the transport's threads waking up on busy
    cores): a run of a layout sharing the cores over its replay with these costs, measured by
    the pipeline probe when these costs were fitted on a layout with a core per worker
    (`pdcli.probe.runtime`). 1.0: not measured, or fitted on shared cores (the fit holds it)."""
    shared_cpu_scale: float = 1.0
    """How much more CPU time a compute action takes where workers outnumber `cores` than the
    costs say (caches and memory bandwidth shared, the kernel switching workers): the same run's
    compute, in CPU time per minibatch, over its replay's. Part of what `shared_slowdown` holds,
    so it prices a stage's compute, not the time; measured with it. 1.0: as `shared_slowdown`."""
    sources: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What the fit was made from (probe stages, samples, residuals); informational."""
    cluster_links: bool = False
    """Priced for a cluster of several levels (`pdcli.planner.search.runtime_of`; not kept in
    the profile): a message also pays its bytes at the level's nominal bandwidth where that is
    slower than the measured transport, and holds its link for its bytes (`link_wire_ms`)."""

    def mode(self, schedule: str) -> ModeCosts:
        return self.modes[weight_mode(schedule)]

    def slowdown(self, workers: int) -> float:
        """`shared_slowdown` where `workers` outnumber the cores, else 1."""
        return self.shared_slowdown if self.shares(workers) else 1.0

    def cpu_sharing(self, workers: int) -> float:
        """`shared_cpu_scale` where `workers` outnumber the cores, else 1."""
        return self.shared_cpu_scale if self.shares(workers) else 1.0

    def shares(self, workers: int) -> bool:
        """`workers` outnumber the cores."""
        return shares_cores(workers, self.cores)

    def to_json(self) -> dict[str, Any]:
        return {
            "modes": {k: v.to_json() for k, v in sorted(self.modes.items())},
            "loss_fwd_ms": self.loss_fwd_ms, "loss_bwd_ms": self.loss_bwd_ms,
            "load_inputs_ms": self.load_inputs_ms, "load_target_ms": self.load_target_ms,
            "send": self.send.to_json(), "recv": self.recv.to_json(),
            "latency_ms": self.latency_ms, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "transport": self.transport, "cores": self.cores, "gap_ms": self.gap_ms, "sources": self.sources,
            "allreduce": self.allreduce.to_json() if self.allreduce is not None else None,
            "position_scale": list(self.position_scale) if self.position_scale is not None else None,
            "shared_slowdown": self.shared_slowdown, "shared_cpu_scale": self.shared_cpu_scale,
        }

    @staticmethod
    def from_json(obj: Any) -> "RuntimeCosts":
        def opt(key: str) -> float | None:
            value = obj.get(key)
            return None if value is None else float(value)

        cores = obj.get("cores")
        return RuntimeCosts(
            modes={k: ModeCosts.from_json(v) for k, v in obj["modes"].items()},
            loss_fwd_ms=float(obj.get("loss_fwd_ms", 0.0)), loss_bwd_ms=float(obj.get("loss_bwd_ms", 0.0)),
            load_inputs_ms=float(obj.get("load_inputs_ms", 0.0)), load_target_ms=float(obj.get("load_target_ms", 0.0)),
            send=Affine.from_json(obj.get("send", {"scale": 0.0})), recv=Affine.from_json(obj.get("recv", {"scale": 0.0})),
            latency_ms=opt("latency_ms"), bandwidth_bytes_per_s=opt("bandwidth_bytes_per_s"),
            transport=str(obj.get("transport", "")), cores=None if cores is None else int(cores),
            gap_ms=float(obj.get("gap_ms", 0.0)), sources=dict(obj.get("sources", {})),
            allreduce=Affine.from_json(obj["allreduce"]) if obj.get("allreduce") else None,
            position_scale=tuple(float(x) for x in obj["position_scale"]) if obj.get("position_scale") else None,
            shared_slowdown=float(obj.get("shared_slowdown", 1.0)),
            shared_cpu_scale=float(obj.get("shared_cpu_scale", 1.0)),
        )

    @staticmethod
    def from_meta(meta: Any) -> "RuntimeCosts | None":
        obj = meta.get(RUNTIME_META) if isinstance(meta, dict) else None
        return RuntimeCosts.from_json(obj) if obj else None

    def priced(self, chain: Any) -> Any:
        """A copy of `chain` (a profile's `Chain`) whose meta carries these costs, which is how
        the planner finds them."""
        return dataclasses.replace(chain, meta={**chain.meta, RUNTIME_META: self.to_json()})

    def without(self, *terms: str) -> "RuntimeCosts":
        """The same costs with `terms` (of TERMS) switched off."""
        unknown = set(terms) - set(TERMS)
        if unknown:
            raise ValueError(f"unknown runtime terms {sorted(unknown)}; known: {', '.join(TERMS)}")
        out = self
        if "layers" in terms or "fixed" in terms:
            def strip(a: Affine) -> Affine:
                return Affine(1.0 if "layers" in terms else a.scale, 0.0 if "fixed" in terms else a.fixed_ms)
            out = dataclasses.replace(out, modes={
                k: ModeCosts(*(strip(getattr(m, f)) for f in ("forward", "backward", "wgrad", "update")))
                for k, m in out.modes.items()})
        if "loss" in terms:
            out = dataclasses.replace(out, loss_fwd_ms=0.0, loss_bwd_ms=0.0)
        if "load" in terms:
            out = dataclasses.replace(out, load_inputs_ms=0.0, load_target_ms=0.0)
        if "messages" in terms:
            out = dataclasses.replace(out, send=Affine(0.0, 0.0), recv=Affine(0.0, 0.0))
        if "transport" in terms:
            out = dataclasses.replace(out, latency_ms=None, bandwidth_bytes_per_s=None, allreduce=None)
        if "cores" in terms:
            out = dataclasses.replace(out, cores=None)
        if "interpreter" in terms:
            out = dataclasses.replace(out, gap_ms=0.0)
        if "positions" in terms:
            out = dataclasses.replace(out, position_scale=None)
        if "sharing" in terms:
            out = dataclasses.replace(out, shared_slowdown=1.0, shared_cpu_scale=1.0)
        return out

    def position_factors(self, num_positions: int) -> list[float]:
        """`position_scale` for a profile of `num_positions` positions (all 1 when there is none
        or it was fitted on a profile of another length)."""
        scale = self.position_scale
        return list(scale) if scale is not None and len(scale) == num_positions else [1.0] * num_positions

    def cpu_scaled(self, factor: float) -> "RuntimeCosts":
        """Every CPU cost (the actions, the loss, loading, packing and unpacking, the gap)
        times `factor`; the transport and the core count unchanged."""
        def times(a: Affine) -> Affine:
            return Affine(a.scale * factor, a.fixed_ms * factor)

        return dataclasses.replace(
            self, modes={k: ModeCosts(*(times(getattr(m, f)) for f in ("forward", "backward", "wgrad", "update")))
                         for k, m in self.modes.items()},
            loss_fwd_ms=self.loss_fwd_ms * factor, loss_bwd_ms=self.loss_bwd_ms * factor,
            load_inputs_ms=self.load_inputs_ms * factor, load_target_ms=self.load_target_ms * factor,
            send=times(self.send), recv=times(self.recv), gap_ms=self.gap_ms * factor)

    def link_ms(self, message_bytes: Any, nominal_bandwidth_bytes_per_s: Any) -> Any:
        """Time in flight of one message: the measured latency + bytes / measured bandwidth, or
        bytes / the cluster's nominal bandwidth where nothing was measured; on a cluster of
        several levels (`cluster_links`) the latency + `link_wire_ms`."""
        if self.latency_ms is None or self.bandwidth_bytes_per_s is None:
            return message_bytes / nominal_bandwidth_bytes_per_s * 1e3
        if self.cluster_links:
            return self.latency_ms + self.link_wire_ms(message_bytes, nominal_bandwidth_bytes_per_s)
        return self.latency_ms + message_bytes / self.bandwidth_bytes_per_s * 1e3

    def link_wire_ms(self, message_bytes: Any, nominal_bandwidth_bytes_per_s: Any) -> Any:
        """How long one message holds its link (`cluster_links` only, else 0: the measured
        transport of one host carries messages side by side): its bytes at the slower of the
        measured transport and the level's nominal bandwidth."""
        if not self.cluster_links:
            return 0.0 * message_bytes
        bandwidth = np.minimum(self.bandwidth_bytes_per_s or np.inf, nominal_bandwidth_bytes_per_s)
        return message_bytes / bandwidth * 1e3

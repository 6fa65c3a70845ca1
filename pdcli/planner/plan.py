"""The plan: stages, replication, ranks and predictions, and its `plan.json` form.

`plan.json` (consumed by the compiler and the runtime):

    {"version": 1,
     "inputs": {"profile_sha256"?, "cost_model", "schedule", "num_microbatches", "batch_size",
                "topology": {"levels": [...]}, "memory_bytes_per_device", "straight",
                "use_fewer_devices", "num_stages", "precision"?, "recompute"?, "split_backward"?,
                "boundaries"?, "split_points"?, "replicas"?, "fixed_cuts"?, "virtual_stages"?},
     "stages": [{"stage_id", "start", "end", "first_node", "last_node", "node_names",
                 "replicas", "ranks", "split_point"?, "predicted": {PREDICTED_KEYS}}],
     "pipeline": {PIPELINE_KEYS},
     "warnings"?: [str],
     "search"?: {"space", "objective", "max_staleness", "configurations", "without_plan",
                 "front": [{"schedule", "num_microbatches", "split_backward", "stages", "boundaries", "replicas",
                            "time_per_minibatch_ms", "throughput_samples_per_s", "peak_bytes",
                            "staleness"}], "chosen": index into front}}

Virtual stages (`inputs.virtual_stages` = V > 1; `interleaved`, `loopedbfs`, `zbv`): the stages
are the model's S x V chunks in model order, each with `replicas` 1 and `ranks` [the device
that runs it] (loop placement: chunk k on device k mod S; V placement: chunks d and 2S-1-d on
device d), so several stages share a rank; `pipeline.devices` holds each device's chunks and
predicted memory, and `time_per_minibatch_ms` is the replay of the schedule's lists.
`pd compile` writes one module per chunk as it does per stage.

`split_point` names the cut a stage starts at (`layer2`, `layer3:end`; see
`pdcli.planner.steer`), when a module begins or ends there. `fixed_cuts` are the positions
the user fixed (split points, `pipe_split()` markers, boundaries); a plan with fixed cuts or
replicas has `pipeline.unconstrained`: the best plan without them (UNCONSTRAINED_KEYS).

`start`/`end` are half-open chain positions. Times are ms per minibatch of `batch_size`
samples; `fwd_ms`/`bwd_ms` are the stage's whole minibatch on one replica (`wgrad_ms`, the
part of `bwd_ms` a split backward defers, too; `pd` cost model only), the other terms are
per minibatch with the replicas sharing the work. Floats are rounded to 9 significant
digits so the same inputs give byte-identical files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PLAN_VERSION = 1
SIGNIFICANT_DIGITS = 9
PREDICTED_KEYS = (
    "fwd_ms", "bwd_ms", "compute_ms", "optimizer_ms", "sync_ms", "comm_in_ms", "comm_out_ms",
    "stage_time_ms", "weights_bytes", "optimizer_state_bytes", "stashed_weights_bytes",
    "activations_bytes", "total_bytes", "wgrad_ms", "messages_ms", "load_ms", "actions_ms",
)
ADDED_PREDICTED_KEYS = ("optimizer_ms", "optimizer_state_bytes", "wgrad_ms", "messages_ms", "load_ms", "actions_ms")
"""Keys plans written before the optimizer (or split backward) was modelled lack,
`wgrad_ms` the `pipedream` cost model does not predict (read back as absent), and the
runtime-cost terms (`messages_ms`, `load_ms`, `actions_ms`: one replica's cost per action,
`pdcli.schedule.simulator.StageCost` fields) only a profile with `meta.runtime` gives."""
PIPELINE_KEYS = (
    "time_per_minibatch_ms", "throughput_samples_per_s", "data_parallel_time_per_minibatch_ms",
    "speedup_over_data_parallel", "num_devices", "num_devices_used", "bottleneck_stage", "replay", "unconstrained",
    "devices",
)
OPTIONAL_PIPELINE_KEYS = ("replay", "unconstrained", "devices")
"""`replay`: how the time per minibatch was replayed (runtime costs only); `unconstrained`:
the best plan without the user's fixed cuts and replicas (only when they fixed any); `devices`:
virtual stages only, each device's chunks and memory (DEVICE_KEYS)."""
DEVICE_KEYS = ("rank", "chunks", "total_bytes", "activations_bytes", "compute_ms")
"""A device's row in `pipeline.devices`: its rank, the chunks it runs (stage ids), its predicted
peak memory (its chunks' weights and optimizer state plus the activations its list holds at
once) and its chunks' compute per minibatch."""
UNCONSTRAINED_KEYS = ("time_per_minibatch_ms", "faster_pct", "boundaries", "split_points", "replicas")
"""`faster_pct`: how much less time per minibatch than the user's plan, in percent;
`split_points`: its cuts by name (null where a cut has no name)."""


def round_float(value: float) -> float:
    """`value` to SIGNIFICANT_DIGITS digits (deterministic text in plan.json)."""
    return float(f"{float(value):.{SIGNIFICANT_DIGITS}g}")


def _clean(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, float):
        return round_float(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return round_float(float(value))  # numpy scalars


@dataclass(frozen=True)
class Stage:
    stage_id: int
    start: int
    end: int
    first_node: str
    last_node: str
    node_names: tuple[str, ...]
    replicas: int
    ranks: tuple[int, ...]
    predicted: dict[str, Any]
    """PREDICTED_KEYS -> value (ms or bytes; `actions_ms` a dict of ms)."""
    split_point: str = ""
    """The cut this stage starts at by name; `` for stage 0 and unnamed cuts."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "stage_id": self.stage_id, "start": self.start, "end": self.end,
            "first_node": self.first_node, "last_node": self.last_node,
            "node_names": list(self.node_names), "replicas": self.replicas,
            "ranks": list(self.ranks),
        }
        if self.split_point:
            out["split_point"] = self.split_point
        out["predicted"] = {k: _clean(self.predicted[k]) for k in PREDICTED_KEYS
                            if k in self.predicted or k not in ADDED_PREDICTED_KEYS}
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Stage":
        return cls(
            stage_id=int(obj["stage_id"]), start=int(obj["start"]), end=int(obj["end"]),
            first_node=str(obj.get("first_node", "")), last_node=str(obj.get("last_node", "")),
            node_names=tuple(obj.get("node_names", ())), replicas=int(obj["replicas"]),
            ranks=tuple(int(r) for r in obj["ranks"]), predicted=dict(obj.get("predicted", {})),
            split_point=str(obj.get("split_point", "")),
        )


@dataclass(frozen=True)
class Plan:
    inputs: dict[str, Any]
    stages: tuple[Stage, ...]
    pipeline: dict[str, Any]
    """PIPELINE_KEYS -> value."""
    warnings: tuple[str, ...] = ()
    """What the user fixed that the plan allows but advises against."""
    search: dict[str, Any] | None = None
    """When the planner chose the configuration too (`plan.search`): the space searched, the
    objective, the Pareto front's rows and the chosen one (`pdcli.planner.pareto`)."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def time_per_minibatch_ms(self) -> float:
        return float(self.pipeline["time_per_minibatch_ms"])

    def to_json(self) -> dict[str, Any]:
        out = {
            "version": PLAN_VERSION,
            "inputs": _clean(self.inputs),
            "stages": [s.to_json() for s in self.stages],
            "pipeline": {k: _clean(self.pipeline[k]) for k in PIPELINE_KEYS
                         if k in self.pipeline or k not in OPTIONAL_PIPELINE_KEYS},
        }
        if self.warnings:
            out["warnings"] = list(self.warnings)
        if self.search is not None:
            out["search"] = _clean(self.search)
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Plan":
        version = obj.get("version")
        if version != PLAN_VERSION:
            raise ValueError(f"plan version {version!r} is not supported (expected {PLAN_VERSION})")
        return cls(
            inputs=dict(obj.get("inputs", {})),
            stages=tuple(Stage.from_json(s) for s in obj["stages"]),
            pipeline=dict(obj.get("pipeline", {})),
            warnings=tuple(obj.get("warnings", ())),
            search=obj.get("search"),
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or isinstance(value, float)


def plan_shape_error(plan: Any) -> str | None:
    """What makes `plan` (a plan.json read back) unlike one pd writes, in the fields `pd plan
    diff` and the runtime read (each stage's ids, positions, replicas, ranks and predicted
    times and bytes; the pipeline's and the inputs' mappings): the first such key and why, or
    None where they all have their types."""
    if not isinstance(plan, dict):
        return "the plan is not a mapping"
    stages = plan.get("stages")
    if not isinstance(stages, list) or not stages:
        return "`stages` is not a non-empty list"
    for i, stage in enumerate(stages):
        if not isinstance(stage, dict):
            return f"stages[{i}] is not a mapping"
        for key in ("stage_id", "start", "end", "replicas"):
            if not _is_int(stage.get(key)):
                return f"stages[{i}].{key} is not an integer"
        ranks = stage.get("ranks")
        if not isinstance(ranks, list) or not all(_is_int(r) for r in ranks):
            return f"stages[{i}].ranks is not a list of integers"
        predicted = stage.get("predicted", {})
        if not isinstance(predicted, dict):
            return f"stages[{i}].predicted is not a mapping"
        for key in ("stage_time_ms", "total_bytes"):
            if predicted.get(key) is not None and not _is_number(predicted[key]):
                return f"stages[{i}].predicted.{key} is not a number"
    for section in ("pipeline", "inputs"):
        if not isinstance(plan.get(section, {}), dict):
            return f"`{section}` is not a mapping"
    pipeline = plan.get("pipeline", {})
    for key in ("time_per_minibatch_ms", "throughput_samples_per_s"):
        if pipeline.get(key) is not None and not _is_number(pipeline[key]):
            return f"pipeline.{key} is not a number"
    return None

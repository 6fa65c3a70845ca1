"""The profile chain: the planner's input, and the `profile.json` format (pure, no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PROFILE_VERSION = 1
PROFILE_ARTIFACT = "profile.json"
"""A run directory's profile: a `Chain` as JSON."""
HELD_META = "held_memory"
"""`meta` key of what stages hold for their backward (`pdcli.profiler.held`)."""
PIPE_SPLITS_META = "pipe_split_positions"
"""`meta` key: chain positions where the model's forward called `pdcli.pipe_split()` (a stage
starts at each); absent when it calls none."""


@dataclass(frozen=True)
class ChainNode:
    """One position of the linearized model graph."""

    name: str
    """Stable id: the torch.fx node name, or PipeDream's state id for imported profiles."""
    label: str
    """Human-readable: module path and op (e.g. `features.0: Conv2d(3, 64, ...)`)."""
    fwd_ms: float
    """Forward time of this position for one minibatch."""
    bwd_ms: float
    """Backward time of this position for one minibatch."""
    parameter_bytes: int
    """Bytes of the parameters owned by this position."""
    activation_bytes: int
    """Bytes of the outputs this position produces (kept for backward)."""
    backward_memory_bytes: int = 0
    """Extra memory the backward of this position keeps alive (saved tensors)."""
    members: tuple[str, ...] = ()
    """Graph nodes merged into this position (PipeDream antichain states); empty = just `name`."""
    optimizer_ms: float = 0.0
    """Time of one step of the configured optimizer on this position's parameters alone
    (0 without parameters, and in profiles written before it was measured)."""
    optimizer_state_bytes: int = 0
    """Bytes of optimizer state for this position's parameters (momentum, Adam's moments)."""
    wgrad_ms: float = 0.0
    """Of `bwd_ms`, the weight-gradient part a split backward defers to WeightGrads: the
    `g^T x` matmul of an `nn.Linear` layer (pdcli.torchutil.wgrad; of each one a leaf module
    such as `nn.TransformerEncoderLayer` runs); 0 for every other position and in older
    profiles."""
    module: str = ""
    """Qualified name of the innermost module whose forward made this position, as
    `model.named_modules()` names it (`layer2.0.conv1`; `layer2.0` for the residual add of that
    block); the enclosing modules are its dotted prefixes. `` for the model's own forward, in
    imported profiles and in profiles written before it was recorded. `plan.split_points`
    resolves through it (`pdcli.planner.steer`)."""


@dataclass(frozen=True)
class Chain:
    """A model as a chain of positions; a stage is a contiguous range [start, end)."""

    nodes: tuple[ChainNode, ...]
    cut_bytes: tuple[int, ...]
    """cut_bytes[i]: bytes of every tensor produced at or before position i and consumed
    after i (skip connections included); len == len(nodes) - 1."""
    input_bytes: int = 0
    """Bytes of the model's inputs (what stage 0 receives for one minibatch)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """device, torch_version, batch_size, dtype, config_hash, calibration, source ...;
    PIPE_SPLITS_META: the positions the model's `pipe_split()` calls cut before."""

    def __post_init__(self) -> None:
        if len(self.cut_bytes) != max(len(self.nodes) - 1, 0):
            raise ValueError(
                f"cut_bytes has {len(self.cut_bytes)} entries, expected {len(self.nodes) - 1}"
            )

    def __len__(self) -> int:
        return len(self.nodes)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION,
            "meta": self.meta,
            "input_bytes": self.input_bytes,
            "nodes": [
                {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(n).items()}
                for n in self.nodes
            ],
            "cut_bytes": list(self.cut_bytes),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Chain":
        version = obj.get("version")
        if version != PROFILE_VERSION:
            raise ValueError(f"profile version {version!r} is not supported (expected {PROFILE_VERSION})")
        nodes = tuple(
            ChainNode(**{**n, "members": tuple(n.get("members", ()))}) for n in obj["nodes"]
        )
        return cls(
            nodes=nodes,
            cut_bytes=tuple(int(b) for b in obj["cut_bytes"]),
            input_bytes=int(obj.get("input_bytes", 0)),
            meta=dict(obj.get("meta", {})),
        )

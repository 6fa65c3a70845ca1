"""What the user fixed of a plan, resolved against the chain: cuts and replicas per stage.

A cut is a chain position where a stage starts. The user fixes cuts by module name
(`plan.split_points`: `layer2` cuts before the module, `layer3:end` after it), by
`pdcli.pipe_split()` calls in the model's forward (the profile records where), or by
position (`plan.boundaries`); the replicas of every stage with `plan.replicas`; the number
of stages with `plan.num_stages`. The search places whatever is left (`pdcli.planner.make`).

A module name resolves through the chain's `ChainNode.module` paths: a module covers the
positions whose path is its name or starts with its name and a dot.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Mapping

from pdcli.config.schema import SPLIT_AT_BEGIN, SPLIT_AT_END, split_point_fields
from pdcli.errors import UserError
from pdcli.profiler.chain import PIPE_SPLITS_META, Chain

NEAREST_CUTS = 3
"""How many nearby cuts an error about an uncuttable name suggests."""


@dataclass(frozen=True)
class SplitPoint:
    """A cut by module name: before the module (`begin`) or after it (`end`)."""

    name: str
    at: str = SPLIT_AT_BEGIN

    @classmethod
    def of(cls, item: str | Mapping[str, Any]) -> "SplitPoint":
        """From a `plan.split_points` entry (`layer2`, `layer3:end`, {name: layer3, at: end})."""
        name, at = split_point_fields(item)
        return cls(name, at)

    def __str__(self) -> str:
        return self.name if self.at == SPLIT_AT_BEGIN else f"{self.name}:{SPLIT_AT_END}"


@dataclass(frozen=True)
class Steering:
    """The fixed part of a plan."""

    cuts: tuple[int, ...] = ()
    """Fixed cut positions, increasing (each in 1..n-1)."""
    num_stages: int | None = None
    """Stages of the plan; None = the search decides."""
    replicas: tuple[int, ...] | None = None
    """Replicas of each stage; None = the search decides."""
    sources: tuple[str, ...] = ()
    """Config keys (or `pipe_split()`) that fixed something, for messages."""
    point_names: tuple[tuple[int, str], ...] = ()
    """(cut, the split point the user wrote for it)."""

    @property
    def fixed(self) -> bool:
        """Whether the user fixed any cut or the replicas (`pd plan` then shows the unconstrained best)."""
        return bool(self.cuts) or self.replicas is not None

    @property
    def complete_split(self) -> bool:
        """Every cut is fixed: the stages are the fixed cuts' ranges."""
        return bool(self.cuts) and self.num_stages == len(self.cuts) + 1


def module_positions(chain: Chain) -> dict[str, list[int]]:
    """Every module name the chain knows (each position's module path and its dotted
    prefixes) -> the positions its forward covers, increasing."""
    out: dict[str, list[int]] = {}
    for position, node in enumerate(chain.nodes):
        parts = node.module.split(".") if node.module else []
        for depth in range(1, len(parts) + 1):
            out.setdefault(".".join(parts[:depth]), []).append(position)
    return out


def _contiguous(positions: list[int]) -> bool:
    return positions[-1] - positions[0] + 1 == len(positions)


def cut_names(chain: Chain) -> dict[int, str]:
    """Cut position -> the split point that names it: the outermost module starting there,
    else `<module>:end` of the outermost module ending right before it (positions that no
    module begins or ends at have no name)."""
    begins: dict[int, str] = {}
    ends: dict[int, str] = {}
    outermost_first = sorted(module_positions(chain).items(), key=lambda item: (item[0].count("."), item[0]))
    for name, positions in outermost_first:
        if _contiguous(positions):
            begins.setdefault(positions[0], name)
            ends.setdefault(positions[-1] + 1, f"{name}:{SPLIT_AT_END}")
    return {p: begins.get(p) or ends[p] for p in range(1, len(chain.nodes)) if p in begins or p in ends}


def _nearest(chain: Chain, position: int) -> str:
    names = cut_names(chain)
    near = sorted(names, key=lambda p: (abs(p - position), p))[:NEAREST_CUTS]
    return ", ".join(f"{names[p]} (position {p})" for p in sorted(near)) or "none"


def resolve_split_point(chain: Chain, point: SplitPoint) -> int:
    """The cut position `point` names (UserError: an unknown name with the closest names, a
    name the chain cannot be cut at with why and the nearest cuts)."""
    key = f"plan.split_points: {str(point)!r}"
    if not any(node.module for node in chain.nodes):
        source = chain.meta.get("source", "this profile")
        raise UserError(f"{key}: the profile ({source}) records no module names; re-profile with "
                        f"`pd profile RECIPE --force`, or cut by position with plan.boundaries")
    modules = module_positions(chain)
    positions = modules.get(point.name)
    if positions is None:
        close = difflib.get_close_matches(point.name, list(modules), n=NEAREST_CUTS, cutoff=0.5)
        top = sorted({name.split(".")[0] for name in modules}, key=lambda m: modules[m][0])
        listed = ", ".join(top[:NEAREST_CUTS * 3]) + (", ..." if len(top) > NEAREST_CUTS * 3 else "")
        hint = f"closest: {', '.join(close)}" if close else f"top-level modules: {listed}"
        raise UserError(f"{key}: no module of that name runs in the model's forward; {hint}")
    n = len(chain.nodes)
    if not _contiguous(positions):
        raise UserError(f"{key}: cannot cut there: its forward runs at positions {positions[0]}..{positions[-1]} "
                        f"with other layers in between (it runs more than once, or its forward calls a module "
                        f"registered elsewhere); nearest cuts: {_nearest(chain, positions[0])}")
    cut = positions[0] if point.at == SPLIT_AT_BEGIN else positions[-1] + 1
    if not 0 < cut < n:
        side = "before the first layer" if cut == 0 else "after the last layer"
        raise UserError(f"{key}: cannot cut there: it is {side}, so a stage would be empty; "
                        f"nearest cuts: {_nearest(chain, cut)}")
    return cut


def _check_positions(key: str, positions: tuple[int, ...] | list[int], n: int) -> None:
    if list(positions) != sorted(set(positions)) or any(not 0 < b < n for b in positions):
        raise UserError(f"{key}: {list(positions)} must be strictly increasing positions in 1..{n - 1} "
                        f"(where stages 1.. start; `pd profile` lists the positions)")


def steering_of(chain: Chain, boundaries: tuple[int, ...] | None, split_points: tuple[SplitPoint, ...],
                pipe_splits: bool, replicas: tuple[int, ...] | None, num_stages: int | None, straight: bool,
                num_microbatches: int, num_devices: int) -> Steering:
    """The fixed cuts (union of `boundaries`, `split_points` and, with `pipe_splits`, the
    profile's `pipe_split()` markers), the stage count they and `replicas`/`num_stages` imply, checked against each
    other and the devices (UserError naming the keys)."""
    n = len(chain.nodes)
    cuts: set[int] = set()
    sources: list[str] = []
    if boundaries is not None:
        _check_positions("plan.boundaries", boundaries, n)
        cuts.update(boundaries)
        sources.append("plan.boundaries")
    point_names = tuple((resolve_split_point(chain, point), str(point)) for point in split_points)
    if point_names:
        cuts.update(cut for cut, _ in point_names)
        sources.append("plan.split_points")
    markers = (chain.meta.get(PIPE_SPLITS_META) or []) if pipe_splits else []
    if markers:
        for position in markers:
            if not 0 < position < n:
                side = "before the first layer" if position <= 0 else "after the last layer"
                raise UserError(f"pipe_split(): the model's forward calls it {side}, so a stage would be empty; "
                                f"move the call between two layers")
        cuts.update(markers)
        sources.append("pipe_split()")
    key = " and ".join(sources)
    if replicas is not None:
        if num_stages is not None and num_stages != len(replicas):
            raise UserError(f"plan.replicas: {len(replicas)} entries but plan.num_stages is {num_stages}; "
                            f"give one replica count per stage")
        num_stages = len(replicas)
        key = " and ".join([*sources, "plan.replicas"])
    if cuts:
        implied = len(cuts) + 1
        if num_stages is None:
            num_stages = implied
        elif num_stages < implied:
            what = "plan.replicas has" if replicas is not None else "plan.num_stages is"
            raise UserError(f"{key}: {len(cuts)} fixed cuts make {implied} stages but {what} {num_stages}")
    if num_stages is not None and num_stages > n:
        raise UserError(f"{key or 'plan.num_stages'}: cannot split a chain of {n} positions into {num_stages} "
                        f"stages ({num_stages} > {n})")
    if replicas is not None:
        _check_replicas(replicas, straight, num_microbatches, num_devices)
    elif num_stages is not None and num_stages > num_devices:
        raise UserError(f"{key or 'plan.num_stages'}: {num_stages} stages need at least {num_stages} devices, "
                        f"the cluster has {num_devices}")
    return Steering(tuple(sorted(cuts)), num_stages, replicas, tuple(sources), point_names)


def _check_replicas(replicas: tuple[int, ...], straight: bool, num_microbatches: int, num_devices: int) -> None:
    if any(r < 1 or num_microbatches % r for r in replicas):
        raise UserError(f"plan.replicas: {list(replicas)}: each must be >= 1 and divide "
                        f"schedule.num_microbatches={num_microbatches} (microbatches are spread evenly)")
    if straight and any(r > 1 for r in replicas):
        raise UserError(f"plan.replicas: {list(replicas)} replicates a stage but plan.straight=true forbids it; "
                        f"set one of them")
    if sum(replicas) > num_devices:
        raise UserError(f"plan.replicas: {list(replicas)} needs {sum(replicas)} devices, the cluster has "
                        f"{num_devices}; lower the replicas or add devices (cluster.levels)")

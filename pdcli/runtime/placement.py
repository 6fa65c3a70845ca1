"""Which rank runs which stage replica, from the plan's `stages[k].ranks` lists.

With virtual stages the plan's stages are the model's chunks, several on one rank (a device):
`stage_ranks[chunk]` is that rank, `chunks_of(rank)` its chunks, and `of(rank)` the device's
first chunk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Placement:
    """`stage_ranks[k]` = the ranks of stage k's replicas, in replica order."""

    stage_ranks: tuple[tuple[int, ...], ...]

    @staticmethod
    def from_plan(plan: dict[str, Any]) -> "Placement":
        stages = sorted(plan["stages"], key=lambda s: s["stage_id"])
        ranks = tuple(tuple(int(r) for r in s["ranks"]) for s in stages)
        for s, rs in zip(stages, ranks):
            if len(rs) != int(s.get("replicas", len(rs))):
                raise ValueError(f"plan stage {s['stage_id']}: {len(rs)} ranks but replicas={s['replicas']}")
        flat = sorted(r for rs in ranks for r in rs)
        virtual = int(plan.get("inputs", {}).get("virtual_stages", 1))
        if virtual > 1:  # chunks: each rank holds `virtual` of them, one replica each
            if any(len(rs) != 1 for rs in ranks) or flat != sorted(list(range(len(flat) // virtual)) * virtual):
                raise ValueError(f"plan with {virtual} virtual stages: each of ranks 0..{len(flat) // virtual - 1} "
                                 f"must hold {virtual} chunks, got {flat}")
        elif flat != list(range(len(flat))):
            raise ValueError(f"plan ranks must be 0..{len(flat) - 1} each once, got {flat}")
        return Placement(ranks)

    @property
    def num_stages(self) -> int:
        """Stages of the plan (with virtual stages: chunks)."""
        return len(self.stage_ranks)

    @property
    def world_size(self) -> int:
        return len({r for rs in self.stage_ranks for r in rs})

    @property
    def virtual(self) -> bool:
        """Some rank runs several stages (chunks)."""
        return self.world_size < sum(len(rs) for rs in self.stage_ranks)

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The stages (chunks) `rank` runs, in model order."""
        return tuple(k for k, rs in enumerate(self.stage_ranks) if rank in rs)

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(len(rs) for rs in self.stage_ranks)

    def of(self, rank: int) -> tuple[int, int]:
        """(stage_id, replica_id) of `rank`."""
        for stage_id, rs in enumerate(self.stage_ranks):
            if rank in rs:
                return stage_id, rs.index(rank)
        raise ValueError(f"rank {rank} is not in the plan (world size {self.world_size})")

    def rank(self, stage_id: int, replica_id: int) -> int:
        return self.stage_ranks[stage_id][replica_id]

    def node_of(self, rank: int, nnodes: int) -> int:
        """The node (host) running `rank`: ranks fill nodes in blocks of world_size / nnodes,
        as torch's static rendezvous numbers them (node_rank * nproc + local_rank)."""
        return rank // (self.world_size // nnodes)

    def stages_saved_on(self, node: int, nnodes: int) -> list[int]:
        """The stages whose checkpoint files `node` writes (their first replica runs there)."""
        return [k for k in range(self.num_stages) if self.node_of(self.rank(k, 0), nnodes) == node]

"""Weights tied between stages (Megatron's embedding group): one copy per holder stage, gradients summed.

A weight the model uses in two stages (GPT-2's input embedding and LM head) is a parameter of
each holder stage. The copies start identical (the compiler writes the same tensor into both
stages' weights) and, before every update, each holder's gradient is replaced by the sum over
the holders (an all-reduce over a process group of every rank of every holder stage), so the
same optimizer applies the same update to every copy: the copies stay identical and train as
the one tied weight of the single-process model.

A replicated holder stage has summed its gradient over its replicas already (AllReduceGrads
comes first), so each replica contributes its share, 1 / replicas, to the sum.

Only schedules whose stages update in the same rounds can do this: `gpipe`, `1f1b` and `2bw`
(one update per minibatch everywhere). `pipedream`'s stages update once per microbatch at
different times against different weight versions; it is refused (`check_schedule`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pdcli.compiler.load import held_parameter, tied_holders
from pdcli.errors import UserError
from pdcli.runtime.placement import Placement
from pdcli.schedule.spec import SCHEDULES, rules

SCHEDULES_WITH_TIES = tuple(name for name in SCHEDULES if not rules(name).step_per_microbatch and not rules(name).chunked)
"""Schedules whose stages all update once per minibatch, in the same rounds (virtual stages aside:
a device's chunks would each need their own group)."""


def check_schedule(manifest: dict[str, Any], schedule: str) -> None:
    """UserError when the stages tie weights and `schedule` cannot keep the copies equal."""
    groups = tied_holders(manifest)
    if groups and schedule not in SCHEDULES_WITH_TIES:
        first = groups[0]
        where = ", ".join(f"stage {k} as {name!r}" for k, name in sorted(first.items()))
        why = ("a device's chunks would need a group each (not supported yet)" if rules(schedule).chunked
               else "its stages update at different times, so the copies would differ")
        raise UserError(
            f"schedule.name: {schedule} cannot train a weight tied between stages ({where}): {why}",
            hint=f"use schedule.name={' / '.join(SCHEDULES_WITH_TIES)}, or plan.boundaries that keep every "
            "use of the weight in one stage",
        )


@dataclass(frozen=True)
class TiedCopy:
    """This rank's copy of one tied weight, the group of all holder ranks, and this rank's share."""

    param: nn.Parameter
    group: Any
    share: float
    in_norm: bool = True
    """Whether this copy counts in a global gradient norm: on the first holder stage only (the
    copies hold one weight's gradient once summed)."""


def tied_copies(manifest: dict[str, Any], placement: Placement, stage_id: int,
                module: nn.Module, entry: dict[str, Any]) -> list[TiedCopy]:
    """The copies this stage holds, one process group per tied weight. Collective: every rank
    calls it (each group is created by every rank, in manifest order)."""
    copies = []
    for holders in tied_holders(manifest):
        ranks = sorted(r for k in holders for r in placement.stage_ranks[k])
        group = dist.new_group(ranks)
        if stage_id in holders:
            param = held_parameter(module, entry, holders[stage_id])
            copies.append(TiedCopy(param, group, 1.0 / placement.replicas[stage_id], stage_id == min(holders)))
    return copies


@torch.no_grad()
def sum_tied_grads(copies: list[TiedCopy]) -> None:
    """Replace the gradient of each tied copy by the sum over its holders (one all-reduce each)."""
    for copy in copies:
        p = copy.param
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if copy.share != 1.0:
            grad.mul_(copy.share)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=copy.group)
        p.grad = grad

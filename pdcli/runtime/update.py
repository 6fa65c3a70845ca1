"""What an update applies besides the optimizer's rule: the learning rate of its samples and
gradient clipping by norm. The executor (each stage) and the reference trainer use the same
functions, so the pipeline and the single-process reference take the same steps.

Clipping (`optim.clip_grad_norm`), as `torch.nn.utils.clip_grad_norm_` does it: the gradients
(already the mean over the update's microbatches) are scaled by min(1, max_norm / (norm + 1e-6)).
- gpipe, 1f1b, 2bw: every stage updates at the same step, so the norm is global over all
  stages, the model's norm: each stage's squared norm, summed over the stages by an all-reduce
  at the step (a replicated stage counted once: after AllReduceGrads its replicas agree).
- pipedream: the stages update at different times on different weight versions, so there is no
  model-wide gradient to measure at any one update; each stage clips by its own norm (its
  replicas agree after AllReduceGrads). With one stage this is the global norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from pdcli.config.schema import LRScheduleConfig, OptimConfig
from pdcli.runtime.lr import lr_at
from pdcli.schedule import ScheduleSpec
from pdcli.schedule.spec import rules

CLIP_EPS = 1e-6
"""Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does."""


def clips_per_stage(schedule: str) -> bool:
    """pipedream clips each stage by its own norm; the other schedules by the global norm."""
    return rules(schedule).step_per_microbatch


def samples_through_step(spec: ScheduleSpec, stage_id: int, step: int, microbatch_size: int) -> int:
    """Samples of data consumed when optimizer step `step` of `stage_id` is applied (its own included)."""
    return spec.microbatches_of_step(stage_id, step).stop * microbatch_size


def squared_norm(grads: Iterable[Tensor], device: torch.device) -> Tensor:
    """The sum of the squared L2 norms of `grads`: a float64 scalar on `device` (NCCL reduces
    only device tensors)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        total += torch.linalg.vector_norm(g.detach(), dtype=torch.float32).double().to(device) ** 2
    return total


def scale_to_norm(grads: Iterable[Tensor], total_norm: float, max_norm: float) -> None:
    """Scale `grads` in place by min(1, max_norm / (total_norm + eps))."""
    coef = max_norm / (total_norm + CLIP_EPS)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)


@dataclass(frozen=True)
class UpdateRule:
    """The learning rate and clipping of one stage's updates."""

    spec: ScheduleSpec
    stage_id: int
    schedule: LRScheduleConfig
    base_lr: float
    batch_size: int
    clip_grad_norm: float | None = None
    clip_group: Any = None
    """The process group of every rank (global clipping); None: this stage's own norm."""
    counts_in_global_norm: bool = True
    """False on replicas > 0 of a stage: their gradients equal replica 0's, counted once."""

    @staticmethod
    def make(optim: OptimConfig, spec: ScheduleSpec, stage_id: int, batch_size: int, replica_id: int = 0,
             clip_group: Any = None) -> "UpdateRule":
        """The rule of `stage_id`; `clip_group` is needed when clipping globally."""
        per_stage = clips_per_stage(spec.name)
        return UpdateRule(spec, stage_id, optim.schedule, optim.lr, batch_size, optim.clip_grad_norm,
                          None if per_stage else clip_group, counts_in_global_norm=per_stage or replica_id == 0)

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.spec.num_microbatches

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step `step` of this stage."""
        samples = samples_through_step(self.spec, self.stage_id, step, self.microbatch_size)
        return lr_at(self.schedule, self.base_lr, samples, self.batch_size, self.spec.num_steps * self.batch_size)

    def clip(self, grads: list[Tensor], counted: list[Tensor] | None = None) -> float | None:
        """Clip `grads` (this stage's mean gradients) in place; the norm clipped by, or None when
        off. `counted`: of `grads`, those this stage adds to the norm (default all; a weight tied
        between stages counts on one of them)."""
        if self.clip_grad_norm is None:
            return None
        device = grads[0].device if grads else torch.device("cpu")
        squared = squared_norm((grads if counted is None else counted) if self.counts_in_global_norm else [], device)
        if self.clip_group is not None:
            dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.clip_group)  # ~1 small collective per step
        norm = float(squared.sqrt())
        scale_to_norm(grads, norm, self.clip_grad_norm)
        return norm


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every parameter group of `optimizer` takes `lr` for its next step."""
    for group in optimizer.param_groups:
        group["lr"] = lr

"""Divergence is a failure: non-finite numbers and a climbing loss stop the run.

- A non-finite loss (last stage, at each forward) or gradient (every stage, before each
  optimizer step: `check_gradients`) raises `Diverged` naming the stage and the minibatch.
- A stage file holding a non-finite tensor is never written (`check_finite_state`, before
  the atomic write), so rotation can never push good checkpoints out for a bad one.
- `LossGuard` (`train.divergence`, on by default) watches the last stage's minibatch
  losses: after `GUARD_WARMUP_MINIBATCHES`, the start is their mean; the smoothed loss
  (an exponential moving average, weight `GUARD_SMOOTHING` per minibatch) climbing above
  `train.divergence` times the start stops the run with the schedule or learning rate to try.

The worker reports a `Diverged` as an error of kind `diverged` with the last good
checkpoint; the launcher does not restart such a run (it would diverge again).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

GUARD_WARMUP_MINIBATCHES = 10
"""Minibatches whose mean loss is the start the guard compares with (none checked before)."""
GUARD_SMOOTHING = 0.1
"""Weight of each new minibatch loss in the smoothed loss (about a 10-minibatch window)."""


class Diverged(RuntimeError):
    """The run's numbers diverged; the message names the stage and the minibatch."""


def check_loss(value: float, stage_id: int, microbatch_id: int, num_microbatches: int) -> None:
    if not math.isfinite(value):
        raise Diverged(f"stage {stage_id}: the loss is {value} at minibatch {microbatch_id // num_microbatches} "
                       f"(microbatch {microbatch_id})")


def non_finite_gradient(named: Mapping[str, torch.Tensor | None]) -> str | None:
    """The name of the first gradient holding a NaN or an infinity, else None. Their sums say
    so in one pass and one synchronization for all: a NaN or an infinity makes its tensor's
    sum non-finite; only then is each element looked at (a sum of finite elements that
    overflowed passes)."""
    grads = [(name, g) for name, g in named.items() if g is not None and g.numel() > 0]
    if not grads or bool(torch.isfinite(torch.stack([g.sum(dtype=torch.float32) for _, g in grads])).all()):
        return None
    return next((n for n, g in grads if not bool(torch.isfinite(g).all())), None)


def check_gradients(named: Mapping[str, torch.Tensor | None], stage_id: int, minibatch: int) -> None:
    """Every gradient of the optimizer step after `minibatch` is finite (`non_finite_gradient`)."""
    name = non_finite_gradient(named)
    if name is not None:
        raise Diverged(f"stage {stage_id}: non-finite gradient of {name} at minibatch {minibatch}")


def scale_and_check_gradients(named: Mapping[str, torch.Tensor | None], scale: float, stage_id: int,
                              minibatch: int) -> None:
    """Every gradient times `scale` (in place, `scale` <= 1), then `check_gradients`, in one pass
    per device and dtype: torch's fused unscale-and-check (`GradScaler`'s), which multiplies each
    element and flags a NaN or an infinity among them; the gradients are looked at one by one
    only when one is flagged, to name it."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in named.values():
        if g is not None and g.numel() > 0:
            groups.setdefault((g.device, g.dtype), []).append(g)
    flagged = False
    for (device, _), grads in groups.items():
        found = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((1,), scale, device=device))
        flagged = flagged or bool(found.item())
    if flagged:
        check_gradients(named, stage_id, minibatch)


def first_non_finite(tensors: Iterable[tuple[str, object]]) -> str | None:
    """The name of the first floating-point tensor holding NaN or Inf (nested dicts/lists
    followed, e.g. an optimizer state), else None."""
    for name, value in tensors:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                return name
        elif isinstance(value, Mapping):
            found = first_non_finite((f"{name}.{k}", v) for k, v in value.items())
            if found:
                return found
        elif isinstance(value, (list, tuple)):
            found = first_non_finite((f"{name}.{i}", v) for i, v in enumerate(value))
            if found:
                return found
    return None


def check_finite_state(payload: Mapping[str, object], stage_id: int, step: int) -> None:
    """A stage checkpoint's weights and optimizer state are finite, else `Diverged`."""
    bad = first_non_finite((k, payload[k]) for k in ("model", "optimizer") if k in payload)
    if bad:
        raise Diverged(f"stage {stage_id}: {bad} is not finite after minibatch {step}; "
                       f"its checkpoint was not written")


def remedies(schedule: str, vertical_sync: bool, lr: float) -> str:
    """What to try when `schedule` diverged at learning rate `lr` (stale updates first)."""
    lower = f"a lower optim.lr (e.g. {lr / 10:g})"
    if schedule == "pipedream":
        sync = "" if vertical_sync else ", schedule.vertical_sync=true"
        return f"try schedule.name=1f1b or 2bw (less stale weights){sync}, or {lower}"
    if schedule == "2bw":
        return f"try schedule.name=1f1b (no stale weights) or {lower}"
    return f"try {lower}"


@dataclass
class LossGuard:
    """Stops a run whose smoothed loss climbs above `factor` times its start."""

    factor: float
    stage_id: int
    advice: str
    start: float | None = None
    smoothed: float | None = None
    _first: list[float] = field(default_factory=list)

    def update(self, minibatch: int, loss: float) -> None:
        if self.start is None:
            self._first.append(loss)
            if len(self._first) == GUARD_WARMUP_MINIBATCHES:
                self.start = self.smoothed = sum(self._first) / len(self._first)
            return
        assert self.smoothed is not None
        self.smoothed += GUARD_SMOOTHING * (loss - self.smoothed)
        if self.start > 0 and self.smoothed > self.factor * self.start:
            raise Diverged(
                f"stage {self.stage_id}: the smoothed loss {self.smoothed:.4g} at minibatch {minibatch} is "
                f"{self.smoothed / self.start:.1f}x its start {self.start:.4g} (train.divergence={self.factor:g}); "
                f"{self.advice}"
            )

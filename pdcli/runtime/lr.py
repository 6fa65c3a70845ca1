"""The learning rate of an update, as a function of the samples of data trained on (pure).

An update's learning rate is the schedule's value at the number of samples consumed when
the update is applied, its own samples included: a flush schedule's update of minibatch t
at (t + 1) x batch_size, pipedream's update of microbatch b at (b + 1) x microbatch_size.
So `pipedream` (one update per microbatch) and the flush schedules walk the same curve over
the data, every stage applies the same rate to the same update, and the rate of any update
follows from its step index alone (a resumed run continues the curve exactly).

The curve (`optim.schedule`), with s the samples and every length in samples:
warm-up  lr(s) = base x s / warmup                          for s < warmup
constant lr(s) = base
linear   lr(s) = base x (1 - (1 - f) p)                     p = (s - warmup) / decay, clamped to [0, 1]
cosine   lr(s) = base x (f + (1 - f) (1 + cos(pi p)) / 2)
step     lr(s) = base x gamma ^ floor((s - warmup) / step_every)
"""

from __future__ import annotations

import math

from pdcli.config.schema import LRScheduleConfig


def unit_samples(schedule: LRScheduleConfig, batch_size: int) -> int:
    """Samples in one unit of the schedule's lengths."""
    return batch_size if schedule.unit == "minibatches" else 1


def lr_at(schedule: LRScheduleConfig, base_lr: float, samples: int, batch_size: int, total_samples: int) -> float:
    """The learning rate of an update applied after `samples` samples of a run of `total_samples`."""
    unit = unit_samples(schedule, batch_size)
    warmup = schedule.warmup * unit
    if samples < warmup:
        return base_lr * samples / warmup
    after = samples - warmup
    if schedule.name == "constant":
        return base_lr
    if schedule.name == "step":
        return base_lr * schedule.gamma ** math.floor(after / (schedule.step_every * unit))
    decay = schedule.decay * unit if schedule.decay is not None else total_samples - warmup
    progress = min(1.0, after / decay) if decay > 0 else 1.0
    f = schedule.final_fraction
    if schedule.name == "linear":
        return base_lr * (1.0 - (1.0 - f) * progress)
    if schedule.name == "cosine":
        return base_lr * (f + (1.0 - f) * (1.0 + math.cos(math.pi * progress)) / 2.0)
    raise ValueError(f"optim.schedule.name: unknown schedule {schedule.name!r}")

"""The single-process reference trainer: each schedule's numerics, without a pipeline.

It runs the microbatches one after another in id order, through all stages, and at
each stage uses the weight version `ScheduleSpec.weight_version` names (the rule the
action lists follow; the checker proves they do). So a multi-process run of a schedule
must give the same losses and final weights as `reference_train`, to float tolerance:

- gpipe, 1f1b: gradient accumulation over the M microbatches of a minibatch, mean over
  microbatches, one step per minibatch: plain training on the whole minibatch.
- pipedream: every microbatch b is a minibatch of its own; stage s runs forward and
  backward of b on its stashed version (straight pipeline: the updates of 0..b-(S-s));
  the gradient updates the stage's live weights. A stage with r replicas steps once per
  round of r microbatches (b // r), with the mean of their gradients.
- 2bw: minibatch t runs on version t - 1 at every stage (clamped at 0), so
  W(t+1) = W(t) - lr * grad computed on W(t-1).
- drain points (`drain_after`, checkpoints every N minibatches): pipedream and 2bw drain
  there, so each segment follows the rules above as a run of its own that starts from
  the weights and optimizer state the previous segment left (`ScheduleSpec.weight_version`).
- learning rate per update (`lr_at_samples`) at the samples consumed when it is applied, and
  clipping with `torch.nn.utils.clip_grad_norm_`: over all stages at once for gpipe, 1f1b
  and 2bw, over each stage's own parameters for pipedream (`pdcli.runtime.update`).

`reference_eval` is the single-process forward over held-out batches that the pipeline's
evaluation must equal.

Stages must be deterministic (no dropout): the reference does not replay random state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.optim import Optimizer

from pdcli.models.loss import num_correct
from pdcli.schedule import ScheduleSpec
from pdcli.runtime.update import clips_per_stage, samples_through_step


@dataclass(frozen=True)
class StageSpec:
    """A stage over a name -> tensor environment, so a tensor may skip stages."""

    module: nn.Module
    """Takes the tensors `input_names` positionally; returns a tuple (or one tensor)."""
    input_names: tuple[str, ...]
    """Environment names of the inputs (model inputs or outputs of earlier stages)."""
    output_names: tuple[str, ...]
    """Names given to the outputs; the last stage's single output feeds the loss."""


class MicrobatchLike(Protocol):
    """What the reference reads of a `pdcli.data.Batch`."""

    inputs: tuple[Tensor, ...]
    target: Tensor

    def split(self, num_microbatches: int) -> Sequence[MicrobatchLike]: ...


@dataclass(frozen=True)
class ReferenceResult:
    """What a run of the reference produced."""

    losses: list[float]
    """Loss of every microbatch, in microbatch id order (on the version its forward used)."""
    state_dicts: list[dict[str, Tensor]]
    """The final live weights (and buffers) of every stage."""


LossFn = Callable[[Tensor, Tensor], Tensor]
Params = dict[str, Tensor]


def _as_tuple(value: Tensor | Sequence[Tensor]) -> tuple[Tensor, ...]:
    return (value,) if isinstance(value, Tensor) else tuple(value)


def _run_model(stages: Sequence[StageSpec | nn.Module], params: Sequence[Params],
               model_input_names: Sequence[str], inputs: tuple[Tensor, ...]) -> Tensor:
    """The model output for `inputs`, stage s running on `params[s]`. A plain module
    stage takes the previous stage's outputs positionally."""
    env: dict[str, Tensor] = dict(zip(model_input_names, inputs))
    previous = inputs
    for stage_id, (stage, stage_params) in enumerate(zip(stages, params)):
        if isinstance(stage, StageSpec):
            missing = [name for name in stage.input_names if name not in env]
            if missing:
                raise ValueError(f"stage {stage_id} reads {missing}, not produced by an earlier stage")
            outputs = _as_tuple(functional_call(
                stage.module, stage_params, tuple(env[n] for n in stage.input_names)))
            if len(outputs) != len(stage.output_names):
                raise ValueError(f"stage {stage_id} returned {len(outputs)} tensors for "
                                 f"output_names {list(stage.output_names)}")
            env.update(zip(stage.output_names, outputs))
        else:
            outputs = _as_tuple(functional_call(stage, stage_params, previous))
        previous = outputs
    if len(previous) != 1:
        raise ValueError(f"the last stage returned {len(previous)} tensors, the loss takes one")
    return previous[0]


def _snapshot(params: Params) -> Params:
    return {name: p.detach().clone() for name, p in params.items()}


def reference_train(
    stages: Sequence[StageSpec | nn.Module],
    loss_fn: LossFn,
    batches: Sequence[MicrobatchLike],
    schedule: str,
    num_microbatches: int,
    make_optimizer: Callable[[list[nn.Parameter]], Optimizer],
    replicas: Sequence[int] | None = None,
    vertical_sync: bool = False,
    model_input_names: Sequence[str] | None = None,
    drain_after: Sequence[int] = (),
    lr_at_samples: Callable[[int], float] | None = None,
    clip_grad_norm: float | None = None,
) -> ReferenceResult:
    """Train the stages in place on `batches` (minibatches) as `schedule` would.

    One optimizer per stage (`make_optimizer(stage parameters)`). Gradients are summed
    over the microbatches an update covers and divided by their number before the step.
    `model_input_names` name `Batch.inputs` in the environment (default: the first
    stage's `input_names`). `drain_after`: minibatch counts where the pipeline drains
    (see `pdcli.schedule.drain_points`). `lr_at_samples(samples)`: the learning rate
    of an update applied after `samples` samples (None: the optimizers' own); `clip_grad_norm`:
    clip before each update (see the module docstring).
    """
    spec = ScheduleSpec.make(schedule, len(stages), num_microbatches, len(batches),
                             replicas, vertical_sync, drain_after)
    modules = [s.module if isinstance(s, StageSpec) else s for s in stages]
    if model_input_names is None:
        model_input_names = stages[0].input_names if isinstance(stages[0], StageSpec) else ()
    live: list[Params] = [dict(m.named_parameters()) for m in modules]
    # A stage without parameters still counts its (empty) updates as versions.
    optimizers = [make_optimizer(list(p.values())) if p else None for p in live]
    history: list[dict[int, Params]] = [{0: _snapshot(p)} for p in live]  # version -> weights
    for optimizer in optimizers:
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)

    microbatches = [mb for batch in batches for mb in batch.split(num_microbatches)]
    losses: list[float] = []
    for microbatch_id, micro in enumerate(microbatches):
        versions = [spec.weight_version(s, microbatch_id) for s in range(spec.num_stages)]
        for stage_id, version in enumerate(versions):
            if version not in history[stage_id]:
                raise AssertionError(f"stage {stage_id} has no version {version} for "
                                     f"microbatch {microbatch_id} (has {sorted(history[stage_id])})")
        # Fresh leaves over the stashed tensors: autograd gives the gradient on that version.
        params = [{n: history[s][v][n].detach().requires_grad_(p.requires_grad)
                   for n, p in live[s].items()} for s, v in enumerate(versions)]
        loss = loss_fn(_run_model(stages, params, model_input_names, tuple(micro.inputs)),
                       micro.target)
        losses.append(float(loss.detach()))
        flat = [t for stage_params in params for t in stage_params.values() if t.requires_grad]
        grads = iter(torch.autograd.grad(loss, flat, allow_unused=True))
        for stage_params, stage_live in zip(params, live):
            for name, t in stage_params.items():
                if not t.requires_grad:
                    continue
                grad = next(grads)
                if grad is None:
                    continue
                target = stage_live[name]
                target.grad = grad.clone() if target.grad is None else target.grad + grad
        stepping = [s for s in range(spec.num_stages)
                    if microbatch_id == spec.microbatches_of_step(s, spec.step_of(s, microbatch_id))[-1]]
        for stage_id in stepping:
            covered = spec.microbatches_of_step(stage_id, spec.step_of(stage_id, microbatch_id))
            for p in live[stage_id].values():
                if p.grad is not None:
                    p.grad /= len(covered)
        if clip_grad_norm is not None:
            _clip(spec, [live[s] for s in stepping], clip_grad_norm)
        for stage_id in stepping:
            step = spec.step_of(stage_id, microbatch_id)
            optimizer = optimizers[stage_id]
            if optimizer is not None:
                if lr_at_samples is not None:
                    lr = lr_at_samples(samples_through_step(spec, stage_id, step, int(micro.target.size(0))))
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            history[stage_id][step + 1] = _snapshot(live[stage_id])
        _drop_unneeded(spec, history, microbatch_id + 1)
    return ReferenceResult(losses, [m.state_dict() for m in modules])


def _clip(spec: ScheduleSpec, stepping: list[Params], max_norm: float) -> None:
    """clip_grad_norm_ over the stages that step now: each alone (pipedream) or all together."""
    groups = [[p] for p in stepping] if clips_per_stage(spec.name) else [stepping]
    for group in groups:
        params = [t for stage in group for t in stage.values() if t.grad is not None]
        if params:
            torch.nn.utils.clip_grad_norm_(params, max_norm)


def reference_eval(stages: Sequence[StageSpec | nn.Module], loss_fn: LossFn, batches: Sequence[MicrobatchLike],
                   model_input_names: Sequence[str] | None = None) -> tuple[float, float]:
    """(mean loss, accuracy) of the stages' current weights over `batches`, forward only, in
    eval mode: the loss averaged over the batches (equal sizes), accuracy = argmax over the
    last dimension equal to the target, over every target element."""
    modules = [s.module if isinstance(s, StageSpec) else s for s in stages]
    if model_input_names is None:
        model_input_names = stages[0].input_names if isinstance(stages[0], StageSpec) else ()
    params = [dict(m.named_parameters()) for m in modules]
    modes = [m.training for m in modules]
    losses, correct, count = [], 0, 0
    try:
        for m in modules:
            m.eval()
        with torch.no_grad():
            for batch in batches:
                logits = _run_model(stages, params, model_input_names, tuple(batch.inputs)).float()
                losses.append(float(loss_fn(logits, batch.target)))
                correct += num_correct(logits, batch.target)
                count += batch.target.numel()
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)
    return sum(losses) / len(losses), correct / count


def _drop_unneeded(spec: ScheduleSpec, history: list[dict[int, Params]], next_id: int) -> None:
    """Forget versions older than any later microbatch uses (versions never decrease)."""
    if next_id >= spec.total_microbatches:
        return
    for stage_id, versions in enumerate(history):
        oldest = spec.weight_version(stage_id, next_id)
        for version in [v for v in versions if v < oldest]:
            del versions[version]

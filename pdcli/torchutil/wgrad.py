"""Split backward: the weight gradients of `nn.Linear` layers computed later, in their own action.

A layer's backward does two things: the gradient of its input (B: the previous stage and the
layers before it wait for it) and the gradient of its weight (W: nothing waits for it until
the optimizer step). The flush schedules (`gpipe`, `1f1b`) idle while the pipeline fills
and drains; with `schedule.split_backward` a stage's Backward computes B only, and a later
`WeightGrads(mb)` action computes W, placed where the stage would otherwise wait (the idea
of Zero Bubble pipeline parallelism, Qi et al. 2023; `pdcli.schedule` places them).

Only `nn.Linear` layers defer (the matmul layers that dominate MLPs and transformers); every
other parameter gets its gradient in B as usual. For a deferred layer B computes
`grad_input = g @ W` and the bias gradient, and keeps `(x, g)`; W computes
`weight.grad += g^T x`, into the gradient already accumulated (`addmm_`: one pass over it, no
weight-sized temporary, where autograd computes the product and then adds it). The weight
gradients are added in the order of the WeightGrads actions, which is microbatch order, as
autograd would have added them: the numbers are those of an unsplit backward up to the order
of float additions inside one matmul and its accumulation.

Merged (`schedule.merge_weight_grads`): the lowering puts each chunk's W's of a minibatch in one
run after its last Backward (at the flush, or where the device waits and no peer waits for it),
and the first W of the run computes them all, one `addmm_` per weight over the rows of every
pending microbatch, concatenated in microbatch order (one matmul of M x the rows instead of M
small ones, which run well below a matmul's full rate on small microbatches); the other W's of
the run find nothing pending. The sum is the same up to the order of float additions.

Cost: the inputs `x` of the deferred layers live until W instead of until B, plus one
output-sized `g` per layer per microbatch waiting for its W; merged, every microbatch's until
the flush, and while a weight's merged matmul runs, a concatenated copy of its `x` and `g`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F


@dataclass
class _Pending:
    """One deferred weight gradient: weight.grad += g^T x (flattened to 2-D)."""

    weight: Tensor
    x: Tensor
    g: Tensor


class _LinearBackwardInputOnly(torch.autograd.Function):
    """y = x W^T + b; backward returns the input and bias gradients, hands (x, g) to `owner`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, owner: "DeferredWeightGrads", param: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight if ctx.needs_input_grad[0] else None)  # W only for the input's gradient
        ctx.owner, ctx.param, ctx.has_bias = owner, param, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = g.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_bias = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[1]:
            ctx.owner.defer(ctx.param, x, g)
        return grad_x, None, grad_bias, None, None


def _deferred_forward(layer: nn.Linear, owner: "DeferredWeightGrads", x: Tensor) -> Tensor:
    weight, bias = layer.weight, layer.bias
    if not weight.requires_grad or not torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        # what autocast does for F.linear, done here so the deferred matmul sees the same dtypes
        dtype = torch.get_autocast_dtype(device_type)
        x, cast_weight = x.to(dtype), weight.to(dtype)
        cast_bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device_type, enabled=False):
            return _LinearBackwardInputOnly.apply(x, cast_weight, cast_bias, owner, weight)
    return _LinearBackwardInputOnly.apply(x, weight, bias, owner, weight)


def deferrable_layers(module: nn.Module) -> list[nn.Linear]:
    """The `nn.Linear` layers of `module` (not subclasses with a forward of their own) with
    a trainable weight: the layers whose weight gradient split backward defers."""
    return [
        m for m in module.modules()
        if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and m.weight.requires_grad
    ]


class DeferredWeightGrads:
    """Defers the weight gradients of `module`'s Linear layers from B to `apply(mb)`.

    Usage: `install()` once; run each microbatch's backward inside `collecting(mb)`; call
    `apply(mb)` (the WeightGrads action) before the optimizer step.
    """

    def __init__(self, module: nn.Module, merge: bool = False) -> None:
        self.layers = deferrable_layers(module)
        self.pending: dict[int, list[_Pending]] = {}
        self.current: int | None = None
        self.merge = merge
        """`apply` computes every pending microbatch at once (the flush's run of W's)."""

    def install(self) -> "DeferredWeightGrads":
        """Route the layers' forward through the split-backward function (an instance attribute
        shadows the class's forward; `uninstall` removes it)."""
        for layer in self.layers:
            layer.forward = functools.partial(_deferred_forward, layer, self)  # type: ignore[method-assign]
        return self

    def uninstall(self) -> None:
        for layer in self.layers:
            if "forward" in vars(layer):
                del layer.forward

    def collecting(self, microbatch_id: int) -> "_Collecting":
        """Context for the backward of `microbatch_id`: deferred pieces are filed under it."""
        return _Collecting(self, microbatch_id)

    def defer(self, weight: Tensor, x: Tensor, g: Tensor) -> None:
        if self.current is None:
            raise RuntimeError("a deferred Linear backward ran outside DeferredWeightGrads.collecting(mb)")
        self.pending.setdefault(self.current, []).append(_Pending(weight, x, g))

    def held(self, microbatch_id: int) -> list[Tensor]:
        """The tensors kept for `microbatch_id`'s W (for memory accounting)."""
        return [t for p in self.pending.get(microbatch_id, []) for t in (p.x, p.g)]

    @torch.no_grad()
    def apply(self, microbatch_id: int) -> None:
        """W of `microbatch_id`: add its deferred weight gradients to the weights' `.grad`;
        merged, those of every pending microbatch (nothing when `microbatch_id`'s are done)."""
        if not self.merge:
            for p in self.pending.pop(microbatch_id, []):
                _accumulate(p.weight, p.g.reshape(-1, p.g.shape[-1]), p.x.reshape(-1, p.x.shape[-1]))
            return
        if microbatch_id not in self.pending:
            return
        by_weight: dict[int, list[_Pending]] = {}
        for mb in sorted(self.pending):
            for p in self.pending[mb]:
                by_weight.setdefault(id(p.weight), []).append(p)
        self.pending.clear()
        for pieces in by_weight.values():
            g2 = torch.cat([p.g.reshape(-1, p.g.shape[-1]) for p in pieces])
            x2 = torch.cat([p.x.reshape(-1, p.x.shape[-1]) for p in pieces])
            _accumulate(pieces[0].weight, g2, x2)


def _accumulate(weight: Tensor, g2: Tensor, x2: Tensor) -> None:
    """weight.grad += g2^T x2."""
    accumulated = weight.grad
    if accumulated is not None and g2.dtype == accumulated.dtype:
        accumulated.addmm_(g2.t(), x2)  # one pass over the gradient, no weight-sized temporary
        return
    grad = g2.t().mm(x2)
    if grad.dtype != weight.dtype:
        grad = grad.to(weight.dtype)
    if accumulated is None:
        weight.grad = grad
    else:
        accumulated.add_(grad)


class _Collecting:
    def __init__(self, owner: DeferredWeightGrads, microbatch_id: int) -> None:
        self.owner, self.microbatch_id = owner, microbatch_id

    def __enter__(self) -> None:
        self.owner.current = self.microbatch_id

    def __exit__(self, *exc: object) -> None:
        self.owner.current = None

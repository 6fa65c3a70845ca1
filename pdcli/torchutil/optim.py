"""The optimizer of one stage, from `cfg.optim` (sgd / adam / adamw), and an out-of-place SGD step.

Weight stashing (pipedream, 2bw) keeps old weight versions by reference; a step that
writes its result into fresh storage leaves them intact without copying the parameters
(`step_out_of_place`). It follows `torch.optim.SGD`'s single-tensor arithmetic (the one
used on CPU) operation for operation, so the numbers are identical; other optimizers fall
back to a copy of the parameters before an in-place step (`pdcli.runtime.weights`).
"""

from __future__ import annotations

import torch
from torch import nn

from pdcli.config.schema import OptimConfig


def build_optimizer(cfg: OptimConfig, module: nn.Module) -> torch.optim.Optimizer:
    """The optimizer over `module`'s parameters (the live weights)."""
    params = list(module.parameters())
    if not params:  # a stage without weights (e.g. only a pooling op) still runs OptimizerStep
        params = [nn.Parameter(torch.zeros(0))]
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ValueError(f"optim.name: unknown optimizer {cfg.name!r} (sgd, adam, adamw)")


def supports_out_of_place(optimizer: torch.optim.Optimizer) -> bool:
    """True for plain `torch.optim.SGD` with float hyper-parameters (what `step_out_of_place` covers)."""
    if type(optimizer) is not torch.optim.SGD:
        return False
    return all(
        not isinstance(g["lr"], torch.Tensor) and not g.get("differentiable", False) and not g.get("fused", False)
        for g in optimizer.param_groups
    )


@torch.no_grad()
def step_out_of_place(optimizer: torch.optim.Optimizer) -> None:
    """One SGD step that leaves every parameter's old storage untouched: `p.data` becomes a
    new tensor `p - lr * d_p` (same arithmetic as `torch.optim.SGD`'s single-tensor path;
    momentum buffers in `optimizer.state[p]["momentum_buffer"]` as SGD keeps them)."""
    if not supports_out_of_place(optimizer):
        raise TypeError(f"step_out_of_place covers torch.optim.SGD only, not {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        wd, momentum, lr = group["weight_decay"], group["momentum"], group["lr"]
        dampening, nesterov, maximize = group["dampening"], group["nesterov"], group["maximize"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad if not maximize else -p.grad
            if wd != 0:
                grad = grad.add(p, alpha=wd)
            if momentum != 0:
                state = optimizer.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = grad.detach().clone()
                    state["momentum_buffer"] = buf
                else:
                    buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                grad = grad.add(buf, alpha=momentum) if nesterov else buf
            p.data = p.detach().add(grad, alpha=-lr)

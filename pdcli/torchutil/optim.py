"""The optimizer of one stage, from `cfg.optim` (sgd / adam / adamw), and an out-of-place SGD step.

Weight stashing (pipedream, 2bw) keeps old weight versions by reference; a step that
writes its result into fresh storage leaves them intact without copying the parameters
(`step_out_of_place`). It follows `torch.optim.SGD`'s single-tensor arithmetic (the one
used on CPU) operation for operation, so the numbers are identical; other optimizers fall
back to a copy of the parameters before an in-place step (`pdcli.runtime.weights`).
"""

from __future__ import annotations

import inspect
import sys

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

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


DYNAMO_WRAPPED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
"""The `torch.optim.Optimizer` methods under `torch._disable_dynamo`, whose first call imports
`torch._dynamo` (with sympy: ~1.7 s of CPU on a 2-core host, more than the rest of a small
stage's set-up)."""


def optimizers_without_dynamo() -> bool:
    """Let this process build, step, save and load optimizers without importing `torch._dynamo`;
    for a process that compiles nothing (a pd worker). `torch._disable_dynamo` keeps a method
    out of a graph torch.compile traces and changes nothing outside one: each such method is
    marked as already disabled, which `torch._disable_dynamo` checks before it imports. False
    (nothing changed) where `torch._dynamo` is loaded already or torch's optimizer is not built
    as expected; `step` then imports it at the first `optimizer_step`."""
    if "torch._dynamo" in sys.modules:
        return False
    methods = [vars(torch.optim.Optimizer).get(name) for name in DYNAMO_WRAPPED]
    inner = [getattr(m, "__wrapped__", None) for m in methods]
    if any(f is None or not callable(f) for f in inner):
        return False
    for f in inner:
        if getattr(f, "__dynamo_disable", None) is None:
            setattr(f, "__dynamo_disable", f)
    return True


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()`, without importing `torch._dynamo` when nothing has: the class's own
    `step` under the grad mode torch's wrapper sets (`torch.optim` wraps every `step` in one that
    imports `torch._dynamo` to mark graph breaks, and in one that runs the step hooks). Through
    `optimizer.step()` itself where torch._dynamo is loaded, a step hook is registered, or the
    instance's own `step` was replaced (an LR scheduler's call counter)."""
    hooked = any(getattr(owner, name, None) for owner, name in (
        (optimizer, "_optimizer_step_pre_hooks"), (optimizer, "_optimizer_step_post_hooks"),
        (torch_optimizer, "_global_optimizer_pre_hooks"), (torch_optimizer, "_global_optimizer_post_hooks")))
    if "torch._dynamo" in sys.modules or hooked or "step" in vars(optimizer):
        optimizer.step()
        return
    step = inspect.unwrap(type(optimizer).step)
    with torch.set_grad_enabled(bool(optimizer.defaults.get("differentiable", False))):
        step(optimizer)


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

"""The optimizer of one stage, from `cfg.optim` (sgd / adam / adamw)."""

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

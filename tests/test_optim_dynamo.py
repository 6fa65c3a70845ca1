"""A worker's optimizers never import torch._dynamo (`pdcli.torchutil.optim.optimizers_without_dynamo`
and `optimizer_step`), and step, save and load exactly as `torch.optim` does through its wrappers (an LR scheduler's step counter included).

The path without torch._dynamo only runs in a process that has not loaded it, so it runs in a
fresh interpreter; the same steps through `optimizer.step()` run here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pdcli.torchutil.optim import optimizer_step

CASES = {
    "sgd": ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": ("Adam", {"lr": 0.01}),
    "adamw": ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
}

TRAIN = """
import torch
def train(name, kwargs, step):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = getattr(torch.optim, name)(model.parameters(), **kwargs)
    for i in range(4):
        model(torch.randn(5, 4)).square().sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        step(opt)
        opt.zero_grad(set_to_none=True)
        if i == 1:  # a checkpoint's round trip
            opt.load_state_dict(opt.state_dict())
    return [p.detach().flatten().tolist() for p in model.parameters()]
"""


def _train_here(name: str, kwargs: dict, step) -> list[list[float]]:
    scope: dict = {}
    exec(TRAIN, scope)
    return scope["train"](name, kwargs, step)


def test_optimizers_step_without_torch_dynamo_exactly_as_through_torch() -> None:
    script = TRAIN + f"""
import json, sys
from pdcli.torchutil.optim import optimizers_without_dynamo, optimizer_step
applied = optimizers_without_dynamo()
out = {{key: train(name, kwargs, optimizer_step) for key, (name, kwargs) in {CASES!r}.items()}}
dynamo = "torch._dynamo" in sys.modules
import warnings
model = torch.nn.Linear(2, 1)
plain = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(plain, 1)  # it wraps the instance's step to count its calls
model(torch.ones(1, 2)).sum().backward()
optimizer_step(plain)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    scheduler.step()  # warns "lr_scheduler.step() before optimizer.step()" where the counter was skipped
print(json.dumps({{"applied": applied, "dynamo": dynamo, "weights": out,
                  "warnings": [str(w.message) for w in caught]}}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got["applied"] is True
    assert got["dynamo"] is False  # built, stepped, clipped, saved and loaded without it
    assert got["warnings"] == []  # an LR scheduler's step counter saw the step
    for key, (name, kwargs) in CASES.items():
        assert got["weights"][key] == _train_here(name, kwargs, lambda opt: opt.step()), key


def test_a_registered_step_hook_still_runs() -> None:
    calls: list[str] = []
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    model(torch.ones(1, 2)).sum().backward()
    optimizer_step(opt)
    assert calls == ["pre", "post"]


@pytest.mark.parametrize("key", sorted(CASES))
def test_optimizer_step_in_a_process_with_torch_dynamo_is_optimizer_step(key: str) -> None:
    import torch._dynamo  # noqa: F401 - the fallback: torch's own step

    name, kwargs = CASES[key]
    assert _train_here(name, kwargs, optimizer_step) == _train_here(name, kwargs, lambda opt: opt.step())

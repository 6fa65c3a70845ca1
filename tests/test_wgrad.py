"""Split backward in one process: B leaves the Linear weight gradients to W, and B then W
gives the gradients of an ordinary backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pdcli.torchutil.wgrad import DeferredWeightGrads, deferrable_layers


class Scaled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # a forward of its own: not deferred
        return 2 * super().forward(x)


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 16, bias=False),
                         nn.Tanh(), Scaled(16, 4))


@pytest.mark.parametrize("shape", [(6, 8), (2, 3, 8)])
@pytest.mark.parametrize("precision", [None, torch.bfloat16])
def test_backward_then_weight_grads_equals_one_backward(shape, precision):
    plain, split = net(), net()
    deferred = DeferredWeightGrads(split).install()
    assert deferred.layers == [split[0], split[3]]  # Scaled has its own forward
    torch.manual_seed(1)
    xs = [torch.randn(*shape) for _ in range(3)]
    for microbatch_id, x in enumerate(xs):
        for model in (plain, split):
            with torch.autocast("cpu", dtype=precision or torch.bfloat16, enabled=precision is not None):
                loss = model(x).float().square().mean()
            with deferred.collecting(microbatch_id) if model is split else torch.enable_grad():
                loss.backward()
    # B left the deferred weights without gradient and kept what W needs
    assert split[0].weight.grad is None and split[3].weight.grad is None
    assert split[0].bias.grad is not None and split[2].weight.grad is not None
    assert len(deferred.held(0)) == 4  # (x, g) of two layers
    for microbatch_id in range(len(xs)):
        deferred.apply(microbatch_id)
    assert deferred.pending == {}
    for (name, p), q in zip(plain.named_parameters(), split.parameters()):
        assert q.grad is not None and q.grad.dtype == p.dtype, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_no_grad_forward_and_frozen_weights_are_not_deferred():
    model = net()
    model[3].weight.requires_grad_(False)
    assert deferrable_layers(model) == [model[0]]
    deferred = DeferredWeightGrads(model).install()
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert deferred.pending == {}


def test_a_deferred_backward_outside_collecting_is_an_error_and_uninstall_restores():
    model = net()
    deferred = DeferredWeightGrads(model).install()
    with pytest.raises(RuntimeError, match="outside DeferredWeightGrads.collecting"):
        model(torch.randn(2, 8)).sum().backward()
    deferred.uninstall()
    model.zero_grad(set_to_none=True)
    model(torch.randn(2, 8)).sum().backward()
    assert model[0].weight.grad is not None


def test_a_layer_used_twice_defers_both_uses():
    layer = nn.Linear(4, 4)
    plain = copy.deepcopy(layer)
    deferred = DeferredWeightGrads(layer).install()
    x = torch.randn(3, 4)
    with deferred.collecting(0):
        layer(layer(x)).sum().backward()
    deferred.apply(0)
    plain(plain(x)).sum().backward()
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad)


@pytest.mark.parametrize("precision", [None, torch.bfloat16])
def test_merged_weight_grads_equal_one_backward_per_microbatch(precision):
    """merge: the first apply computes every pending microbatch in one matmul per weight (a layer
    used twice included); the later applies of the run find nothing; the gradients are the same."""
    plain, merged = net(), net()
    shared = nn.Linear(8, 8)
    plain.append(shared), merged.append(copy.deepcopy(shared))
    deferred = DeferredWeightGrads(merged, merge=True).install()
    torch.manual_seed(1)
    xs = [torch.randn(3 + k, 8) for k in range(3)]  # microbatches of different sizes

    def forward(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        h = model[:6](x)
        return model[6](torch.cat([h, h], dim=1)) + model[6](torch.cat([h, h], dim=1) * 2)  # used twice

    for microbatch_id, x in enumerate(xs):
        for model in (plain, merged):
            with torch.autocast("cpu", dtype=precision or torch.bfloat16, enabled=precision is not None):
                loss = forward(model, x).float().square().mean()
            with deferred.collecting(microbatch_id) if model is merged else torch.enable_grad():
                loss.backward()
    assert set(deferred.pending) == {0, 1, 2}
    deferred.apply(0)
    assert deferred.pending == {}
    first = {name: p.grad.clone() for name, p in merged.named_parameters()}
    deferred.apply(1), deferred.apply(2)  # nothing left: no change
    for (name, p), q in zip(plain.named_parameters(), merged.parameters()):
        assert q.grad is not None and q.grad.dtype == p.dtype, name
        assert torch.equal(q.grad, first[name]), name
        tolerance = dict(rtol=1e-6, atol=1e-6) if precision is None else dict(rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(q.grad, p.grad, msg=name, **tolerance)

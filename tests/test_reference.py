"""The reference trainer: flush schedules equal unpipelined training; pipedream and 2bw
follow their weight-version rules on small examples computed by hand."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pdcli.data.batch import Batch
from pdcli.testing.reference import StageSpec, reference_train
from pdcli.schedule import ScheduleSpec

LR = 0.1


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def make_batches(num_batches: int, batch_size: int, width: int, seed: int = 0) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [Batch(inputs=(torch.randn(batch_size, width, generator=g),),
                  target=torch.randn(batch_size, 1, generator=g)) for _ in range(num_batches)]


def make_stages(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 6), nn.Tanh()),
            nn.Linear(6, 1)]


def plain_training(stages: list[nn.Module], batches: list[Batch], make_optimizer) -> list[dict]:
    """Unpipelined: the whole model, one step per minibatch on the whole minibatch."""
    model = nn.Sequential(*copy.deepcopy(stages))
    optimizer = make_optimizer(list(model.parameters()))
    for batch in batches:
        optimizer.zero_grad()
        mse(model(*batch.inputs), batch.target).backward()
        optimizer.step()
    return [m.state_dict() for m in model]


def assert_states_close(got: list[dict], expected: list[dict]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        for key in g:
            torch.testing.assert_close(g[key], e[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("replicas", [None, (1, 2, 1), (2, 2, 2)])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_flush_schedules_equal_unpipelined_training(schedule, replicas, optimizer):
    def make_optimizer(params):
        if optimizer == "adam":
            return torch.optim.Adam(params, lr=0.01)
        return torch.optim.SGD(params, lr=LR, momentum=0.9)

    stages, batches = make_stages(), make_batches(3, 8, 4)
    expected = plain_training(stages, batches, make_optimizer)
    result = reference_train(stages, mse, batches, schedule, 4, make_optimizer, replicas=replicas)
    assert_states_close(result.state_dicts, expected)
    assert len(result.losses) == 3 * 4


def test_flush_losses_are_per_microbatch_before_the_step():
    stages, batches = make_stages(), make_batches(1, 6, 4)
    model = nn.Sequential(*copy.deepcopy(stages))
    with torch.no_grad():
        expected = [float(mse(model(*m.inputs), m.target)) for m in batches[0].split(3)]
    result = reference_train(stages, mse, batches, "gpipe", 3, sgd)
    assert result.losses == pytest.approx(expected, rel=1e-6)


def test_skip_connection_across_stages_equals_the_whole_model():
    torch.manual_seed(1)
    a, b, c = nn.Linear(4, 5), nn.Linear(5, 5), nn.Bilinear(5, 5, 1)

    class Whole(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = copy.deepcopy(a), copy.deepcopy(b), copy.deepcopy(c)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            return self.c(torch.tanh(self.b(h)), h)

    class Act(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *xs):
            return (torch.tanh(self.inner(*xs)),)

    stages = [StageSpec(Act(a), ("x",), ("h",)), StageSpec(Act(b), ("h",), ("g",)),
              StageSpec(c, ("g", "h"), ("out",))]
    whole, batches = Whole(), make_batches(2, 4, 4)
    optimizer = torch.optim.SGD(whole.parameters(), lr=LR)
    for batch in batches:
        optimizer.zero_grad()
        mse(whole(*batch.inputs), batch.target).backward()
        optimizer.step()
    reference_train(stages, mse, batches, "1f1b", 2, sgd)
    torch.testing.assert_close(stages[0].module.inner.weight, whole.a.weight)
    torch.testing.assert_close(stages[2].module.weight, whole.c.weight)


def test_pipedream_one_stage_is_plain_sgd_per_microbatch():
    stages, batches = make_stages(), make_batches(2, 8, 4)
    model = nn.Sequential(*copy.deepcopy(stages))
    optimizer = sgd(list(model.parameters()))
    for micro in [m for batch in batches for m in batch.split(4)]:
        optimizer.zero_grad()
        mse(model(*micro.inputs), micro.target).backward()
        optimizer.step()
    result = reference_train([nn.Sequential(*stages)], mse, batches, "pipedream", 4, sgd)
    assert_states_close(result.state_dicts, [model.state_dict()])


# ---- hand-computed examples: two scalar stages, out = w1 * (w0 * x), loss (out - t)^2 ----


def scalar_stages(w0: float, w1: float) -> list[nn.Module]:
    stages = [nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)]
    with torch.no_grad():
        stages[0].weight.fill_(w0)
        stages[1].weight.fill_(w1)
    return stages


XS = [1.0, -2.0, 0.5, 1.5, -1.0, 2.0]
TS = [0.5, 1.0, -1.0, 2.0, 0.0, 1.0]


def scalar_batches(per_minibatch: int) -> list[Batch]:
    return [Batch(inputs=(torch.tensor(XS[i:i + per_minibatch]).reshape(-1, 1),),
                  target=torch.tensor(TS[i:i + per_minibatch]).reshape(-1, 1))
            for i in range(0, len(XS), per_minibatch)]


def grads(w0: float, w1: float, x: float, t: float) -> tuple[float, float]:
    """d/dw0 and d/dw1 of (w1 * w0 * x - t)^2."""
    d_out = 2.0 * (w1 * w0 * x - t)
    return d_out * w1 * x, d_out * w0 * x


def run_versions(versions0: list[int], versions1: list[int], round0: int = 1) -> tuple[float, float]:
    """SGD, one microbatch per minibatch; stage 0 steps every `round0` microbatches with
    the mean gradient, stage 1 every microbatch; microbatch b runs on the given versions."""
    w0s, w1s, acc0 = [0.8], [-0.6], 0.0
    for b, (x, t) in enumerate(zip(XS, TS)):
        g0, g1 = grads(w0s[versions0[b]], w1s[versions1[b]], x, t)
        w1s.append(w1s[-1] - LR * g1)
        acc0 += g0
        if b % round0 == round0 - 1:
            w0s.append(w0s[-1] - LR * acc0 / round0)
            acc0 = 0.0
    return w0s[-1], w1s[-1]


def final_weights(result) -> tuple[float, float]:
    return tuple(float(sd["weight"]) for sd in result.state_dicts)


def test_pipedream_two_stages_uses_stale_stashed_versions():
    spec = ScheduleSpec.make("pipedream", 2, 1, 6)
    # Stage 0 keeps 2 minibatches in flight: b runs on the updates of 0..b-2.
    assert [spec.weight_version(0, b) for b in range(6)] == [0, 0, 1, 2, 3, 4]
    assert [spec.weight_version(1, b) for b in range(6)] == [0, 1, 2, 3, 4, 5]
    result = reference_train(scalar_stages(0.8, -0.6), mse, scalar_batches(1), "pipedream", 1, sgd)
    expected = run_versions([0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5])
    assert final_weights(result) == pytest.approx(expected, rel=1e-5)
    plain = run_versions(list(range(6)), list(range(6)))
    assert abs(expected[0] - plain[0]) > 1e-3  # staleness is real


def test_pipedream_vertical_sync_uses_stage_zero_versions():
    spec = ScheduleSpec.make("pipedream", 2, 1, 6, vertical_sync=True)
    assert [spec.weight_version(1, b) for b in range(6)] == [0, 0, 1, 2, 3, 4]
    result = reference_train(scalar_stages(0.8, -0.6), mse, scalar_batches(1), "pipedream", 1, sgd,
                             vertical_sync=True)
    expected = run_versions([0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 3, 4])
    assert final_weights(result) == pytest.approx(expected, rel=1e-5)


def test_pipedream_replicated_stage_steps_once_per_round_with_the_mean():
    spec = ScheduleSpec.make("pipedream", 2, 2, 3, replicas=(2, 1))
    # Stage 0 has 2 replicas; each keeps ceil(3 / 2) = 2 rounds in flight; round k = b // 2
    # runs on the updates of rounds 0..k-2.
    assert [spec.weight_version(0, b) for b in range(6)] == [0, 0, 0, 0, 1, 1]
    assert [spec.weight_version(1, b) for b in range(6)] == [0, 1, 2, 3, 4, 5]
    result = reference_train(scalar_stages(0.8, -0.6), mse, scalar_batches(2), "pipedream", 2, sgd,
                             replicas=(2, 1))
    expected = run_versions([0, 0, 0, 0, 1, 1], [0, 1, 2, 3, 4, 5], round0=2)
    assert final_weights(result) == pytest.approx(expected, rel=1e-5)


def test_2bw_updates_with_the_gradient_of_the_version_before():
    spec = ScheduleSpec.make("2bw", 2, 2, 3)
    assert [spec.weight_version(s, b) for s in (0, 1) for b in range(6)] == [0, 0, 0, 0, 1, 1] * 2
    result = reference_train(scalar_stages(0.8, -0.6), mse, scalar_batches(2), "2bw", 2, sgd)
    # W(t+1) = W(t) - lr * mean over the minibatch's 2 microbatches of the grad on W(t-1).
    w0s, w1s = [0.8], [-0.6]
    for t in range(3):
        v = max(0, t - 1)
        g = [grads(w0s[v], w1s[v], XS[2 * t + k], TS[2 * t + k]) for k in range(2)]
        w0s.append(w0s[t] - LR * (g[0][0] + g[1][0]) / 2)
        w1s.append(w1s[t] - LR * (g[0][1] + g[1][1]) / 2)
    assert final_weights(result) == pytest.approx((w0s[-1], w1s[-1]), rel=1e-5)
    assert result.losses[4] == pytest.approx((w1s[1] * w0s[1] * XS[4] - TS[4]) ** 2, rel=1e-5)


def test_stage_reading_an_unknown_name_is_an_error():
    stages = [StageSpec(nn.Linear(4, 1), ("x",), ("y",)), StageSpec(nn.Identity(), ("nope",), ("z",))]
    with pytest.raises(ValueError, match="nope"):
        reference_train(stages, mse, make_batches(1, 2, 4), "gpipe", 1, sgd)


def test_2bw_replicated_stage_equals_2bw_straight():
    batches = make_batches(3, 8, 4)
    straight = reference_train(make_stages(), mse, batches, "2bw", 4, sgd)
    replicated = reference_train(make_stages(), mse, batches, "2bw", 4, sgd, replicas=(2, 1, 2))
    assert_states_close(replicated.state_dicts, straight.state_dicts)
    assert replicated.losses == pytest.approx(straight.losses, rel=1e-6)

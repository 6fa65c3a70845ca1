"""Learning-rate schedules over samples and gradient clipping: pure rules, the reference
trainer against plain single-process training, and real pipelines against the reference."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from pdcli.config.schema import Config, LRScheduleConfig, OptimConfig, check_values
from pdcli.data.batch import Batch
from pdcli.runtime.lr import lr_at
from pdcli.testing.reference import reference_train
from pdcli.schedule import ScheduleSpec
from pdcli.runtime.update import UpdateRule

BATCH_SIZE = 16
M = 4


def schedule(**kwargs: object) -> LRScheduleConfig:
    cfg = LRScheduleConfig()
    for key, value in kwargs.items():
        setattr(cfg, key, value)
    return cfg


def test_curves_warm_up_then_decay_over_samples() -> None:
    total = 100 * BATCH_SIZE
    warm = schedule(name="cosine", warmup=10, final_fraction=0.1)
    assert lr_at(warm, 1.0, 5 * BATCH_SIZE, BATCH_SIZE, total) == pytest.approx(0.5)
    assert lr_at(warm, 1.0, 10 * BATCH_SIZE, BATCH_SIZE, total) == pytest.approx(1.0)
    assert lr_at(warm, 1.0, 55 * BATCH_SIZE, BATCH_SIZE, total) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert lr_at(warm, 1.0, total, BATCH_SIZE, total) == pytest.approx(0.1)
    linear = schedule(name="linear", decay=40, unit="samples")
    assert lr_at(linear, 2.0, 10, BATCH_SIZE, total) == pytest.approx(1.5)
    assert lr_at(linear, 2.0, 400, BATCH_SIZE, total) == 0.0  # past the decay: final_fraction
    step = schedule(name="step", step_every=3, gamma=0.5)
    assert [lr_at(step, 1.0, t * BATCH_SIZE, BATCH_SIZE, total) for t in (1, 2, 3, 6, 7)] == [1, 1, 0.5, 0.25, 0.25]
    assert lr_at(schedule(), 0.3, 7, BATCH_SIZE, total) == 0.3


def test_bad_schedule_values_name_their_keys() -> None:
    cfg = Config()
    cfg.optim.schedule.name = "exp"
    cfg.optim.schedule.warmup = -1
    cfg.optim.clip_grad_norm = 0.0
    problems = "\n".join(check_values(cfg))
    assert "optim.schedule.name: 'exp' is not one of constant, linear, cosine, step" in problems
    assert "optim.schedule.warmup: must be a finite number >= 0" in problems
    assert "optim.clip_grad_norm: must be a finite number > 0" in problems


def rules(name: str, replicas: tuple[int, ...], curve: LRScheduleConfig, steps: int = 6) -> list[list[float]]:
    """The learning rate of every update of every stage."""
    spec = ScheduleSpec.make(name, len(replicas), M, steps, replicas)
    optim = OptimConfig(lr=0.1, schedule=curve)
    out = []
    for stage_id in range(spec.num_stages):
        rule = UpdateRule.make(optim, spec, stage_id, BATCH_SIZE)
        out.append([rule.lr(step) for step in range(spec.num_optimizer_steps(stage_id))])
    return out


@pytest.mark.parametrize("curve", [schedule(name="cosine", warmup=2), schedule(name="linear", warmup=0.5, final_fraction=0.2),
                                   schedule(name="step", step_every=2, gamma=0.5)], ids=["cosine", "linear", "step"])
def test_pipedream_and_1f1b_follow_the_same_curve_over_the_data(curve: LRScheduleConfig) -> None:
    steps, microbatch = 6, BATCH_SIZE // M
    pipedream = rules("pipedream", (1, 1), curve, steps)
    flush = rules("1f1b", (1, 1), curve, steps)
    assert pipedream[0] == pipedream[1] and flush[0] == flush[1]  # every stage: the same rate for the same update
    assert len(pipedream[0]) == steps * M and len(flush[0]) == steps
    total = steps * BATCH_SIZE
    # each update at the samples consumed when it is applied
    assert pipedream[0] == [lr_at(curve, 0.1, (b + 1) * microbatch, BATCH_SIZE, total) for b in range(steps * M)]
    assert flush[0] == [lr_at(curve, 0.1, (t + 1) * BATCH_SIZE, BATCH_SIZE, total) for t in range(steps)]
    # where both have consumed the same data they apply the same rate
    assert [pipedream[0][t * M + M - 1] for t in range(steps)] == flush[0]
    assert len(set(flush[0])) > 2  # the curve moves
    # a stage with 2 replicas steps once per 2 microbatches, at its samples: on the same curve
    replicated = rules("pipedream", (2, 1), curve, steps)
    assert replicated[0] == [pipedream[1][2 * k + 1] for k in range(steps * M // 2)]


# ---- the reference trainer against plain training ---------------------------------------


def make_stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Linear(6, 3)]


def make_batches(num_batches: int, batch_size: int = 8) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    return [Batch(inputs=(torch.randn(batch_size, 4, generator=g),), target=torch.randn(batch_size, 3, generator=g) * 5)
            for _ in range(num_batches)]


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def test_reference_flush_with_clipping_and_schedule_equals_plain_training() -> None:
    stages, batches = make_stages(), make_batches(4)
    plain = copy.deepcopy(stages)
    curve = schedule(name="cosine", warmup=1)
    result = reference_train(stages, mse, batches, "1f1b", 2, lambda ps: torch.optim.SGD(ps, lr=0.3),
                             lr_at_samples=lambda s: lr_at(curve, 0.3, s, 8, 32), clip_grad_norm=0.5)
    model = nn.Sequential(*plain)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    norms = []
    for t, batch in enumerate(batches):
        mse(model(batch.inputs[0]), batch.target).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        for group in opt.param_groups:
            group["lr"] = lr_at(curve, 0.3, (t + 1) * 8, 8, 32)
        opt.step()
        opt.zero_grad()
    assert max(norms) > 0.5  # clipping took effect
    for got, want in zip(result.state_dicts, [m.state_dict() for m in plain]):
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5)


def test_reference_pipedream_clips_each_stage_by_its_own_norm() -> None:
    stages, batches = make_stages(), make_batches(1, 2)  # 2 microbatches of one sample, 2 stages
    live = copy.deepcopy(stages)
    reference_train(stages, mse, batches, "pipedream", 2, lambda ps: torch.optim.SGD(ps, lr=0.1), clip_grad_norm=0.1)
    (x0, x1), (y0, y1) = batches[0].inputs[0].split(1), batches[0].target.split(1)
    stage0_v0 = copy.deepcopy(live[0])  # S = 2: stage 0 runs microbatch 1 on version 0, stage 1 on version 1

    def update(grads_of: nn.Module, into: nn.Module) -> None:
        assert torch.nn.utils.clip_grad_norm_(grads_of.parameters(), 0.1) > 0.1  # clipping takes effect
        with torch.no_grad():
            for p, q in zip(into.parameters(), grads_of.parameters()):
                p -= 0.1 * q.grad
                q.grad = None

    mse(live[1](live[0](x0)), y0).backward()
    update(live[0], live[0])
    update(live[1], live[1])
    mse(live[1](stage0_v0(x1)), y1).backward()
    update(stage0_v0, live[0])
    update(live[1], live[1])
    for got, want in zip(stages, live):
        for a, b in zip(got.parameters(), want.parameters()):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# ---- real pipelines against the reference -------------------------------------------------


def run_pipeline(tmp_path: Path, name: str, curve: LRScheduleConfig, clip: float | None, replicas: list[int]):
    """A real run of ToyNet; (microbatch losses, final weights, reference losses, reference weights)."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_transparency import STEPS, by_original_name, stage_specs, toy_config

    from pdcli.data import build_data
    from pdcli.models import build_loss
    from pdcli.rundir import RunDir
    from pdcli.runtime.checkpoint import load_model_state
    from pdcli.runtime.job import run_training
    from pdcli.testing.toy import write_toy_run

    run_dir = tmp_path / "run"
    cfg = toy_config(run_dir, name, eval_batches=0)
    cfg.optim.momentum = 0.0
    cfg.optim.schedule, cfg.optim.clip_grad_norm = curve, clip
    plan, manifest = write_toy_run(run_dir, cfg, replicas)
    run_training(cfg, RunDir(run_dir), plan, manifest)
    summary = json.loads((run_dir / "train/summary.json").read_text())
    m = cfg.schedule.num_microbatches
    losses = [summary["microbatch_losses"][str(i)] for i in range(STEPS * m)]
    weights = load_model_state(run_dir / "train", STEPS)
    specs = stage_specs(run_dir / "stages", manifest)
    data = build_data(cfg.data, cfg.data.batch_size)
    b = cfg.data.batch_size
    ref = reference_train(
        specs, build_loss("cross_entropy"), [data.batch(t) for t in range(STEPS)], name, m,
        lambda ps: torch.optim.SGD(ps, lr=cfg.optim.lr), replicas=replicas, model_input_names=manifest["model_inputs"],
        lr_at_samples=lambda s: lr_at(curve, cfg.optim.lr, s, b, STEPS * b), clip_grad_norm=clip,
    )
    return losses, weights, ref.losses, by_original_name(manifest, ref.state_dicts)


CASES = [("1f1b", [1, 1, 1]), ("pipedream", [1, 1, 1]), ("2bw", [1, 2]), ("gpipe", [2, 1])]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,replicas", CASES, ids=[f"{n}-{'x'.join(map(str, r))}" for n, r in CASES])
def test_pipeline_with_schedule_and_clipping_equals_the_reference(tmp_path: Path, name: str, replicas: list[int]) -> None:
    curve = schedule(name="cosine", warmup=1, final_fraction=0.1)
    losses, weights, ref_losses, ref_weights = run_pipeline(tmp_path, name, curve, 0.05, replicas)
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=1e-5)
    for key in ref_weights:
        torch.testing.assert_close(weights[key], ref_weights[key], atol=1e-5, rtol=1e-5, msg=key)


def test_a_schedule_or_held_out_split_does_not_make_pd_profile_measure_again() -> None:
    from pdcli.steps.profile import profile_inputs_hash

    cfg = Config()
    before = profile_inputs_hash(cfg, torch.device("cpu"), 1)
    cfg.optim.schedule.name, cfg.data.eval_fraction, cfg.data.eval_path = "cosine", 0.3, "held_out.pt"
    cfg.optim.clip_grad_norm = 1.0
    assert profile_inputs_hash(cfg, torch.device("cpu"), 1) == before
    cfg.optim.momentum = 0.9
    assert profile_inputs_hash(cfg, torch.device("cpu"), 1) != before

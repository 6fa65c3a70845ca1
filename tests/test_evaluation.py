"""Evaluation on the held-out split, forward-only through a real pipeline, against a
single-process forward of the same weights over the same held-out batches: before the first
training step (training goes on after it and still equals the reference), between
minibatches and at the end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from pdcli.data import build_data
from pdcli.models import build_loss
from pdcli.rundir import RunDir
from pdcli.runtime.metrics import TENSORBOARD_DIR, tensorboard_available
from pdcli.testing.reference import reference_eval, reference_train
from pdcli.runtime.job import run_training
from pdcli.testing.toy import write_toy_run

sys.path.insert(0, str(Path(__file__).parent))
from test_transparency import stage_specs, toy_config  # noqa: E402

STEPS = 4
EVAL_BATCHES = 2


CASES = [  # schedule, replicas, eval_every, drain points the evaluations make
    ("1f1b", [1, 1], 1, ()),
    ("pipedream", [1, 1, 1], 2, (2,)),
    ("gpipe", [1, 2], 3, ()),  # a replicated last stage: its replicas' sums add up
    ("2bw", [1, 1], 2, (2,)),
]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,replicas,every,drains", CASES, ids=[c[0] for c in CASES])
def test_evaluation_equals_a_single_process_forward_before_during_and_after_training(
    tmp_path: Path, name: str, replicas: list[int], every: int, drains: tuple[int, ...]
) -> None:
    run_dir = tmp_path / "run"
    cfg = toy_config(run_dir, name, steps=STEPS, eval_every=every, eval_at_start=True, eval_batches=EVAL_BATCHES)
    plan, manifest = write_toy_run(run_dir, cfg, replicas)
    result = run_training(cfg, RunDir(run_dir), plan, manifest)
    summary = json.loads((run_dir / "train/summary.json").read_text())
    points = sorted({0, *range(every, STEPS, every), STEPS})
    assert [e["step"] for e in summary["evals"]] == points

    held_out = build_data(cfg.data, cfg.data.batch_size, split="eval")
    eval_batches = [held_out.batch(t) for t in range(EVAL_BATCHES)]
    train = build_data(cfg.data, cfg.data.batch_size)
    loss_fn = build_loss("cross_entropy")
    for e in summary["evals"]:  # the reference trained for the same minibatches, then a plain forward
        specs = stage_specs(run_dir / "stages", manifest)
        t = e["step"]
        if t:
            reference_train(specs, loss_fn, [train.batch(i) for i in range(t)], name, cfg.schedule.num_microbatches,
                            lambda ps: torch.optim.SGD(ps, lr=cfg.optim.lr, momentum=cfg.optim.momentum), replicas=replicas,
                            model_input_names=manifest["model_inputs"], drain_after=[d for d in drains if d < t])
        loss, accuracy = reference_eval(specs, loss_fn, eval_batches, manifest["model_inputs"])
        assert e["eval_loss"] == pytest.approx(loss, abs=1e-5), t
        assert e["eval_accuracy"] == pytest.approx(accuracy), t
        assert e["eval_samples"] == EVAL_BATCHES * cfg.data.batch_size
    assert result.eval_metrics["eval_loss"] == summary["evals"][-1]["eval_loss"]

    # training went on after the first evaluation exactly as without evaluations
    losses = [summary["microbatch_losses"][str(i)] for i in range(STEPS * cfg.schedule.num_microbatches)]
    ref = reference_train(stage_specs(run_dir / "stages", manifest), loss_fn, [train.batch(i) for i in range(STEPS)], name,
                          cfg.schedule.num_microbatches, lambda ps: torch.optim.SGD(ps, lr=cfg.optim.lr, momentum=cfg.optim.momentum),
                          replicas=replicas, model_input_names=manifest["model_inputs"], drain_after=drains)
    assert losses == pytest.approx(ref.losses, abs=1e-5)

    lines = [json.loads(x) for x in (run_dir / "train/metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], "eval_loss" in line) for line in lines if not line.get("final")] == sorted(
        [(t, False) for t in range(1, STEPS + 1)] + [(t, True) for t in points if t < STEPS])
    assert lines[-1]["final"] and lines[-1]["eval_loss"] == summary["eval_loss"]
    if tensorboard_available():  # the same lines as TensorBoard scalars
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run_dir / "train" / TENSORBOARD_DIR))
        events.Reload()
        assert [e.step for e in events.Scalars("eval/loss")] == points
        assert [e.value for e in events.Scalars("eval/loss")] == pytest.approx([e["eval_loss"] for e in summary["evals"]])
        assert [e.step for e in events.Scalars("train/lr")] == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name,every,fault", [("1f1b", 1, "1:2:written"), ("pipedream", 2, "0:2:complete")])
def test_resume_with_a_learning_rate_schedule_and_evaluations_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, every: int, fault: str
) -> None:
    from pdcli.runtime import checkpoint
    from pdcli.runtime.job import TrainingFailed
    from pdcli.runtime.watchdog import CHECKPOINT_FAULT_ENV

    def train(run_dir: Path, resume: bool = False):
        cfg = toy_config(run_dir, name, steps=STEPS, checkpoint_every=every, eval_every=2, eval_batches=1)
        cfg.optim.schedule.name, cfg.optim.schedule.warmup, cfg.optim.schedule.final_fraction = "cosine", 1.5, 0.1
        if resume:
            plan = json.loads((run_dir / "plan.json").read_text())
            manifest = json.loads((run_dir / "stages/manifest.json").read_text())
        else:
            plan, manifest = write_toy_run(run_dir, cfg, [1, 1, 1])
        run_training(cfg, RunDir(run_dir), plan, manifest, resume=resume)

    def outcome(run_dir: Path):
        lines = [json.loads(x) for x in (run_dir / "train/metrics.jsonl").read_text().splitlines()]
        keys = ("step", "final", "loss", "accuracy", "lr", "eval_loss", "eval_accuracy")
        return [{k: v for k, v in line.items() if k in keys} for line in lines], checkpoint.load_model_state(run_dir / "train", STEPS)

    monkeypatch.delenv(CHECKPOINT_FAULT_ENV, raising=False)
    train(tmp_path / "whole")
    whole_lines, whole_weights = outcome(tmp_path / "whole")
    assert len({line["lr"] for line in whole_lines if "lr" in line}) == STEPS  # the rate moves every minibatch
    assert [line["step"] for line in whole_lines if "eval_loss" in line] == [2, STEPS]
    monkeypatch.setenv(CHECKPOINT_FAULT_ENV, fault)
    with pytest.raises(TrainingFailed):
        train(tmp_path / "broken")
    monkeypatch.delenv(CHECKPOINT_FAULT_ENV)
    train(tmp_path / "broken", resume=True)
    lines, weights = outcome(tmp_path / "broken")
    assert [(line["step"], "eval_loss" in line, line.get("final")) for line in lines] == [
        (line["step"], "eval_loss" in line, line.get("final")) for line in whole_lines]
    for got, want in zip(lines, whole_lines):
        assert got == pytest.approx(want, abs=1e-6)
    for key in whole_weights:
        torch.testing.assert_close(weights[key], whole_weights[key], atol=1e-6, rtol=1e-6, msg=key)


def test_eval_metrics_of_a_classifier_and_of_token_targets() -> None:
    import math

    from pdcli.runtime.evaluation import EvalSums, eval_metrics_text

    images = EvalSums(loss_sum=3.0, num_microbatches=4, num_correct=30, num_targets=40, num_samples=40)
    assert images.metrics() == {"eval_loss": 0.75, "eval_accuracy": 0.75, "eval_samples": 40}
    tokens = EvalSums(loss_sum=4.0, num_microbatches=2, num_correct=50, num_targets=400, num_samples=8, tokens=True)
    assert tokens.metrics()["eval_perplexity"] == pytest.approx(math.exp(2.0))
    assert tokens.metrics()["eval_accuracy"] == 0.125  # per token
    regression = EvalSums(loss_sum=1.0, num_microbatches=2, num_correct=-1, num_targets=8, num_samples=8)
    assert regression.metrics() == {"eval_loss": 0.5, "eval_samples": 8}
    summed = EvalSums.from_list([a + b for a, b in zip(images.as_list(), images.as_list())], classifier=True, tokens=False)
    assert summed.metrics()["eval_accuracy"] == 0.75 and summed.num_samples == 80  # replicas' sums add up
    assert eval_metrics_text(tokens.metrics()) == {"eval_loss": "2.0000", "eval_accuracy": "0.125", "eval_perplexity": "7.39"}

"""A steered plan trains as it was asked and equals its single-process reference (real
processes, flush schedule): cuts by module name, pipe_split() in a user's model file, fixed
replicas."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdcli.cli import app
from pdcli.config.loader import load_resolved
from pdcli.torchutil.threads import torch_threads
from pdcli.runtime.checkpoint import load_model_state

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_transparency import STEPS, assert_same, reference  # noqa: E402

pytestmark = pytest.mark.slow  # real processes over torch.distributed

REPO = Path(__file__).resolve().parents[1]
QUICK = ("profile.repeats=1", "profile.warmup=0", "profile.runtime_probe=false", f"train.steps={STEPS}",
         "train.log_every=1", "train.threads_per_worker=1", "train.timeout_s=60")
"""Short runs: STEPS minibatches (what `reference` replays), a rough profile."""

MODEL_FILE = '''
import torch
from torch import nn
from pdcli import pipe_split


class Marked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 32), nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.a(x.flatten(1)))
        pipe_split()
        x = torch.relu(self.b(x))
        pipe_split()
        return self.c(x)


def make_net():
    return Marked()
'''


def train(tmp_path: Path, recipe: str, *overrides: str) -> tuple[dict, Path]:
    result = CliRunner().invoke(app, ["train", str(REPO / recipe), f"run.root={tmp_path}", "run.name=steer",
                                      *QUICK, *overrides])
    assert result.exit_code == 0, result.output
    run = tmp_path / "steer"
    return json.loads((run / "plan.json").read_text()), run


def assert_matches_reference(run: Path, replicas: list[int]) -> None:
    cfg = load_resolved(run / "config.yaml")
    manifest = json.loads((run / "stages/manifest.json").read_text())
    summary = json.loads((run / "train/summary.json").read_text())
    m = cfg.schedule.num_microbatches
    losses = [summary["microbatch_losses"][str(i)] for i in range(STEPS * m)]
    weights = load_model_state(run / "train", STEPS)
    with torch_threads(1):  # as the workers (train.threads_per_worker=1): a conv sums in another order on 2
        expected = reference(cfg, manifest, replicas, run / "stages")
    assert_same(losses, weights, *expected)


@pytest.mark.timeout(300)
def test_split_points_by_module_name_train_resnet18_as_three_stages(tmp_path: Path) -> None:
    # the README's command as written (the recipe's 2 stages give way to the 3 the cuts make), smaller
    plan, run = train(tmp_path, "recipes/resnet18.yaml", "plan.split_points=[layer2,layer4]", "model.kwargs.width=4",
                      "model.kwargs.image_size=8",
                      "data.kwargs.image_size=8", "data.batch_size=8", "schedule.num_microbatches=2")
    assert [s.get("split_point") for s in plan["stages"]] == [None, "layer2", "layer4"]
    assert plan["stages"][1]["first_node"] == "layer2_0_conv1" and plan["stages"][2]["first_node"] == "layer4_0_conv1"
    assert plan["pipeline"]["unconstrained"]["time_per_minibatch_ms"] > 0
    assert_matches_reference(run, [1, 1, 1])


@pytest.mark.timeout(300)
def test_pipe_split_calls_in_a_user_model_file_train_as_three_stages(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "steer_marked_model.py").write_text(MODEL_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    plan, run = train(tmp_path, "recipes/quickstart.yaml", "model.target=steer_marked_model:make_net", "~model.kwargs",
                      "~plan.num_stages", "cluster.levels.0.devices=3", "schedule.name=1f1b", "data.batch_size=16")
    assert [(s["first_node"], s["last_node"]) for s in plan["stages"]] == [
        ("flatten", "relu"), ("b", "relu_1"), ("c", "c")]
    assert plan["inputs"]["fixed_cuts"] == [3, 5]
    assert_matches_reference(run, [1, 1, 1])


@pytest.mark.timeout(300)
def test_fixed_replicas_train_stage_0_three_times(tmp_path: Path) -> None:
    plan, run = train(tmp_path, "recipes/quickstart.yaml", "plan.replicas=[3,1]", "cluster.levels.0.devices=4",
                      "schedule.name=1f1b", "schedule.num_microbatches=3", "data.batch_size=12")
    assert [(s["replicas"], s["ranks"]) for s in plan["stages"]] == [(3, [0, 1, 2]), (1, [3])]
    summary = json.loads((run / "train/summary.json").read_text())
    assert [s["replicas"] for s in summary["stages"]] == [3, 1]
    assert_matches_reference(run, [3, 1])

"""`pd train` does not wait for the pipeline probe where the recipe fixes the pipeline's shape
(`profile.defer_pipeline_probe`); `pd profile` / `pd plan` complete that profile with the probe
instead of measuring it again."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from pdcli.config.loader import load_config
from pdcli.config.schema import Config
from pdcli.profiler.chain import Chain
from pdcli.profiler.measure import profile_model
from pdcli.rundir import RunDir
from pdcli.steps import profile as step

REPO = Path(__file__).resolve().parents[1]


def recipe(name: str, *overrides: str) -> Config:
    return load_config(REPO / "recipes" / f"{name}.yaml", list(overrides)).config


@pytest.mark.parametrize("name", ["quickstart", "gpt", "resnet18", "vgg16", "gnmt", "inception"])
def test_every_shipped_recipe_fixes_its_shape(name: str) -> None:
    assert step.shape_fixed(recipe(name))


@pytest.mark.parametrize("overrides", [
    ["plan.num_stages=null"],  # the stage count is the planner's
    ["plan.search=[schedule.name]"],  # a searched configuration
    ["cluster.levels=[{devices: 4, bandwidth_bytes_per_s: 1.0e9}]"],  # 2 stages on 4 devices: replicas searched
    ["schedule.name=interleaved", "schedule.virtual_stages=2"],
])
def test_a_shape_left_to_the_planner_is_not_fixed(overrides: list[str]) -> None:
    assert not step.shape_fixed(recipe("quickstart", *overrides))


def test_fixed_stages_and_replicas_fix_the_shape_on_more_devices() -> None:
    four = "cluster.levels=[{devices: 4, bandwidth_bytes_per_s: 1.0e9}]"
    assert step.shape_fixed(recipe("quickstart", four, "plan.straight=true"))
    assert step.shape_fixed(recipe("quickstart", four, "plan.replicas=[3,1]"))
    assert step.shape_fixed(recipe("quickstart", four, "plan.num_stages=null", "plan.boundaries=[4,8,12]"))


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """`profile_config` and `with_pipeline_probe` of the profile step stubbed: the first records
    the pipeline probe's minibatches of each profile it measures, the second each completion."""
    monkeypatch.delenv("PD_PIPELINE_PROBE", raising=False)  # the conftest turns the probe off
    torch.manual_seed(0)
    batch = SimpleNamespace(inputs=(torch.randn(4, 8),), target=torch.randint(0, 3, (4,)))
    base = profile_model(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)), batch,
                         nn.functional.cross_entropy, "cpu", 0, 1, False)
    calls: list[Any] = []

    def profile_config(cfg: Config, device: torch.device, num_threads: int | None, config_hash: str,
                       **_: Any) -> Chain:
        calls.append(("measured", cfg.profile.pipeline_probe_minibatches))
        return dataclasses.replace(base, meta={**base.meta, "config_hash": config_hash})

    def with_pipeline_probe(cfg: Config, chain: Chain, device: torch.device, *_: Any) -> Chain:
        calls.append(("completed", cfg.profile.pipeline_probe_minibatches))
        return dataclasses.replace(chain, meta={**chain.meta, "probed": True})

    monkeypatch.setattr(step, "profile_config", profile_config)
    monkeypatch.setattr(step, "with_pipeline_probe", with_pipeline_probe)
    return calls


def test_train_measures_without_the_probe_and_plan_completes_that_profile(
        tmp_path: Path, measured: list[Any]) -> None:
    cfg = recipe("quickstart", f"run.root={tmp_path}")
    run = RunDir(tmp_path / "quickstart").create()
    assert cfg.profile.pipeline_probe_minibatches > 0

    chain, reused = step.ensure_profile(cfg, run, defer_pipeline=True)  # `pd train`
    assert measured == [("measured", 0)] and not reused and "probed" not in chain.meta
    _, reused = step.ensure_profile(cfg, run, defer_pipeline=True)  # `pd train` again: reused
    assert reused and len(measured) == 1

    chain, reused = step.ensure_profile(cfg, run)  # `pd plan`: the probe added, nothing measured again
    assert measured[1:] == [("completed", cfg.profile.pipeline_probe_minibatches)]
    assert not reused and chain.meta["probed"]
    assert step.load_profile(run).meta["probed"]  # written
    for defer in (False, True):  # the completed profile serves both
        again, reused = step.ensure_profile(cfg, run, defer_pipeline=defer)
        assert reused and again.meta["probed"] and len(measured) == 2


def test_the_probe_off_or_forced_measures_as_before(tmp_path: Path, measured: list[Any]) -> None:
    off = recipe("quickstart", f"run.root={tmp_path}", "profile.pipeline_probe_minibatches=0")
    run = RunDir(tmp_path / "quickstart").create()
    step.ensure_profile(off, run, defer_pipeline=True)
    _, reused = step.ensure_profile(off, run)  # the probe is off: nothing to complete
    assert reused and measured == [("measured", 0)]

    on = recipe("quickstart", f"run.root={tmp_path}")
    step.ensure_profile(on, run, force=True)
    assert measured[1:] == [("measured", on.profile.pipeline_probe_minibatches)]


def test_the_setting_is_not_an_input_of_the_profile() -> None:
    cfg = recipe("quickstart")
    other = recipe("quickstart", "profile.defer_pipeline_probe=false")
    device = torch.device("cpu")
    assert step.profile_inputs_hash(cfg, device, 1) == step.profile_inputs_hash(other, device, 1)

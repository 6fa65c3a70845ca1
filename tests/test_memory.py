"""Measured memory accounting (`pdcli.runtime.memory`), copy-on-update weight versions and the
out-of-place SGD step, checked against numbers computed by hand and the schedules' own stash
depths; plus one short 2-process run whose summary.json carries the measured fields."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdcli.compiler import load_stage  # noqa: E402
from pdcli.rundir import RunDir  # noqa: E402
from pdcli import schedule as S  # noqa: E402
from pdcli.runtime.memory import MemoryTracker  # noqa: E402
from pdcli.torchutil.optim import step_out_of_place, supports_out_of_place  # noqa: E402
from pdcli.runtime.job import run_training  # noqa: E402
from pdcli.testing.toy import write_toy_run  # noqa: E402
from pdcli.runtime.weights import WeightVersions  # noqa: E402
from test_transparency import toy_config  # noqa: E402

F32_BYTES = 4


def test_saved_activations_are_counted_once_without_weights_and_released_on_backward() -> None:
    torch.manual_seed(0)
    batch, d_in, d_hidden = 5, 3, 7
    net = nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, 2))
    tracker = MemoryTracker(param_bytes=0)
    x = torch.randn(batch, d_in, requires_grad=True)
    with tracker.saving(0, [x], list(net.parameters())):
        out = net(x)
    # addmm saves x and W1 (a weight: not counted); ReLU saves its result, which the second
    # addmm saves again (once); so x + relu output, nothing else.
    expected = (batch * d_in + batch * d_hidden) * F32_BYTES
    assert tracker.activations_bytes == expected
    with tracker.saving(1, [], list(net.parameters())):
        net(torch.randn(batch, d_in))  # a second microbatch: its input is saved for W1's gradient
    assert tracker.activations_bytes == tracker.peak_activations_bytes == 2 * expected
    out.sum().backward()
    tracker.released(0)
    assert tracker.activations_bytes == expected
    tracker.released(1)
    assert tracker.activations_bytes == 0 and tracker.peak_activations_bytes == 2 * expected


def _replay(name: str, num_stages: int, stage_id: int, num_microbatches: int, param_bytes: int, act_bytes: int) -> tuple[int, int, int]:
    """Run one stage's action list through WeightVersions and MemoryTracker without processes:
    a Forward holds `act_bytes` until its Backward. Returns (peak stashed bytes, peak
    activation bytes, max weight versions held)."""
    module = nn.Linear(param_bytes // F32_BYTES, 1, bias=False)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    actions = S.build_schedule(name, num_stages, stage_id, num_microbatches, 3)
    versions = WeightVersions(module, any(isinstance(a, S.StashWeights) for a in actions), supports_out_of_place(opt))
    tracker = MemoryTracker(versions.param_bytes)
    for a in actions:
        if isinstance(a, S.Forward):
            versions.leaves(a.weight_version)
            with tracker.saving(a.microbatch_id, [torch.zeros(act_bytes // F32_BYTES)], []):
                pass
        elif isinstance(a, S.Backward):
            versions.leaves(a.weight_version)
            module.weight.grad = torch.ones_like(module.weight)
            tracker.released(a.microbatch_id)
        elif isinstance(a, S.StashWeights):
            versions.stash(a.version)
        elif isinstance(a, S.FreeWeights):
            versions.free(a.version)
        elif isinstance(a, S.OptimizerStep):
            if versions.must_update_out_of_place:
                step_out_of_place(opt)
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            versions.stepped()
        tracker.note(0, versions.stashed_bytes)
    return versions.peak_stashed_bytes, tracker.peak_activations_bytes, versions.max_versions_held


@pytest.mark.parametrize("name", ["pipedream", "2bw", "1f1b", "gpipe"])
@pytest.mark.parametrize("stage_id", [0, 1, 2])
def test_stashed_versions_and_activation_sets_follow_the_schedule(name: str, stage_id: int) -> None:
    num_stages, m, param_bytes, act_bytes = 3, 4, 64, 40
    stashed, acts, versions = _replay(name, num_stages, stage_id, m, param_bytes, act_bytes)
    depth = S.stash_depth(name, num_stages, stage_id, m)
    assert versions == depth.weight_versions
    assert stashed == (depth.weight_versions - 1) * param_bytes
    assert acts == depth.activation_sets * act_bytes
    # by hand: gpipe keeps all M microbatches, 1f1b at most S - s, pipedream S - s versions
    if name == "gpipe":
        assert acts == m * act_bytes
    if name in ("1f1b", "pipedream"):
        assert acts == min(num_stages - stage_id, m) * act_bytes
    if name == "pipedream":
        assert versions == num_stages - stage_id


@pytest.mark.parametrize("kwargs", [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
                                    {"momentum": 0.5, "dampening": 0.1, "maximize": True}])
def test_out_of_place_sgd_equals_torch_sgd_and_leaves_old_storage(kwargs: dict) -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(6, 4), nn.Linear(6, 4)
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1, **kwargs), torch.optim.SGD(b.parameters(), lr=0.1, **kwargs)
    assert supports_out_of_place(opt_b) and not supports_out_of_place(torch.optim.Adam(a.parameters()))
    for _ in range(3):
        x = torch.randn(3, 6)
        for net in (a, b):
            net.zero_grad()
            net(x).pow(2).sum().backward()
        opt_a.step()
        old = b.weight.detach().clone()
        old_storage = b.weight.detach()
        step_out_of_place(opt_b)
        assert torch.equal(old_storage, old)  # the stash's storage was not written
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)


def test_stash_without_out_of_place_updates_moves_live_weights_to_a_copy() -> None:
    module = nn.Linear(3, 2)
    opt = torch.optim.Adam(module.parameters(), lr=0.1)
    versions = WeightVersions(module, stashed_mode=True, out_of_place_updates=supports_out_of_place(opt))
    leaves0 = versions.leaves(0)
    assert leaves0 is not None and leaves0["weight"].data_ptr() == module.weight.data_ptr()  # no copy for a forward
    before = leaves0["weight"].detach().clone()
    versions.stash(0)
    module(torch.randn(2, 3)).sum().backward()
    opt.step()
    versions.stepped()
    assert torch.equal(versions.leaves(0)["weight"], before) and not torch.equal(module.weight, before)
    assert versions.stashed_bytes == versions.param_bytes == (3 * 2 + 2) * F32_BYTES


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_run_reports_measured_memory_per_stage(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = toy_config(run_dir, "pipedream")  # SGD with momentum: optimizer state = 1 x params
    plan, manifest = write_toy_run(run_dir, cfg, [1, 1])
    run_training(cfg, RunDir(run_dir), plan, manifest)
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    final = json.loads((run_dir / "train" / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["final"] and final["stages"] == summary["stages"]
    for stage in summary["stages"]:
        module, _ = load_stage(run_dir / "stages", stage["stage_id"])
        p_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        versions = S.stash_depth("pipedream", 2, stage["stage_id"], cfg.schedule.num_microbatches).weight_versions
        assert stage["weights_bytes"] == 2 * p_bytes
        assert stage["optimizer_state_bytes"] == p_bytes
        assert stage["stashed_weights_bytes"] == (versions - 1) * p_bytes
        assert stage["activations_bytes"] > 0
        assert stage["peak_bytes"] >= 3 * p_bytes + stage["activations_bytes"] and stage["memory_source"]

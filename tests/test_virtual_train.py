"""Virtual stages trained for real: interleaved, loopedbfs and zbv on 2 and 4 worker processes
(V = 2 chunks each, CPU, sockets and gloo) equal the single-process reference with gradient
accumulation: per-microbatch losses and final weights to fp32 tolerance. The model is
`ToyNet` cut into 2P chunks (a two-tensor message, an output with two consumers, a skip from
chunk 0 to chunk 2: on one device under the loop placement, handed over in the process).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from pdcli.rundir import RunDir
from pdcli.runtime import checkpoint
from pdcli.runtime.checkpoint import load_model_state
from pdcli.runtime.job import TrainingFailed, run_training
from pdcli.runtime.watchdog import CHECKPOINT_FAULT_ENV
from pdcli.runtime.sockets import TRANSPORT_ENV
from pdcli.schedule import ScheduleSpec
from pdcli.testing.toy import ToyNet, write_toy_stages

sys.path.insert(0, str(Path(__file__).parent))
from test_transparency import STEPS, assert_same, plain_accumulation, reference, toy_config  # noqa: E402

pytestmark = pytest.mark.slow  # real processes over torch.distributed


def chunk_plan(spec: ScheduleSpec) -> dict:
    """plan.json for ToyNet's chunks: chunk k is stage k of the plan, on the device the schedule places it."""
    stages = [{"stage_id": k, "start": k, "end": k + 1, "replicas": 1, "ranks": [spec.stage_of_chunk(k)]}
              for k in range(spec.num_chunks)]
    return {"version": 1, "inputs": {"virtual_stages": spec.virtual_stages}, "stages": stages, "pipeline": {}}


def run_chunked(tmp_path: Path, schedule: str, devices: int, num_microbatches: int, run_name: str = "run",
                resume: bool = False, clip_grad_norm: float | None = None, merge_weight_grads: bool | None = None,
                **train: object):
    from omegaconf import OmegaConf

    run_dir = tmp_path / run_name
    cfg = toy_config(run_dir, schedule, num_microbatches=num_microbatches, **train)
    cfg.schedule.virtual_stages = 2
    cfg.schedule.merge_weight_grads = merge_weight_grads
    cfg.optim.clip_grad_norm = clip_grad_norm
    spec = ScheduleSpec.from_config(cfg.schedule, [1] * devices, cfg.train.steps)
    if not resume:
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        torch.manual_seed(0)
        write_toy_stages(run_dir / "stages", ToyNet(spec.num_chunks), cfg.data.batch_size // num_microbatches)
        (run_dir / "plan.json").write_text(json.dumps(chunk_plan(spec)))
    plan = json.loads((run_dir / "plan.json").read_text())
    manifest = json.loads((run_dir / "stages" / "manifest.json").read_text())
    run_training(cfg, RunDir(run_dir), plan, manifest, resume=resume)
    steps = cfg.train.steps
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    losses = [summary["microbatch_losses"][str(i)] for i in range(steps * num_microbatches)]
    return cfg, manifest, losses, load_model_state(run_dir / "train", steps), spec


CASES = [  # (schedule, devices, microbatches, transport)
    ("interleaved", 2, 2, "socket"),
    ("loopedbfs", 2, 2, "socket"),
    ("zbv", 2, 2, "socket"),
    ("interleaved", 4, 4, "socket"),
    ("loopedbfs", 4, 2, "gloo"),
    ("zbv", 4, 4, "gloo"),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule,devices,transport,merge", [("interleaved", 2, "gloo", True),
                                                              ("loopedbfs", 4, "socket", False)])
def test_the_other_weight_grad_merging_on_virtual_stages_equals_the_reference(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, schedule: str, devices: int, transport: str,
        merge: bool) -> None:
    """Merged W's on interleaved, per-microbatch W's on loopedbfs (each schedule's default runs in
    `test_virtual_stages_equal_the_reference`)."""
    monkeypatch.setenv(TRANSPORT_ENV, transport)
    cfg, manifest, losses, weights, spec = run_chunked(tmp_path, schedule, devices, 4, merge_weight_grads=merge)
    assert spec.merge_weight_grads is merge
    cfg.schedule.name, cfg.schedule.merge_weight_grads = "1f1b", False  # the reference, over the 2P chunks as stages
    assert_same(losses, weights, *reference(cfg, manifest, [1] * spec.num_chunks, tmp_path / "run" / "stages"))
    assert_same(losses, weights, *plain_accumulation(cfg, spec.num_chunks))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule,devices,num_microbatches,transport", CASES,
                         ids=[f"{s}-p{p}-m{m}-{t}" for s, p, m, t in CASES])
def test_virtual_stages_equal_the_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, schedule: str,
                                            devices: int, num_microbatches: int, transport: str) -> None:
    monkeypatch.setenv(TRANSPORT_ENV, transport)
    cfg, manifest, losses, weights, spec = run_chunked(tmp_path, schedule, devices, num_microbatches)
    chunks = [1] * spec.num_chunks
    cfg.schedule.name = "1f1b"  # the reference of every flush schedule, over the 2P chunks as stages
    assert_same(losses, weights, *reference(cfg, manifest, chunks, tmp_path / "run" / "stages"))
    assert_same(losses, weights, *plain_accumulation(cfg, spec.num_chunks))
    trace = json.loads((tmp_path / "run" / "train" / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e.get("args", {}).get("action", "") for e in events}
    assert any(":c" in n for n in names)  # the trace names the chunks


@pytest.mark.timeout(180)
def test_virtual_stages_checkpoint_and_resume_like_the_uninterrupted_run(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk writes its stage file; a run stopped after checkpoint 2 resumes into the same numbers."""
    monkeypatch.delenv(CHECKPOINT_FAULT_ENV, raising=False)
    _, _, losses, weights, spec = run_chunked(tmp_path, "zbv", 2, 2, "whole", checkpoint_every=1, steps=4)
    assert all(checkpoint.stage_file(tmp_path / "whole" / "train", 4, k).exists() for k in range(spec.num_chunks))
    monkeypatch.setenv(CHECKPOINT_FAULT_ENV, "0:2:complete")  # rank 0 exits right after checkpoint 2
    with pytest.raises(TrainingFailed):
        run_chunked(tmp_path, "zbv", 2, 2, "broken", checkpoint_every=1, steps=4)
    monkeypatch.delenv(CHECKPOINT_FAULT_ENV)
    assert checkpoint.latest_step(tmp_path / "broken" / "train") == 2
    _, _, resumed_losses, resumed_weights, _ = run_chunked(tmp_path, "zbv", 2, 2, "broken", resume=True,
                                                           checkpoint_every=1, steps=4)
    assert resumed_losses == pytest.approx(losses, abs=1e-6)
    for name in weights:
        torch.testing.assert_close(resumed_weights[name], weights[name], atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.timeout(300)
def test_pd_train_plans_compiles_and_trains_zbv_like_1f1b(tmp_path: Path) -> None:
    """The whole path: `pd train` profiles, plans four chunks on two devices (V placement),
    compiles one module per chunk and trains; a flush schedule, so the losses are 1f1b's."""
    from typer.testing import CliRunner

    from pdcli.cli import app

    quickstart = str(Path(__file__).resolve().parents[1] / "recipes/quickstart.yaml")
    finals = {}
    for name, extra in (("1f1b", []), ("zbv", ["schedule.virtual_stages=2"])):
        root = tmp_path / name
        result = CliRunner().invoke(app, ["train", quickstart, f"run.root={root}", f"schedule.name={name}", *extra,
                                          "train.steps=6", "train.log_every=3", "train.eval_every=0"])
        assert result.exit_code == 0, result.output
        plan = json.loads((root / "quickstart" / "plan.json").read_text())
        lines = [json.loads(x) for x in (root / "quickstart" / "train" / "metrics.jsonl").read_text().splitlines()]
        finals[name] = [line["loss"] for line in lines if "loss" in line and "eval_loss" not in line]
        if name == "zbv":
            assert [s["ranks"] for s in plan["stages"]] == [[0], [1], [1], [0]]
            assert len(list((root / "quickstart" / "stages").glob("stage_*.py"))) == 4
            report = CliRunner().invoke(app, ["report", str(root / "quickstart"), "--format", "json"])
            assert report.exit_code == 0, report.output  # held per device: the chunks' predictions summed
            shown, _ = json.JSONDecoder().raw_decode(report.output[report.output.index("{"):])
            assert len(shown["stages"]) == 2
            # a minibatch completes once a rank has backwarded every microbatch through each of its chunks
            from pdcli.report.measured import completion_times_ms, read_trace, steady_time_per_minibatch_ms

            first = [read_trace(root / "quickstart" / "train" / "trace.json")[0]]
            per_rank = int(plan["inputs"]["num_microbatches"]) * 2
            assert len(completion_times_ms(first, per_rank)) == 6
            assert shown["pipeline"]["measured"]["steady_time_per_minibatch_ms"] == pytest.approx(
                steady_time_per_minibatch_ms(first, per_rank))
            refit = CliRunner().invoke(app, ["plan", quickstart, f"run.root={root}", "schedule.name=zbv", *extra,
                                             "--calibrate", str(root / "quickstart")])
            assert refit.exit_code == 0, refit.output  # refitted per chunk (V placement: chunks 1 and 2 share rank 1)
            calibration = json.loads((root / "quickstart" / "calibration.json").read_text())
            assert [s["stage_id"] for s in calibration["measured"]["stages"]] == [0, 1, 2, 3]
    assert finals["zbv"] == pytest.approx(finals["1f1b"], abs=1e-5)


@pytest.mark.timeout(120)
def test_virtual_stages_clip_by_the_norm_of_the_whole_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """optim.clip_grad_norm: a device sums the squares of all its chunks, the devices add theirs;
    the updates are those of torch.nn.utils.clip_grad_norm_ on the whole model."""
    from pdcli.data import build_data
    from pdcli.models import build_loss

    monkeypatch.setenv(TRANSPORT_ENV, "socket")
    clip = 0.05
    cfg, _, losses, weights, spec = run_chunked(tmp_path, "interleaved", 2, 2)  # unclipped: to see clipping bite
    _, _, clipped_losses, clipped, _ = run_chunked(tmp_path, "interleaved", 2, 2, "clipped", clip_grad_norm=clip)
    torch.manual_seed(0)
    model = ToyNet(spec.num_chunks)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    data, loss_fn, m = build_data(cfg.data, cfg.data.batch_size), build_loss("cross_entropy"), 2
    ref_losses, norms = [], []
    for t in range(STEPS):
        for micro in data.batch(t).split(m):
            loss = loss_fn(model(*micro.inputs), micro.target)
            (loss / m).backward()
            ref_losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    assert min(norms) > clip  # clipping takes effect
    assert clipped_losses == pytest.approx(ref_losses, abs=1e-5)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(clipped[name], value, atol=1e-5, rtol=1e-5, msg=name)
    assert any(not torch.allclose(clipped[name], weights[name], atol=1e-4) for name in weights)

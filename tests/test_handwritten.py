"""Hand-written schedules (`schedule.name: file`): the lines read and checked before anything
runs (exit 2 naming the file, device, action and reason), lowered like the built-in schedules,
replayed by the planner, and run by real processes to the numbers of `1f1b` / the reference."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdcli.cli import app
from pdcli.errors import UserError
from pdcli.planner.evaluate import StageEval, replay
from pdcli.planner.memory import StageMemory
from pdcli.planner.options import PlanOptions
from pdcli.schedule import ScheduleSpec, WeightGrads, build_all, build_for
from pdcli.schedule.checker import check_schedules
from pdcli.schedule.handwritten import check_lines
from pdcli.schedule.orders import device_lines
from pdcli.schedule.simulator import StageCost, simulate

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "recipes/quickstart.yaml")
EXAMPLE = REPO / "recipes/schedules/1f1b_2x4.txt"
GPIPE_2X4 = ["F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 F3 B0 B1 B2 B3 W0 W1 W2 W3 U"]
SEQUENTIAL_2X4 = ["F0 B0 F1 B1 F2 B2 F3 B3"] * 2
runner = CliRunner()


def example_lines() -> list[str]:
    return device_lines(EXAMPLE.read_text())


# ---- reading and lowering a good file ----


def test_the_example_file_lowers_to_the_lists_of_1f1b() -> None:
    """pd adds loads, messages, weight gradients and steps as it does for 1f1b: the same lists."""
    for split in (True, False):
        orders = check_lines(example_lines(), 4, split, str(EXAMPLE))
        written = ScheduleSpec.make("file", 2, 4, 3, split_backward=split, orders=orders,
                                    eval_after=(0, 3), num_eval_microbatches=4)
        builtin = ScheduleSpec.make("1f1b", 2, 4, 3, split_backward=split, eval_after=(0, 3), num_eval_microbatches=4)
        for eager in (False, True):
            assert build_all(written, eager_sends=eager) == build_all(builtin, eager_sends=eager)
        for stage_id in (0, 1):  # a resumed run continues the same lists
            assert build_for(written, stage_id, start_minibatch=2) == build_for(builtin, stage_id, start_minibatch=2)
        assert written.stash_depth(0) == builtin.stash_depth(0) and written.stash_depth(1) == builtin.stash_depth(1)


def test_written_weight_grads_and_step_stay_where_the_line_puts_them() -> None:
    orders = check_lines(GPIPE_2X4, 4, True, "gpipe.txt")
    assert orders[1][-4:] == tuple(WeightGrads(k) for k in range(4)) and len(orders[1]) == 12  # U dropped: pd adds it
    spec = ScheduleSpec.make("file", 2, 4, 2, split_backward=True, orders=orders)
    lists = build_all(spec)
    device_1 = [type(a).__name__ for a in lists[1]]
    last_backward = max(i for i, name in enumerate(device_1[:device_1.index("OptimizerStep")]) if name == "Backward")
    assert device_1[last_backward + 1:device_1.index("OptimizerStep")] == ["SendGrads", *["WeightGrads"] * 4]
    report = check_schedules(lists, spec)
    assert [d.activation_sets for d in report.max_depth_by_rank] == [spec.stash_depth(0).activation_sets, 4]


@pytest.mark.parametrize("line, reason", [
    ("F0 F1 B0 F2 B1 F3 B2 X3", "action 8 (X3): not an action"),
    ("F0 F1 B0 F2 B1 F3 B2 B4", "action 8 (B4): microbatch 4 is out of range: schedule.num_microbatches=4 numbers them 0..3"),
    ("F0 F1 B0 F2 B1 F3 B2 B3 SA3->r0", "action 9 (SA3->r0): pd adds loads, sends"),
    ("F0 F1 B0 F2 B1 F3 B2 B2", "action 8 (B2): a second B2 (the first is action 7)"),
    ("F0 B1 F1 B0 F2 B2 F3 B3", "action 2 (B1): the backward of microbatch 1 before its forward F1"),
    ("F0@v1 F1 B0 F2 B1 F3 B2 B3", "action 1 (F0@v1): weight version 1"),
    ("F0 F1 B0 W0 F2 B1 F3 B2 B3 W2 W1 W3", "action 10 (W2): W2 before W1"),
])
def test_a_bad_line_is_refused_naming_device_action_and_reason(line: str, reason: str) -> None:
    with pytest.raises(UserError) as e:
        check_lines([example_lines()[0], line], 4, True, "my.txt")
    assert str(e.value).startswith(f"my.txt: device 1, {reason}"), str(e.value)


def test_w_actions_need_a_split_backward() -> None:
    with pytest.raises(UserError, match=r"my.txt: device 1, action 9 \(W0\): W actions need a split backward"):
        check_lines(GPIPE_2X4, 4, False, "my.txt")


def test_a_deadlock_only_blocking_sends_hit_is_refused_too() -> None:
    """Device 0 backwards 1 before 0, device 1 the other way round: a socket's buffered sends get
    through, NCCL's (which wait for their receive) would not; pd runs a file on both."""
    with pytest.raises(UserError, match=r"my.txt: device 0, action 2 \(F1\): deadlock: device 0 waits there to send "
                                        r"the activations of microbatch 1 to device 1; .* as NCCL's do"):
        check_lines(["F0 F1 B1 B0 F2 F3 B2 B3", example_lines()[1]], 4, True, "my.txt")


# ---- pd train refuses a broken file before anything runs ----


BROKEN = {
    "missing_backward": (["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3"],
                         "broken.txt: device 1: no B3: every device runs the forward and the backward of each microbatch 0..3 once"),
    "deadlock": (["F0 B0 F1 B1 F2 B2 F3 B3", "F1 F0 B0 B1 F2 B2 F3 B3"],
                 "broken.txt: device 0, action 2 (B0): deadlock: device 0 waits there for the gradient of microbatch 0 "
                 "from device 1; device 1 waits at action 1 (F1) for the activations of microbatch 1 from device 0"),
    "update_before_last_gradient": (["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 U B3"],
                                    "broken.txt: device 1, action 8 (U): the optimizer step comes before B3 (action 9)"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_pd_train_refuses_a_broken_schedule_before_any_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            case: str) -> None:
    lines, message = BROKEN[case]
    (tmp_path / "broken.txt").write_text("# " + case + "\n" + "\n\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path)  # schedule.path is relative to the current directory
    result = runner.invoke(app, ["train", QUICKSTART, f"run.root={tmp_path / 'runs'}", "schedule.name=file",
                                 "schedule.path=broken.txt", "schedule.num_microbatches=4"])
    assert result.exit_code == 2, result.output
    assert f"error: {message}" in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "runs").exists()  # not even profiled: no worker started


def test_pd_train_refuses_replicas_and_a_stage_count_the_file_does_not_have(tmp_path: Path) -> None:
    result = runner.invoke(app, ["train", QUICKSTART, f"run.root={tmp_path}", "schedule.name=file",
                                 f"schedule.path={EXAMPLE}", "plan.num_stages=3", "plan.replicas=[2,1,1]"])
    assert result.exit_code == 2, result.output
    assert "plan.replicas: [2, 1, 1], but schedule.name=file runs one device per stage" in result.output
    assert f"plan.num_stages: 3 stages, but {EXAMPLE} has 2 device lines" in result.output
    missing = runner.invoke(app, ["train", QUICKSTART, f"run.root={tmp_path}", "schedule.name=file",
                                  "schedule.path=no_such_schedule.txt"])
    assert missing.exit_code == 2 and "schedule.path: no_such_schedule.txt not found" in missing.output
    searched = runner.invoke(app, ["train", QUICKSTART, f"run.root={tmp_path}", "schedule.name=file",
                                   f"schedule.path={EXAMPLE}", "schedule.num_microbatches=auto"])
    assert searched.exit_code == 2 and "schedule.num_microbatches: `auto` does not go with schedule.name=file" \
        in searched.output, searched.output
    assert not list(tmp_path.iterdir())  # nothing ran


def test_the_path_resolves_beside_the_recipe_and_the_lines_reach_the_resolved_config(tmp_path: Path) -> None:
    """`schedules/1f1b_2x4.txt` is found beside recipes/quickstart.yaml from any directory, and the
    resolved config (what the workers load) holds the lines themselves."""
    result = runner.invoke(app, ["config", "show", QUICKSTART, "schedule.name=file",
                                 "schedule.path=schedules/1f1b_2x4.txt"])
    assert result.exit_code == 0, result.output
    assert "  - F0 F1 B0 F2 B1 F3 B2 B3\n  - F0 B0 F1 B1 F2 B2 F3 B3\n" in result.output


# ---- the planner replays the written order ----


def test_the_plan_replay_runs_the_written_lists() -> None:
    stages = [StageEval(k, k + 1, (k,), {}, StageMemory(0, 0, 0, 0), {"fwd_ms": 1.0, "bwd_ms": 2.0, "comm_ms": 0.1})
              for k in range(2)]
    options = PlanOptions(schedule="file", num_microbatches=4,
                          orders=check_lines(example_lines(), 4, False, "x.txt"))
    as_1f1b = replay(stages, dataclasses.replace(options, schedule="1f1b", orders=()), None)
    written = replay(stages, options, None)
    sequential = replay(stages, dataclasses.replace(options, orders=check_lines(SEQUENTIAL_2X4, 4, False, "s.txt")), None)
    assert as_1f1b is not None and written is not None and sequential is not None
    assert written.time_per_minibatch_ms == pytest.approx(as_1f1b.time_per_minibatch_ms)
    # one microbatch at a time through both devices: no overlap, (1 + 2 + 0.1 + 0.1) x 2 x 4 per minibatch
    assert sequential.time_per_minibatch_ms > 1.4 * written.time_per_minibatch_ms
    costs = [StageCost(fwd_ms=1.0, bwd_ms=2.0, comm_ms=0.1)] * 2
    spec = ScheduleSpec.make("file", 2, 4, 16, orders=check_lines(SEQUENTIAL_2X4, 4, False, "s.txt"))
    assert sequential.time_per_minibatch_ms == pytest.approx(simulate(spec, costs).time_per_minibatch_ms)


# ---- real runs ----


def run_file(tmp_path: Path, lines: list[str], num_stages: int, num_microbatches: int = 4):
    """A toy pipeline trained with the written schedule `lines`: (cfg, manifest, losses, weights)."""
    from test_transparency import STEPS, toy_config

    from pdcli.rundir import RunDir
    from pdcli.runtime.checkpoint import load_model_state
    from pdcli.runtime.job import run_training
    from pdcli.testing.toy import write_toy_run

    run_dir = tmp_path / "run"
    cfg = toy_config(run_dir, "file", num_microbatches=num_microbatches)
    cfg.schedule.orders = list(lines)
    plan, manifest = write_toy_run(run_dir, cfg, [1] * num_stages)
    run_training(cfg, RunDir(run_dir), plan, manifest)
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    losses = [summary["microbatch_losses"][str(i)] for i in range(STEPS * num_microbatches)]
    return cfg, manifest, losses, load_model_state(run_dir / "train", STEPS)


def test_a_file_whose_lines_miss_a_stage_is_refused_before_launch(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="schedule.orders: 2 device lines, but the plan has 3 stages"):
        run_file(tmp_path, example_lines(), num_stages=3)
    assert not (tmp_path / "run" / "train" / "status").exists()  # no worker was started


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_written_1f1b_trains_as_1f1b_and_as_the_reference(tmp_path: Path) -> None:
    import torch
    from test_transparency import assert_same, pipelined, plain_accumulation

    cfg, _, losses, weights = run_file(tmp_path / "file", example_lines(), num_stages=2)
    _, _, builtin_losses, builtin_weights = pipelined(tmp_path / "1f1b", "1f1b", [1, 1], num_microbatches=4)
    assert losses == builtin_losses  # the same lists, the same seed: the same numbers, bit for bit
    assert sorted(weights) == sorted(builtin_weights)
    assert all(torch.equal(weights[name], builtin_weights[name]) for name in weights)
    assert_same(losses, weights, *plain_accumulation(cfg, 2))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_written_gpipe_with_its_own_weight_grads_equals_the_reference(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_transparency import assert_same, plain_accumulation, reference, weight_grads_ran

    from pdcli.runtime.sockets import TRANSPORT_ENV

    monkeypatch.setenv(TRANSPORT_ENV, "gloo")
    cfg, manifest, losses, weights = run_file(tmp_path, GPIPE_2X4, num_stages=2)
    assert weight_grads_ran(tmp_path / "run") == 2 * 4 * 3  # both devices, 4 microbatches, 3 minibatches
    trace = json.loads((tmp_path / "run" / "train" / "trace.json").read_text())["traceEvents"]
    ran = [e["args"]["action"].split("@")[0] for e in trace
           if e.get("pid") == 1 and e["name"] in ("Forward", "Backward", "WeightGrads")]
    assert ran[:12] == GPIPE_2X4[1].split()[:12]  # device 1 ran its line as written (its W's after every B)
    assert_same(losses, weights, *plain_accumulation(cfg, 2))
    flush = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, name="gpipe", orders=None))
    assert_same(losses, weights, *reference(flush, manifest, [1, 1], tmp_path / "run" / "stages"))

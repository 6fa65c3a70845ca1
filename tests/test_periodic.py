"""A long run's action list computed action by action (`pdcli.schedule.periodic`): the same
actions as the whole lowering, for every schedule, with replicas, evaluations, drain points,
virtual stages and resumes; never held whole."""

from __future__ import annotations

import pytest

from pdcli import schedule as S
from pdcli.schedule import periodic
from pdcli.schedule.spec import drain_points, eval_points

STEPS = 60


def whole(spec: S.ScheduleSpec, stage: int, replica: int, eager: bool, start: int = 0) -> list[S.Action]:
    """The list built whole (no run is long enough to repeat)."""
    saved = periodic.MIN_PERIODS
    periodic.MIN_PERIODS = 10**9
    try:
        return list(S.build_for(spec, stage, replica, start_minibatch=start, eager_sends=eager))
    finally:
        periodic.MIN_PERIODS = saved


def specs() -> list[tuple[str, S.ScheduleSpec]]:
    out = []
    for name, extra in [("pipedream", {}), ("pipedream", {"vertical_sync": True}), ("2bw", {}), ("gpipe", {}),
                        ("1f1b", {}), ("1f1b", {"split_backward": True}), ("gpipe", {"split_backward": True})]:
        for stages, replicas, m in [(2, None, 4), (3, None, 1), (3, (1, 2, 1), 2)]:
            if name == "2bw" and m == 1:
                m = 2
            if name == "2bw" and replicas:
                continue
            out.append((f"{name}{'+' if extra else ''}-{stages}x{m}{replicas or ''}",
                        S.ScheduleSpec.make(name, stages, m, STEPS, replicas, **extra)))
            evals = eval_points(STEPS, 3, True)
            drains = drain_points(STEPS, 3, [e for e in evals if 0 < e < STEPS]) if name in ("pipedream", "2bw") else ()
            out.append((f"{name}{'+' if extra else ''}-{stages}x{m}{replicas or ''}-eval", S.ScheduleSpec.make(
                name, stages, m, STEPS, replicas, eval_after=evals, num_eval_microbatches=m, drain_after=drains, **extra)))
    for name in ("interleaved", "loopedbfs", "zbv"):
        out.append((f"{name}-eval", S.ScheduleSpec.make(name, 2, 4, STEPS, virtual_stages=2, split_backward=name == "zbv",
                                                        eval_after=eval_points(STEPS, 2, False), num_eval_microbatches=4)))
    return out


SPECS = specs()


@pytest.mark.parametrize("spec", [s for _, s in SPECS], ids=[i for i, _ in SPECS])
def test_a_long_runs_list_is_the_whole_lowering(spec: S.ScheduleSpec) -> None:
    for rank in range(spec.num_ranks):
        stage, replica = spec.stage_replica_of(rank)
        for eager in (False, True):
            got = S.build_for(spec, stage, replica, eager_sends=eager)
            assert isinstance(got, S.ActionList)
            want = whole(spec, stage, replica, eager)
            assert len(got) == len(want) and list(got) == want
            assert [got[i] for i in range(0, len(want), 7)] == want[::7] and got[-1] == want[-1]
            assert S.action_kinds(got) == S.action_kinds(want)
            held = len(got.prefix.base) + len(got.body.base) + len(got.tail.base)
            assert held < len(want) / 2  # what it holds is a few minibatches', not the run's


@pytest.mark.parametrize("spec", [s for i, s in SPECS if i.startswith(("pipedream-3x1-eval", "2bw-2x4-eval", "1f1b-2x4",
                                                                     "interleaved"))])
def test_a_resumed_long_run_is_the_whole_lists_suffix(spec: S.ScheduleSpec) -> None:
    start = spec.drain_after[len(spec.drain_after) // 2] if spec.drain_after else STEPS // 2
    for rank in range(spec.num_ranks):
        stage, replica = spec.stage_replica_of(rank)
        got = S.build_for(spec, stage, replica, start_minibatch=start, eager_sends=True)
        assert isinstance(got, S.ActionList)
        want = whole(spec, stage, replica, True, start)
        assert list(got) == want and got[0] == want[0]
        if spec.chunked:  # each chunk's executor sees its own actions and the device's
            for chunk in spec.chunks_of(stage):
                def mine(a: S.Action) -> bool:
                    return getattr(a, "chunk", None) in (None, chunk)
                assert list(S.kept_actions(got, mine)) == [a for a in want if mine(a)]


def test_a_very_long_run_is_not_built_whole() -> None:
    """Ten million minibatches of 1f1b: the list's length and its last actions, from a few
    short runs' lists (the whole list would hold 300 million actions)."""
    steps = 10_000_000
    spec = S.ScheduleSpec.make("1f1b", 2, 4, steps, split_backward=True)
    got = S.build_for(spec, 0, eager_sends=True)
    assert isinstance(got, S.ActionList)
    short = S.ScheduleSpec.make("1f1b", 2, 4, 100, split_backward=True)
    per_minibatch = len(whole(short, 0, 0, True)) // 100
    assert len(got) == steps * per_minibatch
    assert got[-1] == S.OptimizerStep(steps - 1, 4)
    assert {a.microbatch_id for a in got[-per_minibatch:] if isinstance(a, S.Forward)} == set(range(4 * steps - 4, 4 * steps))


def test_a_run_whose_middle_does_not_repeat_is_built_whole() -> None:
    evals = (0, 7, 19, 20, 41, STEPS)  # no regular spacing
    spec = S.ScheduleSpec.make("gpipe", 2, 2, STEPS, eval_after=evals, num_eval_microbatches=2)
    got = S.build_for(spec, 1)
    assert not isinstance(got, S.ActionList) and got == whole(spec, 1, 0, False)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_long_pipedream_run_with_evaluations_trains_like_one_process(tmp_path) -> None:
    """A real pipeline running the computed lists (evaluation every 2 minibatches, drains there):
    its losses are the single-process reference's, its last evaluation the reference's forward."""
    import json
    import sys
    from pathlib import Path

    import torch

    from pdcli.data import build_data
    from pdcli.models import build_loss
    from pdcli.rundir import RunDir
    from pdcli.runtime.job import run_training
    from pdcli.testing.reference import reference_eval, reference_train
    from pdcli.testing.toy import write_toy_run

    sys.path.insert(0, str(Path(__file__).parent))
    from test_transparency import stage_specs, toy_config

    steps, every, replicas = 40, 2, [1, 1, 1]
    run_dir = tmp_path / "run"
    cfg = toy_config(run_dir, "pipedream", steps=steps, eval_every=every, eval_at_start=True, eval_batches=1)
    cfg.optim.lr = 0.02  # the toy's rate diverges on pipedream's stale weights within 40 minibatches
    m = cfg.schedule.num_microbatches
    evals = eval_points(steps, every, True)
    drains = drain_points(steps, 0, [e for e in evals if 0 < e < steps])
    spec = S.ScheduleSpec.make("pipedream", 3, m, steps, eval_after=evals, num_eval_microbatches=m, drain_after=drains)
    assert all(isinstance(S.build_for(spec, s, eager_sends=True), S.ActionList) for s in range(3))
    plan, manifest = write_toy_run(run_dir, cfg, replicas)
    run_training(cfg, RunDir(run_dir), plan, manifest)
    summary = json.loads((run_dir / "train/summary.json").read_text())
    assert [e["step"] for e in summary["evals"]] == list(evals)

    train = build_data(cfg.data, cfg.data.batch_size)
    loss_fn = build_loss("cross_entropy")
    specs = stage_specs(run_dir / "stages", manifest)
    ref = reference_train(specs, loss_fn, [train.batch(i) for i in range(steps)], "pipedream", m,
                          lambda ps: torch.optim.SGD(ps, lr=cfg.optim.lr, momentum=cfg.optim.momentum),
                          replicas=replicas, model_input_names=manifest["model_inputs"], drain_after=drains)
    losses = [summary["microbatch_losses"][str(i)] for i in range(steps * m)]
    assert losses == pytest.approx(ref.losses, abs=1e-5)
    held_out = build_data(cfg.data, cfg.data.batch_size, split="eval")
    loss, _ = reference_eval(specs, loss_fn, [held_out.batch(0)], manifest["model_inputs"])
    assert summary["evals"][-1]["eval_loss"] == pytest.approx(loss, abs=1e-5)


def test_evaluations_and_checkpoints_of_different_periods_repeat_together() -> None:
    """Evaluations every 3 minibatches and checkpoints every 5 (pipedream drains at both):
    the middle repeats every 15."""
    steps = 300
    evals = eval_points(steps, 3, True)
    spec = S.ScheduleSpec.make("pipedream", 2, 2, steps, eval_after=evals, num_eval_microbatches=2,
                               drain_after=drain_points(steps, 5, [e for e in evals if 0 < e < steps]))
    for stage in range(2):
        got = S.build_for(spec, stage, eager_sends=True)
        assert isinstance(got, S.ActionList) and list(got) == whole(spec, stage, 0, True)

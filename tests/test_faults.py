"""Faults a run survives or stops on cleanly: a silent (stopped) rank, a launcher killed
with -9, a worker killed under `train.max_restarts`, divergence (NaN, a climbing loss).

Pure tests first (the watchdog's liveness reading, the divergence guard), then small
multi-process runs of the toy pipeline (`pdcli.testing.toy`), each with a timeout.
Times are measured and printed (`-s`), never asserted tightly.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdcli.testing.toy import write_toy_run
from pdcli.runtime.watchdog import Heartbeat, Watchdog, exists, read_error, read_life, status_path, write_error

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_reliability import KILL_SCRIPT, worker_pids  # noqa: E402
from test_runtime import processes_mentioning  # noqa: E402
from test_transparency import toy_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GENEROUS_S = 60.0
"""Bound on times that are measured and reported: loose enough for a loaded machine."""


# ---- pure ---------------------------------------------------------------------------------


def test_sign_of_life_is_read_back_and_a_finished_rank_is_never_silent(tmp_path: Path) -> None:
    beat = Heartbeat(status_path(tmp_path, 3))
    beat.beat(2, "F5@v0")
    life = read_life(tmp_path, 3)
    assert life is not None and life[0] == os.getpid() and 0 <= life[1] < GENEROUS_S
    beat.alive(done=True)
    assert read_life(tmp_path, 3) is None
    assert read_life(tmp_path, 4) is None  # no status file: not started, not silent
    beat.close()
    assert exists(os.getpid())
    ended = subprocess.Popen(["true"])
    deadline = time.monotonic() + GENEROUS_S
    while exists(ended.pid) and time.monotonic() < deadline:  # a zombie until waited for: it ended
        time.sleep(0.01)
    assert not exists(ended.pid)
    ended.wait()
    assert not exists(ended.pid)  # a dead rank is never called silent: the launcher says how it died


@pytest.mark.timeout(30)
def test_a_rank_whose_wait_failed_waits_for_a_stuck_peer_to_report_first(tmp_path: Path) -> None:
    """A receive that timed out on a peer stuck in compute is the symptom: the failing rank waits
    (up to a timeout) until the stuck peer's own watchdog reported, so the diagnosis names it first;
    a peer that waits itself, or moves on, is not waited for."""
    own, stuck = Heartbeat(status_path(tmp_path, 0)), Heartbeat(status_path(tmp_path, 1))
    living = threading.Event()
    keeper = threading.Thread(target=lambda: [stuck.alive() for _ in iter(lambda: living.wait(0.1), True)])
    keeper.start()  # rank 1's sign of life stays fresh: stuck, not silent (the silent case is the next test)
    own.beat(2, "RA4<-r0")
    watchdog = Watchdog(own, GENEROUS_S, tmp_path, 0, "rank 0", world_size=2)
    stuck.beat(2, "RG3<-r0")  # waiting on a peer too: not a cause to wait for
    watchdog.await_stuck_peers()
    assert read_error(tmp_path, 1) is None

    stuck.beat(2, "F4@v2")  # in compute: its watchdog will report
    reporter = threading.Timer(0.3, write_error, (tmp_path, 1, "hang", "rank 1 made no progress"))
    reporter.start()
    watchdog.await_stuck_peers()
    assert read_error(tmp_path, 1) is not None  # returned once the stuck rank had reported
    reporter.join()

    (tmp_path / "status" / "rank1.error.json").unlink()
    mover = threading.Timer(0.3, stuck.beat, (2, "B4@v2"))  # it moves on: not stuck
    mover.start()
    watchdog.await_stuck_peers()
    assert read_error(tmp_path, 1) is None and mover.finished.is_set()
    mover.join()
    living.set()
    keeper.join()
    own.close()
    stuck.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_peer_that_falls_silent_while_a_rank_waits_for_it_is_killed_as_the_cause(tmp_path: Path) -> None:
    """A peer still alive when this rank's wait timed out, then stopped (SIGSTOP) inside the wait
    for stuck peers: it is killed with a `silent` report, and the waiting rank is told it need not fail
    (otherwise torch's agent SIGKILLs the stopped peer later, and the diagnosis blames a kill without a report)."""
    from pdcli.runtime.watchdog import FROZEN_S

    own = Heartbeat(status_path(tmp_path, 0))
    own.beat(3, "RA6<-r1")
    freeze = ("import os, signal, sys; from pathlib import Path; "
              "from pdcli.runtime.watchdog import Heartbeat, status_path; "
              "Heartbeat(status_path(Path(sys.argv[1]), 1)).beat(3, 'F6@v3'); os.kill(os.getpid(), signal.SIGSTOP)")
    peer = subprocess.Popen([sys.executable, "-c", freeze, str(tmp_path)], cwd=REPO, start_new_session=True)
    try:
        _, how = os.waitpid(peer.pid, os.WUNTRACED)  # returns once it stopped itself: its last sign of life is written
        assert os.WIFSTOPPED(how), how
        watchdog = Watchdog(own, GENEROUS_S, tmp_path, 0, "rank 0", world_size=2)
        assert watchdog.await_stuck_peers() is True
        report = read_error(tmp_path, 1)
        assert report is not None and report["kind"] == "silent", report
        assert "rank 0 killed it" in report["message"] and "F6@v3" in report["message"]
        quiet_s = float(re.search(r"sent nothing for ([0-9.]+) s", report["message"]).group(1))
        assert quiet_s >= FROZEN_S  # killed once its sign of life was FROZEN_S old, not before
        assert peer.wait(timeout=GENEROUS_S) == -signal.SIGKILL
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
        own.close()


def test_loss_guard_stops_a_climbing_loss_and_names_what_to_try() -> None:
    from pdcli.runtime.divergence import GUARD_WARMUP_MINIBATCHES, Diverged, LossGuard, remedies

    falling = LossGuard(3.0, 3, remedies("pipedream", False, 0.05))
    for t in range(200):  # a normal run: falling with noise, spikes included
        falling.update(t, 2.3 / (1 + t / 20) + (1.5 if t % 37 == 0 else 0.0))
    climbing = LossGuard(3.0, 3, remedies("pipedream", False, 0.05))
    with pytest.raises(Diverged) as e:
        for t in range(200):
            climbing.update(t, 2.3 * 1.05 ** t)
    message = str(e.value)
    assert "stage 3" in message and "train.divergence=3" in message
    assert "1f1b or 2bw" in message and "vertical_sync=true" in message and "optim.lr (e.g. 0.005)" in message
    stopped_at = int(message.split("at minibatch ")[1].split()[0])
    assert GUARD_WARMUP_MINIBATCHES < stopped_at < 100
    assert "vertical_sync" not in remedies("2bw", False, 0.1) and "1f1b" in remedies("2bw", False, 0.1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gradient_check_finds_each_nan_and_infinity_and_passes_sums_that_overflow(dtype: str) -> None:
    import torch

    from pdcli.runtime.divergence import Diverged, check_gradients

    big = torch.finfo(getattr(torch, dtype)).max
    grads = {"a.weight": torch.ones(64, 64, dtype=getattr(torch, dtype)), "b.bias": None,
             "c.weight": torch.full((1000,), big, dtype=getattr(torch, dtype))}  # finite; its sum is not
    check_gradients(grads, 0, 3)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for name in ("a.weight", "c.weight"):
            broken = {k: None if v is None else v.clone() for k, v in grads.items()}
            broken[name][7] = bad
            with pytest.raises(Diverged, match=f"stage 2: non-finite gradient of {name} at minibatch 5"):
                check_gradients(broken, 2, 5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_scaling_the_gradients_checks_them_in_the_same_pass(dtype: str) -> None:
    """`scale_and_check_gradients` leaves each gradient as `mul_(scale)` would, bit for bit, and
    names a non-finite one as `check_gradients` does."""
    import torch

    from pdcli.runtime.divergence import Diverged, scale_and_check_gradients

    torch.manual_seed(0)
    kind = getattr(torch, dtype)
    grads = {"a.weight": torch.randn(64, 64).to(kind), "b.bias": None, "c.weight": torch.randn(1000).to(kind),
             "d.weight": torch.randn(3)}  # another dtype beside them
    for scale in (1.0, 0.5, 1 / 3, 1 / 48):
        expected = {k: None if v is None else v.clone().mul_(scale) for k, v in grads.items()}
        got = {k: None if v is None else v.clone() for k, v in grads.items()}
        scale_and_check_gradients(got, scale, 0, 3)
        for k, v in expected.items():
            assert (v is None and got[k] is None) or torch.equal(got[k], v), (k, scale)
    broken = {k: None if v is None else v.clone() for k, v in grads.items()}
    broken["c.weight"][7] = float("nan")
    with pytest.raises(Diverged, match="stage 2: non-finite gradient of c.weight at minibatch 5"):
        scale_and_check_gradients(broken, 0.5, 2, 5)


def test_a_non_finite_checkpoint_is_never_written(tmp_path: Path) -> None:
    import torch
    from torch import nn

    from pdcli.runtime import checkpoint
    from pdcli.runtime.divergence import Diverged

    module = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    with torch.no_grad():
        module.weight[0, 1] = float("inf")
    with pytest.raises(Diverged, match="stage 1: model.weight is not finite after minibatch 4; its checkpoint was not written"):
        checkpoint.save_stage(tmp_path, 4, 1, module, {}, optimizer, 4, {})
    assert not checkpoint.stage_file(tmp_path, 4, 1).exists()
    assert list(tmp_path.rglob("*.tmp")) == []


def test_pd_plan_prints_the_staleness_of_its_schedule() -> None:
    from pdcli.planner.render import staleness_line
    from pdcli.schedule import ScheduleSpec

    delays = {name: [ScheduleSpec.make(name, 4, 4, 20).update_delay(k) for k in range(4)]
              for name in ("pipedream", "2bw", "1f1b", "gpipe")}
    assert delays == {"pipedream": [3, 2, 1, 0], "2bw": [1, 1, 1, 1], "1f1b": [0, 0, 0, 0], "gpipe": [0, 0, 0, 0]}
    assert [ScheduleSpec.make("pipedream", 4, 4, 20, vertical_sync=True).update_delay(k) for k in range(4)] == [3, 3, 3, 3]
    plan = {"inputs": {"schedule": "pipedream", "num_microbatches": 4},
            "stages": [{"stage_id": k, "replicas": 1} for k in range(3)]}
    assert staleness_line(plan) == "staleness: weights lag 2, 1, 0 optimizer steps behind (stages 0..2, pipedream)"


def test_pd_report_lists_the_restarts_with_their_causes() -> None:
    from pdcli.report.render import event_lines

    events = ({"event": "restart", "rank": 1, "stage": 1, "cause": "signal SIGKILL", "resume_step": 3},
              {"event": "restart", "rank": 2, "stage": 1, "cause": "silent", "resume_step": None},
              {"event": "failure", "rank": 0, "stage": 0, "cause": "exit code 1"})
    assert event_lines(events) == [
        "restarts: 2",
        "  restart: rank 1 (stage 1), signal SIGKILL; restarted from checkpoint step 3",
        "  restart: rank 2 (stage 1), silent; restarted from the start",
        "  failure: rank 0 (stage 0), exit code 1; the job stopped",
    ]
    assert event_lines(()) == []


# ---- real processes -------------------------------------------------------------------------


def _long_toy_config(run_dir: Path, **train: object):  # type: ignore[no-untyped-def]
    """The toy pipeline for a run that lasts until a fault ends it: a learning rate it
    survives (its default lr 0.2 with momentum reaches NaN by minibatch ~70)."""
    cfg = toy_config(run_dir, "1f1b", steps=5_000, log_every=10_000, **train)
    cfg.optim.lr, cfg.optim.momentum = 0.01, 0.0
    return cfg


def _start(run_dir: Path) -> subprocess.Popen[str]:
    """`run_training` of `run_dir` in a child process (its stderr holds the failure)."""
    return subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(run_dir)], cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)


def _wait_training(run_dir: Path, ranks: int) -> dict[int, int]:
    """rank -> pid once every rank runs Forward/Backward actions."""
    deadline = time.monotonic() + GENEROUS_S
    training: set[int] = set()  # ranks seen in a Forward/Backward or past their first step
    while time.monotonic() < deadline and len(training) < ranks:
        for r in range(ranks):
            p = status_path(run_dir / "train", r)
            text = p.read_bytes().decode(errors="replace") if p.exists() else ""
            step = re.search(r"step=(\d+)", text)
            if re.search(r"\b[FB]\d+@v\d+", text) or (step is not None and int(step.group(1)) > 0):
                training.add(r)
        time.sleep(0.05)
    pids = worker_pids(run_dir)
    assert sorted(pids) == list(range(ranks)), pids
    return pids


def _alive(pid: int) -> bool:
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return "zombie" not in state


@contextlib.contextmanager
def _training(run_dir: Path, timeout_s: float) -> Iterator[tuple[subprocess.Popen[str], dict[int, int]]]:
    """A long toy run started in a child process: (its process, rank -> worker pid) once every
    rank trains; whatever is left of it is SIGKILLed on the way out."""
    write_toy_run(run_dir, _long_toy_config(run_dir, timeout_s=timeout_s), [1, 1, 1])
    proc = _start(run_dir)
    try:
        yield proc, _wait_training(run_dir, 3)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in worker_pids(run_dir).values():
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stopped_rank_is_killed_by_a_peer_and_named_as_silent(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with _training(run_dir, timeout_s=5) as (proc, pids):
        os.kill(pids[1], signal.SIGSTOP)
        stopped_s = time.monotonic()
        _, stderr = proc.communicate(timeout=GENEROUS_S)
        elapsed_s = time.monotonic() - stopped_s
    print(f"SIGSTOP of rank 1 with train.timeout_s=5: job stopped after {elapsed_s:.1f} s")
    assert proc.returncode == 1, stderr
    first_line = stderr.strip().splitlines()[0]
    assert "rank 1 (stage 1) sent nothing for" in first_line, stderr
    assert "killed by signal" not in first_line
    assert processes_mentioning(str(run_dir)) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_die_with_their_launcher(tmp_path: Path) -> None:
    with _training(tmp_path / "run", timeout_s=30) as (proc, pids):
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only: the workers are in sessions of their own
        killed_s = time.monotonic()
        proc.wait(timeout=GENEROUS_S)
        deadline = killed_s + 5.0
        while time.monotonic() < deadline and any(_alive(p) for p in pids.values()):
            time.sleep(0.05)
        gone_s = time.monotonic() - killed_s
        left = [p for p in pids.values() if _alive(p)]
    print(f"kill -9 of the launcher: every worker gone after {gone_s:.2f} s")
    assert left == [], f"workers {left} outlived their launcher by 5 s"


def _toy_train(run_dir: Path, schedule: str, monkeypatch: pytest.MonkeyPatch, fault: str | None = None, **train: object):
    from pdcli.rundir import RunDir
    from pdcli.runtime.job import run_training
    from pdcli.runtime.watchdog import FAULT_ENV

    cfg = toy_config(run_dir, schedule, **train)
    plan, manifest = write_toy_run(run_dir, cfg, [1, 1, 1])
    if fault:
        monkeypatch.setenv(FAULT_ENV, fault)
    else:
        monkeypatch.delenv(FAULT_ENV, raising=False)
    return run_training(cfg, RunDir(run_dir), plan, manifest)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule,every,fault,cause", [
    ("1f1b", 1, "1:3:kill", "signal SIGKILL"),  # rank 1 SIGKILLs itself after 3 steps: resumes from checkpoint 3
    ("pipedream", 2, "1:9:kill", "signal SIGKILL"),  # pipedream steps per microbatch: after minibatch 4, checkpoint 4
    ("1f1b", 1, "1:3:stop", "silent"),  # SIGSTOP: a peer's watchdog kills it, then the same restart
])
def test_a_killed_worker_is_restarted_and_the_run_ends_as_the_uninterrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, schedule: str, every: int, fault: str, cause: str
) -> None:
    import json

    import torch

    from pdcli.runtime import checkpoint
    from pdcli.runtime.events import read_events

    steps = 6
    _toy_train(tmp_path / "whole", schedule, monkeypatch, steps=steps, checkpoint_every=every)
    healed = _toy_train(tmp_path / "healed", schedule, monkeypatch, fault=fault, steps=steps, checkpoint_every=every,
                        max_restarts=1, timeout_s=10)
    events = read_events(tmp_path / "healed/train")
    assert [(e["event"], e["rank"], e["stage"], e["cause"]) for e in events] == [("restart", 1, 1, cause)], events
    resumed_at = events[0]["resume_step"]
    assert resumed_at is not None and 0 < resumed_at < steps
    print(f"{schedule}: rank 1 killed, restarted from checkpoint {resumed_at}; "
          f"run done {time.time() - events[0]['time_s']:.1f} s after the restart")
    assert healed.steps == steps
    whole = checkpoint.load_model_state(tmp_path / "whole/train", steps)
    weights = checkpoint.load_model_state(tmp_path / "healed/train", steps)
    for name in whole:
        assert torch.equal(weights[name], whole[name]), name  # bit-exact, as --resume
    lines = [json.loads(x) for x in (tmp_path / "healed/train/metrics.jsonl").read_text().splitlines()]
    whole_lines = [json.loads(x) for x in (tmp_path / "whole/train/metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["loss"]) for m in lines] == [(m["step"], m["loss"]) for m in whole_lines]


def _nan_data_set(path: Path, cfg, nan_minibatch: int) -> None:  # type: ignore[no-untyped-def]
    """48 toy examples (inputs 1x4x4, 4 classes) for `cfg.data`, the data switched to this
    tensor_file; the example that lands first in minibatch `nan_minibatch` holds a NaN."""
    import torch

    from pdcli.data import build_data

    rows = torch.arange(48, dtype=torch.float32)
    torch.save({"inputs": rows.view(48, 1, 1, 1).repeat(1, 1, 4, 4) / 100, "target": torch.arange(48) % 4}, path)
    cfg.data.name, cfg.data.kwargs = "tensor_file", {"path": str(path)}
    row = int(round(float(build_data(cfg.data, cfg.data.batch_size).batch(nan_minibatch).inputs[0][0, 0, 0, 0]) * 100))
    inputs = rows.view(48, 1, 1, 1).repeat(1, 1, 4, 4) / 100
    inputs[row, 0, 2, 1] = float("nan")
    torch.save({"inputs": inputs, "target": torch.arange(48) % 4}, path)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_nan_in_the_data_stops_the_run_naming_stage_minibatch_and_last_good_checkpoint(tmp_path: Path) -> None:
    import torch

    from pdcli.rundir import RunDir
    from pdcli.runtime import checkpoint
    from pdcli.runtime.events import read_events
    from pdcli.runtime.job import TrainingFailed, run_training

    run_dir = tmp_path / "run"
    cfg = toy_config(run_dir, "1f1b", steps=6, checkpoint_every=1, max_restarts=1)
    cfg.train.eval_batches = 0  # the set is a few minibatches: nothing to hold out
    _nan_data_set(tmp_path / "set.pt", cfg, nan_minibatch=3)
    plan, manifest = write_toy_run(run_dir, cfg, [1, 1, 1])
    with pytest.raises(TrainingFailed) as e:
        run_training(cfg, RunDir(run_dir), plan, manifest)
    first_line = str(e.value).splitlines()[0]
    good = checkpoint.checkpoint_dir(run_dir / "train", 3)
    assert first_line == (f"rank 2 (stage 2, replica 0) diverged: stage 2: the loss is nan at minibatch 3 (microbatch 6); "
                          f"last good checkpoint: {good}"), str(e.value)
    assert checkpoint.latest_step(run_dir / "train") == 3
    for name, tensor in checkpoint.load_model_state(run_dir / "train", 3).items():
        assert torch.isfinite(tensor).all(), name
    events = read_events(run_dir / "train")
    assert [(x["event"], x["cause"]) for x in events] == [("failure", "diverged")]  # max_restarts=1 left unused


def test_restart_and_guard_settings_are_checked() -> None:
    from pdcli.config.schema import Config, check_values

    cfg = Config()
    assert cfg.train.max_restarts == 0 and cfg.train.divergence == 3.0  # no restarts, the guard on
    cfg.train.max_restarts, cfg.train.divergence = -1, 0.5
    problems = check_values(cfg)
    assert any(p.startswith("train.max_restarts: must be a finite number >= 0") for p in problems), problems
    assert any(p.startswith("train.divergence: 0.5 would stop a run") for p in problems), problems
    cfg.train.max_restarts, cfg.train.divergence = 2, None
    assert not [p for p in check_values(cfg) if p.startswith(("train.max_restarts", "train.divergence"))]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_probe_worker_killed_during_pd_profile_stops_it_naming_the_probe(tmp_path: Path) -> None:
    """The pipeline probe is a `pd train` like any other: SIGKILL one of its workers and `pd
    profile` stops (exit 1, one message naming the probe and what to do), leaving no process."""
    probe_tmp = tmp_path / "tmp"  # the probe's run directory lands here: its workers name it
    probe_tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "from pdcli.cli import main; main()", "profile",
                             str(REPO / "recipes" / "quickstart.yaml"), f"run.root={tmp_path}", "profile.repeats=2",
                             "profile.pipeline_probe_runs=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**{k: v for k, v in os.environ.items() if k != "PD_PIPELINE_PROBE"},  # conftest's: off
                                 "TMPDIR": str(probe_tmp)})
    try:
        deadline = time.monotonic() + 5 * GENEROUS_S
        workers: list[int] = []
        while not workers and proc.poll() is None and time.monotonic() < deadline:
            workers = [pid for pid in processes_mentioning(str(probe_tmp)) if b"pdcli.runtime.worker" in
                       Path(f"/proc/{pid}/cmdline").read_bytes()] if probe_tmp.exists() else []
            time.sleep(0.2)
        why = proc.communicate()[1][-1500:] if proc.poll() is not None else "still running"
        assert workers, f"the pipeline probe's workers never started: {why}"
        os.kill(workers[-1], signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=GENEROUS_S)
        print(f"pd profile exited {time.monotonic() - killed:.1f} s after its probe worker was killed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err[-2000:]
    assert "error: the pipeline probe's training run failed" in err and "killed by signal 9" in err, err[-2000:]
    assert "hint: run `pd profile` again" in err and "Traceback" not in err
    deadline = time.monotonic() + GENEROUS_S
    while processes_mentioning(str(probe_tmp)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_mentioning(str(probe_tmp)), "a probe process was left behind"
    assert not (tmp_path / "quickstart" / "profile.json").exists()  # nothing half-written

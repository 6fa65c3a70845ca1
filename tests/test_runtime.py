"""Runtime pieces (pure) and the multi-process runtime's behaviour: failures, torchrun, outputs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from pdcli.errors import UserError
from pdcli.host import core_share, host_cores
from pdcli.rundir import RunDir
from pdcli.runtime import checkpoint
from pdcli.runtime.comm import MessageLayout, TensorSpec, message_tag
from pdcli.schedule import parse_action
from pdcli.runtime.watchdog import FAULT_ENV
from pdcli.runtime.placement import Placement
from pdcli.runtime.sockets import TRANSPORT_ENV
from pdcli.runtime.stageio import StageIO
from pdcli.runtime.job import TrainingFailed, format_summary, run_training
from pdcli.testing.toy import ToyNet, toy_plan, write_toy_run, write_toy_stages
from pdcli.torchutil.allocator import huge_page_env
from pdcli.runtime.weights import WeightVersionError, WeightVersions

pytestmark = pytest.mark.slow  # real processes over torch.distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_transparency import pipelined, reference, assert_same, toy_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


# ---- pure pieces -----------------------------------------------------------------------------


def test_core_share_gives_each_local_worker_its_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {6, 2, 3, 7, 4, 5}, raising=False)
    assert [core_share(r, 2) for r in range(2)] == [[2, 3, 4], [5, 6, 7]]
    assert [core_share(r, 4) for r in range(4)] == [[2], [3], [4], [5]]  # 2 cores left over, unused
    assert core_share(0, 7) is None  # more workers than cores: not pinned


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bind", [True, False])
def test_bind_cores_pins_a_worker_to_its_share_or_leaves_it(bind: bool) -> None:
    code = ("import os; from pdcli.config import Config; from pdcli.runtime.session import bind_cpu_worker\n"
            f"cfg = Config(); cfg.train.bind_cores = {bind}\n"
            "before = sorted(os.sched_getaffinity(0)); got = bind_cpu_worker(cfg, 1, 2)\n"
            "print(before, got, sorted(os.sched_getaffinity(0)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=50,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, got, after = (json.loads(part.replace("None", "null")) for part in
                          re.findall(r"\[[^\]]*\]|None", proc.stdout))
    if bind and len(before) >= 2:
        assert got == after == before[len(before) // 2:2 * (len(before) // 2)]
    else:
        assert got is None and after == before


def test_message_layout_round_trips_mixed_dtypes_in_one_buffer() -> None:
    specs = [TensorSpec("b", (3,), torch.float16), TensorSpec("a", (2, 2), torch.float32), TensorSpec("c", (5,), torch.int64)]
    layout = MessageLayout.of(specs)
    assert layout.names == ("a", "b", "c")  # sorted: sender and receiver agree whatever their list order
    tensors = {"a": torch.randn(2, 2), "b": torch.randn(3).half(), "c": torch.arange(5)}
    flat = layout.pack(tensors, torch.device("cpu"))
    assert flat.dtype == torch.uint8 and flat.numel() == 16 + 6 + 40
    out = layout.unpack(flat)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)
    with pytest.raises(ValueError, match="shape"):
        layout.pack({**tensors, "a": torch.randn(3)}, torch.device("cpu"))


def test_message_tags_are_unique_per_kind_and_microbatch() -> None:
    tags = {message_tag(k, mb) for k in ("activation", "gradient") for mb in range(100)}
    assert len(tags) == 200


def test_stage_io_follows_manifest_edges_including_skips(tmp_path: Path) -> None:
    manifest = write_toy_stages(tmp_path, ToyNet(4), microbatch_size=2)
    s0, s2, s3 = (StageIO.from_manifest(manifest, k) for k in (0, 2, 3))
    assert s0.data_inputs == {"x": 0} and sorted(s0.acts_out) == [1, 2]
    assert s0.acts_out[1].names == ("g0", "h0") and s0.acts_out[2].names == ("h0",)
    assert sorted(s2.acts_in) == [0, 1] and s2.grads_out[0].names == ("h0",)
    assert s3.loss_output == "output" and not s3.acts_out and not s3.grads_in


def test_placement_maps_ranks_to_stage_replicas() -> None:
    p = Placement.from_plan(toy_plan([1, 2, 1]))
    assert p.world_size == 4 and p.replicas == (1, 2, 1)
    assert [p.of(r) for r in range(4)] == [(0, 0), (1, 0), (1, 1), (2, 0)]
    assert p.rank(1, 1) == 2
    with pytest.raises(ValueError, match="ranks must be"):
        Placement.from_plan({"stages": [{"stage_id": 0, "replicas": 1, "ranks": [1]}]})


def test_weight_versions_stash_keeps_old_version_while_live_moves() -> None:
    module = nn.Linear(2, 2)
    versions = WeightVersions(module, stashed_mode=True)
    leaves0 = versions.leaves(0)
    assert leaves0 is not None and torch.equal(leaves0["weight"], module.weight)
    versions.stash(0)
    with torch.no_grad():
        module.weight.add_(1.0)  # the optimizer's update of the live weights
    versions.stepped()
    assert torch.equal(versions.leaves(0)["weight"] + 1.0, module.weight)  # v0 still the old weights
    assert versions.max_versions_held == 2
    versions.free(0)
    with pytest.raises(WeightVersionError, match="version 0"):
        versions.leaves(0)
    direct = WeightVersions(nn.Linear(2, 2), stashed_mode=False)
    assert direct.leaves(0) is None  # gpipe/1f1b: the module's own parameters, no copies


def test_checkpoint_is_complete_only_with_every_stage(tmp_path: Path) -> None:
    module = nn.Linear(2, 2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    checkpoint.save_stage(tmp_path, 5, 0, module, {"weight": "fc.0.weight", "bias": "fc.0.bias"}, opt, 5, {})
    with pytest.raises(RuntimeError, match=r"lacks stage files \[1\]"):
        checkpoint.mark_complete(tmp_path, 5, num_stages=2, keep=2)
    assert checkpoint.complete_steps(tmp_path) == []
    checkpoint.mark_complete(tmp_path, 5, num_stages=1, keep=2)
    assert checkpoint.complete_steps(tmp_path) == [5]
    state = checkpoint.load_model_state(tmp_path, 5)
    assert sorted(state) == ["fc.0.bias", "fc.0.weight"] and torch.equal(state["fc.0.weight"], module.weight)


def test_bad_schedule_parameters_fail_before_launch(tmp_path: Path) -> None:
    cfg = toy_config(tmp_path / "run", "2bw")  # 4 stages, 2 microbatches: 2bw cannot hold them
    plan, manifest = write_toy_run(tmp_path / "run", cfg, [1, 1, 1, 1])
    with pytest.raises(UserError, match="2bw"):
        run_training(cfg, RunDir(tmp_path / "run"), plan, manifest)
    assert not (tmp_path / "run" / "train" / "status").exists()  # no worker was started


def test_socket_transport_matches_messages_by_tag_and_reports_a_dead_peer() -> None:
    import socket
    import threading

    from pdcli.runtime.sockets import PeerClosedError, SocketTransport, _Peer

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender = SocketTransport({1: _Peer(1, a)}, timeout_s=5)
    receiver = SocketTransport({0: _Peer(0, b)}, timeout_s=5)
    big = torch.arange(300_000, dtype=torch.uint8)  # larger than the socket buffer: sent in parts
    got_big, got_small = torch.empty_like(big), torch.empty(3, dtype=torch.uint8)
    pending = [receiver.irecv(got_small, 0, tag=7), receiver.irecv(got_big, 0, tag=9)]  # posted ahead
    small = torch.tensor([1, 2, 3], dtype=torch.uint8)
    t = threading.Thread(target=lambda: (sender.isend(big, 1, tag=9), sender.isend(small, 1, tag=7)))
    t.start()
    for p in pending:
        p.wait()
    t.join()
    assert torch.equal(got_big, big) and got_small.tolist() == [1, 2, 3]
    a.shutdown(socket.SHUT_RDWR)  # the sending worker dies (the kernel closes its end)
    with pytest.raises(PeerClosedError, match="rank 0 closed its connection"):
        receiver.irecv(torch.empty(1, dtype=torch.uint8), 0, tag=11).wait()
    receiver.close()


def test_socket_send_returns_before_the_peer_reads_and_fails_once_the_peer_is_gone() -> None:
    import socket

    from pdcli.runtime.sockets import PeerClosedError, SocketTransport, _Peer, _recv_exact

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender = SocketTransport({1: _Peer(1, a)}, timeout_s=5)
    big = torch.ones(4 << 20, dtype=torch.uint8)  # 4 MiB: far more than the socket buffer holds
    pending = sender.isend(big, 1, tag=3)  # nobody reads b yet: a blocking send would hang here
    assert not pending.is_completed()
    header = bytearray(16)
    assert _recv_exact(b, memoryview(header))
    body = bytearray(big.numel())
    assert _recv_exact(b, memoryview(body))
    pending.wait()
    assert pending.is_completed() and body == bytes(big.numpy())
    b.close()  # the receiving worker dies
    with pytest.raises(PeerClosedError, match="send failed"):
        for _ in range(100):  # the kernel may still take one message after the close
            sender.isend(big, 1, tag=5).wait()
    sender.close()


def test_inconsistent_manifest_edges_are_refused(tmp_path: Path) -> None:
    from pdcli.runtime.job import check_edges

    manifest = write_toy_stages(tmp_path, ToyNet(3), microbatch_size=2)
    check_edges(manifest)
    manifest["stages"][1]["inputs"][1]["shape"] = [2, 99]  # g0 as stage 1 expects it
    with pytest.raises(UserError, match=r"stage 0 sends \['g0', 'h0'\] to stage 1"):
        check_edges(manifest)


# ---- real processes --------------------------------------------------------------------------


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (our run directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next((l for l in (entry / "status").read_text().splitlines() if l.startswith("State:")), "")
        except OSError:
            continue
        if text in cmdline and "zombie" not in state:
            pids.append(int(entry.name))
    return pids


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode,transport", [("exit", "socket"), ("hang", "socket"), ("exit", "gloo")])
def test_failed_worker_stops_the_job_naming_rank_stage_and_action(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, transport: str
) -> None:
    monkeypatch.setenv(TRANSPORT_ENV, transport)
    run_dir = tmp_path / "run"
    cfg = toy_config(run_dir, "1f1b", timeout_s=5)
    cfg.train.steps = 50
    plan, manifest = write_toy_run(run_dir, cfg, [1, 1, 1])
    monkeypatch.setenv(FAULT_ENV, f"1:2:{mode}")  # rank 1 dies / hangs once it has taken 2 steps
    start_s = time.monotonic()
    with pytest.raises(TrainingFailed) as failure:
        run_training(cfg, RunDir(run_dir), plan, manifest)
    elapsed_s = time.monotonic() - start_s
    message = str(failure.value)
    first_line = message.splitlines()[0]  # the root cause comes first
    assert "rank 1 (stage 1, replica 0)" in first_line, message
    assert "step=2" in first_line or "at step 2" in first_line, message
    assert re.search(r"\b[FB]\d+@v\d+\b", first_line), message  # the action it died in (text form: F3@v1)
    assert ("exit code 3" if mode == "exit" else "made no progress") in first_line, message
    assert elapsed_s < 60, f"failure took {elapsed_s:.1f} s to stop the job"
    assert processes_mentioning(str(run_dir)) == []
    assert not (run_dir / "train" / "summary.json").exists()


@pytest.mark.timeout(60)
def test_recompute_matches_reference(tmp_path: Path) -> None:
    cfg, manifest, losses, weights = pipelined(tmp_path, "pipedream", [1, 1, 1], recompute=True)
    assert_same(losses, weights, *reference(cfg, manifest, [1, 1, 1], tmp_path / "run" / "stages"))


@pytest.mark.timeout(60)
def test_run_outputs_metrics_trace_checkpoint_and_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = toy_config(run_dir, "1f1b", precision="bf16", checkpoint_every=1, keep_checkpoints=2)
    plan, manifest = write_toy_run(run_dir, cfg, [1, 2])
    result = run_training(cfg, RunDir(run_dir), plan, manifest)
    lines = [json.loads(l) for l in result.metrics_path.read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 3, 3] and lines[-1]["final"]
    assert all(0 <= l["accuracy"] <= 1 and l["loss"] > 0 and l["samples_per_s"] > 0 for l in lines)
    assert [s["stage_id"] for s in lines[-1]["stages"]] == [0, 1] and lines[-1]["stages"][1]["replicas"] == 2
    trace = json.loads(result.trace_path.read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2}
    assert {"Forward", "Backward", "OptimizerStep", "AllReduceGrads"} <= {e["name"] for e in spans}
    # each span names its action in the text form, which parses back to an action of its type
    assert all(type(parse_action(e["args"]["action"])).__name__ == e["name"] for e in spans)
    assert checkpoint.complete_steps(run_dir / "train") == [2, 3]  # every step, the last 2 kept
    state = checkpoint.load_model_state(run_dir / "train", cfg.train.steps)
    assert sorted(state) == sorted(ToyNet(2).state_dict())
    assert all((run_dir / "train" / f"rank{r}.log").exists() for r in range(3))
    # the workers' heap is the one `pd profile` measures under (pdcli.torchutil.allocator)
    on_huge_pages = ["heap on transparent huge pages" in (run_dir / "train" / f"rank{r}.log").read_text()
                     for r in range(3)]
    assert on_huge_pages == [huge_page_env({}) is not None] * 3
    table = format_summary(result)
    assert "compute ms" in table and f"{result.final_loss:.4f}" in table


@pytest.mark.timeout(60)
def test_worker_runs_as_is_under_torchrun(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = toy_config(run_dir, "pipedream")
    write_toy_run(run_dir, cfg, [1, 1])  # plan.json in the run dir: what the worker reads without pd train
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "pdcli.runtime.worker", "--run-dir", str(run_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=50, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    assert len(summary["minibatch_losses"]) == cfg.train.steps
    assert checkpoint.complete_steps(run_dir / "train") == [cfg.train.steps]
    # train.bind_cores: each worker on its own share of the host's cores where there are enough
    pinned = [re.findall(r"pinned to cores \[([0-9, ]+)\]", (run_dir / "train" / f"rank{r}.log").read_text())
              for r in range(2)]
    if host_cores() >= 2:
        shares = [set(map(int, p[0].split(","))) for p in pinned]
        assert shares[0] and shares[1] and not shares[0] & shares[1]
    else:
        assert pinned == [[], []]


def test_diagnosis_puts_the_root_cause_first(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from pdcli.runtime.launcher import diagnose
    from pdcli.runtime.watchdog import Heartbeat, status_path, write_error

    placement = Placement.from_plan(toy_plan([1, 1, 1]))
    beat = Heartbeat(status_path(tmp_path, 1))
    beat.beat(4, "Backward(microbatch_id=9, weight_version=3)")
    beat.close()
    write_error(tmp_path, 0, "peer", "rank 0 (stage 0, replica 0) failed in RecvGrads: connection closed")
    failures = {
        r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=code, error_file=str(tmp_path / "none.json"))
        for r, code in ((0, 1), (1, 3), (2, -15))
    }
    message = diagnose(tmp_path, placement, ChildFailedError("worker", failures), tmp_path)
    lines = message.splitlines()
    assert lines[0] == "rank 1 (stage 1, replica 0) died with exit code 3; last: step=4 action=Backward(microbatch_id=9, weight_version=3)"
    assert "rank 0" in lines[1] and "rank 2" in lines[2] and "signal 15" in lines[2]

"""Several hosts: one rendezvous id, one plan (node 0's), peers that prove themselves.

In-process first (a HashStore stands for the job's rendezvous store, threads for ranks),
then real jobs (marked slow): two nodes on this host with separate run directories, two
network namespaces joined by a veth pair (root only), and strangers racing the set-up.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import HashStore

from pdcli import share
from pdcli.config.schema import Config
from pdcli.errors import UserError
from pdcli.rundir import RunDir
from pdcli.runtime import handshake, sockets
from pdcli.runtime.launcher import Hosts, job_endpoint
from pdcli.runtime.rendezvous import DEFAULT_MASTER_PORT, rendezvous_id
from pdcli.runtime.sockets import HEADER, Place, SocketTransport


# ---- the rendezvous id and the endpoint ------------------------------------------------


def test_every_node_derives_the_same_rendezvous_id() -> None:
    assert rendezvous_id(None, 29611, {}) == rendezvous_id(None, 29611, {"HOSTNAME": "other"}) == "pd-port29611"
    assert rendezvous_id(None, 29611, {"SLURM_JOB_ID": "4242"}) == "pd-4242"
    assert rendezvous_id(None, 29611, {"PET_RDZV_ID": "exp1", "SLURM_JOB_ID": "4242"}) == "pd-exp1"  # torchrun's first
    assert rendezvous_id("mine", 29611, {"PET_RDZV_ID": "exp1"}) == "pd-mine"  # the command line wins
    with pytest.raises(UserError, match="rendezvous id 'a b'"):
        rendezvous_id("a b", 29611, {})
    assert job_endpoint(Hosts(nnodes=2, node_rank=1, master_addr="10.0.0.1")) == ("10.0.0.1", DEFAULT_MASTER_PORT)
    with pytest.raises(UserError, match="--nnodes 2: every node needs node 0's address"):
        job_endpoint(Hosts(nnodes=2, node_rank=1))


# ---- one plan: node 0's artifacts ------------------------------------------------------


def _fake_run(root: Path, profile: str = '{"nodes": 1}') -> tuple[RunDir, Config]:
    """A run directory holding a registered profile, plan and stages/ (two files)."""
    run = RunDir(root).create()
    run.write_json("profile.json", json.loads(profile), "in-profile")
    run.write_json("plan.json", {"stages": [{"stage_id": 0, "ranks": [0]}]}, "in-plan")
    (run / "stages" / "sub").mkdir(parents=True)
    (run / "stages" / "manifest.json").write_text('{"num_stages": 1}')
    (run / "stages" / "sub" / "stage_0.pt").write_bytes(bytes(range(256)) * 4)
    run.register("stages", "in-stages")
    cfg = Config()
    cfg.run.root = str(root)
    return run, cfg


def _files(run: RunDir) -> dict[str, bytes]:
    return {rel: p.read_bytes() for name in share.SHARED for rel, p in run.artifact_files(name).items()}


def test_other_nodes_take_node_0s_artifacts_and_keep_what_already_matches(tmp_path: Path) -> None:
    store = HashStore()
    node0, cfg = _fake_run(tmp_path / "node0")
    share.publish(store, node0, cfg)
    empty = RunDir(tmp_path / "empty")
    assert share.receive(store, empty, cfg, "n0:1", 5) == list(share.SHARED)
    assert _files(empty) == _files(node0) and empty.record("stages") == node0.record("stages")
    assert share.receive(store, empty, cfg, "n0:1", 5) == []  # the second time everything matches
    other, _ = _fake_run(tmp_path / "other", profile='{"nodes": 2}')  # measured otherwise
    assert share.receive(store, other, cfg, "n0:1", 5) == ["profile.json"]
    assert _files(other) == _files(node0)
    assert other.verify("profile.json").inputs_hash == "in-profile"  # registered under node 0's record


def test_a_node_with_another_config_or_too_large_artifacts_is_told_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = HashStore()
    node0, cfg = _fake_run(tmp_path / "node0")
    mine = Config()
    mine.train.steps, mine.run.name = cfg.train.steps + 1, "elsewhere"  # run.* may differ, train.steps may not
    share.publish(store, node0, cfg)
    with pytest.raises(UserError, match=rf"config.yaml differs from node 0's \(n0:1\): train.steps={cfg.train.steps + 1} here, "
                                        rf"{cfg.train.steps} on node 0") as e:
        share.receive(store, RunDir(tmp_path / "b"), mine, "n0:1", 5)
    assert "same recipe and overrides" in (e.value.hint or "")
    monkeypatch.setattr(share, "MAX_SENT_BYTES", 10)
    big = HashStore()
    share.publish(big, node0, cfg)
    with pytest.raises(UserError, match=r"profile.json differs from node 0's \(n0:1\).* too large to send") as e:
        share.receive(big, RunDir(tmp_path / "c"), cfg, "n0:1", 5)
    assert f"rsync -a NODE0:{tmp_path / 'c'}/ {tmp_path / 'c'}/" in (e.value.hint or "")
    with pytest.raises(UserError, match=r"node 0 \(n0:1\) did not share its plan within 0.1 s \(DistStoreError\)"):
        share.receive(HashStore(), RunDir(tmp_path / "d"), cfg, "n0:1", 0.1)
    failed = HashStore()
    share.publish_failure(failed, "plan: infeasible")
    with pytest.raises(UserError, match=r"node 0 \(n0:1\) stopped before sharing its plan: plan: infeasible"):
        share.receive(failed, RunDir(tmp_path / "e"), cfg, "n0:1", 5)


def test_workers_started_by_torchrun_check_they_run_rank_0s_plan(tmp_path: Path) -> None:
    """torchrun copies nothing: a host whose run directory differs stops at start-up, saying how to copy it."""
    from pdcli.runtime.session import check_same_plan

    store = HashStore()
    node0, _ = _fake_run(tmp_path / "node0")
    same, _ = _fake_run(tmp_path / "same")
    other, _ = _fake_run(tmp_path / "other")
    (other / "stages" / "sub" / "stage_0.pt").write_bytes(b"other weights")
    other.register("stages", "in-stages")
    check_same_plan(store, node0.path, rank=0)
    check_same_plan(store, same.path, rank=1)
    with pytest.raises(RuntimeError, match=rf"plan.json or stages/ differ from rank 0's; .*rsync -a NODE0:{other.path}/ {other.path}/"):
        check_same_plan(store, other.path, rank=1)


# ---- peers that prove themselves -------------------------------------------------------


def _connect_pair(store: Any, hosts: tuple[str, str], log: list[str]) -> dict[int, SocketTransport]:
    """Ranks 0 and 1 as threads: 1 receives 16-byte activations from 0."""
    out: dict[int, SocketTransport] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = SocketTransport.connect(rank, [0, 1], 10, {0: {"activation": 16}} if rank else {}, store,
                                                Place(hosts[rank], "127.0.0.1"), log.append)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    if errors:
        raise errors[0]
    return out


def _send_one(pair: dict[int, SocketTransport]) -> bool:
    sent, got = torch.arange(16, dtype=torch.uint8), torch.empty(16, dtype=torch.uint8)
    pair[0].isend(sent, 1, 0).wait()
    pair[1].irecv(got, 0, 0).wait()
    for t in pair.values():
        t.close()
    return torch.equal(sent, got)


def _stranger_hello(sock: socket.socket) -> None:
    sock.sendall(handshake.HELLO.pack(0, b"\0" * 16, b"\0" * 32))  # claims rank 0, no proof


def _stranger_huge_header(sock: socket.socket) -> None:
    sock.sendall(b"\0" * 8 + HEADER.pack(0, 1 << 60))  # the old hello, then a header announcing 1 EiB
    sock.shutdown(socket.SHUT_WR)


@pytest.mark.parametrize("hosts, family", [(("a", "a"), socket.AF_UNIX), (("a", "b"), socket.AF_INET)])
@pytest.mark.parametrize("stranger", [_stranger_hello, _stranger_huge_header])
def test_a_stranger_that_connects_first_is_refused_and_the_real_peer_accepted(
    monkeypatch: pytest.MonkeyPatch, hosts: tuple[str, str], family: int, stranger: Any
) -> None:
    """The stranger connects the moment the listener exists (before its address is even
    published), claims a rank, and is refused; the real rank 0 then gets through."""
    strangers: list[socket.socket] = []
    real_listen = sockets._Acceptor._listen

    def listen_then_stranger(self: Any, fam: int, address: Any) -> socket.socket:
        listener = real_listen(self, fam, address)
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.connect(listener.getsockname())
        stranger(s)
        strangers.append(s)
        return listener

    monkeypatch.setattr(sockets._Acceptor, "_listen", listen_then_stranger)
    log: list[str] = []
    pair = _connect_pair(HashStore(), hosts, log)
    assert pair[1].peers[0].sock.family == family and len(strangers) == 1
    assert len(log) == 1 and log == pair[1].refusals
    who = "on this host" if family == socket.AF_UNIX else "127.0.0.1:"
    assert log[0].startswith("rank 1: refused a connection from ") and who in log[0]
    assert ("claimed rank 0 without this job's proof" if stranger is _stranger_hello
            else "closed during the handshake, 24 of the 56 bytes") in log[0]
    strangers[0].settimeout(10)
    challenge = strangers[0].recv(handshake.CHALLENGE.size, socket.MSG_WAITALL)
    assert challenge.startswith(handshake.MAGIC) and strangers[0].recv(1) == b""  # no proof for it: closed
    assert _send_one(pair)


def test_a_connection_from_an_address_no_awaited_rank_published_is_closed_before_any_handshake(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 published 127.0.0.1 as its place and dials from it; a stranger from 127.0.0.2
    (another address of this host's loopback) connects first and is closed without a challenge:
    no handshake thread, nothing sent to it. The real rank 0 gets through."""
    strangers: list[socket.socket] = []
    real_listen = sockets._Acceptor._listen
    handshakes = [0]
    real_check = sockets._Acceptor._check

    def listen_then_stranger(self: Any, fam: int, address: Any) -> socket.socket:
        listener = real_listen(self, fam, address)
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.bind(("127.0.0.2", 0))
        s.connect(listener.getsockname())
        _stranger_hello(s)
        strangers.append(s)
        return listener

    def counted(self: Any, conn: socket.socket, peer: Any) -> None:
        handshakes[0] += 1
        real_check(self, conn, peer)

    monkeypatch.setattr(sockets._Acceptor, "_listen", listen_then_stranger)
    monkeypatch.setattr(sockets._Acceptor, "_check", counted)
    log: list[str] = []
    pair = _connect_pair(HashStore(), ("a", "b"), log)
    assert pair[1].peers[0].sock.getpeername()[0] == "127.0.0.1"
    assert handshakes[0] == 1  # rank 0's only
    assert len(log) == 1 and log[0].startswith("rank 1: refused a connection from 127.0.0.2:"), log
    assert "not the address of a rank it awaits, closed at once" in log[0]
    strangers[0].settimeout(10)
    try:
        assert strangers[0].recv(1) == b""  # closed, not even challenged
    except ConnectionResetError:  # closed with its hello unread
        pass
    assert _send_one(pair)


@pytest.mark.parametrize("hosts", [("a", "a"), ("a", "b")])
def test_a_flood_of_silent_connections_is_bounded_and_the_real_peer_gets_through(
    monkeypatch: pytest.MonkeyPatch, hosts: tuple[str, str]
) -> None:
    """More strangers than handshakes pending connect the moment the listener exists and say
    nothing: at most MAX_PENDING_HANDSHAKES handshake threads run (the rest are closed at once),
    each silent one is dropped after the handshake deadline, and the real rank 0, dialling again
    while it is closed early, connects."""
    monkeypatch.setattr(sockets, "HANDSHAKE_TIMEOUT_S", 0.5)
    flood = sockets.MAX_PENDING_HANDSHAKES + 24
    strangers: list[socket.socket] = []
    real_listen = sockets._Acceptor._listen

    def listen_then_flood(self: Any, fam: int, address: Any) -> socket.socket:
        listener = real_listen(self, fam, address)
        for _ in range(flood):
            s = socket.socket(fam, socket.SOCK_STREAM)
            s.connect(listener.getsockname())
            strangers.append(s)
        return listener

    peak = [0]
    real_check = sockets._Acceptor._check

    def counted(self: Any, conn: socket.socket, peer: Any) -> None:
        peak[0] = max(peak[0], sum(t.name == "pd-handshake" for t in threading.enumerate()))
        real_check(self, conn, peer)

    monkeypatch.setattr(sockets._Acceptor, "_listen", listen_then_flood)
    monkeypatch.setattr(sockets._Acceptor, "_check", counted)
    log: list[str] = []
    try:
        pair = _connect_pair(HashStore(), hosts, log)
        assert _send_one(pair)
    finally:
        for s in strangers:
            s.close()
    assert 1 <= peak[0] <= sockets.MAX_PENDING_HANDSHAKES
    assert any("handshakes pending, closed at once" in line for line in log)
    assert any("timed out" in line for line in log)  # a silent one, after the deadline


def test_a_listener_without_the_secret_is_not_trusted() -> None:
    a, b = socket.socketpair()
    b.sendall(handshake.CHALLENGE.pack(handshake.MAGIC, b"n" * 16) + b"\0" * 32)  # answers without proof
    with pytest.raises(handshake.Refused, match="did not prove it belongs to this job"):
        handshake.prove_to_listener(a, b"s" * 32, 0, 1)
    a.close()
    b.close()


@pytest.fixture(autouse=True)
def job_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The secret every node of these jobs is given out of band (their workers inherit it)."""
    monkeypatch.setenv(handshake.SECRET_ENV, "the secret of the tests' jobs")


# ---- real jobs: two nodes, two network namespaces, strangers --------------------------

REPO = Path(__file__).resolve().parents[1]
PD = Path(sys.executable).parent / "pd"
RECIPE = str(REPO / "recipes" / "quickstart.yaml")
STEPS = 12
ARGS = [f"train.steps={STEPS}", "train.log_every=4", "train.threads_per_worker=1", "run.name=mh"]
JOB_TIMEOUT_S = 300


def pd(*args: str, ns: str | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`pd ARGS` in a process of its own (in network namespace `ns` when given)."""
    prefix = ["ip", "netns", "exec", ns] if ns else []
    return subprocess.Popen([*prefix, str(PD), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def finish(*procs: subprocess.Popen[str]) -> list[tuple[int, str]]:
    """(exit status, stderr) of each, killing what is left after JOB_TIMEOUT_S."""
    return [(code, err) for code, _, err in finish_with_output(*procs)]


def finish_with_output(*procs: subprocess.Popen[str]) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each, killing what is left after JOB_TIMEOUT_S."""
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=JOB_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        done.append((proc.returncode, out, err))
    return done


def final_weights(root: Path, stage_ids: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    step_dir = root / "mh" / "train" / "checkpoints" / f"step_{STEPS}"
    return {k: torch.load(step_dir / f"stage_{k}.pt", weights_only=True)["model"] for k in stage_ids}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """run.root of the quickstart profiled, planned (2 stages, 2 ranks) and compiled once."""
    root = tmp_path_factory.mktemp("compiled")
    (code, err), = finish(pd("compile", RECIPE, f"run.root={root}", *ARGS))
    assert code == 0, err
    return root


@pytest.fixture(scope="module")
def one_node(compiled: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, torch.Tensor]]:
    """The final weights per stage of that plan trained on one node."""
    root = tmp_path_factory.mktemp("one") / "root"
    shutil.copytree(compiled, root)
    (code, err), = finish(pd("train", RECIPE, f"run.root={root}", *ARGS))
    assert code == 0, err
    return final_weights(root, [0, 1])


def assert_same_weights(got: dict[int, dict[str, torch.Tensor]], want: dict[int, dict[str, torch.Tensor]]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert sorted(got[k]) == sorted(want[k])
        for name in want[k]:
            torch.testing.assert_close(got[k][name], want[k][name])


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_two_nodes_with_their_own_run_directories_train_like_one(
    compiled: Path, one_node: dict[int, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """Node 1's directory holds another profile: it trains node 0's plan, to the same weights;
    node 0 ends with node 1's summary, metrics and trace, and the link measured between them."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(compiled, a)
    shutil.copytree(compiled, b)
    theirs = RunDir(b / "mh")
    profile = json.loads((b / "mh" / "profile.json").read_text())
    profile.setdefault("meta", {})["measured_elsewhere"] = True
    theirs.write_json("profile.json", profile, theirs.verify("profile.json").inputs_hash)
    port = str(free_port())
    nodes = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port)
    (code0, out0, err0), (code1, _, err1) = finish_with_output(
        pd("train", RECIPE, f"run.root={a}", *ARGS, *nodes, "--node-rank", "0"),
        pd("train", RECIPE, f"run.root={b}", *ARGS, *nodes, "--node-rank", "1"))
    assert (code0, code1) == (0, 0), err0 + err1
    assert f"job pd-port{port} at 127.0.0.1:{port}" in err0 and "waiting for node 0's plan" in err1
    assert (b / "mh" / "profile.json").read_bytes() == (a / "mh" / "profile.json").read_bytes()
    assert_same_weights(final_weights(a, [0]) | final_weights(b, [1]), one_node)
    # the last stage ran on node 1: node 0 ends with its summary, metrics and trace, and says how it went
    for name in ("summary.json", "metrics.jsonl", "trace.json"):
        assert (a / "mh" / "train" / name).read_bytes() == (b / "mh" / "train" / name).read_bytes(), name
    assert "samples/s" in out0 and "the last stage ran on another node" not in err0
    # the link between the nodes, measured at the start, recorded on both and in the summary
    link = json.loads((a / "mh" / "train" / "link.json").read_text())
    assert link["measured_bandwidth_bytes_per_s"] > 0 and link["latency_ms"] > 0 and link["between"] == [0, 1]
    assert link["configured_bandwidth_bytes_per_s"] == 1e9 and link["level"] == 0  # the quickstart's one level
    assert json.loads((a / "mh" / "train" / "summary.json").read_text())["link"] == link
    assert json.loads((b / "mh" / "train" / "link.json").read_text()) == link
    assert "link:    between node 0 and node 1: measured" in err0 or "warning: the link between node 0 and node 1" in err0


@pytest.mark.slow
@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_the_secret_from_a_file_or_the_environment_or_the_store_when_the_user_accepts_it(
    compiled: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 0 reads the secret from --secret-file, node 1 from PD_JOB_SECRET: the same key, one
    job. Without either, --insecure-network on both shares one through the store: the job
    trains, each node warns, and its events record it."""
    secret = tmp_path / "job.secret"
    secret.write_text("shared out of band\n")
    secret.chmod(0o600)
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(compiled, a)
    monkeypatch.delenv(handshake.SECRET_ENV)
    port = str(free_port())
    nodes = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port)
    (code0, err0), (code1, err1) = finish(
        pd("train", RECIPE, f"run.root={a}", *ARGS, *nodes, "--node-rank", "0", "--secret-file", str(secret)),
        pd("train", RECIPE, f"run.root={b}", *ARGS, *nodes, "--node-rank", "1",
           env={handshake.SECRET_ENV: "shared out of band"}))
    assert (code0, code1) == (0, 0), err0 + err1
    assert "insecure" not in err0 + err1

    port = str(free_port())
    nodes = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port, "--insecure-network")
    (code0, err0), (code1, err1) = finish(
        pd("train", RECIPE, f"run.root={a}", *ARGS, *nodes, "--node-rank", "0"),
        pd("train", RECIPE, f"run.root={b}", *ARGS, *nodes, "--node-rank", "1"))
    assert (code0, code1) == (0, 0), err0 + err1
    for err, root in ((err0, a), (err1, b)):
        assert "warning: --insecure-network" in err and "can read it" in err
        events = [json.loads(line) for line in (root / "mh" / "train" / "events.jsonl").read_text().splitlines()]
        assert any(e["event"] == "insecure_network" for e in events)


@pytest.mark.slow
@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_slurm_environment_and_torchrun_start_the_same_job(
    compiled: Path, one_node: dict[int, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """`srun pd train` (SLURM's variables, node 1 empty), then torchrun running the worker as
    is on copies of node 0's run directory: both train the one-node weights."""
    a, b = tmp_path / "slurm_a", tmp_path / "slurm_b"
    shutil.copytree(compiled, a)
    port = str(free_port())
    slurm = {"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": f"t{port}"}
    (code0, err0), (code1, err1) = finish(
        pd("train", RECIPE, f"run.root={a}", *ARGS, "--master-port", port, env={**slurm, "SLURM_NODEID": "0"}),
        pd("train", RECIPE, f"run.root={b}", *ARGS, "--master-port", port, env={**slurm, "SLURM_NODEID": "1"}))
    assert (code0, code1) == (0, 0), err0 + err1
    assert f"node 0 of 2, job pd-t{port} at localhost:{port}" in err0
    assert_same_weights(final_weights(a, [0]) | final_weights(b, [1]), one_node)

    roots = [tmp_path / "torchrun_a", tmp_path / "torchrun_b"]
    port = str(free_port())
    procs = []
    for node, root in enumerate(roots):
        shutil.copytree(compiled, root)  # torchrun copies nothing: node 0's run directory on each
        procs.append(subprocess.Popen(
            [str(PD.parent / "torchrun"), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
             "--master-addr", "127.0.0.1", "--master-port", port, "-m", "pdcli.runtime.worker", "--run-dir", str(root / "mh")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}))
    (code0, err0), (code1, err1) = finish(*procs)
    assert (code0, code1) == (0, 0), err0[-2000:] + err1[-2000:]
    assert_same_weights(final_weights(roots[0], [0]) | final_weights(roots[1], [1]), one_node)


@pytest.fixture
def two_namespaces() -> Any:
    """Two network namespaces joined by a veth pair: ((ns0, addr0), (ns1, addr1)); removed after."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (ip netns)")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip`")
    tag = f"pd{os.getpid() % 100000}"
    ns, veth = (f"{tag}n0", f"{tag}n1"), (f"{tag}v0", f"{tag}v1")
    addrs = (f"10.213.{os.getpid() % 250}.1", f"10.213.{os.getpid() % 250}.2")

    def ip(*args: str, check: bool = True) -> None:
        subprocess.run(["ip", *args], check=check, timeout=20, capture_output=True)

    try:
        for name in ns:
            ip("netns", "add", name)
        ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for name, dev, addr in zip(ns, veth, addrs):
            ip("link", "set", dev, "netns", name)
            ip("-n", name, "addr", "add", f"{addr}/30", "dev", dev)
            ip("-n", name, "link", "set", dev, "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield tuple(zip(ns, addrs))
    finally:
        ip("link", "del", veth[0], check=False)  # still here if the set-up failed before moving it
        for name in ns:
            ip("netns", "del", name, check=False)  # takes its end of the veth pair with it
        assert not any(name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout for name in ns)


def worker_pids(run_dir: Path) -> dict[int, int]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_reliability import worker_pids as pids

    return pids(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_two_network_namespaces_run_one_job_and_a_killed_worker_stops_both(
    two_namespaces: Any, compiled: Path, one_node: dict[int, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """Each node sees only its namespace's address; node 1 starts with an empty directory;
    the default port (29500) is free in a namespace of its own."""
    (ns0, addr0), (ns1, addr1) = two_namespaces
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(compiled, a)

    def nodes(*extra: str) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
        common = ("--nnodes", "2", "--master-addr", addr0, *extra)
        return (pd("train", RECIPE, f"run.root={a}", *ARGS, *common, "--node-rank", "0", ns=ns0),
                pd("train", RECIPE, f"run.root={b}", *ARGS, *common, "--node-rank", "1", ns=ns1))

    (code0, err0), (code1, err1) = finish(*nodes())
    assert (code0, code1) == (0, 0), err0 + err1
    assert_same_weights(final_weights(a, [0]) | final_weights(b, [1]), one_node)
    assert f"rank 1 ({addr1}) over TCP" in (a / "mh" / "train" / "rank0.log").read_text()
    assert f"rank 0 ({addr0}) over TCP" in (b / "mh" / "train" / "rank1.log").read_text()

    # kill -9 a worker in namespace 1 while both train: both nodes stop, naming it
    status = b / "mh" / "train" / "status" / "rank1.txt"
    status.unlink()  # the first run's: it named a forward already
    node0, node1 = nodes("train.steps=3000", "train.timeout_s=20")  # long enough to be killed in
    deadline_s = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline_s and not (re.search(r"\bF\d+@v\d+", status.read_text() if status.exists() else "")
                                                 and 1 in worker_pids(b)):
        time.sleep(0.2)
    pid = worker_pids(b)[1]
    os.kill(pid, signal.SIGKILL)
    killed_s = time.monotonic()
    (code0, err0), (code1, err1) = finish(node0, node1)
    elapsed_s = time.monotonic() - killed_s
    assert code0 != 0 and code1 != 0
    error0, error1 = (next(line for line in err.splitlines() if line.startswith("error:")) for err in (err0, err1))
    assert "rank 1 (stage 1, replica 0) was killed by signal 9" in error1, err1
    assert f"rank 1 ({addr1})" in error0, err0  # node 0 names the rank and where it ran
    assert elapsed_s < 20 + 30, elapsed_s  # bounded by train.timeout_s, not by the run
    assert processes_mentioning(str(tmp_path)) == []


def processes_mentioning(text: str) -> list[int]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_runtime import processes_mentioning as find

    return find(text)


def listening_unix_names(pids: list[int]) -> list[str]:
    """Abstract names (`pd-...`) of the Unix sockets listening in processes `pids` (/proc)."""
    from pdcli.testing.flood import socket_inodes

    inodes = socket_inodes(pids)
    names = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and int(fields[3], 16) & 0x10000 and fields[6] in inodes and fields[7].startswith("@pd-"):
            names.append(fields[7][1:])  # 0x10000: __SO_ACCEPTCON, a listening socket
    return names


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_strangers_racing_the_set_up_are_refused_and_the_numbers_unchanged(
    compiled: Path, one_node: dict[int, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """A stranger on the host watches /proc for the workers' listeners and connects to each
    the moment it exists, twice: claiming rank 0, and announcing a 1 EiB message. The workers
    hold their listeners unpublished until it has (PD_TEST_LISTEN_GATE), so it is first."""
    root, gate = tmp_path / "root", tmp_path / "gate"
    shutil.copytree(compiled, root)
    proc = pd("train", RECIPE, f"run.root={root}", *ARGS, env={sockets.LISTEN_GATE_ENV: str(gate)})
    strangers: list[socket.socket] = []
    try:
        deadline_s = time.monotonic() + JOB_TIMEOUT_S
        names: list[str] = []
        while not names and time.monotonic() < deadline_s and proc.poll() is None:
            names = listening_unix_names(list(worker_pids(root / "mh").values()))
            time.sleep(0.01)
        assert len(names) == 1, names  # 2 ranks: rank 1 listens for rank 0
        for claim in (_stranger_hello, _stranger_huge_header):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\0" + names[0])
            claim(s)
            strangers.append(s)
    finally:
        gate.touch()
    (code, err), = finish(proc)
    assert code == 0, err
    for s in strangers:
        s.settimeout(JOB_TIMEOUT_S)
        assert s.recv(handshake.CHALLENGE.size, socket.MSG_WAITALL).startswith(handshake.MAGIC)
        assert s.recv(1) == b""  # refused: closed without a proof
        s.close()
    log = (root / "mh" / "train" / "rank1.log").read_text()
    assert log.count(f"refused a connection from pid {os.getpid()} ") == 2, log
    assert "claimed rank 0 without this job's proof" in log and "closed during the handshake" in log
    assert_same_weights(final_weights(root, [0, 1]), one_node)


JUNK_CONNECTIONS = 1000


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_a_thousand_junk_connections_during_training_change_nothing(
    compiled: Path, one_node: dict[int, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """Mid-training (rank 1 holds itself stopped after 6 minibatches: PD_TEST_FAULT=1:6:stop), 1,000
    connections to the TCP ports the job listens on (the rendezvous store's, torch's process
    group's: pd's own listeners closed after the set-up), all held open at once, a third silent,
    a third sending random bytes, a third a flood of bytes: the job ends as the undisturbed run,
    and no process of it gained a thread per connection."""
    import resource

    from pdcli.testing.flood import listening_tcp_ports, open_junk, threads_of

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < JUNK_CONNECTIONS + 200:
        pytest.skip(f"the open-file limit ({hard}) is below the {JUNK_CONNECTIONS} connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process's end of each connection
    root = tmp_path / "root"
    shutil.copytree(compiled, root)
    proc = pd("train", RECIPE, f"run.root={root}", *ARGS, "train.timeout_s=120", env={"PD_TEST_FAULT": "1:6:stop"})
    junk: list[socket.socket] = []
    try:
        deadline_s = time.monotonic() + JOB_TIMEOUT_S
        stopped = None
        while stopped is None and time.monotonic() < deadline_s and proc.poll() is None:
            pids = worker_pids(root / "mh")
            states = {r: Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
                      for r, p in pids.items() if Path(f"/proc/{p}/stat").exists()}
            stopped = pids[1] if states.get(1) == "T" and len(pids) == 2 else None
            time.sleep(0.05)
        assert stopped is not None, "rank 1 never stopped itself mid-training"
        job = [proc.pid, *worker_pids(root / "mh").values()]
        ports = listening_tcp_ports(job)
        assert ports, "the job listens on no TCP port (its rendezvous store at least)"
        before = {pid: threads_of(pid) for pid in job}
        junk = open_junk(ports, JUNK_CONNECTIONS)
        time.sleep(1.0)  # the listeners' threads see every connection
        during = {pid: threads_of(pid) for pid in job}
        assert all(during[p] <= before[p] + sockets.MAX_PENDING_HANDSHAKES for p in job), (before, during)
        os.kill(stopped, signal.SIGCONT)
        (code, err), = finish(proc)
    finally:
        for s in junk:
            s.close()
        if proc.poll() is None:
            proc.kill()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert code == 0, err[-3000:]
    assert_same_weights(final_weights(root, [0, 1]), one_node)


# ---- a third host: a stranger on the job's network --------------------------------------


SECRET_TEXT = "the secret of the tests' jobs"


@pytest.fixture
def lan() -> Any:
    """Three namespaces on one bridged segment: node 0, node 1 and a stranger; removed after."""
    from pdcli.testing import netns

    why = netns.available()
    if why is not None:
        pytest.skip(why)
    before = set(netns.existing())
    with netns.Lan(3) as made:
        yield made.hosts
    assert set(netns.existing()) <= before


def stranger(host: Any, *args: str) -> subprocess.Popen[str]:
    """`python -m pdcli.testing.stranger ARGS` inside the stranger's namespace."""
    return subprocess.Popen([*host.prefix(), sys.executable, "-m", "pdcli.testing.stranger", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**{k: v for k, v in os.environ.items() if k != handshake.SECRET_ENV},
                                 "PYTHONPATH": str(REPO)})


def stranger_says(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The stranger's next JSON line (it has at most JOB_TIMEOUT_S to say it)."""
    assert proc.stdout is not None
    ready: list[str] = []
    reader = threading.Thread(target=lambda: ready.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(JOB_TIMEOUT_S)
    assert ready and ready[0], f"the stranger said nothing: {proc.stderr.read() if proc.poll() is not None else ''}"  # type: ignore[union-attr]
    return dict(json.loads(ready[0]))


def assert_no_secret_in(values: dict[str, str]) -> None:
    import base64

    key = handshake.secret_key(SECRET_TEXT)
    for name, value in values.items():
        raw = base64.b64decode(value)
        for secret in (SECRET_TEXT.encode(), key, key.hex().encode()):
            assert secret not in raw, f"the store's {name!r} holds the job's secret"
    assert not any(name.endswith(handshake.SECRET_KEY) for name in values)


def only_key(values: dict[str, str], suffix: str) -> str:
    found = [k for k in values if k.endswith(suffix)]
    assert len(found) == 1, (suffix, sorted(values))
    return found[0]


def node(lan: Any, root: Path, port: int, rank: int, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Node `rank` of a two-node job in namespace `rank` of `lan`, master port `port`."""
    return pd("train", RECIPE, f"run.root={root}", *ARGS, "--nnodes", "2", "--master-addr", lan[0].addr,
              "--master-port", str(port), "train.timeout_s=20", "--node-rank", str(rank), ns=lan[rank].ns, env=env)


@pytest.mark.slow
@pytest.mark.timeout(4 * JOB_TIMEOUT_S)
def test_a_third_host_reads_the_store_but_cannot_join_or_plant_a_plan_or_an_address(
    lan: Any, compiled: Path, one_node: dict[int, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """A stranger on the job's segment reaches the master port: it reads every key the store
    holds (no secret among them), knocks on a worker's listener (closed before any handshake:
    not an address of the job's hosts), and plants a plan and an address, each refused by name;
    the job trains the same weights when left alone and never trains what was planted."""
    import base64

    h0, h1, h2 = lan
    gate = tmp_path / "gate"

    # 1. reads everything, knocks on rank 1's listener while it waits unpublished; the job finishes
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(compiled, a)
    procs = [node(lan, a, 29500, 0), node(lan, b, 29500, 1, env={sockets.LISTEN_GATE_ENV: str(gate)})]
    try:
        reader = stranger(h2, "dump", h0.addr, "29500", "pd/transport/host/1")
        values = stranger_says(reader)
        assert_no_secret_in(values)
        listening = Path(f"{gate}.rank1")
        deadline_s = time.monotonic() + JOB_TIMEOUT_S
        while not listening.exists() and time.monotonic() < deadline_s:
            time.sleep(0.05)
        address, port = json.loads(listening.read_text())["tcp"]  # rank 1's listener for rank 0, unpublished
        assert address == h1.addr
        knock = stranger(h2, "hello", h1.addr, str(port))
        assert stranger_says(knock) == {"connected": True}
    finally:
        gate.touch()
    (code0, err0), (code1, err1) = finish(*procs)
    assert (code0, code1) == (0, 0), err0 + err1
    assert stranger_says(knock) == {"received": ""}  # closed without even a challenge
    assert_same_weights(final_weights(a, [0]) | final_weights(b, [1]), one_node)
    log1 = (b / "mh" / "train" / "rank1.log").read_text()
    assert re.search(rf"refused a connection from {re.escape(h2.addr)}:\d+: not the address of a rank it awaits", log1), log1

    # 2. a forged plan: node 0 publishes its listing, the stranger replaces it, node 1 refuses it
    a, b = tmp_path / "a2", tmp_path / "b2"
    shutil.copytree(compiled, a)
    node0 = node(lan, a, 29501, 0)
    values = stranger_says(stranger(h2, "dump", h0.addr, "29501", "/pd/listing"))
    assert_no_secret_in(values)
    listing_key = only_key(values, "/pd/listing")
    signed = base64.b64decode(values[listing_key])
    listing = json.loads(signed[32:])
    listing["artifacts"]["plan.json"]["sha256"] = "0" * 64  # the stranger's plan, under node 0's MAC
    planted = stranger(h2, "set", h0.addr, "29501", listing_key, base64.b64encode(signed[:32] + json.dumps(listing).encode()).decode())
    assert stranger_says(planted) == {"set": listing_key}
    node1 = node(lan, b, 29501, 1)
    (code1, err1), (code0, err0) = finish(node1, node0)
    assert code1 == 2, err1
    assert f"node 0's ({h0.addr}:29501) plan and stages: 'listing' in the job's store is not signed" in err1, err1
    assert not (b / "mh" / "plan.json").exists() and not (b / "mh" / "stages").exists()
    assert not (b / "mh" / "train").exists()  # no worker started on node 1
    assert code0 == 2 and "node 1 of the job stopped before training: node 0's" in err0, err0  # at once, not at a timeout

    # 3. a forged address: rank 1 waits unpublished, the stranger plants its own listener as rank 1's
    a, b = tmp_path / "a3", tmp_path / "b3"
    shutil.copytree(compiled, a)
    gate = tmp_path / "gate3"
    procs = [node(lan, a, 29502, 0), node(lan, b, 29502, 1, env={sockets.LISTEN_GATE_ENV: str(gate)})]
    trap = stranger(h2, "listen", h2.addr, "30")
    try:
        values = stranger_says(stranger(h2, "dump", h0.addr, "29502", "pd/transport/host/1"))
        assert_no_secret_in(values)
        addr_key = only_key(values, "pd/transport/host/1")[:-len("host/1")] + "addr/1"
        trap_port = stranger_says(trap)["port"]
        forged = json.dumps({"unix": None, "tcp": [h2.addr, trap_port]}).encode()
        planted = stranger(h2, "set", h0.addr, "29502", addr_key, base64.b64encode(b"\0" * 32 + forged).decode())
        assert stranger_says(planted) == {"set": addr_key}
        (code0, err0), = finish(procs[0])
    finally:
        gate.touch()
    (code1, err1), = finish(procs[1])
    assert code0 != 0 and code1 != 0
    assert "'pd/transport/addr/1' in the job's store is not signed with this job's secret" in err0, err0
    assert stranger_says(trap) == {"connections": 0}  # nobody dialled the planted address
    assert processes_mentioning(str(tmp_path)) == []

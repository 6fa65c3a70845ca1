"""Several hosts: one rendezvous id, one plan (node 0's), peers that prove themselves.

In-process first (a HashStore stands for the job's rendezvous store, threads for ranks),
then real jobs (marked slow): two nodes on this host with separate run directories, two
network namespaces joined by a veth pair (root only), and strangers racing the set-up.
"""

from __future__ import annotations

import json
import socket
import threading
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
    return {rel: p.read_bytes() for name in share.SHARED for rel, p in share.artifact_files(run, name).items()}


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
    with pytest.raises(UserError, match=r"node 0 \(n0:1\) did not share its plan within 0.1 s"):
        share.receive(HashStore(), RunDir(tmp_path / "d"), cfg, "n0:1", 0.1)


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


def test_a_listener_without_the_secret_is_not_trusted() -> None:
    a, b = socket.socketpair()
    b.sendall(handshake.CHALLENGE.pack(handshake.MAGIC, b"n" * 16) + b"\0" * 32)  # answers without proof
    with pytest.raises(handshake.Refused, match="did not prove it belongs to this job"):
        handshake.prove_to_listener(a, b"s" * 32, 0, 1)
    a.close()
    b.close()
    store = HashStore()
    assert handshake.job_secret(store) == handshake.job_secret(store)  # the first worker's, for everyone

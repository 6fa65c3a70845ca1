"""What a run exposes: socket messages bounded by the manifest's layouts, the one-host rendezvous.

In-process only (socket pairs, one rendezvous store): no worker processes.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import torch

from pdcli.errors import UserError
from pdcli.runtime import sockets
from pdcli.runtime.comm import message_tag, tag_kind
from pdcli.runtime.launcher import LOCAL_RDZV_BACKEND, Hosts, launch_config
from pdcli.runtime.rendezvous import DEFAULT_MASTER_PORT, NODES_RDZV_BACKEND
from pdcli.runtime.sockets import HEADER, BadMessageError, SocketTransport, _Peer
from pdcli.runtime.stageio import StageIO
from pdcli.testing.toy import ToyNet, write_toy_stages


@pytest.fixture
def allocated(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of every payload buffer the socket readers allocate during the test."""
    sizes: list[int] = []
    real = sockets._payload
    monkeypatch.setattr(sockets, "_payload", lambda n: sizes.append(n) or real(n))
    return sizes


def test_each_peer_may_send_one_size_per_message_kind_fixed_by_the_manifest(tmp_path: Path) -> None:
    manifest = write_toy_stages(tmp_path, ToyNet(4), microbatch_size=2)
    s0, s2 = StageIO.from_manifest(manifest, 0), StageIO.from_manifest(manifest, 2)
    assert s2.recv_bytes() == {0: {"activation": s2.acts_in[0].num_bytes}, 1: {"activation": s2.acts_in[1].num_bytes},
                               3: {"gradient": s2.grads_in[3].num_bytes}}  # a skip edge 0 -> 2 included
    assert s0.recv_bytes() == {k: {"gradient": s0.grads_in[k].num_bytes} for k in (1, 2)}
    assert all(tag_kind(message_tag(kind, mb)) == kind for kind in ("activation", "gradient") for mb in (0, 5, 1 << 21))
    assert tag_kind(-1) is None and tag_kind(2 << 29) is None


@pytest.mark.parametrize("tag, nbytes, refusal", [
    (6, 1 << 60, "rank 0 sent a activation message (tag 6) of 1152921504606846976 bytes; the manifest's layout fixes 48 bytes"),
    (6, 49, "(tag 6) of 49 bytes; the manifest's layout fixes 48 bytes"),
    (7, 48, "rank 0 sent a gradient message (tag 7, 48 bytes); the manifest has it send this rank activation messages of 48 bytes"),
    ((1 << 64) - 1, 48, "a message with a tag pd never makes (tag 18446744073709551615, 48 bytes)"),
])
def test_a_header_no_receive_can_take_is_refused_before_anything_is_allocated(
    allocated: list[int], tag: int, nbytes: int, refusal: str
) -> None:
    """Over a real socket pair: a well-formed message, then a header that announces a size (or
    a kind, or a tag) the manifest does not give this peer; refused, naming the peer rank."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    receiver = SocketTransport({0: _Peer(0, b, {"activation": 48})}, timeout_s=5)
    good = torch.arange(48, dtype=torch.uint8)
    a.sendall(HEADER.pack(4, 48) + bytes(good.numpy()))  # an activation message, not posted yet: the manifest's size
    _filed(receiver.peers[0], 4)
    got = torch.empty(48, dtype=torch.uint8)
    receiver.irecv(got, 0, tag=4).wait()
    assert torch.equal(got, good) and allocated == [48]
    a.sendall(HEADER.pack(tag, nbytes) + b"x" * 48)
    with pytest.raises(BadMessageError, match=r"^refused: .*" + re.escape(refusal)):
        receiver.irecv(torch.empty(48, dtype=torch.uint8), 0, tag=10).wait()
    assert allocated == [48]  # nothing for the refused header
    a.close()
    receiver.close()


def _filed(peer: _Peer, tag: int) -> None:
    """Wait (5 s at most) until the reader has filed a message for `tag`."""
    with peer.cond:
        assert peer.cond.wait_for(lambda: tag in peer.inbox, timeout=5)


def test_a_message_for_a_posted_receive_is_read_into_its_buffer(allocated: list[int]) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    receiver = SocketTransport({0: _Peer(0, b, {"activation": 48})}, timeout_s=5)
    got = torch.zeros(12, dtype=torch.float32)  # the receive's buffer, of any dtype: its bytes are filled
    pending = receiver.irecv(got, 0, tag=4)
    sent = torch.arange(12, dtype=torch.float32)
    a.sendall(HEADER.pack(4, 48) + bytes(sent.view(torch.uint8).numpy()))
    _filed(receiver.peers[0], 4)
    assert receiver.peers[0].inbox[4].data_ptr() == got.data_ptr() and allocated == []  # no buffer of its own
    pending.wait()
    assert torch.equal(got, sent)
    a.close()
    receiver.close()


def test_a_receive_posted_after_its_message_was_checked_keeps_the_stream_framed(allocated: list[int]) -> None:
    """A receive of another size posted between the header's check (by the manifest's sizes) and
    the read of its bytes: the bytes go to a buffer of the checked size, the stream stays framed
    and that receive refuses the message."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    peer = _Peer(0, b, {"activation": [48, 64]})
    receiver = SocketTransport({0: peer}, timeout_s=5)
    checked = peer._refusal
    late: list = []

    def check_then_post(tag: int, nbytes: int) -> str | None:
        refusal = checked(tag, nbytes)
        if tag == 4:
            late.append(receiver.irecv(torch.empty(64, dtype=torch.uint8), 0, tag=4))
        return refusal

    peer._refusal = check_then_post  # type: ignore[method-assign]
    a.sendall(HEADER.pack(4, 48) + bytes(48) + HEADER.pack(6, 64) + bytes(range(64)))
    _filed(peer, 4)
    with pytest.raises(ValueError, match="48 bytes, expected 64"):
        late[0].wait()
    _filed(peer, 6)  # read before any receive for it is posted: into a buffer of its own
    got = torch.empty(64, dtype=torch.uint8)
    receiver.irecv(got, 0, tag=6).wait()  # the next message is read whole: the stream is still framed
    assert bytes(got.numpy()) == bytes(range(64)) and allocated == [48, 64]
    a.close()
    receiver.close()


def test_a_posted_receive_fixes_the_size_of_its_message(allocated: list[int]) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    receiver = SocketTransport({0: _Peer(0, b, {"gradient": 2})}, timeout_s=5)
    pending = receiver.irecv(torch.empty(3, dtype=torch.uint8), 0, tag=9)  # posted for 3 bytes, not the manifest's 2
    a.sendall(HEADER.pack(9, 1 << 40))
    with pytest.raises(BadMessageError, match=r"rank 0 sent a gradient message \(tag 9\) of 1099511627776 bytes; "
                                              r"the receive posted for it fixes 3 bytes"):
        pending.wait()
    assert allocated == []
    a.close()
    receiver.close()


def test_without_manifest_sizes_a_message_waits_unread_for_its_receive(allocated: list[int]) -> None:
    """A peer made without `expected_bytes` (e.g. the profiler's ping-pong) reads a header's
    payload only once a receive for its tag is posted, into the posted buffer."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    receiver = SocketTransport({0: _Peer(0, b)}, timeout_s=5)
    a.sendall(HEADER.pack(5, 3) + b"abc")
    assert allocated == [] and not receiver.peers[0].inbox  # no receive says how much to accept yet
    got = torch.empty(3, dtype=torch.uint8)
    receiver.irecv(got, 0, tag=5).wait()
    assert bytes(got.numpy()) == b"abc" and allocated == []
    a.sendall(HEADER.pack(7, 1 << 50))
    with pytest.raises(BadMessageError, match=r"of 1125899906842624 bytes; the receive posted for it fixes 3 bytes"):
        receiver.irecv(torch.empty(3, dtype=torch.uint8), 0, tag=7).wait()
    assert allocated == []
    a.close()
    receiver.close()


def test_a_tag_that_is_already_waiting_is_refused() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    receiver = SocketTransport({0: _Peer(0, b, {"gradient": 2})}, timeout_s=5)
    a.sendall((HEADER.pack(9, 2) + b"ab") * 2)  # nobody takes the first before the second comes
    with pytest.raises(BadMessageError, match="rank 0 sent a second gradient message with tag 9"):
        receiver.irecv(torch.empty(2, dtype=torch.uint8), 0, tag=11).wait()
    a.close()
    receiver.close()


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) of the TCP sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, _, hex_port = fields[1].partition(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_a_one_host_rendezvous_listens_on_localhost_only(tmp_path: Path) -> None:
    """torch's TCPStore listens on every interface whatever address it is given; pd's must not."""
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux's /proc/net/tcp to see where a socket listens")
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    config = launch_config(1, Hosts(), tmp_path, rdzv_timeout_s=10)
    assert config.rdzv_backend == LOCAL_RDZV_BACKEND and config.rdzv_endpoint == "127.0.0.1:0"
    params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
                                  min_nodes=1, max_nodes=1, **config.rdzv_configs)
    info = rendezvous_handler_registry.create_handler(params).next_rendezvous()
    port = info.bootstrap_store_info.master_port
    assert info.bootstrap_store_info.master_addr == "127.0.0.1" and port > 0  # what the workers are told
    assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only: not 0.0.0.0, not ::
    info.store.set("k", "v")
    assert info.store.get("k") == b"v"
    # an explicit --master-port that is taken: a user error naming it
    params = RendezvousParameters(backend=LOCAL_RDZV_BACKEND, endpoint=f"127.0.0.1:{port}", run_id="again",
                                  min_nodes=1, max_nodes=1, rank=0, timeout=10)
    with pytest.raises(UserError, match=f"--master-port {port}: cannot listen on 127.0.0.1:{port}"):
        rendezvous_handler_registry.create_handler(params).next_rendezvous()
    # several hosts: the store node 0 opened on the given address, under the job's id
    multi = launch_config(4, Hosts(nnodes=2, node_rank=1, master_addr="10.0.0.1"), tmp_path, 10, run_id="pd-x")
    assert (multi.rdzv_backend, multi.rdzv_endpoint, multi.rdzv_configs["rank"], multi.run_id) == (
        NODES_RDZV_BACKEND, f"10.0.0.1:{DEFAULT_MASTER_PORT}", 1, "pd-x")


def test_an_error_naming_a_remote_peers_address_gets_a_note_naming_the_rank() -> None:
    """gloo names the far end of a failed collective by address only; the worker's report then
    names the rank too (`naming_remote_peers`). A peer on this host, another address, or an address
    that merely starts alike is not named."""
    from pdcli.runtime.session import naming_remote_peers

    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
    transport = SocketTransport({1: _Peer(1, pairs[0][0], address="10.213.182.2"), 2: _Peer(2, pairs[1][0]),
                                 3: _Peer(3, pairs[2][0], address="10.213.182.21")}, timeout_s=5)
    try:
        gloo = "[../gloo/transport/tcp/pair.cc:537] Read error [10.213.182.2]:60112: Connection reset by peer."
        assert transport.remote_peers_in(gloo) == ["rank 1 (10.213.182.2)"]
        assert transport.remote_peers_in("Read error [10.213.182.21]:1: Connection reset") == ["rank 3 (10.213.182.21)"]
        assert transport.remote_peers_in("Read error [10.213.182.3]:1") == []
        with pytest.raises(RuntimeError) as raised, naming_remote_peers(transport):
            raise RuntimeError(gloo)
        assert raised.value.__notes__ == ["that address is rank 1 (10.213.182.2)"]
        with pytest.raises(RuntimeError) as raised, naming_remote_peers(transport):
            raise RuntimeError("an error with no address in it")
        assert not getattr(raised.value, "__notes__", [])
    finally:
        transport.close()
        for a, b in pairs:
            a.close()
            b.close()

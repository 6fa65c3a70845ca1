"""A same-host transport: Unix domain sockets between the ranks that talk, behind `Transport`.

Why: on this machine a gloo send/recv costs ~1.5 ms per message while a local socket moves
32 KiB in ~15 us (see DESIGN.md "Runtime"). Each connected peer gets one reader thread that
pulls framed messages (tag, byte count, bytes) off the socket as they arrive, so a receive
posted ahead completes in the background; a send is a `sendmsg` from the compute thread
(the kernel buffers it; a reader on the other side drains it continuously).

Only for ranks on one host; `socket_transport_possible` says when it applies. The
connection set-up uses the default process group's barrier, so every rank must call
`SocketTransport.connect` collectively.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time
from typing import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

HEADER = struct.Struct("<QQ")  # tag, payload bytes
RANK_HELLO = struct.Struct("<Q")
GIL_SWITCH_INTERVAL_S = 0.0005
TRANSPORT_ENV = "PD_TRANSPORT"  # "socket" (default on one host) or "gloo"


class PeerClosedError(ConnectionError):
    """A peer's socket closed mid-run: that worker probably died."""


def socket_transport_possible() -> bool:
    """True when every rank runs on this host (torchrun's LOCAL_WORLD_SIZE == WORLD_SIZE)."""
    return os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE") and os.name == "posix"


def _address(rank: int) -> str:
    # Linux abstract namespace: nothing on disk; unique per job through the rendezvous port.
    job = f"{os.environ.get('MASTER_PORT', '0')}-{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    return f"\0pd-{job}-{rank}"


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view`; False on a clean end of stream before any byte."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise PeerClosedError("socket closed in the middle of a message")
        got += n
    return True


class _Peer:
    """One connection: a reader thread files arriving messages under their tag."""

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.inbox: dict[int, Tensor] = {}
        self.cond = threading.Condition()
        self.error: str | None = None
        self.closing = False
        self.thread = threading.Thread(target=self._read, name=f"pd-recv-{rank}", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        header = bytearray(HEADER.size)
        try:
            while _recv_exact(self.sock, memoryview(header)):
                tag, nbytes = HEADER.unpack(header)
                payload = torch.empty(nbytes, dtype=torch.uint8)
                if nbytes:
                    _recv_exact(self.sock, memoryview(payload.numpy()))
                with self.cond:
                    self.inbox[tag] = payload
                    self.cond.notify_all()
            reason = "closed its connection"
        except OSError as e:
            reason = f"connection error: {e}"
        with self.cond:
            if not self.closing:
                self.error = f"rank {self.rank} {reason} (that worker probably died)"
            self.cond.notify_all()

    def take(self, tag: int, timeout_s: float) -> Tensor:
        deadline_s = time.monotonic() + timeout_s
        with self.cond:
            while tag not in self.inbox:
                if self.error is not None:
                    raise PeerClosedError(self.error)
                left_s = deadline_s - time.monotonic()
                if left_s <= 0:
                    raise TimeoutError(f"timed out after {timeout_s:g} s waiting for a message from rank {self.rank}")
                self.cond.wait(left_s)
            return self.inbox.pop(tag)


class _Done:
    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class _Recv:
    def __init__(self, peer: _Peer, buf: Tensor, tag: int, timeout_s: float) -> None:
        self.peer, self.buf, self.tag, self.timeout_s = peer, buf, tag, timeout_s

    def wait(self) -> None:
        data = self.peer.take(self.tag, self.timeout_s)
        if data.numel() != self.buf.numel():
            raise ValueError(f"message from rank {self.peer.rank}: {data.numel()} bytes, expected {self.buf.numel()}")
        self.buf.copy_(data)

    def is_completed(self) -> bool:
        with self.peer.cond:
            return self.tag in self.peer.inbox


class SocketTransport:
    """`Transport` over Unix domain sockets to `peers` (CPU tensors only)."""

    def __init__(self, peers: dict[int, _Peer], timeout_s: float) -> None:
        self.peers = peers
        self.timeout_s = timeout_s

    @staticmethod
    def connect(rank: int, world_size: int, peer_ranks: Iterable[int], timeout_s: float) -> "SocketTransport":
        """Collective: listen, barrier, connect to higher peers, accept lower ones."""
        wanted = sorted(set(peer_ranks) - {rank})
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(_address(rank))
        listener.listen(max(1, world_size))
        dist.barrier()  # every rank listens before anyone connects
        peers: dict[int, _Peer] = {}
        for other in (r for r in wanted if r > rank):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(_address(other))
            s.sendall(RANK_HELLO.pack(rank))
            peers[other] = _Peer(other, s)
        for _ in (r for r in wanted if r < rank):
            s, _addr = listener.accept()
            hello = bytearray(RANK_HELLO.size)
            _recv_exact(s, memoryview(hello))
            (other,) = RANK_HELLO.unpack(hello)
            peers[int(other)] = _Peer(int(other), s)
        listener.close()
        # A reader thread needs the GIL to file a message; the default 5 ms switch interval
        # would add up to 5 ms to a receive that arrives while the compute thread runs Python.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        return SocketTransport(peers, timeout_s)

    def _peer(self, rank: int) -> _Peer:
        if rank not in self.peers:
            raise KeyError(f"no socket to rank {rank}; connected: {sorted(self.peers)}")
        return self.peers[rank]

    def isend(self, buf: Tensor, dst_rank: int, tag: int) -> _Done:
        peer = self._peer(dst_rank)
        payload = memoryview(buf.contiguous().numpy())
        header = HEADER.pack(tag, buf.numel())
        sent = peer.sock.sendmsg([header, payload])
        total = HEADER.size + len(payload)
        if sent < total:  # a large message: the kernel took part of it; send the rest
            if sent < HEADER.size:
                peer.sock.sendall(header[sent:])
                sent = HEADER.size
            peer.sock.sendall(payload[sent - HEADER.size :])
        return _Done()

    def irecv(self, buf: Tensor, src_rank: int, tag: int) -> _Recv:
        return _Recv(self._peer(src_rank), buf, tag, self.timeout_s)

    def close(self) -> None:
        for peer in self.peers.values():
            with peer.cond:
                peer.closing = True
            try:
                peer.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            peer.sock.close()

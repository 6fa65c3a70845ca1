"""A same-host transport: Unix domain sockets between the ranks that talk, behind `Transport`.

Why: on this machine a gloo send/recv costs ~1.5 ms per message while a local socket moves
32 KiB in ~15 us (see DESIGN.md "Runtime"). Each connected peer gets one reader thread that
pulls framed messages (tag, byte count, bytes) off the socket as they arrive, so a receive
posted ahead completes in the background. Each peer also gets one writer thread: `isend`
queues the message and returns at once. A message larger than the socket buffer (212 KB
by default; a 256 x 1024 fp32 activation is 1 MB) cannot leave before the peer's reader
thread gets a core to drain it; with both cores computing, that blocked the compute
thread 2.5-4 ms per send on the 2-stage runtime benchmark.

Only for ranks on one host; `socket_transport_possible` says when it applies. The
connection set-up uses the default process group's barrier, so every rank must call
`SocketTransport.connect` collectively.
"""

from __future__ import annotations

import os
import queue
import socket
import struct
import sys
import threading
import time
from typing import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from pdcli.config.schema import TRANSPORTS
from pdcli.errors import UserError
from pdcli.runtime.comm import tag_kind

HEADER = struct.Struct("<QQ")  # tag, payload bytes
RANK_HELLO = struct.Struct("<Q")
GIL_SWITCH_INTERVAL_S = 0.0005
TRANSPORT_ENV = "PD_TRANSPORT"  # "socket" (default on one host) or "gloo"


class PeerClosedError(ConnectionError):
    """A peer's socket closed mid-run: that worker probably died."""


class BadMessageError(ConnectionError):
    """A peer sent a header no posted receive can take (size, kind or tag): refused unread."""


def transport_from_env(env: Mapping[str, str]) -> str | None:
    """`PD_TRANSPORT` when set (it overrides `train.transport`), else None; UserError when it
    is not a transport. The launcher asks before any worker starts."""
    value = env.get(TRANSPORT_ENV, "").strip()
    if not value:
        return None
    if value not in TRANSPORTS:
        raise UserError(f"environment variable {TRANSPORT_ENV}={value!r} is not one of {', '.join(TRANSPORTS)}",
                        hint=f"unset {TRANSPORT_ENV} (train.transport then decides) or set it to {' or '.join(TRANSPORTS)}")
    return value


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


def _payload(nbytes: int) -> Tensor:
    """The buffer a checked header's bytes are read into."""
    return torch.empty(nbytes, dtype=torch.uint8)


class _Peer:
    """One connection: a reader thread files arriving messages under their tag.

    The reader never allocates what a header merely announces. A message must have the size
    of the receive posted for its tag (`post`); one that arrives before its receive is posted
    must have the size `expected_bytes` fixes for its kind (message kind -> bytes, from the
    manifest's layouts: `StageIO.recv_bytes`), or, without `expected_bytes`, waits unread in
    the socket until its receive is posted. A header of another size, of a kind this peer
    never sends, or for a tag already waiting is refused before anything is allocated, and
    the connection is read no further (its byte stream can no longer be framed).
    """

    def __init__(self, rank: int, sock: socket.socket, expected_bytes: Mapping[str, int] | None = None) -> None:
        self.rank = rank
        self.sock = sock
        self.expected_bytes = None if expected_bytes is None else dict(expected_bytes)
        self.posted: dict[int, int] = {}
        """Tag -> bytes of the receive posted for it and not yet taken."""
        self.refused = False
        self.inbox: dict[int, Tensor] = {}
        self.cond = threading.Condition()
        self.error: str | None = None
        self.closing = False
        self.send_error: str | None = None
        self.outbox: queue.SimpleQueue[tuple[list[memoryview | bytes], "_Sent"] | None] = queue.SimpleQueue()
        self.writing = threading.Lock()
        """Held while bytes go into the socket: one message at a time, in order."""
        self.queued = 0
        """Messages handed to the writer thread and not yet written (under `writing`)."""
        self.thread = threading.Thread(target=self._read, name=f"pd-recv-{rank}", daemon=True)
        self.thread.start()
        self.writer = threading.Thread(target=self._write, name=f"pd-send-{rank}", daemon=True)
        self.writer.start()

    def _write(self) -> None:
        """Send queued messages in order; after a failure, fail every later one at once."""
        while (item := self.outbox.get()) is not None:
            parts, sent = item
            with self.writing:
                self.queued -= 1
                if self.send_error is None:
                    try:
                        for part in parts:
                            self.sock.sendall(part)  # releases the GIL while the kernel waits for the peer
                    except OSError as e:
                        self.send_error = f"rank {self.rank}: send failed ({e}; that worker probably died)"
            sent.done(self.send_error)

    def _send_now(self, parts: list[memoryview | bytes]) -> list[memoryview | bytes]:
        """Write what the socket buffer takes without waiting; the rest of `parts` (under `writing`)."""
        left = [memoryview(p).cast("B") for p in parts]
        while left:
            try:
                n = self.sock.send(left[0], socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            left[0] = left[0][n:]
            if not len(left[0]):
                left.pop(0)
        return list(left)

    def send(self, parts: list[memoryview | bytes], keep_alive: Tensor) -> "_Sent":
        """Queue a message. When nothing is queued before it, the calling thread writes what the
        socket buffer takes at once: a message handed to the writer thread leaves only once that
        thread gets the GIL from a computing thread (measured: a p90 of 1.5 ms in flight
        instead of 0.15 ms on the 2-stage quickstart)."""
        if self.send_error is not None:
            raise PeerClosedError(self.send_error)
        sent = _Sent(keep_alive)
        if self.writing.acquire(blocking=False):
            try:
                if self.queued == 0:
                    try:
                        parts = self._send_now(parts)
                    except OSError as e:
                        self.send_error = f"rank {self.rank}: send failed ({e}; that worker probably died)"
                        sent.done(self.send_error)
                        return sent
                    if not parts:
                        sent.done(None)
                        return sent
                self.queued += 1
                self.outbox.put((parts, sent))
            finally:
                self.writing.release()
            return sent
        with self.writing:  # the writer thread is writing: queue behind it
            self.queued += 1
            self.outbox.put((parts, sent))
        return sent

    def post(self, tag: int, nbytes: int) -> None:
        """A receive of `nbytes` is posted for `tag`: the size its message must have."""
        with self.cond:
            self.posted[tag] = nbytes
            self.cond.notify_all()

    def _refusal(self, tag: int, nbytes: int) -> str | None:
        """Why a header cannot be taken (None: it can), decided before any allocation."""
        kind = tag_kind(tag)
        what = f"{kind} message" if kind else "message with a tag pd never makes"
        with self.cond:
            if tag in self.inbox:
                return f"rank {self.rank} sent a second {what} with tag {tag} before the first was taken"
            while tag not in self.posted and self.expected_bytes is None:  # nothing else to go by: wait
                if self.closing:
                    raise PeerClosedError("closing while a message waited for its receive")
                self.cond.wait()
            if tag in self.posted:
                expected, by = self.posted[tag], "the receive posted for it"
            else:
                assert self.expected_bytes is not None
                if kind is None or kind not in self.expected_bytes:
                    sends = ", ".join(f"{k} messages of {n} bytes" for k, n in sorted(self.expected_bytes.items()))
                    return (f"rank {self.rank} sent a {what} (tag {tag}, {nbytes} bytes); the manifest has it "
                            f"send this rank {sends or 'nothing'}")
                expected, by = self.expected_bytes[kind], "the manifest's layout"
        if nbytes != expected:
            return f"rank {self.rank} sent a {what} (tag {tag}) of {nbytes} bytes; {by} fixes {expected} bytes"
        return None

    def _read(self) -> None:
        header = bytearray(HEADER.size)
        refusal = None
        try:
            while _recv_exact(self.sock, memoryview(header)):
                tag, nbytes = HEADER.unpack(header)
                refusal = self._refusal(tag, nbytes)
                if refusal is not None:
                    break
                payload = _payload(nbytes)
                if nbytes:
                    _recv_exact(self.sock, memoryview(payload.numpy()))
                with self.cond:
                    self.inbox[tag] = payload
                    self.cond.notify_all()
            reason = "closed its connection"
        except OSError as e:
            reason = f"connection error: {e}"
        if refusal is not None:
            try:
                self.sock.shutdown(socket.SHUT_RD)  # the peer's later sends fail instead of piling up
            except OSError:
                pass
        with self.cond:
            if refusal is not None:
                self.error, self.refused = f"refused: {refusal} (a stale or foreign stages/ directory, or not a pd worker)", True
            elif not self.closing:
                self.error = f"rank {self.rank} {reason} (that worker probably died)"
            self.cond.notify_all()

    def take(self, tag: int, timeout_s: float) -> Tensor:
        deadline_s = time.monotonic() + timeout_s
        with self.cond:
            while tag not in self.inbox:
                if self.error is not None:
                    raise (BadMessageError if self.refused else PeerClosedError)(self.error)
                left_s = deadline_s - time.monotonic()
                if left_s <= 0:
                    raise TimeoutError(f"timed out after {timeout_s:g} s waiting for a message from rank {self.rank}")
                self.cond.wait(left_s)
            self.posted.pop(tag, None)
            return self.inbox.pop(tag)


class _Sent:
    """A queued send: complete once the writer thread has handed all its bytes to the kernel."""

    def __init__(self, keep_alive: Tensor) -> None:
        self.buf: Tensor | None = keep_alive  # the bytes must live until they are sent
        self.event = threading.Event()
        self.error: str | None = None

    def done(self, error: str | None) -> None:
        self.error, self.buf = error, None
        self.event.set()

    def wait(self) -> None:
        self.event.wait()  # the writer always finishes an item: sent, or failed at once
        if self.error is not None:
            raise PeerClosedError(self.error)

    def is_completed(self) -> bool:
        return self.event.is_set()


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

    stream_ordered = False  # a reader thread per peer files messages by tag, in any order

    def __init__(self, peers: dict[int, _Peer], timeout_s: float) -> None:
        self.peers = peers
        self.timeout_s = timeout_s

    @staticmethod
    def connect(rank: int, world_size: int, peer_ranks: Iterable[int], timeout_s: float,
                expected_bytes: Mapping[int, Mapping[str, int]]) -> "SocketTransport":
        """Collective: listen, barrier, connect to higher peers, accept lower ones.

        `expected_bytes`: peer rank -> message kind -> bytes this rank receives from it (a
        peer it only sends to is absent: nothing from it is accepted)."""
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
            peers[other] = _Peer(other, s, expected_bytes.get(other, {}))
        lower = [r for r in wanted if r < rank]
        for _ in lower:
            s, _addr = listener.accept()
            hello = bytearray(RANK_HELLO.size)
            _recv_exact(s, memoryview(hello))
            (other,) = RANK_HELLO.unpack(hello)
            if other not in lower or other in peers:
                s.close()
                raise BadMessageError(f"rank {rank}: a connection introduced itself as rank {other}; "
                                      f"expected one of {[r for r in lower if r not in peers]}")
            peers[int(other)] = _Peer(int(other), s, expected_bytes.get(int(other), {}))
        listener.close()
        # A reader thread needs the GIL to file a message; the default 5 ms switch interval
        # would add up to 5 ms to a receive that arrives while the compute thread runs Python.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        return SocketTransport(peers, timeout_s)

    def _peer(self, rank: int) -> _Peer:
        if rank not in self.peers:
            raise KeyError(f"no socket to rank {rank}; connected: {sorted(self.peers)}")
        return self.peers[rank]

    def isend(self, buf: Tensor, dst_rank: int, tag: int) -> _Sent:
        payload = buf.contiguous()
        return self._peer(dst_rank).send([HEADER.pack(tag, payload.numel()), memoryview(payload.numpy())], payload)

    def irecv(self, buf: Tensor, src_rank: int, tag: int) -> _Recv:
        peer = self._peer(src_rank)
        peer.post(tag, buf.numel() * buf.element_size())
        return _Recv(peer, buf, tag, self.timeout_s)

    def close(self) -> None:
        for peer in self.peers.values():
            peer.outbox.put(None)  # the writer finishes what is queued, then stops
            peer.writer.join(timeout=self.timeout_s)
            with peer.cond:
                peer.closing = True
                peer.cond.notify_all()  # a reader waiting for a receive to be posted stops
            try:
                peer.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            peer.sock.close()

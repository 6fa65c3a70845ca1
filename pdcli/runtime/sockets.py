"""The socket transport: a stream socket between each two ranks that talk, behind `Transport`.

Why: a gloo send/recv pays a large fixed cost per message, a local socket a small one.
Each connected peer gets one reader thread that pulls framed messages (tag, byte count,
bytes) off the socket as they arrive, so a receive posted ahead completes in the background.
Each peer also gets one writer thread: `isend` queues the message and returns at once. A
message larger than the socket buffer (212 KB by default; a 256 x 1024 fp32 activation is
1 MB) cannot leave before the peer's reader thread gets a core to drain it, and blocks the
sending thread until then when every core is computing.

Between ranks of one host (one network namespace) the socket is an abstract Unix socket;
between hosts, TCP on the interface that reaches the rendezvous host. Every connection
starts with a handshake that proves both ends hold the job's secret (`handshake.py`); the
set-up goes through the job's rendezvous store, so the ranks that talk call
`SocketTransport.connect` together.
"""

from __future__ import annotations

import ipaddress
import json
import os
import queue
import re
import secrets
import selectors
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor

from pdcli.config.schema import TRANSPORTS
from pdcli.errors import UserError
from pdcli.runtime import handshake
from pdcli.runtime.comm import tag_kind
from pdcli.runtime.signed import SignedStore, worker_store

HEADER = struct.Struct("<QQ")  # tag, payload bytes
GIL_SWITCH_INTERVAL_S = 0.0005
TRANSPORT_ENV = "PD_TRANSPORT"  # "socket" (default on CPU) or "gloo"
LISTEN_GATE_ENV = "PD_TEST_LISTEN_GATE"
STORE_PREFIX = "pd/transport"


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
    """True where Linux's abstract Unix sockets exist (between hosts the transport uses TCP)."""
    return sys.platform.startswith("linux")


@dataclass(frozen=True)
class Place:
    """Where a worker is: who shares its network namespace, and its address for other hosts."""

    host_id: str
    """Equal for workers that reach each other through an abstract Unix socket (`host.network_host_id`)."""
    address: str
    """This worker's address on the interface that reaches the rendezvous host (`host.reach_address`)."""


def listen_gate(timeout_s: float, rank: int, addresses: Mapping[str, Any]) -> None:
    """Tests only: with `LISTEN_GATE_ENV=<path>`, write this rank's listeners' `addresses` to
    `<path>.rank<rank>` and wait (at most `timeout_s`) with them open and not yet published until
    `<path>` exists, so a test's stranger connects first."""
    gate = os.environ.get(LISTEN_GATE_ENV)
    if gate:
        with open(f"{gate}.rank{rank}.tmp", "w") as f:
            json.dump(addresses, f)
        os.replace(f"{gate}.rank{rank}.tmp", f"{gate}.rank{rank}")
    deadline_s = time.monotonic() + timeout_s
    while gate and not os.path.exists(gate) and time.monotonic() < deadline_s:
        time.sleep(0.01)


def _dial(address: str | tuple[str, int], timeout_s: float, source: str | None = None) -> socket.socket:
    """A connection to a listener: an abstract Unix name (this host) or (host, port) over TCP,
    from this host's `source` address where given (the one published for it: the listener
    drops connections from addresses of no awaited peer, `_Acceptor`)."""
    if isinstance(address, str):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout_s)
        s.connect("\0" + address)
        return s
    bound = (source, 0) if source is not None and _same_family(source, address[0]) else None
    s = socket.create_connection(address, timeout=timeout_s, source_address=bound)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a message is one write: send it now
    return s


def _same_family(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a).version == ipaddress.ip_address(b).version
    except ValueError:  # a host name: let the kernel choose
        return False


def canonical_ip(address: str) -> str:
    """`address` as the listener sees it: IPv4 inside an IPv4-mapped IPv6 address unwrapped,
    a name kept as it is."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)


MAX_PENDING_HANDSHAKES = 16
"""Handshakes a listener runs at once; a connection past them is closed at once (its connector,
if it is a real peer, dials again: `_dial_and_prove`)."""
HANDSHAKE_TIMEOUT_S = 5.0
"""The most a connection may take to answer the challenge (at most the transport's timeout)."""


def _dial_and_prove(address: str | tuple[str, int], secret: bytes, rank: int, listener_rank: int,
                    timeout_s: float, source: str | None = None) -> socket.socket:
    """A proven connection to `listener_rank`'s listener, dialled again while the listener closes
    it before its challenge (busy with MAX_PENDING_HANDSHAKES others: strangers flooding it), up
    to `timeout_s`; a listener that answers without the job's proof is Refused at once."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        s = _dial(address, max(deadline_s - time.monotonic(), 0.1), source)
        try:
            handshake.prove_to_listener(s, secret, rank, listener_rank)
        except handshake.Refused as e:
            s.close()
            if not isinstance(e, handshake.ClosedEarly) or time.monotonic() >= deadline_s:
                raise
            time.sleep(0.05)
            continue
        except BaseException:
            s.close()
            raise
        s.settimeout(None)
        return s


class _Acceptor:
    """The listening side of `SocketTransport.connect`: a thread accepts connections, closes at
    once a TCP connection from an address that is none of the awaited peers' (`peer_addresses`,
    as each published it), runs at most MAX_PENDING_HANDSHAKES handshakes at once (each within
    HANDSHAKE_TIMEOUT_S), and keeps the proven connections by rank. A listener per kind of peer
    awaited: an abstract Unix socket with a random name for this host's, TCP on `address` (port
    chosen by the OS) for other hosts'."""

    def __init__(self, rank: int, secret: bytes, wanted: set[int], same_host: Mapping[int, bool], address: str,
                 timeout_s: float, log: Callable[[str], None], peer_addresses: Iterable[str] = ()) -> None:
        self.rank, self.secret, self.wanted, self.timeout_s, self.log = rank, secret, set(wanted), timeout_s, log
        self.peer_addresses = {canonical_ip(a) for a in peer_addresses}
        self.listeners: list[socket.socket] = []
        self.addresses: dict[str, Any] = {"unix": None, "tcp": None}
        if any(same_host.values()):
            name = f"pd-{secrets.token_hex(8)}-r{rank}"  # abstract namespace: nothing on disk
            self.listeners.append(self._listen(socket.AF_UNIX, "\0" + name))
            self.addresses["unix"] = name
        if not all(same_host.values()):
            family = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0][0]
            tcp = self._listen(family, (address, 0))
            self.addresses["tcp"] = [address, tcp.getsockname()[1]]
            self.listeners.append(tcp)
        self.accepted: dict[int, tuple[socket.socket, str]] = {}
        self.refusals: list[str] = []
        self.cond = threading.Condition()
        self.closed = False
        self.pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self.thread = threading.Thread(target=self._accept, name="pd-accept", daemon=True)

    def _listen(self, family: int, address: Any) -> socket.socket:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.bind(address)
        s.listen(socket.SOMAXCONN)
        return s

    def start(self) -> None:
        if self.wanted:
            self.thread.start()

    def _accept(self) -> None:
        with selectors.DefaultSelector() as selector:
            for listener in self.listeners:
                selector.register(listener, selectors.EVENT_READ)
            while not self.closed:
                for key, _ in selector.select(timeout=0.1):
                    try:
                        conn, peer = key.fileobj.accept()  # type: ignore[union-attr]
                    except OSError:
                        continue
                    if isinstance(peer, tuple) and canonical_ip(str(peer[0])) not in self.peer_addresses:
                        conn.close()
                        self._refused(f"{peer[0]}:{peer[1]}: not the address of a rank it awaits, closed at once")
                        continue
                    if not self.pending.acquire(blocking=False):
                        where = _describe_connection(conn, peer)  # while it is open: its peer's pid, over a Unix socket
                        conn.close()
                        self._refused(f"{where}: over the {MAX_PENDING_HANDSHAKES} handshakes pending, closed at once")
                        continue
                    threading.Thread(target=self._check, args=(conn, peer), name="pd-handshake", daemon=True).start()

    def _refused(self, why: str) -> None:
        message = f"rank {self.rank}: refused a connection from {why}"
        with self.cond:
            self.refusals.append(message)
        self.log(message)

    def _check(self, conn: socket.socket, peer: Any) -> None:
        try:
            self._prove(conn, peer)
        finally:
            self.pending.release()

    def _prove(self, conn: socket.socket, peer: Any) -> None:
        where = _describe_connection(conn, peer)
        try:
            conn.settimeout(min(self.timeout_s, HANDSHAKE_TIMEOUT_S))
            with self.cond:
                awaited = self.wanted - set(self.accepted)
            other = handshake.check_connector(conn, self.secret, self.rank, awaited)
            conn.settimeout(None)
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (handshake.Refused, OSError) as e:
            conn.close()
            self._refused(f"{where}: {e}")
            return
        with self.cond:
            if other in self.accepted:  # two proven connections for one rank: keep the first
                conn.close()
                return
            self.accepted[other] = (conn, str(peer[0]) if isinstance(peer, tuple) else "this host")
            self.cond.notify_all()

    def result(self) -> dict[int, tuple[socket.socket, str]]:
        """Every awaited rank's connection, once each proved itself (TimeoutError after `timeout_s`)."""
        deadline_s = time.monotonic() + self.timeout_s
        with self.cond:
            while set(self.accepted) != self.wanted:
                left_s = deadline_s - time.monotonic()
                if left_s <= 0:
                    missing = sorted(self.wanted - set(self.accepted))
                    raise TimeoutError(f"rank {self.rank}: ranks {missing} did not connect within {self.timeout_s:g} s"
                                       + (f" ({len(self.refusals)} connections refused)" if self.refusals else ""))
                self.cond.wait(left_s)
            return dict(self.accepted)

    def close(self) -> None:
        """Stop listening: later connections are refused by the kernel."""
        self.closed = True
        if self.thread.is_alive():
            self.thread.join()
        for listener in self.listeners:
            listener.close()


def _describe_connection(conn: socket.socket, peer: Any) -> str:
    """`10.0.0.7:40112`, or for a Unix socket the process that connected (pid, uid)."""
    if conn.family == socket.AF_UNIX:
        creds = struct.Struct("3i")
        try:
            pid, uid, _ = creds.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, creds.size))
            return f"pid {pid} (uid {uid}) on this host"
        except OSError:
            return "a process on this host"
    return f"{peer[0]}:{peer[1]}"


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

    def __init__(self, rank: int, sock: socket.socket, expected_bytes: Mapping[str, int | Iterable[int]] | None = None,
                 address: str | None = None) -> None:
        self.rank = rank
        self.address = address
        """Its address when it is on another host (None: on this one)."""
        self.name = f"rank {rank}" if address is None else f"rank {rank} ({address})"
        """How messages name the peer: `rank r`, with its address when it is on another host."""
        self.sock = sock
        self.expected_bytes = None if expected_bytes is None else {
            kind: frozenset([n]) if isinstance(n, int) else frozenset(n) for kind, n in expected_bytes.items()}
        """Message kind -> the sizes its messages may have (several: virtual stages, one per chunk)."""
        self.posted: dict[int, Tensor] = {}
        """Tag -> the buffer of the receive posted for it and not yet taken: its size is the
        size the message must have, and a message that arrives after it is read straight into it."""
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
                        self.send_error = f"{self.name}: send failed ({e}; that worker probably died)"
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
        if self.writing.acquire(blocking=False):
            try:
                if self.queued == 0:
                    try:
                        parts = self._send_now(parts)
                    except OSError as e:
                        self.send_error = f"{self.name}: send failed ({e}; that worker probably died)"
                        return _Sent.finished(self.send_error)
                    if not parts:
                        return _Sent.finished(None)
                sent = _Sent(keep_alive)
                self.queued += 1
                self.outbox.put((parts, sent))
            finally:
                self.writing.release()
            return sent
        sent = _Sent(keep_alive)
        with self.writing:  # the writer thread is writing: queue behind it
            self.queued += 1
            self.outbox.put((parts, sent))
        return sent

    def post(self, tag: int, buf: Tensor) -> None:
        """A receive into `buf` (contiguous bytes) is posted for `tag`: its size is the size the message must have."""
        with self.cond:
            self.posted[tag] = buf
            self.cond.notify_all()

    def _refusal(self, tag: int, nbytes: int) -> str | None:
        """Why a header cannot be taken (None: it can), decided before any allocation."""
        kind = tag_kind(tag)
        what = f"{kind} message" if kind else "message with a tag pd never makes"
        with self.cond:
            if tag in self.inbox:
                return f"{self.name} sent a second {what} with tag {tag} before the first was taken"
            while tag not in self.posted and self.expected_bytes is None:  # nothing else to go by: wait
                if self.closing:
                    raise PeerClosedError("closing while a message waited for its receive")
                self.cond.wait()
            if tag in self.posted:
                expected, by = self.posted[tag].numel(), "the receive posted for it"
            else:
                assert self.expected_bytes is not None
                if kind is None or kind not in self.expected_bytes:
                    sends = ", ".join(f"{k} messages of {' or '.join(map(str, sorted(n)))} bytes"
                                      for k, n in sorted(self.expected_bytes.items()))
                    return (f"{self.name} sent a {what} (tag {tag}, {nbytes} bytes); the manifest has it "
                            f"send this rank {sends or 'nothing'}")
                sizes = self.expected_bytes[kind]
                if nbytes not in sizes:
                    return (f"{self.name} sent a {what} (tag {tag}) of {nbytes} bytes; the manifest's layout "
                            f"fixes {' or '.join(map(str, sorted(sizes)))} bytes")
                return None
        if nbytes != expected:
            return f"{self.name} sent a {what} (tag {tag}) of {nbytes} bytes; {by} fixes {expected} bytes"
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
                with self.cond:
                    posted = self.posted.get(tag)
                # a posted receive's own buffer, if it has the size checked above (a receive posted
                # since the check may not: its wait then refuses the message), else a new one
                payload = posted if posted is not None and posted.numel() == nbytes else _payload(nbytes)
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
                self.error = f"{self.name} {reason} (that worker probably died)"
            self.cond.notify_all()

    def take(self, tag: int, timeout_s: float) -> Tensor:
        deadline_s = time.monotonic() + timeout_s
        with self.cond:
            while tag not in self.inbox:
                if self.error is not None:
                    raise (BadMessageError if self.refused else PeerClosedError)(self.error)
                left_s = deadline_s - time.monotonic()
                if left_s <= 0:
                    raise TimeoutError(f"timed out after {timeout_s:g} s waiting for a message from {self.name}")
                self.cond.wait(left_s)
            self.posted.pop(tag, None)
            return self.inbox.pop(tag)


class _Sent:
    """A queued send: complete once the writer thread has handed all its bytes to the kernel."""

    def __init__(self, keep_alive: Tensor | None, queued: bool = True) -> None:
        self.buf = keep_alive  # the bytes must live until they are sent
        self.event = threading.Event() if queued else None
        """None: complete from the start (`finished`)."""
        self.error: str | None = None

    @staticmethod
    def finished(error: str | None) -> "_Sent":
        """A send the calling thread completed itself (written whole, or failed)."""
        sent = _Sent(None, queued=False)
        sent.error = error
        return sent

    def done(self, error: str | None) -> None:
        self.error, self.buf = error, None
        assert self.event is not None, "a finished send is never queued"
        self.event.set()

    def wait(self) -> None:
        if self.event is not None:
            self.event.wait()  # the writer always finishes an item: sent, or failed at once
        if self.error is not None:
            raise PeerClosedError(self.error)

    def is_completed(self) -> bool:
        return self.event is None or self.event.is_set()


class _Recv:
    """A posted receive into `buf` (the receive's bytes)."""

    def __init__(self, peer: _Peer, buf: Tensor, tag: int, timeout_s: float) -> None:
        self.peer, self.buf, self.tag, self.timeout_s = peer, buf, tag, timeout_s

    def wait(self) -> None:
        data = self.peer.take(self.tag, self.timeout_s)
        if data is self.buf:
            return  # read straight into the posted buffer
        if data.numel() != self.buf.numel():
            raise ValueError(f"message from rank {self.peer.rank}: {data.numel()} bytes, expected {self.buf.numel()}")
        self.buf.copy_(data)

    def is_completed(self) -> bool:
        with self.peer.cond:
            return self.tag in self.peer.inbox


class SocketTransport:
    """`Transport` over Unix domain sockets to `peers` (CPU tensors only)."""

    stream_ordered = False  # a reader thread per peer files messages by tag, in any order

    def __init__(self, peers: dict[int, _Peer], timeout_s: float, refusals: list[str] | None = None) -> None:
        self.peers = peers
        self.timeout_s = timeout_s
        self.refusals = refusals or []
        """Connections refused while connecting (strangers), as logged."""

    @staticmethod
    def connect(rank: int, peer_ranks: Iterable[int], timeout_s: float, expected_bytes: Mapping[int, Mapping[str, int | Iterable[int]]],
                store: Any, place: Place, log: Callable[[str], None] = lambda _: None) -> "SocketTransport":
        """Collective over `peer_ranks`, through the job's rendezvous `store`: connect to the
        higher peers, accept the lower ones, each proving it holds the job's secret.

        A peer on this host (same `Place.host_id`) is reached through an abstract Unix socket,
        a peer on another host over TCP at the address of the interface that reaches it
        (`Place.address`), dialling from its own. Listeners have random names and ports,
        published in the store signed with the job's secret (`pdcli.runtime.signed`), as is
        each rank's place; a TCP connection from an address that is no awaited rank's is closed
        at once, and one that does not prove to be an awaited rank is refused; both are passed to `log`, and
        the listener goes on waiting for the real peer. `expected_bytes`: peer rank -> message
        kind -> bytes this rank receives from it (a peer it only sends to is absent: nothing
        from it is accepted)."""
        if not isinstance(store, SignedStore):
            store = worker_store(store)  # addresses only a peer wrote
        secret = store.secret
        wanted = sorted(set(peer_ranks) - {rank})
        store.set(f"{STORE_PREFIX}/host/{rank}", json.dumps([place.host_id, place.address]))
        places = {r: Place(*json.loads(store.get(f"{STORE_PREFIX}/host/{r}"))) for r in wanted}
        hosts = {r: places[r].host_id for r in wanted}
        lower = {r for r in wanted if r < rank}
        acceptor = _Acceptor(rank, secret, lower, {r: hosts[r] == place.host_id for r in lower}, place.address, timeout_s, log,
                             peer_addresses=[places[r].address for r in lower if hosts[r] != place.host_id])
        listen_gate(timeout_s, rank, acceptor.addresses)
        store.set(f"{STORE_PREFIX}/addr/{rank}", json.dumps(acceptor.addresses))
        acceptor.start()
        peers: dict[int, _Peer] = {}
        try:
            for other in (r for r in wanted if r > rank):
                addresses = json.loads(store.get(f"{STORE_PREFIX}/addr/{other}"))
                local = hosts[other] == place.host_id
                s = _dial_and_prove(addresses["unix"] if local else tuple(addresses["tcp"]), secret, rank, other, timeout_s,
                                    None if local else place.address)
                peers[other] = _Peer(other, s, expected_bytes.get(other, {}), None if local else addresses["tcp"][0])
            for other, (s, address) in acceptor.result().items():
                peers[other] = _Peer(other, s, expected_bytes.get(other, {}), None if hosts[other] == place.host_id else address)
        finally:
            acceptor.close()
        # A reader thread needs the GIL to file a message; the default 5 ms switch interval
        # would add up to 5 ms to a receive that arrives while the compute thread runs Python.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        return SocketTransport(peers, timeout_s, acceptor.refusals)

    def describe(self) -> str:
        """`rank 1 over a Unix socket, rank 2 (10.0.0.2) over TCP`: who is reached how."""
        return ", ".join(f"{p.name} over {'a Unix socket' if p.sock.family == socket.AF_UNIX else 'TCP'}"
                         for _, p in sorted(self.peers.items()))

    def remote_peers_in(self, text: str) -> list[str]:
        """The names of the peers on other hosts whose address `text` mentions: gloo's errors name
        the far end of a failed collective by its address only."""
        return [p.name for _, p in sorted(self.peers.items())
                if p.address is not None and re.search(rf"(?<![\w.]){re.escape(p.address)}(?!\w|\.\w)", text)]

    def _peer(self, rank: int) -> _Peer:
        if rank not in self.peers:
            raise KeyError(f"no socket to rank {rank}; connected: {sorted(self.peers)}")
        return self.peers[rank]

    def isend(self, buf: Tensor, dst_rank: int, tag: int) -> _Sent:
        payload = buf.contiguous()
        return self._peer(dst_rank).send([HEADER.pack(tag, payload.numel()), memoryview(payload.numpy())], payload)

    def irecv(self, buf: Tensor, src_rank: int, tag: int) -> _Recv:
        peer = self._peer(src_rank)
        raw = buf.view(-1).view(torch.uint8)  # the bytes the reader fills: `buf` must be contiguous
        peer.post(tag, raw)
        return _Recv(peer, raw, tag, self.timeout_s)

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

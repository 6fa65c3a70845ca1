"""Proof on connect: a socket between two workers carries messages only once both ends
showed they hold the job's secret.

The secret is 32 random bytes the first worker to ask puts in the job's rendezvous store
(`job_secret`); every worker of the job reads the same. The listener speaks first:

    listener  -> connector   MAGIC, listener's nonce (16 bytes)
    connector -> listener    claimed rank, connector's nonce, HMAC(secret, "hello" | listener nonce | claimed rank | listener rank)
    listener  -> connector   HMAC(secret, "accept" | connector nonce | listener rank | claimed rank)

Every field has a fixed size, so nothing a stranger announces is ever allocated. The
listener takes a connection as rank r only with r's proof for this very challenge (a
replayed hello fails: the nonce is new), and the connector takes the listener's answer
only with the listener's proof (nobody else listening at that address passes). Digests
are compared with `hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
from typing import Protocol

MAGIC = b"pd-hs-v1"
NONCE_BYTES = 16
SECRET_BYTES = 32
CHALLENGE = struct.Struct(f"<{len(MAGIC)}s{NONCE_BYTES}s")
HELLO = struct.Struct(f"<Q{NONCE_BYTES}s32s")
ACCEPT = struct.Struct("<32s")
RANKS = struct.Struct("<QQ")
SECRET_KEY = "pd/transport/secret"


class Refused(ConnectionError):
    """A handshake that did not prove the other end belongs to this job."""


class KeyStore(Protocol):
    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...


def job_secret(store: KeyStore) -> bytes:
    """The job's secret: set once by the first worker that asks, the same for every worker."""
    mine = secrets.token_hex(SECRET_BYTES)
    return bytes.fromhex(store.compare_set(SECRET_KEY, "", mine).decode())


def _mac(secret: bytes, label: bytes, nonce: bytes, first: int, second: int) -> bytes:
    return hmac.new(secret, label + nonce + RANKS.pack(first, second), hashlib.sha256).digest()


def _read(sock: socket.socket, size: int, what: str) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise Refused(f"the connection closed during the handshake, {len(data)} of the {size} bytes of {what} read")
        data += chunk
    return bytes(data)


def prove_to_listener(sock: socket.socket, secret: bytes, rank: int, listener_rank: int) -> None:
    """Connector's side: answer the listener's challenge as `rank`, then check its proof."""
    magic, their_nonce = CHALLENGE.unpack(_read(sock, CHALLENGE.size, "the challenge"))
    if magic != MAGIC:
        raise Refused(f"the listener of rank {listener_rank} does not speak pd's handshake")
    my_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(HELLO.pack(rank, my_nonce, _mac(secret, b"hello", their_nonce, rank, listener_rank)))
    (proof,) = ACCEPT.unpack(_read(sock, ACCEPT.size, "the listener's proof"))
    if not hmac.compare_digest(proof, _mac(secret, b"accept", my_nonce, listener_rank, rank)):
        raise Refused(f"the listener at rank {listener_rank}'s address did not prove it belongs to this job")


def check_connector(sock: socket.socket, secret: bytes, rank: int, wanted: set[int]) -> int:
    """Listener's side: challenge the connection; its rank once it proved to be one of `wanted`."""
    my_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(CHALLENGE.pack(MAGIC, my_nonce))
    claimed, their_nonce, proof = HELLO.unpack(_read(sock, HELLO.size, "the hello"))
    if not hmac.compare_digest(proof, _mac(secret, b"hello", my_nonce, claimed, rank)):
        raise Refused(f"it claimed rank {claimed} without this job's proof")
    if claimed not in wanted:
        raise Refused(f"it proved to be rank {claimed}, which is not awaited here (awaited: {sorted(wanted)})")
    sock.sendall(ACCEPT.pack(_mac(secret, b"accept", their_nonce, rank, claimed)))
    return int(claimed)

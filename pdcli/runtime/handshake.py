"""Proof on connect: a socket between two workers carries messages only once both ends
showed they hold the job's secret.

The secret never crosses the network (`job_secret`): on one host `pd train`'s launcher makes 32
random bytes and hands them to its workers in their environment (PD_JOB_SECRET); on several
hosts the user gives every node the same secret out of band (PD_JOB_SECRET or `pd train
--secret-file`). Only where the user said `--insecure-network` (or under torchrun on one host,
whose workers have no launcher of pd's to give them one) the first worker puts one in the job's
rendezvous store. The listener speaks first:

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
import os
import secrets
import socket
import struct
from pathlib import Path
from typing import Mapping, Protocol

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


class ClosedEarly(Refused):
    """The other end closed the connection before its part of the handshake was read."""


class KeyStore(Protocol):
    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...


SECRET_ENV = "PD_JOB_SECRET"
"""The job's secret as its workers get it (any text; its sha256 is the key): the same on every node."""
INSECURE_ENV = "PD_INSECURE_NETWORK"
"""`1`: the user accepted a secret shared through the rendezvous store (`--insecure-network`)."""


class NoSecret(RuntimeError):
    """A worker of a job on several hosts has no secret given out of band."""


def secret_key(text: str) -> bytes:
    """The HMAC key of a secret given as text (PD_JOB_SECRET, a --secret-file's contents)."""
    return hashlib.sha256(text.strip().encode()).digest()


def secret_given(env: Mapping[str, str] = os.environ) -> bool:
    """`env` holds a secret given out of band (PD_JOB_SECRET, not blank)."""
    return bool(env.get(SECRET_ENV, "").strip())


def new_secret() -> str:
    """A fresh secret for the workers of one host (`pd train`'s launcher)."""
    return secrets.token_hex(SECRET_BYTES)


def job_secret(store: KeyStore, env: Mapping[str, str] = os.environ) -> bytes:
    """The job's secret: PD_JOB_SECRET from the worker's environment, never read from the store;
    where there is none, the store's (set once by the first worker that asks) only under
    PD_INSECURE_NETWORK=1 or when every rank of the job is on this host (torchrun's
    LOCAL_WORLD_SIZE == WORLD_SIZE); else NoSecret."""
    if secret_given(env):
        return secret_key(env[SECRET_ENV])
    world = env.get("WORLD_SIZE")
    if env.get(INSECURE_ENV) == "1" or (world is not None and env.get("LOCAL_WORLD_SIZE") == world):
        return bytes.fromhex(store.compare_set(SECRET_KEY, "", new_secret()).decode())
    raise NoSecret(f"this job runs on several hosts and this worker has no secret: set {SECRET_ENV} (the same "
                   "on every node) or pass --insecure-network to share one through the rendezvous store")


def read_secret_file(path: Path) -> str:
    """A --secret-file's secret; ValueError where the file is readable by others than its owner
    (mode 0600 wanted), cannot be read, or is empty."""
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror})") from None
    if mode & 0o077:
        raise ValueError(f"{path}: readable by others than its owner (mode {mode & 0o777:o}); `chmod 600 {path}`")
    if not text.strip():
        raise ValueError(f"{path}: empty")
    return text


def _mac(secret: bytes, label: bytes, nonce: bytes, first: int, second: int) -> bytes:
    return hmac.new(secret, label + nonce + RANKS.pack(first, second), hashlib.sha256).digest()


def _read(sock: socket.socket, size: int, what: str) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ClosedEarly(f"the connection closed during the handshake, {len(data)} of the {size} bytes of {what} read")
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

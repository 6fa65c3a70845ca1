"""Values in a job's store that only the job wrote: each one signed with the job's secret.

torch's TCPStore asks nothing of a client: whoever reaches the master port can read, write
and overwrite any key. pd's own values there (node 0's listing of its plan and stages and
their bytes, the result files sent back to node 0, the workers' addresses, the plan digest)
go through a `SignedStore`: a value is stored behind an HMAC-SHA256 of the job's context,
its key and itself under the job's secret (`handshake.job_secret`; never in the store where
it was given out of band). A value read back without a valid MAC, or moved from another key,
or written by a job of another context under the same secret, raises `Forged` instead of
being used. A stranger can still delete or overwrite values, which stops the job; it cannot
make a node write or import files node 0 did not publish, or a worker dial an address its
peer did not publish.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

MAC_BYTES = hashlib.sha256().digest_size
DOMAIN = b"pd-store-value\0"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
"""A worker's job, as torch's elastic agent names it to its workers (`pd train`'s and torchrun's):
the context of the workers' signed values."""


class Forged(ValueError):
    """A value in the job's store that the job's secret did not sign."""


class SignedStore:
    """`store` (a torch.distributed Store) with every value signed under `secret`. `context`
    names the job (its rendezvous id), so a value signed for another job under the same
    secret is refused too."""

    def __init__(self, store: Any, secret: bytes, context: str) -> None:
        if not secret:
            raise ValueError("a SignedStore needs the job's secret")
        self.store = store
        self.secret = secret
        """The job's secret: the socket transport's handshake proves it too."""
        self._context = context.encode()

    def _mac(self, key: str, value: bytes) -> bytes:
        message = DOMAIN + self._context + b"\0" + key.encode() + b"\0" + value
        return hmac.new(self.secret, message, hashlib.sha256).digest()

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.store.set(key, self._mac(key, data) + data)

    def get(self, key: str) -> bytes:
        """The value under `key`; Forged when it does not carry this job's MAC for that key."""
        raw = bytes(self.store.get(key))
        mac, data = raw[:MAC_BYTES], raw[MAC_BYTES:]
        if len(raw) < MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, data)):
            raise Forged(f"{key!r} in the job's store is not signed with this job's secret")
        return data

    def check(self, keys: list[str]) -> bool:
        """Every key of `keys` is in the store (their values unread: `get` checks those)."""
        return bool(self.store.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.store.wait(keys)
        else:
            self.store.wait(keys, timeout)


def worker_store(store: Any, env: Mapping[str, str] = os.environ) -> SignedStore:
    """A worker's signed view of its job's rendezvous `store`: the job's secret
    (`handshake.job_secret`) and the job its elastic agent names (`RUN_ID_ENV`) as the context.
    A worker builds it once and hands it to whatever reads or writes pd's values there."""
    from pdcli.runtime.handshake import job_secret

    return SignedStore(store, job_secret(store, env), env.get(RUN_ID_ENV, ""))

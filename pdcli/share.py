"""One plan for a job on several hosts: node 0's profile, plan and stages, sent to the others.

Node 0 profiles, plans and compiles as on one host, then publishes through the job's store
what it made: its resolved config (without `run.*`, which names a directory on each host)
and, per artifact, its manifest record and the hash and bytes of every file. Another node
checks that its own config is the same, keeps an artifact whose files already hash alike,
and writes node 0's bytes in place of any other (atomically, registered in its manifest
under node 0's record). So two hosts never train two plans, and the other nodes neither
profile nor plan: their measurements would differ from node 0's, and they would wait for
the slowest profile. Artifacts larger than MAX_SENT_BYTES in all are not sent (the store
holds them in memory): then a node whose files differ is told to copy node 0's run directory.
`Job.share` hands these functions a `pdcli.runtime.signed.SignedStore`: every value they put
is signed with the job's secret, and one a stranger wrote is refused as it is read.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from pdcli.config.schema import Config
from pdcli.errors import UserError
from pdcli.rundir import RunDir, atomic_write_bytes, replace_dir, sha256_bytes, temp_dir_beside

SHARED = ("profile.json", "plan.json", "stages")
"""The artifacts a job's nodes share, in the order they are made."""
MAX_SENT_BYTES = 256 << 20
LISTING_KEY = "listing"
STORE_PIECE_BYTES = 4 << 20
"""The largest value pd puts in a store: torch's TCPStore (libuv backend) resets a client that
sends a value over 8 MiB, so a file goes in pieces (`put_bytes`)."""


class Store(Protocol):
    """What this module needs of a torch.distributed store."""

    def set(self, key: str, value: str | bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


def put_bytes(store: Store, key: str, data: bytes) -> None:
    """`data` under `key` in pieces of at most STORE_PIECE_BYTES (`key#0`, `key#1`, ...); the
    reader takes its length from elsewhere (`get_bytes`)."""
    for k in range(max(1, -(-len(data) // STORE_PIECE_BYTES))):
        store.set(f"{key}#{k}", data[k * STORE_PIECE_BYTES:(k + 1) * STORE_PIECE_BYTES])


def get_bytes(store: Store, key: str, size: int) -> bytes:
    """The `size` bytes `put_bytes` put under `key`; ValueError when the pieces do not add up to
    `size` (the count comes from `size`, never from what the store holds)."""
    pieces = []
    for k in range(max(1, -(-size // STORE_PIECE_BYTES))):
        piece = store.get(f"{key}#{k}")
        if len(piece) > STORE_PIECE_BYTES:
            raise ValueError(f"{key}: a piece of {len(piece)} bytes, over {STORE_PIECE_BYTES}")
        pieces.append(piece)
    data = b"".join(pieces)
    if len(data) != size:
        raise ValueError(f"{key}: {len(data)} bytes arrived, {size} were listed")
    return data


def copy_command(run_dir: Path) -> str:
    """The command that copies node 0's run directory to this host."""
    return f"rsync -a NODE0:{run_dir}/ {run_dir}/"


def config_items(cfg: Config) -> dict[str, str]:
    """The resolved config as `key -> value` lines, `run.*` left out (a directory per host)."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = json.dumps(value, sort_keys=True, default=str)

    walk("", {k: v for k, v in dataclasses.asdict(cfg).items() if k != "run"})
    return flat


def publish(store: Store, run: RunDir, cfg: Config) -> None:
    """Node 0: the config and the artifacts of `run` for the other nodes (the listing last,
    so a node that sees it finds every file it names)."""
    artifacts: dict[str, Any] = {}
    files = {name: run.artifact_files(name) for name in SHARED}
    total_bytes = sum(p.stat().st_size for fs in files.values() for p in fs.values())
    sent = total_bytes <= MAX_SENT_BYTES
    for name in SHARED:
        record = run.verify(name)
        hashes, sizes = {}, {}
        for rel, path in files[name].items():
            data = path.read_bytes()
            hashes[rel], sizes[rel] = sha256_bytes(data), len(data)
            if sent:
                put_bytes(store, f"file/{rel}", data)
        artifacts[name] = {"sha256": record.sha256, "inputs_hash": record.inputs_hash, "files": hashes, "sizes": sizes}
    listing = {"config": config_items(cfg), "artifacts": artifacts, "sent": sent, "bytes": total_bytes}
    store.set(LISTING_KEY, json.dumps(listing))


def publish_failure(store: Store, message: str) -> None:
    """Node 0 could not make the artifacts: the other nodes stop with its message."""
    store.set(LISTING_KEY, json.dumps({"failed": message}))


def receive(store: Store, run: RunDir, cfg: Config, node0: str, timeout_s: float) -> list[str]:
    """Another node: check the config against node 0's, then make `run`'s artifacts node 0's.
    Returns the artifacts whose bytes were written (the others already matched)."""
    hint = "see node 0's output: it profiles, plans and compiles before the other nodes can start"
    try:
        store.wait([LISTING_KEY], timedelta(seconds=timeout_s))
    except RuntimeError as e:  # DistStoreError (timed out) or DistNetworkError (node 0 went away)
        went_away = type(e).__name__ == "DistNetworkError"
        raise UserError(f"node 0 ({node0}) " + ("went away before sharing its plan" if went_away else
                                                 f"did not share its plan within {timeout_s:g} s ({type(e).__name__})"),
                        hint=hint) from None
    listing = json.loads(store.get(LISTING_KEY))
    if "failed" in listing:
        raise UserError(f"node 0 ({node0}) stopped before sharing its plan: {listing['failed']}",
                        hint="fix that on node 0, then start every node again")
    _check_config(config_items(cfg), listing["config"], run, node0)
    written = []
    for name in SHARED:
        theirs = listing["artifacts"][name]
        mine = run.record(name)
        if mine is not None and mine.sha256 == theirs["sha256"] and run.content_hash(name) == theirs["sha256"]:
            continue
        if not listing["sent"]:
            raise UserError(
                f"{run / name} differs from node 0's ({node0}), and node 0's artifacts ({listing['bytes']} bytes) "
                f"are too large to send through the rendezvous store",
                hint=f"copy node 0's run directory here first: {copy_command(run.path)}")
        _write(store, run, name, theirs)
        written.append(name)
    return written


def _check_config(mine: dict[str, str], theirs: dict[str, str], run: RunDir, node0: str) -> None:
    differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if differ:
        shown = ", ".join(f"{k}={mine.get(k, '(unset)')} here, {theirs.get(k, '(unset)')} on node 0" for k in differ[:5])
        more = f" and {len(differ) - 5} more" if len(differ) > 5 else ""
        raise UserError(f"{run / 'config.yaml'} differs from node 0's ({node0}): {shown}{more}",
                        hint="pass the same recipe and overrides on every node (run.name and run.root may differ)")


def _write(store: Store, run: RunDir, name: str, theirs: dict[str, Any]) -> None:
    """Node 0's files of artifact `name` into `run`, atomically, each checked against its hash."""

    def fetch(rel: str) -> bytes:
        data = get_bytes(store, f"file/{rel}", int(theirs["sizes"][rel]))
        if sha256_bytes(data) != theirs["files"][rel]:
            raise RuntimeError(f"node 0's {rel} arrived with another hash")  # a bug, not a user error
        return data

    run.create()
    if name in theirs["files"]:  # a file
        atomic_write_bytes(run / name, fetch(name))
    else:
        tmp = temp_dir_beside(run / name)
        try:
            for rel in theirs["files"]:
                path = tmp / Path(rel).relative_to(name)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(fetch(rel))
            replace_dir(tmp, run / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    if run.register(name, theirs["inputs_hash"]).sha256 != theirs["sha256"]:
        raise RuntimeError(f"{run / name}: written from node 0's files but hashes otherwise")


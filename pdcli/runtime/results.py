"""A job's summary, metrics and trace sent to node 0 from the node whose last stage wrote them.

On several hosts the last stage's first replica writes `train/summary.json`, `metrics.jsonl`
and `trace.json` on its own host. After that node's workers end, its `pd train` puts the
files' bytes in the job's store (node 0's, under the job's prefix, the store node 0's `pd
train` serves), then a listing of their sizes and SHA-256 hashes. Node 0 waits for the listing
up to `train.timeout_s`, takes a file only when it is listed at most MAX_RESULT_BYTES and
arrives with that size and hash (the summary must be a JSON object too), and writes each
atomically under its own name: nothing read from the store names a path. `Job` passes a
`pdcli.runtime.signed.SignedStore`, so the listing and the bytes are the other node's. A file over
MAX_RESULT_BYTES is left on its node and said so (the summary over it: none are taken).
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

from pdcli.rundir import atomic_write_bytes, sha256_bytes
from pdcli.runtime.metrics import METRICS_FILE, SUMMARY_FILE, TRACE_FILE
from pdcli.share import Store, get_bytes, put_bytes

RESULT_FILES = (METRICS_FILE, TRACE_FILE, SUMMARY_FILE)
"""What node 0 gets, in the order it writes them: the summary last, as what says the run finished."""
MAX_RESULT_BYTES = 64 << 20
"""The largest file node 0 takes through the store (each; the store holds it in memory)."""
LISTING_KEY = "results/listing"
FILE_KEY = "results/file/"


class ResultsNotReceived(Exception):
    """Node 0 did not get the summary: the message says why and where the files are."""


def publish_results(store: Store, train_dir: Path, node: int) -> list[str]:
    """The node that wrote them: its result files for node 0 (the listing last). Returns the
    files left out (over MAX_RESULT_BYTES)."""
    files: dict[str, Any] = {}
    left_out = []
    for name in RESULT_FILES:
        path = train_dir / name
        if not path.exists():
            continue
        data = path.read_bytes()
        if len(data) > MAX_RESULT_BYTES:
            files[name] = {"bytes": len(data), "left_out": True}
            left_out.append(name)
            continue
        put_bytes(store, FILE_KEY + name, data)
        files[name] = {"bytes": len(data), "sha256": sha256_bytes(data)}
    store.set(LISTING_KEY, json.dumps({"node": node, "files": files}))
    return left_out


def receive_results(store: Store, train_dir: Path, node: int, timeout_s: float) -> list[str]:
    """Node 0: the result files of `node`, written into `train_dir`. Returns the files that
    node left out (over MAX_RESULT_BYTES). Raises ResultsNotReceived when they did not come
    within `timeout_s`, or came otherwise than listed."""
    where = f"node {node}'s run directory holds them"
    try:
        store.wait([LISTING_KEY], timedelta(seconds=timeout_s))
    except RuntimeError as e:  # DistStoreError (timed out) or DistNetworkError
        raise ResultsNotReceived(f"node {node} did not send the summary and metrics within {timeout_s:g} s "
                                 f"(train.timeout_s, {type(e).__name__}); {where}") from None
    try:
        listing = json.loads(store.get(LISTING_KEY))
        files = listing["files"]
        if (not isinstance(files, dict) or not all(isinstance(entry, dict) for entry in files.values())
                or int(listing["node"]) != node):
            raise ValueError("not a listing of this node's files")
    except (ValueError, KeyError, TypeError) as e:
        raise ResultsNotReceived(f"the job's store holds no listing of node {node}'s results ({e}); {where}") from None
    if SUMMARY_FILE not in files or files[SUMMARY_FILE].get("left_out"):
        size = files.get(SUMMARY_FILE, {}).get("bytes")
        raise ResultsNotReceived(f"node {node} sent no {SUMMARY_FILE}" + (f" ({size} bytes, over {MAX_RESULT_BYTES})" if size else "")
                                 + f"; {where}")
    taken: dict[str, bytes] = {}
    for name in RESULT_FILES:
        entry = files.get(name)
        if entry is None or entry.get("left_out"):
            continue
        size = int(entry.get("bytes", -1))
        if not 0 <= size <= MAX_RESULT_BYTES:
            raise ResultsNotReceived(f"node {node} listed {name} at {size} bytes (at most {MAX_RESULT_BYTES} are taken); {where}")
        try:
            data = get_bytes(store, FILE_KEY + name, size)
        except ValueError:
            data = b""
        if len(data) != size or sha256_bytes(data) != entry.get("sha256"):
            raise ResultsNotReceived(f"{name} arrived with another size or hash than node {node} listed; {where}")
        taken[name] = data
    try:
        if not isinstance(json.loads(taken[SUMMARY_FILE]), dict):
            raise ValueError("not an object")
    except ValueError as e:
        raise ResultsNotReceived(f"node {node}'s {SUMMARY_FILE} is not a JSON object ({e}); {where}") from None
    for name, data in taken.items():  # RESULT_FILES order: the summary last
        atomic_write_bytes(train_dir / name, data)
    return sorted(name for name, entry in files.items() if name in RESULT_FILES and entry.get("left_out"))

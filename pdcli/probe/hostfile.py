"""The host calibration file: what the probes measure of the machine rather than of a model,
measured once and reused by every profile on it.

Two figures describe the host, not the model: the socket transport between two of its
processes (latency, bandwidth, the sender's call; `measure_socket_transport`) and the gradient
all-reduce over gloo at each thread count a worker gets (`measure_allreduce`). They live in
`<cache>/hosts/<key digest>.json`, the key covering what changes them (hostname, CPU or GPU
model, cores, torch and Python versions, the file's schema). A file that is missing, of an
older schema, for another key or older than `profile.host_cache_max_days` is measured again
(and the profile says why); `pd profile --recalibrate` measures it again whatever its age.
Each profile copies the figures it used into `meta.runtime` and records the file and its
sha256 in `meta.host_calibration`, so a run directory stays self-contained and a plan
reproducible after the file changes.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any, Callable, Optional

from pdcli.planner.runtime_costs import Affine
from pdcli.rundir import atomic_write_json, canonical_json, sha256_bytes

HOST_SCHEMA = 1
"""Counted up when what the file holds, or how it is measured, changes."""
CACHE_DIR_ENV = "PD_CACHE_DIR"
"""Where pd keeps what it measured of this machine (default: $XDG_CACHE_HOME/pd, else ~/.cache/pd)."""
HOST_META = "host_calibration"
"""Where a profile (`meta`) records the host file it used."""
OFF = "off"
"""`profile.host_cache=off`: measure the host in every profile, keep nothing."""
DAY_S = 86400.0

Transport = tuple[float, float, Affine]
"""(latency ms, bandwidth bytes/s, the sender's `isend` call in its message bytes)."""
AllReduce = tuple[Affine, list[list[float]]]
"""(ms of an all-reduce in its gradient bytes, the (bytes, ms) points measured)."""


def cache_root(setting: str) -> Optional[Path]:
    """The directory `profile.host_cache` names: `off` -> None, a path -> it, empty ->
    $PD_CACHE_DIR, else $XDG_CACHE_HOME/pd, else ~/.cache/pd. YAML reads a bare `off` as false,
    which the config holds as "False": off too."""
    if setting in (OFF, "False", "false"):
        return None
    if setting:
        return Path(setting).expanduser()
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pd"


def host_key(device_type: str) -> dict[str, Any]:
    """What the host figures depend on."""
    import torch

    from pdcli.host import host_cores
    from pdcli.profiler.clock import cpu_model_name

    gpu = torch.cuda.get_device_name(0) if device_type == "cuda" and torch.cuda.is_available() else None
    return {"schema": HOST_SCHEMA, "hostname": socket.gethostname(), "machine": platform.machine(),
            "cpu": cpu_model_name(), "cores": host_cores(), "gpu": gpu, "torch": torch.__version__,
            "python": platform.python_version()}


def key_digest(key: dict[str, Any]) -> str:
    """The file's name: the key without its schema (a file of an older schema is found, and
    measured again)."""
    return sha256_bytes(canonical_json({k: v for k, v in key.items() if k != "schema"}).encode())[:16]


def key_changes(root: Path, key: dict[str, Any]) -> str:
    """How `key` differs from the nearest other key of a host file of this hostname under
    `root` (`torch 2.12.0 -> 2.13.0`), or "" when there is none."""
    nearest: Optional[dict[str, Any]] = None
    for path in sorted((root / "hosts").glob("*.json")) if (root / "hosts").is_dir() else []:
        try:
            other = json.loads(path.read_text()).get("key", {})
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(other, dict) and other.get("hostname") == key.get("hostname") and other != key:
            if nearest is None or _distance(other, key) < _distance(nearest, key):
                nearest = other
    if nearest is None:
        return ""
    return ", ".join(f"{k} {nearest.get(k)} -> {key.get(k)}" for k in key if nearest.get(k) != key.get(k))


def too_old(age_days: float, max_age_days: float) -> bool:
    """A figure or profile measured `age_days` ago is measured again (`profile.host_cache_max_days`;
    0: never by age)."""
    return max_age_days > 0 and age_days > max_age_days


def _distance(a: dict[str, Any], b: dict[str, Any]) -> int:
    return sum(a.get(k) != b.get(k) for k in b)


def _affine(obj: Any) -> Affine:
    return Affine(float(obj["scale"]), float(obj["fixed_ms"]))


class HostFile:
    """This host's figures: read from its file where it is fresh, measured (and written back)
    where it is not. `transport()` and `allreduce(threads)` give each figure, measuring it the
    first time this host is asked for it; `record()` is what a profile keeps of the file."""

    def __init__(self, root: Optional[Path], key: dict[str, Any], max_age_days: float = 30.0,
                 recalibrate: bool = False, now_s: Optional[float] = None) -> None:
        self.key = key
        self.path = root / "hosts" / f"{key_digest(key)}.json" if root is not None else None
        self.figures: dict[str, Any] = {}
        self.measured: list[str] = []
        self.reused: list[str] = []
        self.why = ""
        now_s = time.time() if now_s is None else now_s
        if self.path is None:
            self.why = "profile.host_cache=off: measured for this profile only"
        elif recalibrate:
            self.why = "--recalibrate: measured again"
        elif not self.path.exists():
            changed = key_changes(root, key) if root is not None else ""
            self.why = (f"the host's key changed ({changed}): measured again" if changed
                        else "no calibration of this host yet: measured once")
        else:
            self.figures, self.why, measured_at_s = self._read(self.path, key, max_age_days, now_s)
            if self.figures:
                now_s = measured_at_s  # figures added to a fresh file keep its age
        self._measured_at_s = now_s

    @staticmethod
    def _read(path: Path, key: dict[str, Any], max_age_days: float,
              now_s: float) -> tuple[dict[str, Any], str, float]:
        """(the file's figures, "", when they were measured) where it is fresh, else ({}, why it
        is measured again, now_s)."""
        try:
            obj = json.loads(path.read_text())
            file_key = obj.get("key", {})
            measured_at_s = float(obj.get("measured_at_s", 0.0))
        except (OSError, ValueError, AttributeError, TypeError) as e:
            return {}, f"{path} unreadable ({type(e).__name__}): measured again", now_s
        if not isinstance(file_key, dict) or file_key.get("schema") != HOST_SCHEMA:
            return {}, f"{path} is of another schema ({file_key.get('schema')}, now {HOST_SCHEMA}): measured again", now_s
        age_days = (now_s - measured_at_s) / DAY_S
        if too_old(age_days, max_age_days):
            return {}, (f"{path} is {age_days:.0f} days old (profile.host_cache_max_days={max_age_days:g}): "
                        "measured again"), now_s
        figures = obj.get("figures")
        return (figures if isinstance(figures, dict) else {}), "", measured_at_s

    def _figure(self, name: str, measure: Callable[[], Any]) -> Any:
        if name in self.figures:
            if name not in self.reused:
                self.reused.append(name)
            return self.figures[name]
        from pdcli.progress import current

        with current().phase(f"host: measuring {name.replace('_', ' ')} (once for this host)"):
            value = measure()
        self.figures[name] = value
        self.measured.append(name)
        self._write()
        return value

    def transport(self, measure: Callable[[], Optional[Transport]]) -> Optional[Transport]:
        """The socket transport's figures (None: it cannot run here)."""
        def measured() -> Optional[dict[str, Any]]:
            got = measure()
            return None if got is None else {"latency_ms": got[0], "bandwidth_bytes_per_s": got[1],
                                             "send_call": got[2].to_json()}
        obj = self._figure("transport", measured)
        return None if obj is None else (float(obj["latency_ms"]), float(obj["bandwidth_bytes_per_s"]),
                                         _affine(obj["send_call"]))

    def allreduce(self, threads: int, measure: Callable[[int], Optional[AllReduce]]) -> Optional[AllReduce]:
        """The all-reduce line at `threads` threads per process (None: gloo did not run)."""
        def measured() -> Optional[dict[str, Any]]:
            got = measure(threads)
            return None if got is None else {"line": got[0].to_json(), "points": got[1]}
        obj = self._figure(f"allreduce_threads_{threads}", measured)
        return None if obj is None else (_affine(obj["line"]), [list(p) for p in obj["points"]])

    def _write(self) -> None:
        if self.path is None:
            return
        atomic_write_json(self.path, {"key": self.key, "measured_at_s": self._measured_at_s, "figures": self.figures})

    def sha256(self) -> Optional[str]:
        """The file's sha256 as it is now (None: no file)."""
        if self.path is None or not self.path.exists():
            return None
        return sha256_bytes(self.path.read_bytes())

    def record(self) -> dict[str, Any]:
        """What a profile keeps of the host file (`meta.host_calibration`)."""
        return {"file": str(self.path) if self.path else None, "sha256": self.sha256(), "key": self.key,
                "reused": sorted(self.reused), "measured": sorted(self.measured), "why": self.why}

    def summary(self) -> str:
        """One line: where the host figures came from."""
        where = str(self.path) if self.path else "no host file"
        if self.measured and not self.reused:
            return f"host: {', '.join(self.measured)} measured ({self.why}) -> {where}"
        if self.measured:
            return f"host: {', '.join(self.reused)} reused, {', '.join(self.measured)} measured -> {where}"
        return f"host: {', '.join(self.reused) or 'nothing'} reused from {where}"

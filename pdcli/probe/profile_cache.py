"""This host's profiles, kept beside its host file: a run directory whose profile is missing
gets a copy of the one measured on this host for the same inputs instead of measuring again.

A profile is a function of its inputs (`pdcli.steps.profile.profile_inputs_hash`: the model,
data, optimizer, profile settings, batch, device, what the profiler measures) and of the host
that measured it; within a run directory pd already reuses it while its inputs are unchanged.
The cache extends that reuse to every run directory on the host: `<cache>/profiles/<host key
digest>/<inputs hash>.json` (the cache and host key of `pdcli.probe.hostfile`), written after
each profile is measured, read before one would be. An entry of another host key, older than
`profile.host_cache_max_days`, or unreadable is not used (the profile is measured and the entry
replaced). `profile.host_cache=off` keeps nothing; `pd profile --force` or `--recalibrate`
measures again and replaces the entry.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

from pdcli.errors import UserError
from pdcli.probe.hostfile import DAY_S, key_digest, too_old
from pdcli.rundir import atomic_write_json

PROFILES_DIR = "profiles"


def without_profiles(own: Path, root: Path) -> None:
    """Make the empty directory `own` a cache that shares `root`'s host file (`hosts/`, linked)
    and none of its profiles: the benchmarks' and the tests' runs measure their own profiles on
    the host figures already measured."""
    (root / "hosts").mkdir(parents=True, exist_ok=True)
    (own / "hosts").symlink_to(root / "hosts")


class ProfileCache:
    """The profiles measured on the host `key` under the cache `root` (None: no cache)."""

    def __init__(self, root: Optional[Path], key: dict[str, Any], max_age_days: float = 30.0,
                 now_s: Optional[float] = None) -> None:
        self.key = key
        self.dir = root / PROFILES_DIR / key_digest(key) if root is not None else None
        self.max_age_days = max_age_days
        self.now_s = time.time() if now_s is None else now_s

    def path(self, inputs_hash: str) -> Optional[Path]:
        return self.dir / f"{inputs_hash}.json" if self.dir is not None else None

    def get(self, inputs_hash: str) -> Optional[tuple[dict[str, Any], Path, float]]:
        """(the profile's JSON, its file, how many days ago it was measured) where this host
        has a fresh one for `inputs_hash`; None where it has none (or one it cannot use)."""
        path = self.path(inputs_hash)
        if path is None or not path.is_file():
            return None
        try:
            obj = json.loads(path.read_text())
            measured_at_s = float(obj["measured_at_s"])
            profile = obj["profile"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        age_days = (self.now_s - measured_at_s) / DAY_S
        if obj.get("key") != self.key or obj.get("inputs_hash") != inputs_hash or not isinstance(profile, dict):
            return None
        if too_old(age_days, self.max_age_days):
            return None
        return profile, path, age_days

    def put(self, inputs_hash: str, profile: dict[str, Any]) -> None:
        """Keep `profile`, just measured for `inputs_hash`, for the next run directory."""
        path = self.path(inputs_hash)
        if path is None:
            return
        try:
            atomic_write_json(path, {"key": self.key, "inputs_hash": inputs_hash, "measured_at_s": self.now_s,
                                     "profile": profile})
        except UserError:  # a cache that cannot be written: the run directory has its profile
            pass

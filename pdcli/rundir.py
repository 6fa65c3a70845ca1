"""Run directory: atomic artifact writes and a manifest of content and input hashes."""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from pdcli.errors import UserError

MANIFEST = "manifest.json"


def canonical_json(obj: Any) -> str:
    """Deterministic JSON text (sorted keys, fixed separators) used for hashing and artifacts."""
    return json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def hash_obj(obj: Any) -> str:
    """Hash of a JSON-able object (e.g. a config section)."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


TEMP_SUFFIX = ".tmp"
_TEMP_RANDOM = r"[a-z0-9_]{8}"  # what tempfile.mkstemp puts between prefix and suffix


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def _temp_beside(path: Path) -> tuple[int, str]:
    """A temp file in the target's directory (same filesystem, so rename is atomic), with
    ordinary permissions: mkstemp makes files 0600, which other users could not read."""
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=TEMP_SUFFIX, dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, tmp


def remove_stale_temps(path: str | os.PathLike[str]) -> list[Path]:
    """Delete what interrupted atomic writes of `path` left beside it, and return it.

    Only names `_temp_beside` makes for this very target (`.<name>.<8 random chars>.tmp`)
    in its own directory, and only those no live writer holds: `atomic_save` keeps an
    exclusive `flock` on its temp file until the rename, so a temp whose lock can be taken
    belongs to a writer that is gone (killed, crashed, out of disk)."""
    path = Path(path)
    pattern = re.compile(re.escape(_temp_prefix(path)) + _TEMP_RANDOM + re.escape(TEMP_SUFFIX))
    removed: list[Path] = []
    for candidate in path.parent.glob(glob.escape(_temp_prefix(path)) + "*" + TEMP_SUFFIX):
        if not pattern.fullmatch(candidate.name) or not candidate.is_file() or candidate.is_symlink():
            continue
        try:
            fd = os.open(candidate, os.O_RDONLY)
        except FileNotFoundError:
            continue  # its writer just renamed it into place
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a writer is still at it
        else:
            candidate.unlink(missing_ok=True)
            removed.append(candidate)
        finally:
            os.close(fd)
    return removed


def cannot_write(path: Path, error: OSError) -> UserError:
    """The user-facing form of an OSError while writing `path`."""
    reason = error.strerror or str(error)
    if isinstance(error, IsADirectoryError) or path.is_dir():
        return UserError(f"cannot write {path}: it is a directory", hint=f"give a file name inside it: {path}/<name>")
    return UserError(f"cannot write {path}: {reason}", hint="pick a location you can write to (check the path and its permissions)")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` so readers see the old file or the new one, never half of it."""

    def write(name: str) -> None:
        Path(name).write_bytes(data)

    atomic_save(path, write)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_text(path, canonical_json(obj))


def atomic_save(path: str | os.PathLike[str], save: Callable[[str], None]) -> None:
    """Atomic write for writers that want a file name (e.g. `torch.save(obj, name)`).

    Leftovers of an earlier interrupted write of the same file go first
    (`remove_stale_temps`). An OSError (no such directory, read-only, a directory in
    the way, disk full) is a UserError naming `path`."""
    path = Path(path)
    if path.is_dir():
        raise cannot_write(path, IsADirectoryError(path))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path)
        fd, tmp = _temp_beside(path)
    except OSError as e:
        raise cannot_write(path, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until the rename: a live write is never taken for a leftover
        save(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)  # the rename itself survives a crash only once the directory is synced
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise cannot_write(path, e) from None
        raise
    finally:
        os.close(fd)


def temp_dir_beside(target: Path) -> Path:
    """A new empty directory beside `target`, with the permissions of an ordinary directory
    (mkdtemp makes it owner-only), to fill and then `replace_dir` into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def replace_dir(new: Path, target: Path) -> None:
    """Move `new` to `target`, replacing an old `target` (renames only; no partial state)."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        os.replace(target, old / target.name)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_json(path: str | os.PathLike[str], what: str = "file") -> Any:
    path = Path(path)
    if not path.exists():
        raise UserError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f"{e.msg} at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else f"bytes that are not UTF-8 at {e.start}"
        raise UserError(
            f"{path}: not valid JSON ({where})",
            hint="the file is corrupt; delete it and re-run the step that makes it (or pass --force)",
        ) from None


@dataclass(frozen=True)
class ArtifactRecord:
    """What the manifest knows of one artifact: its content hash and its inputs' hash."""

    sha256: str
    inputs_hash: str


class RunDir:
    """`runs/<name>/`: artifacts plus `manifest.json` recording content and input hashes.

    A step asks `fresh(name, inputs_hash)` before redoing work: True only when the artifact
    exists, its recorded inputs hash equals `inputs_hash`, and its bytes still hash to
    what was recorded. A hand-edited or corrupt artifact is refused (UserError), not
    silently reused or overwritten.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def create(self) -> "RunDir":
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            in_the_way = next((p for p in (self.path, *self.path.parents) if p.exists() and not p.is_dir()), None)
            reason = f"{in_the_way} is a file, not a directory" if in_the_way else (e.strerror or str(e))
            raise UserError(f"cannot create the run directory {self.path}: {reason}",
                            hint="set run.root (and run.name) to a directory you can write") from None
        return self

    # -- manifest ---------------------------------------------------------------
    def _manifest(self) -> dict[str, Any]:
        """The run's manifest.json; UserError naming it where it is not one pd wrote (each
        artifact's entry a `sha256` and an `inputs_hash`, both strings)."""
        p = self.path / MANIFEST
        if not p.exists():
            return {"version": 1, "artifacts": {}}
        manifest = read_json(p, "run manifest")
        artifacts = manifest.get("artifacts") if isinstance(manifest, dict) else None
        if not isinstance(artifacts, dict) or not all(
                isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("inputs_hash"), str)
                for e in artifacts.values()):
            raise UserError(f"{p}: not a pd run manifest (each artifact needs its sha256 and inputs_hash)",
                            hint=f"delete {p}: pd then makes every artifact of {self.path} again")
        return manifest

    def record(self, name: str) -> ArtifactRecord | None:
        entry = self._manifest()["artifacts"].get(name)
        return None if entry is None else ArtifactRecord(entry["sha256"], entry["inputs_hash"])

    def register(self, name: str, inputs_hash: str) -> ArtifactRecord:
        """Record an artifact (file or directory) that is now complete on disk."""
        rec = ArtifactRecord(self.content_hash(name), inputs_hash)
        manifest = self._manifest()
        manifest["artifacts"][name] = {"sha256": rec.sha256, "inputs_hash": rec.inputs_hash}
        atomic_write_json(self.path / MANIFEST, manifest)
        return rec

    def artifact_files(self, name: str) -> dict[str, Path]:
        """Path relative to the run directory -> file, of every file artifact `name` is made
        of: the file itself, or a directory's files (hidden ones, temps, left out)."""
        target = self.path / name
        if target.is_dir():
            return {str(p.relative_to(self.path)): p for p in sorted(target.rglob("*"))
                    if p.is_file() and not p.name.startswith(".")}
        return {name: target} if target.is_file() else {}

    def content_hash(self, name: str) -> str:
        target = self.path / name
        if target.is_dir():
            h = hashlib.sha256()
            for f in self.artifact_files(name).values():
                h.update(str(f.relative_to(target)).encode())
                h.update(sha256_file(f).encode())
            return h.hexdigest()
        return sha256_file(target)

    def verify(self, name: str) -> ArtifactRecord:
        """The artifact's record, after checking its bytes; UserError if it was altered."""
        rec = self.record(name)
        target = self.path / name
        if rec is None or not target.exists():
            raise UserError(f"{target} is missing or was never completed")
        actual = self.content_hash(name)
        if actual != rec.sha256:
            raise UserError(
                f"{target} was changed after it was written (hash mismatch: recorded "
                f"{rec.sha256[:12]}, found {actual[:12]})",
                hint=f"delete it and re-run the step that makes it, or re-run that step with --force",
            )
        return rec

    def fresh(self, name: str, inputs_hash: str) -> bool:
        rec = self.record(name)
        if rec is None or not (self.path / name).exists():
            return False
        self.verify(name)
        return rec.inputs_hash == inputs_hash

    # -- convenience ------------------------------------------------------------
    def write_json(self, name: str, obj: Any, inputs_hash: str) -> ArtifactRecord:
        atomic_write_json(self.path / name, obj)
        return self.register(name, inputs_hash)

    def read_json(self, name: str) -> Any:
        self.verify(name)
        return read_json(self.path / name, name)


def artifact_inputs_hash(config_section: Mapping[str, Any], *upstream: str) -> str:
    """Hash of what made an artifact: its config section and the hashes of upstream artifacts."""
    return hash_obj({"config": dict(config_section), "upstream": list(upstream)})

"""Run directory: atomic artifact writes and a manifest of content and input hashes."""

from __future__ import annotations

import hashlib
import json
import os
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


def _temp_beside(path: Path) -> tuple[int, str]:
    """A temp file in the target's directory (same filesystem, so rename is atomic), with
    ordinary permissions: mkstemp makes files 0600, which other users could not read."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, tmp


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
    """Atomic write for writers that want a file name (e.g. `torch.save(obj, name)`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_beside(path)
    os.close(fd)
    try:
        save(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)  # the rename itself survives a crash only once the directory is synced
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_json(path: str | os.PathLike[str], what: str = "file") -> Any:
    path = Path(path)
    if not path.exists():
        raise UserError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno})",
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
        self.path.mkdir(parents=True, exist_ok=True)
        return self

    # -- manifest ---------------------------------------------------------------
    def _manifest(self) -> dict[str, Any]:
        p = self.path / MANIFEST
        if not p.exists():
            return {"version": 1, "artifacts": {}}
        return read_json(p, "run manifest")

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

    def content_hash(self, name: str) -> str:
        target = self.path / name
        if target.is_dir():
            h = hashlib.sha256()
            for f in sorted(p for p in target.rglob("*") if p.is_file() and not p.name.startswith(".")):
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

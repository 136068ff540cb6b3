"""Atomic checkpoints across ranks: a directory of per-rank files, a manifest, one rename.

Every rank writes its own file into a temporary directory beside the target;
the ranks then agree (a gather of what each wrote, or of its error); rank 0
records a manifest with each file's size and SHA-256 and renames the directory
into place. Until that rename the previous checkpoint at the path is untouched,
so a process killed during a save leaves the last good checkpoint loadable.
Overwriting a checkpoint moves the old directory aside first; should the
process die between the two renames, :func:`read_checkpoint` finds the old one.

Layout of ``path/``: ``manifest.json``, ``common.pt`` (rank 0: what every rank
shares) and ``shard-00000.pt``... (one per rank: what that rank alone holds).
The directory must be on storage every rank sees (a shared file system).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from zorse_lightning.errors import ZorseUserError

FORMAT = "zorse-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
COMMON = "common.pt"
_CHUNK_BYTES = 1 << 20

Gather = Callable[[Any], list[Any]]
"""All-gather of a picklable object over every rank (``torch.distributed.all_gather_object``)."""


class CheckpointError(ZorseUserError):
    """A checkpoint that cannot be loaded (incomplete, corrupt, truncated) or saved."""


@dataclass(frozen=True)
class FileRecord:
    name: str
    size_bytes: int
    sha256: str


def shard_name(rank: int) -> str:
    return f"shard-{rank:05d}.pt"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(obj: Any, path: Path) -> FileRecord:
    with path.open("wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    return FileRecord(path.name, path.stat().st_size, _sha256(path))


def _staging(path: Path, token: str) -> Path:
    return path.parent / f".{path.name}.partial-{token}"


def _aside(path: Path, token: str) -> Path:
    return path.parent / f".{path.name}.replaced-{token}"


def write_checkpoint(
    path: str | Path, rank: int, shard: Any, common: Any, metadata: dict[str, Any], gather: Gather,
    before_publish: Callable[[], None] | None = None,
) -> None:
    """Write this rank's ``shard`` (and on rank 0 ``common`` and the manifest) atomically (collective).

    ``metadata`` (JSON-serialisable, rank 0's) goes into the manifest. ``before_publish``
    runs on rank 0 between the agreement and the rename (tests kill the process there).
    """
    path = Path(path)
    token = gather(uuid.uuid4().hex if rank == 0 else None)[0]
    staging = _staging(path, token)
    records: list[FileRecord] = []
    error = None
    try:
        staging.mkdir(parents=True, exist_ok=True)
        records.append(_write(shard, staging / shard_name(rank)))
        if rank == 0:
            records.append(_write(common, staging / COMMON))
    except OSError as exc:  # disk full, permissions: every rank must learn of it, not only this one
        error = f"rank {rank} could not write {staging}: {exc}"
    agreed = gather((records, error))
    errors = [e for _, e in agreed if e]
    if not errors and rank == 0:
        try:
            _publish(path, staging, token, [r for rs, _ in agreed for r in rs], metadata, before_publish)
        except OSError as exc:
            errors.append(f"rank 0 could not publish {path}: {exc}")
    errors = gather(errors)[0]  # rank 0's list: everyone's write errors and its own publishing error
    if errors:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(
            f"checkpoint {path} was not saved: {'; '.join(errors)}. The previous checkpoint at that path (if any) "
            f"is untouched; free space or fix permissions and save again"
        )


def _publish(path, staging, token, records, metadata, before_publish) -> None:
    manifest = {
        "format": FORMAT, "version": FORMAT_VERSION, **metadata,
        "files": {r.name: asdict(r) for r in sorted(records, key=lambda r: r.name)},
    }
    with (staging / MANIFEST).open("w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    _fsync_dir(staging)
    if before_publish is not None:
        before_publish()
    aside = _aside(path, token)
    if path.exists():
        path.rename(aside)
    staging.rename(path)
    _fsync_dir(path.parent)
    if aside.exists():
        shutil.rmtree(aside)


def _resolve(path: Path) -> Path:
    """The path itself, or the checkpoint it replaced when a save died between its two renames."""
    if path.exists():
        return path
    left = sorted(path.parent.glob(f".{path.name}.replaced-*"))
    if left:
        warnings.warn(
            f"{path} is missing: a save was interrupted while replacing it; loading the previous checkpoint "
            f"{left[-1]} (move it to {path} to keep it)", stacklevel=3,
        )
        return left[-1]
    raise CheckpointError(f"no checkpoint at {path}; check the path (ckpt_path=...)")


def read_manifest(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint's directory (see :func:`_resolve`) and its manifest, checked for completeness."""
    directory = _resolve(Path(path))
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{directory} has no {MANIFEST}: it is not a complete zorse checkpoint (a save that did not finish, "
            f"or another kind of directory); resume from an earlier checkpoint"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{manifest_path} is corrupt ({exc}); resume from an earlier checkpoint") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest_path} is format {manifest.get('format')!r} version {manifest.get('version')!r}; this "
            f"zorse_lightning reads {FORMAT!r} version {FORMAT_VERSION}"
        )
    return directory, manifest


def read_file(directory: Path, manifest: dict[str, Any], name: str) -> Any:
    """One file of the checkpoint, after checking its size and checksum against the manifest."""
    record = manifest["files"].get(name)
    if record is None:
        raise CheckpointError(f"{directory} lists no {name} in its manifest; it is incomplete")
    file = directory / name
    problem = None
    if not file.is_file():
        problem = "is missing"
    elif file.stat().st_size != record["size_bytes"]:
        problem = f"has {file.stat().st_size} bytes, the manifest says {record['size_bytes']} (truncated?)"
    elif _sha256(file) != record["sha256"]:
        problem = "does not match its SHA-256 checksum (corrupt)"
    if problem:
        raise CheckpointError(
            f"checkpoint file {file} {problem}; this checkpoint cannot be loaded: resume from an earlier one "
            f"(it was left untouched)"
        )
    return torch.load(file, map_location="cpu", weights_only=False)


def is_checkpoint_directory(path: str | Path) -> bool:
    """Whether ``path`` is (or was, before an interrupted replacement) a zorse checkpoint directory."""
    path = Path(path)
    return path.is_dir() or (not path.exists() and any(path.parent.glob(f".{path.name}.replaced-*")))

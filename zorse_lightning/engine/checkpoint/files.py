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

Every file holds only tensors and plain containers, so it is read with
``torch.load(weights_only=True)``: unpickling runs no code a file could carry.
A file that is not so is refused when it is written (and, if it came from
elsewhere, when it is read), naming the file, the rule and the fix. Reading
memory-maps the file (``mmap=True``), so a rank's memory holds only the tensors
it touches; a file's checksum is computed once, by one rank
(:func:`verify_files`), not by every rank that reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
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


WEIGHTS_ONLY_RULE = (
    "zorse checkpoint files hold only tensors and plain containers (dict, list, tuple, str, int, float, bool, "
    "None), so that torch.load(weights_only=True) reads them without running code from the file"
)


class NotWeightsOnlyError(CheckpointError):
    """A file the project reads holds objects that ``torch.load(weights_only=True)`` refuses."""


def _unsafe_globals(path: Path) -> list[str]:
    """The classes and functions a torch file's pickle would import (reads the pickle, not the tensors)."""
    return torch.serialization.get_unsafe_globals_in_checkpoint(path)


def _write(obj: Any, path: Path) -> FileRecord:
    with path.open("wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    unsafe = _unsafe_globals(path)
    if unsafe:  # refused now, while the run that wrote it can still be fixed, not at the resume
        raise NotWeightsOnlyError(
            f"{path.name} would hold objects of {', '.join(unsafe[:5])}; {WEIGHTS_ONLY_RULE}: keep hyper-parameters, "
            f"callback and data-module state plain (convert dataclasses with dataclasses.asdict, enums to their "
            f"values, numpy arrays to tensors)"
        )
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
    except NotWeightsOnlyError as exc:
        error = f"rank {rank}: {exc}"
    agreed = gather((records, error))
    errors = [e for _, e in agreed if e]
    if not errors and rank == 0:
        try:
            _publish(path, staging, token, [r for rs, _ in agreed for r in rs], metadata, before_publish)
        except (OSError, CheckpointError) as exc:
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
    """Write the manifest and rename the staging directory into place, unless a file it lists is absent or of
    another size than written (a rank whose write did not reach the shared file system)."""
    incomplete = [
        f"{r.name} ({'missing' if not (staging / r.name).is_file() else 'of another size than written'})"
        for r in records if not (staging / r.name).is_file() or (staging / r.name).stat().st_size != r.size_bytes
    ]
    if incomplete:
        raise CheckpointError(
            f"the checkpoint would list files that are not whole in {staging}: {', '.join(incomplete)}; every rank "
            f"must write to storage rank 0 sees (a shared file system): check that the checkpoint directory is shared"
        )
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


def _problem(directory: Path, manifest: dict[str, Any], name: str, checksum: bool) -> str | None:
    """What is wrong with one file of the checkpoint against its manifest (None: nothing); the checksum reads
    the whole file, so only one rank computes it (:func:`verify_files`)."""
    record = manifest["files"].get(name)
    if record is None:
        return f"{directory} lists no {name} in its manifest; it is incomplete"
    file = directory / name
    problem = None
    if not file.is_file():
        problem = "is missing"
    elif file.stat().st_size != record["size_bytes"]:
        problem = f"has {file.stat().st_size} bytes, the manifest says {record['size_bytes']} (truncated?)"
    elif checksum and _sha256(file) != record["sha256"]:
        problem = "does not match its SHA-256 checksum (corrupt)"
    if problem:
        return (f"checkpoint file {file} {problem}; this checkpoint cannot be loaded: resume from an earlier one "
                f"(it was left untouched)")
    return None


def verify_files(directory: Path, manifest: dict[str, Any], names: list[str], rank: int, world_size: int,
                 gather: Gather) -> None:
    """Check ``names`` against the manifest, each file's checksum computed by one rank (file i by rank i mod the
    world size), and raise the problems on every rank (collective unless ``world_size`` is 1)."""
    ordered = sorted(set(names))
    mine = [p for p in (_problem(directory, manifest, name, checksum=True) for name in ordered[rank::world_size]) if p]
    # a reader alone (world_size 1: a tool, a test) asks nobody, even inside a process group
    problems = mine if world_size == 1 else [p for found in gather(mine) for p in found]
    if problems:
        raise CheckpointError("; ".join(problems))


def open_file(path: Path) -> Any:
    """A file the project wrote, memory-mapped and unpickled with ``weights_only=True``: its tensors are read
    from disk only where touched."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as error:
        raise NotWeightsOnlyError(
            f"{path} is refused: {WEIGHTS_ONLY_RULE}, and this one is not ({str(error).splitlines()[-1]}); it was "
            f"not written by this version of zorse_lightning: resume from a checkpoint it wrote, or, if you trust "
            f"the file, load it with torch.load(path, weights_only=False) and save its tensors again"
        ) from None


def read_file(directory: Path, manifest: dict[str, Any], name: str) -> Any:
    """One file of the checkpoint, checked against the manifest (checksum included) in this process alone."""
    problem = _problem(directory, manifest, name, checksum=True)
    if problem:
        raise CheckpointError(problem)
    return open_file(directory / name)


def is_checkpoint_directory(path: str | Path) -> bool:
    """Whether ``path`` is (or was, before an interrupted replacement) a zorse checkpoint directory."""
    path = Path(path)
    return path.is_dir() or (not path.exists() and any(path.parent.glob(f".{path.name}.replaced-*")))

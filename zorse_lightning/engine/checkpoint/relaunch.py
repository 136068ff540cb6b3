"""The relaunch after a lost rank: the newest step that survivors' kept state (and the checkpoint) cover.

On ``fit(ckpt_path=...)`` the relaunch, on the cluster as it is now, takes the
newest step whose kept state covers every entry of the model and every
parameter the optimizers step (:func:`choose_step`); a step newer than the
checkpoint must be covered by survivors alone, the checkpoint's own step may be
completed by its shards (only those that hold a missing entry are listed).
What survivors keep, and how, is :mod:`.survivors`.

As for a checkpoint (:func:`.shards.load`), nothing is read until asked for: a
rank opens only the files holding its stage's tensors, memory-mapped. A
survivor's file lies on its own machine's disk; a rank that cannot see it gets
it over the host (gloo) group, never staged on a GPU, chunk by chunk into its
own survivors' directory (:func:`send_files`), and reads it from there the same
way; ranks that see the file get nothing.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zorse_lightning.engine.checkpoint.by_name import OpenedFiles
from zorse_lightning.engine.checkpoint.files import COMMON, Gather, read_manifest, shard_name, verify_files
from zorse_lightning.engine.checkpoint.shards import Holder, all_gather, assembled, checkpoint_holders
from zorse_lightning.engine.checkpoint.shards import load as load_checkpoint
from zorse_lightning.engine.checkpoint.survivors import KeptIndex, RecoveryPolicy, RecoveryReport, survivors_directory


def _kept_here(directory: Path) -> list[KeptIndex]:
    found = []
    for index in sorted(directory.glob("step-*/rank-*.json")):
        try:
            fields = json.loads(index.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # a survivor killed while writing: its state is not there
        if index.with_suffix(".pt").is_file():
            found.append(KeptIndex(**{**fields, "entries": tuple(fields["entries"]),
                                      "stepped": tuple(map(tuple, fields["stepped"])), "path": str(index.with_suffix(".pt"))}))
    return found


def choose_step(
    kept: list[KeptIndex], checkpoint_step: int, entries: set[str], trainable: set[str]
) -> tuple[int, list[KeptIndex], str]:
    """The newest step at which kept state (plus the checkpoint, at its own step) covers ``entries`` (the
    module's state dict) and the optimizer state of ``trainable`` (the parameters optimizers step); the
    survivors used there; why (mentioning "only in the checkpoint" when newer kept state had to be passed over)."""
    newer = sorted({k.step for k in kept if k.step > checkpoint_step}, reverse=True)
    gaps = ""
    for step in newer:
        at = [k for k in kept if k.step == step]
        missing = (entries - {e for k in at for e in k.entries}) | (trainable - _stepped(at))
        if not missing:
            return step, at, f"the survivors kept every entry of step {step}"
        gaps = gaps or f"the survivors kept step {step}, but {len(missing)} entries (e.g. {min(missing)}) "
    at = [k for k in kept if k.step == checkpoint_step]
    return checkpoint_step, at, (
        f"{gaps}are only in the checkpoint of step {checkpoint_step}: resuming from step {checkpoint_step}"
        if gaps else f"no survivor kept a step newer than the checkpoint's ({checkpoint_step})"
    )


def _stepped(kept: list[KeptIndex]) -> set[str]:
    return {n for k in kept for names in k.stepped for n in names}


CHUNK_BYTES = 64 * 1024 * 1024
"""Bytes per message when a survivor's file is sent: what a rank holds of a file in flight."""

RECEIVED_DIR = ".received"


def send_files(needs: list[tuple[str, int, int]], rank: int, into: Path, group: Any = None) -> dict[str, Path]:
    """Send each ``(path, provider, receiver)`` of ``needs`` (one order every rank agrees on) from the provider,
    which sees the file, to the receiver, which does not, over ``group`` (gloo) in chunks of
    :data:`CHUNK_BYTES`; the receiver writes it under ``into`` (``step-N/rank-R.pt`` as the survivor named it).
    Returns what this rank received: original path -> its local copy (collective over the pairs' ranks)."""
    received: dict[str, Path] = {}
    for path, provider, receiver in needs:
        if rank == provider:
            _send(Path(path), receiver, group)
        elif rank == receiver:
            source = Path(path)
            received[path] = _receive(into / source.parent.name / source.name, provider, group)
    return received


def _send(path: Path, receiver: int, group: Any) -> None:
    size = path.stat().st_size
    dist.send(torch.tensor([size], dtype=torch.int64), receiver, group)
    chunk = bytearray(CHUNK_BYTES)
    with path.open("rb") as handle:
        while length := handle.readinto(chunk):
            dist.send(torch.frombuffer(chunk, dtype=torch.uint8)[:length], receiver, group)


def _receive(target: Path, provider: int, group: Any) -> Path:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, provider, group)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.partial-{os.getpid()}")
    remaining = int(size.item())
    with temporary.open("wb") as handle:
        while remaining:
            chunk = torch.empty(min(CHUNK_BYTES, remaining), dtype=torch.uint8)
            dist.recv(chunk, provider, group)
            handle.write(memoryview(chunk.numpy()))
            remaining -= chunk.numel()
    temporary.replace(target)
    return target


def _local_paths(chosen: list[KeptIndex], seen: set[str], rank: int, into: Path, gather: Gather,
                 group: Any) -> dict[str, Path]:
    """Where this rank reads each chosen survivor's file: where it lies, or where it was received (collective)."""
    everywhere = [set(s) for s in gather(sorted(seen))]
    needs = [
        (k.path, min(r for r, s in enumerate(everywhere) if k.path in s), receiver)
        for k in sorted(chosen, key=lambda k: k.path)
        for receiver, s in enumerate(everywhere) if k.path not in s
    ]
    local = {k.path: Path(k.path) for k in chosen if k.path in seen}
    local.update(send_files(needs, rank, into, group))
    return local


def _shards_needed(manifest: dict[str, Any], entries: set[str], stepped: set[str]) -> list[str]:
    """The checkpoint's shards holding an entry or optimizer state the survivors lack (every shard when
    the manifest does not list what each holds)."""
    contents = manifest.get("contents")
    needed = []
    for rank in range(manifest["world_size"]):
        holds = contents.get(shard_name(rank)) if contents else None
        if holds is None or set(holds["state_dict"]) - entries or {n for o in holds["optimizers"] for n in o} - stepped:
            needed.append(shard_name(rank))
    return needed


def load(
    path: str | Path, policy: RecoveryPolicy, module: nn.Module, rank: int, world_size: int,
    gather: Gather = all_gather, group: Any = None,
) -> tuple[dict[str, Any], RecoveryReport]:
    """Lightning's checkpoint dictionary for resuming from ``path``, built from survivors' state first, its
    tensors read only when asked for (collective; ``gather`` and ``group`` over the host group)."""
    directory, manifest = read_manifest(path)
    verify_files(directory, manifest, [COMMON], rank, world_size, gather)
    files = OpenedFiles()
    common = files.get(directory / COMMON)
    checkpoint_step = common["global_step"]
    kept_in = survivors_directory(policy, directory.parent)
    listed = _kept_here(kept_in)
    union = {k.path: k for ks in gather(listed) for k in ks}
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    step, chosen, reason = choose_step(list(union.values()), checkpoint_step, set(module.state_dict()), trainable)
    if not chosen:
        message = f"zorse: resuming from the checkpoint {directory} at step {step} ({reason})"
        report = RecoveryReport(step, checkpoint_step, (), tuple(sorted(manifest["files"])), reason, message)
        return load_checkpoint(path, rank, world_size, gather), report
    local = _local_paths(chosen, {k.path for k in listed}, rank, kept_in / RECEIVED_DIR / f"rank-{rank}", gather, group)
    kept = [Holder(local[k.path], k.entries, k.stepped) for k in chosen]
    listed_shards: list[str] = []
    if step == checkpoint_step:
        have = {e for k in chosen for e in k.entries}
        listed_shards = _shards_needed(manifest, have, _stepped(chosen))
        verify_files(directory, manifest, listed_shards, rank, world_size, gather)
        holders = checkpoint_holders(directory, manifest, listed_shards) + kept  # survivors' entries win
        checkpoint = common
    else:
        holders = kept
        checkpoint = copy.deepcopy(files.get(kept[0].path)["common"])
    checkpoint = assembled(checkpoint, holders, files, f"the survivors' files of step {step}")
    message = (f"zorse: resuming from step {step}: {len(chosen)} survivors' files and {len(listed_shards)} shards of "
               f"the checkpoint {directory} ({reason})")
    report = RecoveryReport(step, checkpoint_step, tuple(k.path for k in chosen), tuple(listed_shards), reason, message)
    return checkpoint, report

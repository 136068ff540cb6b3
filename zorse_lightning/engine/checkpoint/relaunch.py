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
way. Which ranks need a file is known only once the plan is (:func:`fetch`,
called by the strategy as the plan is set): a file goes only to the ranks that
cannot see it and whose stage may hold one of its names.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
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
from zorse_lightning.module.blocks import BlockList
from zorse_lightning.schedule.plan import Plan


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


@dataclass(frozen=True)
class RemoteFiles:
    """Survivors' files that some ranks cannot see, sent (:func:`fetch`) once the plan says which of those ranks'
    stages hold names in them: at the resume's reading no rank knows its stage yet."""

    needs: tuple[tuple[str, int, int], ...]
    """``(path, provider, receiver)`` for every rank that cannot see the file, in one order every rank agrees on."""
    kept: tuple[KeptIndex, ...]
    """What each of the files holds."""
    into: Path
    """Where this rank writes what it receives."""
    files: OpenedFiles
    """The checkpoint's files, told where the received ones lie."""


def _remote_files(chosen: list[KeptIndex], seen: set[str], into: Path, files: OpenedFiles,
                  gather: Gather) -> RemoteFiles | None:
    """The chosen survivors' files that some rank cannot see (collective; None, alike everywhere, when none)."""
    everywhere = [set(s) for s in gather(sorted(seen))]
    needs = tuple(
        (k.path, min(r for r, s in enumerate(everywhere) if k.path in s), receiver)
        for k in sorted(chosen, key=lambda k: k.path)
        for receiver, s in enumerate(everywhere) if k.path not in s
    )
    return RemoteFiles(needs, tuple(chosen), into, files) if needs else None


def stage_may_hold(plan: Plan, rank: int, blocks: BlockList | None) -> Callable[[str], bool]:
    """Whether this rank's stage (in ``plan``) may hold the state-dict entry ``name``: every name but another
    stage's blocks' (entries outside the block list are placed by the cut; an idle rank holds nothing)."""
    if rank in plan.idle_ranks:
        return lambda name: False
    if blocks is None or len(plan.stages) == 1:
        return lambda name: True
    mine = {layer for stage in plan.stages_of_rank(rank) for layer in range(*plan.stages[stage].layers)}
    prefix = f"{blocks.path}."

    def may_hold(name: str) -> bool:
        if not name.startswith(prefix):
            return True
        index = name[len(prefix):].split(".", 1)[0]
        return not index.isdigit() or int(index) in mine

    return may_hold


def fetch(remote: RemoteFiles, may_hold: Callable[[str], bool], rank: int, gather: Gather, group: Any = None) -> None:
    """Send each file of ``remote`` only to the ranks that cannot see it and whose stage may hold one of its
    names (``may_hold``: :func:`stage_may_hold`); this rank reads what it received from its own directory
    (collective over the host group, once the plan is known)."""
    lacking = {path for path, _, receiver in remote.needs if receiver == rank}
    mine = sorted(k.path for k in remote.kept if k.path in lacking
                  and any(may_hold(n) for n in (*k.entries, *(n for names in k.stepped for n in names))))
    asked = [set(paths) for paths in gather(mine)]
    needs = [(path, provider, receiver) for path, provider, receiver in remote.needs if path in asked[receiver]]
    received = send_files(needs, rank, remote.into, group)
    remote.files.relocate({Path(path): local for path, local in received.items()})


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


def _common_of(chosen: list[KeptIndex], seen: set[str], rank: int, files: OpenedFiles, gather: Gather,
               group: Any) -> dict[str, Any]:
    """Lightning's checkpoint without its tensors, as the survivors kept it (alike in every file of a step):
    read by the lowest rank that sees one of the files and broadcast over the host group (a few kilobytes)."""
    mine = [k.path for k in chosen if k.path in seen]
    seeing = gather(bool(mine))
    holder = min(r for r, sees in enumerate(seeing) if sees)
    box = [files.get(Path(mine[0]))["common"] if rank == holder else None]
    if len(seeing) > 1:
        dist.broadcast_object_list(box, holder, group=group)
    return box[0]


def load(
    path: str | Path, policy: RecoveryPolicy, module: nn.Module, rank: int, world_size: int,
    gather: Gather = all_gather, group: Any = None,
) -> tuple[dict[str, Any], RecoveryReport, RemoteFiles | None]:
    """Lightning's checkpoint dictionary for resuming from ``path``, built from survivors' state first, its
    tensors read only when asked for (collective; ``gather`` and ``group`` over the host group), and the
    survivors' files some ranks cannot see: :func:`fetch` sends them once the plan is known."""
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
        return load_checkpoint(path, rank, world_size, gather), report, None
    remote = _remote_files(chosen, {k.path for k in listed}, kept_in / RECEIVED_DIR / f"rank-{rank}", files, gather)
    kept = [Holder(Path(k.path), k.entries, k.stepped) for k in chosen]
    listed_shards: list[str] = []
    if step == checkpoint_step:
        have = {e for k in chosen for e in k.entries}
        listed_shards = _shards_needed(manifest, have, _stepped(chosen))
        verify_files(directory, manifest, listed_shards, rank, world_size, gather)
        holders = checkpoint_holders(directory, manifest, listed_shards) + kept  # survivors' entries win
        checkpoint = common
    else:
        holders = kept
        checkpoint = copy.deepcopy(_common_of(chosen, {k.path for k in listed}, rank, files, gather, group))
    checkpoint = assembled(checkpoint, holders, files, f"the survivors' files of step {step}")
    message = (f"zorse: resuming from step {step}: {len(chosen)} survivors' files and {len(listed_shards)} shards of "
               f"the checkpoint {directory} ({reason})")
    report = RecoveryReport(step, checkpoint_step, tuple(k.path for k in chosen), tuple(listed_shards), reason, message)
    return checkpoint, report, remote

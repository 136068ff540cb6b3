"""The relaunch after a lost rank: the newest step that survivors' kept state (and the checkpoint) cover.

On ``fit(ckpt_path=...)`` the relaunch, on the cluster as it is now, takes the
newest step whose kept state covers every entry of the model and every
parameter the optimizers step (:func:`choose_step`); a step newer than the
checkpoint must be covered by survivors alone, the checkpoint's own step may be
completed by its shards (only those that hold a missing entry are read).
What survivors keep, and how, is :mod:`.survivors`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zorse_lightning.engine.checkpoint.files import COMMON, read_file, read_manifest, shard_name
from zorse_lightning.engine.checkpoint.shards import NAMED_STATE_KEY, all_gather, merged_state_dict
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


def _read_kept(chosen: list[KeptIndex], seen: set[str], rank: int) -> dict[str, dict[str, Any]]:
    """The chosen survivors' files, each read by the ranks that see it and sent to those that do not
    (survivors keep their state on their own machine's disk)."""
    everywhere = [set(s) for s in all_gather(sorted(seen))]
    unseen = {k.path for k in chosen if any(k.path not in s for s in everywhere)}
    kept = {k.path: torch.load(k.path, map_location="cpu", weights_only=False, mmap=True)
            for k in chosen if k.path in seen}
    if unseen:
        provider = {path: min(r for r, s in enumerate(everywhere) if path in s) for path in unseen}
        for sent in all_gather({p: kept[p] for p in unseen if provider[p] == rank}):
            kept.update(sent)
    return kept


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
    path: str | Path, policy: RecoveryPolicy, module: nn.Module, rank: int, world_size: int
) -> tuple[dict[str, Any], RecoveryReport]:
    """Lightning's checkpoint dictionary for resuming from ``path``, built from survivors' state first
    (collective)."""
    directory, manifest = read_manifest(path)
    common = read_file(directory, manifest, COMMON)
    checkpoint_step = common["global_step"]
    listed = _kept_here(survivors_directory(policy, directory.parent))
    union = {k.path: k for ks in all_gather(listed) for k in ks}
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    step, chosen, reason = choose_step(list(union.values()), checkpoint_step, set(module.state_dict()), trainable)
    if not chosen:
        message = f"zorse: resuming from the checkpoint {directory} at step {step} ({reason})"
        report = RecoveryReport(step, checkpoint_step, (), tuple(sorted(manifest["files"])), reason, message)
        return load_checkpoint(path, rank, world_size), report
    kept = _read_kept(chosen, {k.path for k in listed}, rank)
    shards = [kept[k.path] for k in chosen]
    read: list[str] = []
    if step == checkpoint_step:
        have = {e for s in shards for e in s["state_dict"]}
        read = _shards_needed(manifest, have, _stepped(chosen))
        shards = [read_file(directory, manifest, name) for name in read] + shards  # survivors' entries win
        checkpoint = common
    else:
        checkpoint = copy.deepcopy(shards[0]["common"])
    checkpoint["state_dict"] = merged_state_dict(shards)
    for index, state in enumerate(checkpoint.get("optimizer_states", [])):
        state[NAMED_STATE_KEY] = {k: v for s in shards for k, v in s["optimizers"][index].items()}
    message = (f"zorse: resuming from step {step}: {len(chosen)} survivors' files and {len(read)} shards of the "
               f"checkpoint {directory} ({reason})")
    return checkpoint, RecoveryReport(step, checkpoint_step, tuple(k.path for k in chosen), tuple(read), reason, message)

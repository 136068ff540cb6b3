"""Lightning checkpoints of a cut model: each rank saves what it alone is responsible for.

Each rank holds part of the model (its stage) and part of the optimizer state
(its shard). Entries are keyed by parameter *name*, which every rank agrees on
(optimizer state dicts key by position in a rank's own, restricted groups), and
each entry is written once: by the lowest rank that holds it (a stage's weights
by its first rank, a tied weight by the first stage). Loading merges every
rank's file into Lightning's usual dictionary of the whole module, so a
checkpoint resumes on any plan, any number of ranks (elastic resume), and
exports to a plain state dict (:mod:`zorse_lightning.apps.export_app`).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from zorse_lightning.engine.checkpoint import files as checkpoint_files
from zorse_lightning.engine.tensor_parallel import like_parameter
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.engine.checkpoint.by_name import ByName, OpenedFiles, optimizer_section, state_dict_section
from zorse_lightning.engine.checkpoint.files import (
    COMMON, CheckpointError, Gather, is_checkpoint_directory, read_file, read_manifest, shard_name, verify_files,
)
from zorse_lightning.schedule.plan import Plan
from zorse_lightning.module.materialize import holds_values

NAMED_STATE_KEY = "zorse_state_by_name"


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (just ``[obj]`` outside torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _to_cpu(value: Any) -> Any:
    return tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, value)


def _mine(local: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``local`` this rank writes: those no lower rank holds (collective)."""
    held = all_gather(sorted(local))
    rank = dist.get_rank() if dist.is_initialized() else 0
    lower = {name for names in held[:rank] for name in names}
    return {name: value for name, value in local.items() if name not in lower}


def held_module_entries(module: nn.Module) -> dict[str, Any]:
    """The module's state dict without what this rank holds no values of (asked of the tensors themselves:
    ``state_dict()`` detaches them, which forgets that sharding freed one)."""
    return {
        k: v.detach() if isinstance(v, torch.Tensor) else v
        for k, v in module.state_dict(keep_vars=True).items()
        if not isinstance(v, torch.Tensor) or holds_values(v)
    }


def held_optimizer_entries(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
    names = {id(p): n for n, p in module.named_parameters()}
    return {names[id(p)]: optimizer.state[p] for g in optimizer.param_groups for p in g["params"] if p in optimizer.state}


def optimizer_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def held_module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Everything of the module's state dict this rank holds, copied to the CPU (not collective: survivors)."""
    return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, _to_cpu(held_module_entries(module)))


def held_optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
    """The optimizer state of every parameter this rank steps, by name, copied (not collective: survivors)."""
    held = _to_cpu(held_optimizer_entries(optimizer, module))
    return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, held)


def _whole(value: Any) -> Any:
    """``value`` with each weight split over a TP group gathered whole (collective over the group, in the same
    order on its ranks: their state dicts agree), so that files hold plain tensors that resume on any plan."""
    return tree_map(lambda v: v.full_tensor() if isinstance(v, DTensor) else v, value)


def local_module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's share of the module's state dict (collective)."""
    return _to_cpu(_mine(_whole(held_module_entries(module))))


def local_optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
    """This rank's share of the optimizer's state, keyed by parameter name (collective)."""
    held = _whole(held_optimizer_entries(optimizer, module))
    return {NAMED_STATE_KEY: _to_cpu(_mine(held)), "param_groups": optimizer_hyperparameters(optimizer)}


def load_optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module, saved: dict[str, Any]) -> None:
    """Give ``optimizer`` the saved state of the parameters it steps (after it was restricted to them)."""
    names = {id(p): n for n, p in module.named_parameters()}
    by_name = saved[NAMED_STATE_KEY]
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        group.update(saved_group)
        for param in group["params"]:
            state = by_name.get(names[id(param)])
            if state is not None:
                optimizer.state[param] = tree_map(
                    lambda v: like_parameter(param, v) if isinstance(v, torch.Tensor) and v.dim() else v, state
                )


def rng_state() -> dict[str, Any]:
    """The generators' states as tensors and plain values (numpy's key array as a tensor: a file holding a numpy
    array is not loadable with ``weights_only=True``)."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(), "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached_gaussian)],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def zorse_section(plan: Plan | None, inventory: ClusterInventory | None, sampler: Any = None) -> dict:
    """What the strategy adds to Lightning's checkpoint: the plan, the cluster, the data position (the sampler's
    state, a dataclass), all as plain dictionaries (the files are read with ``weights_only=True``)."""
    return {
        "plan": plan.to_dict() if plan else None,
        "inventory": asdict(inventory) if is_dataclass(inventory) else inventory,
        "sampler": asdict(sampler) if sampler else None,
    }


def manifest_metadata(module: nn.Module, plan: Plan | None) -> dict[str, Any]:
    """Readable without torch: what the checkpoint is of, and on which plan it was taken."""
    return {
        "model": type(module).__name__,
        "plan": plan.to_dict() if plan else None,
    }


def save(checkpoint: dict[str, Any], path: str | Path, metadata: dict[str, Any], before_publish=None) -> None:
    """Write Lightning's ``checkpoint`` (this rank's shares inside) atomically (collective).

    ``state_dict`` and the optimizers' by-name state go to this rank's file with
    its RNG state; the rest (loops, callbacks, schedulers, the plan) to rank 0's.
    """
    optimizer_states = checkpoint.get("optimizer_states", [])
    shard = {
        "state_dict": checkpoint.get("state_dict", {}),
        "optimizers": [s.get(NAMED_STATE_KEY, {}) for s in optimizer_states],
        "rng": rng_state(),
    }
    common = {k: v for k, v in checkpoint.items() if k != "state_dict"}
    common["optimizer_states"] = [{k: v for k, v in s.items() if k != NAMED_STATE_KEY} for s in optimizer_states]
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    held = all_gather({"state_dict": sorted(shard["state_dict"]), "optimizers": [sorted(o) for o in shard["optimizers"]]})
    contents = {shard_name(r): names for r, names in enumerate(held)}  # fast recovery reads only the shards it lacks
    checkpoint_files.write_checkpoint(
        path, rank, shard, common, {**metadata, "world_size": world_size, "contents": contents}, all_gather,
        before_publish,
    )


def read_shards(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """The manifest, rank 0's common part and every rank's shard, each file verified first, in this process
    alone (the export of the whole model)."""
    directory, manifest = read_manifest(path)
    common = read_file(directory, manifest, COMMON)
    shards = [read_file(directory, manifest, shard_name(rank)) for rank in range(manifest["world_size"])]
    return manifest, common, shards


def merged_state_dict(shards: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    state_dict: dict[str, torch.Tensor] = {}
    for shard in shards:
        state_dict.update(shard["state_dict"])
    return state_dict


@dataclass(frozen=True)
class Holder:
    """A file holding part of a step's state, and what, known without opening it (a checkpoint's manifest
    ``contents``, a survivor's index)."""

    path: Path
    entries: tuple[str, ...]
    """Module state-dict names."""
    stepped: tuple[tuple[str, ...], ...]
    """Per optimizer: the parameter names whose optimizer state it holds."""


def checkpoint_holders(directory: Path, manifest: dict[str, Any], names: list[str]) -> list[Holder]:
    """The checkpoint's shards ``names`` as holders, from the manifest's ``contents``."""
    contents = manifest.get("contents")
    if contents is None:
        raise CheckpointError(
            f"{directory} has no 'contents' in its manifest (what each shard holds), so a rank could not read only "
            f"its stage's shards: it was written by an earlier zorse_lightning; export it with that version "
            f"(python -m zorse_lightning.apps.export_app) and start from the exported weights"
        )
    return [
        Holder(directory / name, tuple(contents[name]["state_dict"]), tuple(map(tuple, contents[name]["optimizers"])))
        for name in names
    ]


def assembled(common: dict[str, Any], holders: list[Holder], files: OpenedFiles, description: str) -> dict[str, Any]:
    """Lightning's checkpoint dictionary: ``common`` with the module's and each optimizer's state by name, read
    from ``holders`` (a later holder's entries win) only when asked for (:mod:`.by_name`)."""
    located: dict[str, Path] = {}
    stepped: list[dict[str, Path]] = [{} for _ in common.get("optimizer_states", [])]
    for holder in holders:
        located.update(dict.fromkeys(holder.entries, holder.path))
        for index, names in enumerate(holder.stepped[: len(stepped)]):
            stepped[index].update(dict.fromkeys(names, holder.path))
    common["state_dict"] = ByName(located, files, state_dict_section, description)
    for index, state in enumerate(common.get("optimizer_states", [])):
        state[NAMED_STATE_KEY] = ByName(stepped[index], files, optimizer_section(index), description)
    return common


def load(path: str | Path, rank: int, world_size: int, gather: Gather = all_gather) -> dict[str, Any]:
    """The checkpoint as Lightning's dictionary, its tensors read only when asked for; every file verified once,
    by one rank (collective); this rank's RNG restored when the checkpoint has as many ranks (on another cluster
    each rank keeps its own generators)."""
    directory, manifest = read_manifest(path)
    names = [shard_name(r) for r in range(manifest["world_size"])]
    verify_files(directory, manifest, [COMMON, *names], rank, world_size, gather)
    files = OpenedFiles()
    checkpoint = assembled(files.get(directory / COMMON), checkpoint_holders(directory, manifest, names), files,
                           f"the checkpoint {directory}")
    if manifest["world_size"] == world_size:
        set_rng_state(files.get(directory / shard_name(rank))["rng"])
    return checkpoint


__all__ = [
    "CheckpointError", "NAMED_STATE_KEY", "held_module_state", "held_optimizer_state", "is_checkpoint_directory", "manifest_metadata", "zorse_section", "load", "load_optimizer_state", "local_module_state",
    "local_optimizer_state", "save",
]

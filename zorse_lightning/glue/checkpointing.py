"""Complete checkpoints from a cut model: every stage's weights and every optimizer shard.

Each rank holds part of the model (its stage) and part of the optimizer state
(its shard), so both are gathered by parameter *name*, which every rank agrees
on (optimizer state dicts key by position in a rank's own, restricted groups).
The result is a plain Lightning checkpoint of the whole module: it loads into
the user's module on one device, and into any other plan.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

NAMED_STATE_KEY = "zorse_state_by_name"


def _to_cpu(value: Any) -> Any:
    return tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, value)


def _gathered(local: dict[str, Any]) -> dict[str, Any]:
    parts: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part or {})
    return merged


def gather_module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole module's state dict (collective): each entry from a rank that holds it."""
    local = {k: v for k, v in module.state_dict().items() if not (isinstance(v, torch.Tensor) and v.is_meta)}
    merged = _gathered(_to_cpu(local))
    return {key: merged[key] for key in module.state_dict() if key in merged}


def gather_optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
    """The optimizer's state for every parameter of the module, keyed by parameter name (collective)."""
    names = {id(p): n for n, p in module.named_parameters()}
    local = {names[id(p)]: optimizer.state[p] for g in optimizer.param_groups for p in g["params"] if p in optimizer.state}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {NAMED_STATE_KEY: _gathered(_to_cpu(local)), "param_groups": groups}


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
                    lambda v: v.to(param.device) if isinstance(v, torch.Tensor) and v.dim() else v, state
                )

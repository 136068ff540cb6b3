"""Host copies of a rank's held state, taken at step end: what survivors keep when their state is on a GPU.

Under NCCL a collective that a dead peer never joins blocks the CUDA stream, so
a device-to-host copy made when the loss is noticed would wait forever. The
copies are therefore made at the end of every step, into reused (pinned)
buffers, and keeping writes them without touching the device
(:class:`~.fast_recovery.SurvivorKeeper`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from zorse_lightning.strategy.checkpoint_io import held_module_entries, held_optimizer_entries


@dataclass(frozen=True)
class HostCopy:
    """A rank's held state of one step in host memory: the layout of ``{"state_dict": ..., "optimizers":
    [...]}`` and its leaves, CPU tensors (buffers a later snapshot may refill) and copies of the rest."""

    spec: TreeSpec
    leaves: list[Any]

    def fits(self, spec: TreeSpec, leaves: list[Any]) -> bool:
        """Whether these buffers can take ``leaves`` in place: same layout, tensors of the same shapes and dtypes."""
        return spec == self.spec and all(
            not isinstance(new, torch.Tensor)
            or (isinstance(old, torch.Tensor) and old.shape == new.shape and old.dtype == new.dtype)
            for old, new in zip(self.leaves, leaves)
        )

    def held(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The module state and the optimizers' states, as ``held_module_state``/``held_optimizer_state`` give them."""
        tree = tree_unflatten(self.leaves, self.spec)
        return tree["state_dict"], tree["optimizers"]


def lives_off_host(tensors: list[torch.Tensor]) -> bool:
    return any(t.device.type != "cpu" for t in tensors)


def held_on_device(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """What ``held_module_state`` and ``held_optimizer_state`` copy, not copied."""
    return {"state_dict": held_module_entries(module),
            "optimizers": [held_optimizer_entries(o, module) for o in optimizers]}


def _host_buffer(value: Any) -> torch.Tensor | None:
    """An empty host tensor for ``value`` (None for a non-tensor), pinned when CUDA is there (faster transfers)."""
    if not isinstance(value, torch.Tensor):
        return None
    return torch.empty(value.shape, dtype=value.dtype, pin_memory=torch.cuda.is_available())


def copy_to_host(tree: dict[str, Any], spare: HostCopy | None) -> HostCopy:
    """``tree`` copied to host memory, into ``spare``'s buffers when they fit (no allocation in steady state)."""
    leaves, spec = tree_flatten(tree)
    buffers = spare.leaves if spare is not None and spare.fits(spec, leaves) else [_host_buffer(v) for v in leaves]
    copied = [
        buffer.copy_(value.detach(), non_blocking=True) if isinstance(value, torch.Tensor) else copy.deepcopy(value)
        for buffer, value in zip(buffers, leaves)
    ]
    _wait_for_copies(leaves)
    return HostCopy(spec, copied)


def _wait_for_copies(sources: list[Any]) -> None:
    """Copies into pinned memory run asynchronously: wait, once per device, until its stream has run them."""
    for device in {v.device for v in sources if isinstance(v, torch.Tensor) and v.is_cuda}:
        torch.cuda.current_stream(device).synchronize()

"""Slicing a rank's batch into its microbatches, whatever the batch's structure."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map


def microbatch_slice(batch: Any, position: int, microbatch_size: int) -> Any:
    """The ``position``-th microbatch of ``batch`` (tensors sliced along dim 0, other leaves kept)."""
    start = position * microbatch_size

    def take(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf[start : start + microbatch_size]
        return leaf

    return tree_map(take, batch)


def samples_in(batch: Any) -> int:
    """Samples in ``batch``: the smallest dim 0 of its tensors (1 when it holds no batched tensor)."""
    sizes = [len(t) for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0]
    return min(sizes, default=1)

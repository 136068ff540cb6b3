"""Gradients of a plan equal to those of the whole global batch on one device.

Each microbatch's loss (a mean over its samples) is scaled by
``microbatch_size / global_batch_size`` before backward, so summing the local
gradients over all ranks that hold a weight gives the global-batch mean. The
sum runs over the group of the stages that hold the weight: a stage's own
group for its blocks, first and last stage for a tied embedding.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from zorse_lightning.engine.groups import StageGroups


def _sorted_sets(sets) -> list[frozenset[int]]:
    """One order on every rank, so collectives over overlapping groups cannot cross."""
    return sorted(sets, key=lambda s: (len(s), sorted(s)))


def reduce_gradients(params: list[tuple[nn.Parameter, frozenset[int]]], groups: StageGroups) -> None:
    """Sum each local parameter's gradient over the ranks of the stages holding it (in place)."""
    by_holders: dict[frozenset[int], list[nn.Parameter]] = defaultdict(list)
    for param, holders in params:
        by_holders[holders].append(param)
    for holders in _sorted_sets(by_holders):
        bucket = by_holders[holders]
        for param in bucket:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat, group=groups.group_for_stages(holders))
        offset = 0
        for param in bucket:
            param.grad.copy_(flat[offset : offset + param.numel()].view_as(param))
            offset += param.numel()


def clip_global_norm_(
    params: list[tuple[nn.Parameter, frozenset[int]]], groups: StageGroups, max_norm: float
) -> torch.Tensor:
    """Scale gradients so that their norm over all stages is at most ``max_norm``; returns the norm.

    Gradients are already reduced (equal on every rank of a stage), so each weight
    is counted once: by the first rank of the first stage that holds it.
    """
    counts_here = not groups.is_idle and groups.rank == groups.stage_ranks[0]  # idle: only joins the sum
    norms = [
        p.grad.detach().float().norm(2)
        for p, holders in params
        if counts_here and min(holders) == groups.stage_index and p.grad is not None
    ]
    device = params[0][0].device if params else torch.device("cpu")
    square = torch.stack(norms).square().sum() if norms else torch.zeros((), device=device)
    dist.all_reduce(square)
    total = square.sqrt()
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param, _ in params:
        if param.grad is not None:
            param.grad.mul_(coefficient.to(param.grad.dtype))
    return total

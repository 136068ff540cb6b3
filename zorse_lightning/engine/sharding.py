"""Optimizer state sharded inside a stage, with the plan's uneven shares.

Parameters are assigned whole and in order: parameter ``i`` goes to the rank
whose cumulative share contains the middle of its elements, so each rank's
shard approaches its ``shard_fractions`` entry (exactly so for many small
tensors). Each rank's optimizer keeps only its own parameters, so only they
get optimizer state, and steps them; the new values then reach the rest of the
stage in one all-gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zorse_lightning.engine.groups import StageGroups


def assign_shards(numels: list[int], fractions: tuple[float, ...]) -> list[int]:
    """Owner (index into ``fractions``) of each parameter, given parameter sizes in order."""
    total = sum(numels)
    bounds, running = [], 0.0
    for fraction in fractions:
        running += fraction
        bounds.append(running * total)
    owners, start = [], 0
    for numel in numels:
        middle = start + numel / 2
        owners.append(next((i for i, bound in enumerate(bounds) if middle < bound), len(fractions) - 1))
        start += numel
    return owners


def restrict_optimizer(optimizer: torch.optim.Optimizer, keep: list[nn.Parameter]) -> None:
    """Drop from the optimizer's groups every parameter not in ``keep`` (before its first step)."""
    kept = {id(p) for p in keep}
    if optimizer.state:
        raise RuntimeError("the optimizer already has state; restrict it to local parameters before its first step")
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in kept]


class OptimizerShards:
    """Who steps which parameter of a stage, and the broadcast that follows the step."""

    def __init__(self, params: list[nn.Parameter], groups: StageGroups) -> None:
        self.groups = groups
        owners = assign_shards([p.numel() for p in params], groups.stage.effective_shard_fractions())
        self.owned_by = {rank: [] for rank in groups.stage_ranks}
        for param, owner in zip(params, owners):
            self.owned_by[groups.stage_ranks[owner]].append(param)

    @property
    def mine(self) -> list[nn.Parameter]:
        return self.owned_by[self.groups.rank]

    def shard_bytes(self) -> dict[int, int]:
        return {rank: sum(p.numel() * p.element_size() for p in params) for rank, params in self.owned_by.items()}

    @torch.no_grad()
    def gather_updates(self) -> None:
        """After each owner stepped its shard: every rank of the stage gets the new values, in one all-gather.

        Shards are padded to the largest (gloo's all-gather takes equal sizes), so
        the collective moves ``ranks x largest shard``: what the cost model prices
        (:func:`zorse_lightning.planner.comm.ring_sync_ms`). One all-gather rather
        than a broadcast from each owner, which sends each shard to every peer
        from one rank's link. Gradients of the parameters other ranks own are
        dropped here: this rank's optimizer does not know them, so its
        ``zero_grad`` would leave them to accumulate into the next step.
        """
        group = self.groups.stage_group
        owners = list(self.owned_by)
        sizes = [sum(p.numel() for p in self.owned_by[rank]) for rank in owners]
        if len(owners) == 1 or max(sizes) == 0:
            return
        for rank, params in self.owned_by.items():
            if rank != self.groups.rank:
                for param in params:
                    param.grad = None
        sample = next(p for params in self.owned_by.values() for p in params)
        mine = self.mine
        flat = torch.zeros(max(sizes), dtype=sample.dtype, device=sample.device)
        if mine:
            torch.cat([p.detach().reshape(-1) for p in mine], out=flat[: sum(p.numel() for p in mine)])
        gathered = [torch.empty_like(flat) for _ in owners]
        dist.all_gather(gathered, flat, group=group)
        by_group_rank = {dist.get_group_rank(group, rank): rank for rank in owners}
        for index, received in enumerate(gathered):
            rank = by_group_rank[index]
            if rank == self.groups.rank:
                continue
            offset = 0
            for param in self.owned_by[rank]:
                param.copy_(received[offset : offset + param.numel()].view_as(param))
                offset += param.numel()

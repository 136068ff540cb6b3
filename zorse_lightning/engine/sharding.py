"""Optimizer state sharded inside a stage, with the plan's uneven shares.

Parameters are assigned whole and in order: parameter ``i`` goes to the rank
whose cumulative share contains the middle of its elements, so each rank's
shard approaches its ``shard_fractions`` entry (exactly so for many small
tensors). Each rank's optimizer keeps only its own parameters, so only they
get optimizer state, and steps them; the new values then reach the rest of the
stage in one all-reduce of the weights (zeros outside each owner's shard).
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
        """After each owner stepped its shard: every rank of the stage gets the new values.

        One all-reduce (a sum) of the stage's weights, each rank filling its own
        shard and zeros elsewhere: exact (x + 0 is x), as cheap as the gradients'
        all-reduce whatever the shard sizes (an all-gather pads every shard to
        the largest; gloo's also ran 1.75x slower than its all-reduce on these
        bytes), and what the cost model prices
        (:func:`zorse_lightning.planner.comm.ring_sync_ms`). Gradients of the
        parameters other ranks own are dropped here: this rank's optimizer does
        not know them, so its ``zero_grad`` would leave them to accumulate into
        the next step.
        """
        everything = [p for params in self.owned_by.values() for p in params]
        if len(self.owned_by) == 1 or not everything:
            return
        flat = torch.zeros(sum(p.numel() for p in everything), dtype=everything[0].dtype, device=everything[0].device)
        offset = 0
        for rank, params in self.owned_by.items():
            for param in params:
                if rank == self.groups.rank:
                    flat[offset : offset + param.numel()].copy_(param.detach().reshape(-1))
                else:
                    param.grad = None
                offset += param.numel()
        dist.all_reduce(flat, group=self.groups.stage_group)
        offset = 0
        for rank, params in self.owned_by.items():
            for param in params:
                if rank != self.groups.rank:
                    param.copy_(flat[offset : offset + param.numel()].view_as(param))
                offset += param.numel()

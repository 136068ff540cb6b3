"""Training state sharded inside a stage, with the plan's uneven shares.

Ownership is by whole parameters, so any optimizer steps its shard exactly as
it would step the whole model (no flattening: Adafactor, LAMB and others that
look at a tensor's shape see the tensor). The parameters a module owns directly
go to one rank together (a module is initialised as a whole, so the ones built
on the meta device get on their owner the values single-process training
starts from); in order, a module's parameters go to the rank whose cumulative
share contains their middle, so each rank's shard approaches its
``shard_fractions`` entry (closely for a model of many modules).

What each level keeps and moves (``StagePlan.sharding``):

* ``optimizer``: every rank holds weights and gradients; gradients are summed
  over the stage (under tensor parallelism: over its ranks of one TP index, each
  weight a local slice, :mod:`.tensor_parallel`), each owner steps its parameters, the new values reach the
  stage in one all-reduce of the weights (:meth:`StageShards.gather_updates`).
* ``optimizer_gradients``: gradients are summed into their owner only
  (:meth:`StageShards.reduce_to_owners`, one reduce per owner), other ranks
  drop theirs; owners step, then send the new values
  (:meth:`StageShards.broadcast_from_owners`).
* ``full``: a rank keeps the weights it does not own without memory between
  steps (the same tensor object, so optimizers and hooks keep referring to
  it); they are gathered before the step's first microbatch
  and freed after the optimizer step, or gathered block by block for each
  microbatch (:mod:`.block_gathering`).

Freed inside a step (:func:`free`), a weight keeps its shape and its storage is
resized to nothing: autograd keeps the tensor (or a view of it) for backward,
and the values gathered back into that same storage are what backward reads.
Between steps (:func:`settle`), the tensor is swapped for an empty one and its
shape kept aside: code that reads a weight then (a callback, ``state_dict``)
gets an empty tensor rather than reading memory that is not there.

Uneven shares rule out ``all_gather_into_tensor`` and ``reduce_scatter_tensor``
(equal sizes only, and gloo's list all-gather refuses uneven ones), so each
owner's tensors travel in one flat buffer with ``reduce`` to it and
``broadcast`` from it: per rank the bytes of a reduce-scatter and an all-gather,
on both gloo and NCCL.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zorse_lightning.engine.groups import StageGroups
from zorse_lightning.engine.tensor_parallel import local
from zorse_lightning.module.materialize import FREED_SHAPE, Swap, replace_parameters


def assign_shards(numels: list[int], fractions: tuple[float, ...]) -> list[int]:
    """Owner (index into ``fractions``) of each item, given item sizes in order."""
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


def module_groups(root: nn.Module, params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` grouped by the module that owns each directly (a shared weight: the first), in module order."""
    wanted = {id(p) for p in params}
    seen: set[int] = set()
    groups = []
    for module in root.modules():
        group = []
        for param in module._parameters.values():
            if param is not None and id(param) in wanted and id(param) not in seen:
                seen.add(id(param))
                group.append(param)
        if group:
            groups.append(group)
    return groups


def restrict_optimizer(optimizer: torch.optim.Optimizer, keep: list[nn.Parameter]) -> None:
    """Drop from the optimizer's groups every parameter not in ``keep`` (before its first step)."""
    kept = {id(p) for p in keep}
    if optimizer.state:
        raise RuntimeError("the optimizer already has state; restrict it to local parameters before its first step")
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in kept]


def true_shape(param: nn.Parameter) -> torch.Size:
    """A parameter's shape, also while :func:`settle` left it empty."""
    return getattr(param, FREED_SHAPE, param.shape)


def true_numel(param: nn.Parameter) -> int:
    return math.prod(true_shape(param))


def free(params: Iterable[nn.Parameter]) -> None:
    """Release each parameter's values inside a step, keeping the object, its shape and its storage (autograd
    may hold it for backward)."""
    for param in params:
        if not hasattr(param, FREED_SHAPE):
            param.untyped_storage().resize_(0)


def settle(params: Iterable[nn.Parameter]) -> None:
    """Between steps: each freed parameter becomes an empty tensor (its shape kept aside), safe to read."""
    for param in params:
        if param.numel() and param.untyped_storage().nbytes() == 0:
            setattr(param, FREED_SHAPE, param.shape)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def refill(param: nn.Parameter, values: torch.Tensor) -> None:
    """Give a freed parameter (:func:`free` or :func:`settle`) its memory and shape back, holding ``values``."""
    if hasattr(param, FREED_SHAPE):
        param.data = torch.empty(true_shape(param), dtype=param.dtype, device=values.device)
        delattr(param, FREED_SHAPE)
    storage = param.untyped_storage()
    if storage.nbytes() == 0:
        storage.resize_(param.numel() * param.element_size())
    param.data.copy_(values)


def placeholders(root: nn.Module, chosen: set[int], device: torch.device) -> list[Swap]:
    """Replace each parameter whose ``id`` is in ``chosen`` by one on ``device`` without values (freed, see
    :func:`free`): a weight this rank will only ever receive needs no memory, host copy or initialisation;
    a tied weight stays one tensor. Returns what was replaced."""

    def freed(param: nn.Parameter) -> nn.Parameter:
        new = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), param.requires_grad)
        free([new])
        return new

    return replace_parameters(root, lambda param: id(param) in chosen, freed)


@dataclass
class Broadcast:
    """One owner's values on their way to the stage (:meth:`StageShards.start_broadcast`)."""

    owner: int
    params: list[nn.Parameter]
    flat: torch.Tensor
    work: Any


class StageShards:
    """Who owns which parameter of a stage, and the collectives that move values between owners and the rest."""

    def __init__(self, groups_of_params: list[list[nn.Parameter]], groups: StageGroups, device: torch.device) -> None:
        self.groups = groups
        self.device = device
        owners = assign_shards(
            [sum(true_numel(p) for p in group) for group in groups_of_params], groups.data_shard_fractions
        )
        self.owned_by: dict[int, list[nn.Parameter]] = {rank: [] for rank in groups.data_ranks}
        self._owner: dict[int, int] = {}
        for params, owner in zip(groups_of_params, owners):
            rank = groups.data_ranks[owner]
            self.owned_by[rank].extend(params)
            self._owner.update((id(p), rank) for p in params)

    @property
    def mine(self) -> list[nn.Parameter]:
        return self.owned_by[self.groups.rank]

    def owns(self, param: nn.Parameter) -> bool:
        return self._owner.get(id(param)) == self.groups.rank

    def owner_ids(self) -> dict[int, int]:
        """Parameter ``id`` -> owning global rank."""
        return dict(self._owner)

    def shard_bytes(self) -> dict[int, int]:
        return {rank: sum(true_numel(p) * p.element_size() for p in params) for rank, params in self.owned_by.items()}

    def _by_owner(self, params: Iterable[nn.Parameter]) -> list[tuple[int, list[nn.Parameter]]]:
        """``params`` split by owner, owners in stage order (the same on every rank: collectives follow it)."""
        wanted = {id(p) for p in params}
        split = [(rank, [p for p in owned if id(p) in wanted]) for rank, owned in self.owned_by.items()]
        return [(rank, owned) for rank, owned in split if owned]

    @torch.no_grad()
    def reduce_to_owners(self, params: Iterable[nn.Parameter]) -> None:
        """Sum each parameter's gradient over the stage into its owner's ``.grad``; the others drop theirs.

        A rank that computed no gradient for a parameter (no microbatch, or an
        empty round) adds zeros. A frozen parameter has none to sum: its ``.grad``
        stays None on every rank (zeros would let an optimizer's weight decay move it).
        """
        for owner, owned in self._by_owner(p for p in params if p.requires_grad):
            flat = torch.cat([self._gradient_or_zeros(p).reshape(-1) for p in owned])
            dist.reduce(flat, dst=owner, group=self.groups.call(self.groups.data_group, "the sharded gradients' reduction"))
            offset = 0
            for param in owned:
                numel = true_numel(param)
                param.grad = flat[offset : offset + numel].view(true_shape(param)) if owner == self.groups.rank else None
                offset += numel

    def _gradient_or_zeros(self, param: nn.Parameter) -> torch.Tensor:
        if param.grad is not None:
            return param.grad
        return torch.zeros(true_shape(param), dtype=param.dtype, device=self.device)

    def broadcast_from_owners(self, params: Iterable[nn.Parameter]) -> None:
        """Give every rank of the stage each owner's values of ``params`` (one flat buffer per owner); a
        freed parameter gets its memory back."""
        self.finish_broadcast(self.start_broadcast(params))

    @torch.no_grad()
    def start_broadcast(self, params: Iterable[nn.Parameter]) -> list[Broadcast]:
        """Start :meth:`broadcast_from_owners` without waiting (a prefetch: compute goes on meanwhile)."""
        started = []
        for owner, owned in self._by_owner(params):
            if owner == self.groups.rank:
                flat = torch.cat([p.detach().reshape(-1) for p in owned])
            else:
                flat = torch.empty(sum(true_numel(p) for p in owned), dtype=owned[0].dtype, device=self.device)
            work = dist.broadcast(flat, src=owner, group=self.groups.call(self.groups.data_group, "the shards' broadcast"), async_op=True)
            started.append(Broadcast(owner, owned, flat, work))
        return started

    @torch.no_grad()
    def finish_broadcast(self, started: list[Broadcast]) -> None:
        """Wait for what :meth:`start_broadcast` started and write the received values into the parameters."""
        for broadcast in started:
            broadcast.work.wait()
            if broadcast.owner == self.groups.rank:
                continue
            offset = 0
            for param in broadcast.params:
                refill(param, broadcast.flat[offset : offset + true_numel(param)].view(true_shape(param)))
                offset += true_numel(param)

    def free_others(self, params: Iterable[nn.Parameter]) -> None:
        """Free the values (and gradients) of the parameters among ``params`` this rank does not own."""
        others = [p for p in params if not self.owns(p)]
        for param in others:
            param.grad = None
        free(others)

    @torch.no_grad()
    def gather_updates(self) -> None:
        """``optimizer`` level, after each owner stepped its shard: every rank of the stage gets the new values.

        One all-reduce (a sum) of the stage's weights, each rank filling its own
        shard and zeros elsewhere: exact (x + 0 is x), as cheap as the gradients'
        all-reduce whatever the shard sizes, and what the cost model prices
        (:func:`zorse_lightning.planner.cost.comm.stage_sync_ms`). Gradients of the
        parameters other ranks own are dropped here: this rank's optimizer does
        not know them, so its ``zero_grad`` would leave them to accumulate into
        the next step.
        """
        everything = [p for params in self.owned_by.values() for p in params]
        if len(self.owned_by) == 1 or not everything:
            return
        flat = torch.zeros(sum(local(p).numel() for p in everything), dtype=everything[0].dtype, device=self.device)
        offset = 0
        for rank, params in self.owned_by.items():
            for param in params:
                mine = local(param)
                if rank == self.groups.rank:
                    flat[offset : offset + mine.numel()].copy_(mine.detach().reshape(-1))
                else:
                    param.grad = None
                offset += mine.numel()
        dist.all_reduce(flat, group=self.groups.call(self.groups.data_group, "the stage's gradient reduction"))
        offset = 0
        for rank, params in self.owned_by.items():
            for param in params:
                mine = local(param)
                if rank != self.groups.rank:
                    mine.copy_(flat[offset : offset + mine.numel()].view_as(mine))
                offset += mine.numel()

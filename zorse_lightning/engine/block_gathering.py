"""``full`` sharding gathered block by block for each microbatch: a rank holds its own shard, the
parameters outside the blocks (embedding, norm, head) and one block's weights at a time.

Each block's parameters are gathered from their owners before its forward and
freed after it; gathered again when the gradient of its output arrives (before
its backward, or its recomputation), and their gradients are summed into the
owners once the block's backward is done, then freed with the weights. The
gather of the block that runs next starts (asynchronously) when a block starts,
so it overlaps that block's compute: two blocks' weights are held at a time. Owners
accumulate the sums of every microbatch in ``.grad``; the optimizer steps only
owned parameters. Parameters outside the blocks are kept whole and reduced to
their owners once per step, like ``optimizer_gradients``.

Every rank of the stage must make the same collectives in the same order. In a
microbatch (a round) that order is fixed: forward, the gathers of blocks
``0..L-1`` (of another stage's blocks: none); backward, for ``k = L-1..0`` the
sums of the blocks after ``k`` not summed yet, then the gather of ``k - 1``
(``k``'s started before); after backward, the sums left. Autograd computes a
block's weight gradients before the gradient of its input (``AccumulateGrad``
runs first), so when block ``k``'s output gradient arrives, block ``k + 1`` is
done; a gradient that arrives after its block was summed raises rather than
being lost. A rank with fewer microbatches than the stage's busiest makes empty
rounds (gathers and zeros, no compute) at the places its schedule would have
them (:mod:`..schedule.gathering_rounds`, which also says where a round meets
the pipeline's messages). Inside a pipeline the stage's last block ends the
microbatch on this rank by raising (:class:`~zorse_lightning.module.blocks.StageOutput`)
before its forward hook runs: :meth:`BlockGathering.stage_ended` does that
hook's work on the activation sent on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from zorse_lightning.engine.sharding import Broadcast, StageShards, free


def block_units(root: nn.Module, blocks: Sequence[nn.Module], local: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Per block, the local parameters that only modules of that block hold; a weight shared with another
    block or with a module outside the blocks (a tied embedding) is in no unit: it stays whole on every rank."""
    block_of = {id(m): k for k, block in enumerate(blocks) for m in block.modules()}
    places: dict[int, set[int | None]] = {}
    for module in root.modules():
        for param in module._parameters.values():
            if param is not None:
                places.setdefault(id(param), set()).add(block_of.get(id(module)))
    units: list[list[nn.Parameter]] = [[] for _ in blocks]
    for param in local:
        where = places.get(id(param), set())
        if len(where) == 1 and None not in where:
            units[next(iter(where))].append(param)
    return units


def _in_backward() -> bool:
    """Whether autograd is running a backward now (a checkpointed block's recomputation)."""
    return torch._C._current_graph_task_id() != -1


class BlockGathering:
    """The hooks and collectives of one rank (see the module's docstring)."""

    def __init__(self, blocks: Sequence[nn.Module], units: list[list[nn.Parameter]], shards: StageShards) -> None:
        self.units = units
        self.shards = shards
        self._gathered = [False] * len(units)
        self._summed = [False] * len(units)
        self._prefetched: dict[int, list[Broadcast]] = {}
        self._running = 0
        """The block whose forward ran last (the one that ends a stage inside a pipeline)."""
        self._handles = []
        for k, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(self._before_forward(k)))
            self._handles.append(block.register_forward_hook(self._after_forward(k)))
            for param in units[k]:
                if param.requires_grad:  # a frozen weight is gathered, but has no gradient
                    self._handles.append(param.register_post_accumulate_grad_hook(self._late_gradient(k)))
        free(self._others(range(len(units))))

    @property
    def unit_parameters(self) -> list[nn.Parameter]:
        return [p for unit in self.units for p in unit]

    def _others(self, ks) -> list[nn.Parameter]:
        return [p for k in ks for p in self.units[k] if not self.shards.owns(p)]

    # -- hooks ----------------------------------------------------------------------------

    def _before_forward(self, k: int):
        def hook(module: nn.Module, args: Any) -> None:
            self._running = k
            self._gather(k)
            self._prefetch(k + 1)

        return hook

    def _after_forward(self, k: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not _in_backward():  # a recomputation: the backward that follows needs the weights
                self._forward_done(k, output)

        return hook

    def _forward_done(self, k: int, output: Any) -> None:
        """Block ``k``'s forward is over: gather it again when its output's gradient arrives; free it now."""
        if torch.is_grad_enabled():
            for tensor in tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._before_backward(k))
        self._free(k)

    def stage_ended(self, activation: torch.Tensor) -> None:
        """The running block ended this rank's stage (it raised before its forward hook): do the hook's work on
        the ``activation`` it sent on, whose gradient starts the stage's backward."""
        self._forward_done(self._running, activation)

    def _before_backward(self, k: int):
        def hook(gradient: torch.Tensor) -> None:
            self._sum_after(k)
            self._gather(k)
            self._prefetch(k - 1)

        return hook

    def _late_gradient(self, k: int):
        def hook(param: nn.Parameter) -> None:
            if self._summed[k]:
                raise RuntimeError(
                    f"a gradient of block {k} arrived after the block's gradients were summed into their owners; "
                    f"block {k}'s weights are used after its output (outside the block?), which gathering block by "
                    f"block cannot follow: gather once per step (gather_per_microbatch false)"
                )

        return hook

    # -- collectives ----------------------------------------------------------------------

    def _gather(self, k: int) -> None:
        if not self._gathered[k]:
            self.shards.finish_broadcast(self._prefetched.pop(k, None) or self.shards.start_broadcast(self.units[k]))
            self._gathered[k] = True

    def _prefetch(self, k: int) -> None:
        """Start gathering the block that runs next while this one computes (one more block's weights held)."""
        if 0 <= k < len(self.units) and not self._gathered[k] and k not in self._prefetched:
            self._prefetched[k] = self.shards.start_broadcast(self.units[k])

    def _free(self, k: int) -> None:
        if self._gathered[k]:
            free(self._others([k]))
            self._gathered[k] = False

    def _sum_after(self, k: int) -> None:
        """Sum, last block first, the gradients of the blocks after ``k`` not summed yet."""
        for j in range(len(self.units) - 1, k, -1):
            if not self._summed[j]:
                self.shards.reduce_to_owners(self.units[j])
                self._summed[j] = True
                self._free(j)

    def finish_backward(self) -> None:
        """After a round's backward: sum what is left, free every gathered block; ready for the next round."""
        self._sum_after(-1)
        for k in range(len(self.units)):
            self._free(k)
        self._summed = [False] * len(self.units)

    def empty_forward(self) -> None:
        for k in range(len(self.units)):
            self._gather(k)
            self._prefetch(k + 1)
            self._free(k)

    def empty_backward(self) -> None:
        for k in range(len(self.units) - 1, -1, -1):
            self._sum_after(k)
            self._gather(k)
            self._prefetch(k - 1)
        self.finish_backward()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

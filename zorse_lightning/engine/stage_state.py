"""What a stage's sharding level does around the schedule: which weights a rank never materializes, when
weights are gathered and freed, where gradients are summed, which rank counts a gradient in the norm.

The executor asks this one object at each point of a step, so the levels
(:mod:`.sharding`) differ in one place. Ownership is decided before the stage
reaches the device (a weight this rank will only receive gets no memory then),
and again, identically, on the placed parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from zorse_lightning.capabilities import Sharding
from zorse_lightning.engine.block_gathering import BlockGathering, block_units
from zorse_lightning.engine.groups import StageGroups
from zorse_lightning.engine.sharding import StageShards, module_groups, settle


class ShardedStage:
    """One rank's part of a sharded stage (any level but ``none``)."""

    def __init__(
        self, root: nn.Module, local: Sequence[nn.Parameter], groups: StageGroups, device: torch.device,
        blocks: Sequence[nn.Module] | None,
    ) -> None:
        """``blocks``: the block list's blocks, needed when the stage gathers block by block."""
        stage = groups.stage
        self.root = root
        self.groups = groups
        self.device = device
        self.level = stage.sharding
        self.per_microbatch = self.level is Sharding.FULL and stage.gather_per_microbatch
        if self.per_microbatch and blocks is None:
            raise RuntimeError(
                "the plan gathers the stage's weights block by block (gather_per_microbatch), but the module has "
                "no block list; name it (block_path) or gather once per step"
            )
        self.blocks = blocks
        self.shards = StageShards(module_groups(root, local), groups, device)
        self._units_ids = {id(p) for unit in block_units(root, blocks, local) for p in unit} if self.per_microbatch else None
        self.gathering: BlockGathering | None = None
        self._gathered = True
        """``full`` gathered once per step: whether the weights of other owners are here now (always true at
        the other levels, and when blocks are gathered one at a time: nothing is gathered whole)."""

    def _freed_between_steps(self, param: nn.Parameter) -> bool:
        if self.level is not Sharding.FULL or self.shards.owns(param):
            return False
        return self._units_ids is None or id(param) in self._units_ids

    def never_placed(self, local: Sequence[nn.Parameter]) -> set[int]:
        """Ids of the parameters this rank does not materialize (``full``: the ones it only receives)."""
        return {id(p) for p in local if self._freed_between_steps(p)}

    def placed(self, local: Sequence[nn.Parameter]) -> None:
        """Ownership again on the placed parameters (the same assignment: the same modules and sizes)."""
        self.shards = StageShards(module_groups(self.root, local), self.groups, self.device)
        if self.per_microbatch:
            self.gathering = BlockGathering(self.blocks, block_units(self.root, self.blocks, local), self.shards)
        self._gathered = self.level is not Sharding.FULL or self.per_microbatch  # per microbatch: block by block
        self.settle(local)

    def settle(self, local: Sequence[nn.Parameter]) -> None:
        """Make the weights freed during a step safe to read until the next (``sharding.settle``)."""
        settle(p for p in local if not self.shards.owns(p))

    @property
    def reduces_own_gradients(self) -> bool:
        """Whether gradients of the stage's own weights go to their owners only (else the stage all-reduces)."""
        return self.level in (Sharding.OPTIMIZER_GRADIENTS, Sharding.FULL)

    @property
    def stepped(self) -> list[nn.Parameter]:
        return self.shards.mine

    def counts_in_norm(self, param: nn.Parameter) -> bool:
        return self.shards.owns(param)

    def before_run(self, local: Sequence[nn.Parameter]) -> bool:
        """``full`` once per step: gather what other ranks own before the first microbatch; whether it did."""
        if self._gathered:
            return False
        self.shards.broadcast_from_owners(local)
        self._gathered = True
        return True

    def release(self, local: Sequence[nn.Parameter]) -> None:
        """Free again what :meth:`before_run` gathered (after an evaluation between steps)."""
        self.shards.free_others(local)
        self._gathered = False
        self.settle(local)

    def _whole(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """Of ``params``, those outside the gathered blocks."""
        units = self.gathering.unit_parameters if self.gathering else []
        ids = {id(p) for p in units}
        return [p for p in params if id(p) not in ids]

    def reduce(self, own: Sequence[nn.Parameter], shared: Sequence[nn.Parameter]) -> None:
        """After the stage's other reductions: gradients of its own weights to their owners (blocks gathered
        per microbatch were summed already); a shared weight's gradient (summed over the stages holding it)
        stays with its owner only."""
        if not self.reduces_own_gradients:
            return
        self.shards.reduce_to_owners(self._whole(own))
        for param in shared:
            if not self.shards.owns(param):
                param.grad = None

    def after_step(self, local: Sequence[nn.Parameter]) -> None:
        """After the owners stepped: the new values reach the stage, or (``full``) other owners' are freed."""
        if self.level is Sharding.OPTIMIZER:
            self.shards.gather_updates()
        elif self.level is Sharding.OPTIMIZER_GRADIENTS or self.per_microbatch:
            self.shards.broadcast_from_owners(self._whole(local))
        else:
            self.release(local)

"""Putting one rank's stage in place before its first step, and its parameters' bookkeeping.

:meth:`StagePreparation.prepare` probes the module on a microbatch (what crosses each cut), cuts it, makes
the communicators, and puts only this rank's stage on the device (split over a TP group where the plan
asks); the bookkeeping says which stages hold each parameter, which this rank holds, and which parameter
now stands where one an optimizer made earlier names stood (:meth:`StagePreparation.setup_optimizer`).

Apart from running steps (:mod:`.executor`, whose :class:`~.executor.PipelineEngine` is this class with
its steps): this happens once per run and collectively, the steps every global batch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from zorse_lightning.capabilities import Sharding
from zorse_lightning.engine import gradients
from zorse_lightning.module.blocks import BlockList, CutError, find_block_list
from zorse_lightning.engine.activation_offload import ActivationOffload
from zorse_lightning.engine.cutting import StageCut, kept_activations_forward, release_module
from zorse_lightning.engine.communicators import make_communicators
from zorse_lightning.engine.groups import StageGroups
from zorse_lightning.module.microbatch import microbatch_slice
from zorse_lightning.module.cut_analysis import CutAnalysis, probe_cut
from zorse_lightning.module.first_block import first_block_view
from zorse_lightning.module.materialize import InitialValues, Swap, place_on_device
from zorse_lightning.engine.sharding import placeholders, restrict_optimizer
from zorse_lightning.engine.stage_state import ShardedStage
from zorse_lightning.engine import tensor_parallel
from zorse_lightning.module.tensor_parallel import BlockTensorPlan, Style, require_block_plan

if TYPE_CHECKING:
    from zorse_lightning.engine.p2p import Transport
    from zorse_lightning.schedule.programs import PipelineSchedule

StepFn = Callable[[Any, int], Any]


def loss_of(output: Any) -> torch.Tensor:
    """The loss a user step returned (a tensor, or a dict with ``"loss"``, as Lightning accepts)."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise RuntimeError(
            f"the step returned {type(output).__name__}; on the last stage it must return the loss tensor "
            f"(or a dict with 'loss'), which the pipeline backpropagates"
        )
    return loss


class StagePreparation:
    """One rank's stage put in place (:meth:`prepare`, once) and the bookkeeping of its parameters."""

    schedule: PipelineSchedule
    """The steps' schedule (set by :class:`~.executor.PipelineEngine`): :meth:`prepare` connects every direction
    of its messages."""
    transport: Transport
    """The steps' transport (set by :class:`~.executor.PipelineEngine`), which those connections serve."""

    def __init__(
        self,
        module: nn.Module,
        groups: StageGroups,
        device: torch.device,
        block_path: str | None,
        gradient_bucket_bytes: int,
        initial: InitialValues,
        tp_plan: dict[str, Style] | None,
    ) -> None:
        self.module = module
        self.tp_plan = tp_plan
        self.initial = initial
        self.gradient_bucket_bytes = gradient_bucket_bytes
        self.groups = groups
        self.plan = groups.plan
        self.device = device
        self.block_path = block_path
        self.cut: StageCut | None = None
        self.sharded: ShardedStage | None = None
        self.reduction: gradients.OverlappedReduction | None = None
        self._holders: dict[int, frozenset[int]] = {}
        self._replaced: dict[int, tuple[weakref.ref, nn.Parameter]] = {}
        """Parameters given a new tensor at :meth:`prepare` (placed on the device, then split over a TP group):
        old id -> (the old one, weakly: its id means it only while it lives; the one now in its place). Optimizers
        made before it still name the old ones."""
        self._leading_to: dict[int, list[int]] = {}
        """Id of a parameter now in place -> the ids in :attr:`_replaced` that lead to it."""
        self._prepared = False
        self._local: list[nn.Parameter] | None = None
        """:meth:`local_parameters` once the stage is placed."""
        self.offload: ActivationOffload | None = None
        """This rank's activation offload, where its stage has one (set at :meth:`prepare`)."""

    @property
    def is_pipelined(self) -> bool:
        return len(self.plan.stages) > 1

    @property
    def prepared(self) -> bool:
        return self._prepared

    def _my_share(self) -> range:
        if self.groups.is_idle:
            return range(0)
        return self.groups.stage.microbatch_ranges()[self.groups.rank]

    def prepare(self, batch: Any, step_fn: StepFn) -> None:
        """Probe the module on this rank's first microbatch, cut it and put the stage on the device
        (collective, once); an idle rank joins the probe's agreement, then frees its whole copy of the module.

        Only the stage reaches the device: tensors built on the meta device are
        materialized there, host tensors moved; the rest stays meta (no memory).
        """
        degrees = sorted({stage.tensor_parallel for stage in self.plan.stages} - {1})
        blocks = None
        if self.is_pipelined or self._gathers_per_microbatch or self._keeps_whole_module_activations or degrees:
            blocks = find_block_list(self.module, self.block_path)
        # checked on every rank, idle ones too: all refuse together, none waits for the others
        for index in range(len(self.plan.stages)):
            tensor_parallel.check_stage(self.plan, index)
        block_plans = {t: require_block_plan(self.module, blocks, t, self.tp_plan) for t in degrees}
        split = block_plans[self.groups.stage.tensor_parallel] if self._splits else None
        if self._keeps_whole_module_activations:  # a pipeline's cut wraps its own blocks
            self.offload = ActivationOffload(self.device) if self.groups.stage.offload_activations else None
            for index, block in enumerate(blocks.blocks):
                block.forward = kept_activations_forward(self.offload, index, block, block.forward, self.groups.stage.recompute)
        if self.is_pipelined:
            analysis = self._agreed_analysis(blocks, batch, step_fn)
        make_communicators(self.groups, self.transport, self.schedule, self.device, self.gradient_bucket_bytes // 4)
        if split is not None:
            tensor_parallel.agree_random_state(
                self.groups.tensor_group, self.groups.stage.tensor_group(self.groups.rank)[0], self.device, self.groups.call
            )
        if self.groups.is_idle:
            release_module(self.module)
        elif self.is_pipelined:
            self.cut = StageCut(self.module, blocks, analysis, self.plan, self.groups.stage_index, self.device)
            self.cut.apply()
            self.offload = self.cut.offload
            self._holders = dict(self.cut.holders)
        else:
            everyone = frozenset({0})
            self._holders = {id(p): everyone for p in self.module.parameters()}
        if not self.groups.is_idle:
            if self.groups.stage.sharding is not Sharding.NONE:
                self.sharded = ShardedStage(
                    self.module, self.local_parameters(), self.groups, self.device, blocks.blocks if blocks else None
                )
            self._place_stage(self.sharded.never_placed(self.local_parameters()) if self.sharded else set(), blocks, split)
            if self.sharded:
                self.sharded.placed(self.local_parameters())
        _, shared = self._own_and_shared()
        stage_wide = self.sharded is None or not self.sharded.reduces_own_gradients
        everyone = self._local_with_holders() if stage_wide else [(p, self._holders[id(p)]) for p in shared]
        self.reduction = gradients.OverlappedReduction(everyone, self.groups, self.gradient_bucket_bytes, self.device)
        self._local = self.local_parameters()
        self._prepared = True

    @property
    def recomputes(self) -> bool:
        """Whether this rank's blocks recompute their activations in backward (its stage's choice; the
        cut checkpoints every block the rank holds, a one-stage plan every block)."""
        return not self.groups.is_idle and self.groups.stage.recompute

    @property
    def _keeps_whole_module_activations(self) -> bool:
        """A one-stage plan that recomputes or offloads its blocks' activations."""
        stage = None if self.is_pipelined or self.groups.is_idle else self.groups.stage
        return stage is not None and (stage.recompute or stage.offload_activations)

    @property
    def _gathers_per_microbatch(self) -> bool:
        return not self.groups.is_idle and self.groups.stage.gather_per_microbatch

    @property
    def _splits(self) -> bool:
        """Whether this rank's stage splits its blocks over TP groups."""
        return not self.groups.is_idle and self.groups.stage.tensor_parallel > 1

    def _place_stage(self, received_only: set[int], blocks: BlockList | None, split: BlockTensorPlan | None = None) -> None:
        """``received_only``: ids of local parameters this rank only ever receives from their owner (no memory).
        ``split``: the blocks' TP plan where the stage has one: each block is placed, then split over the TP
        group, before the next is placed (a rank never holds its stage's blocks whole)."""

        def wanted(name: str, tensor: torch.Tensor) -> bool:
            if isinstance(tensor, nn.Parameter):
                return self.groups.stage_index in self._holders.get(id(tensor), ())
            return self.cut is None or self.cut.holds_buffers_of(name)

        for swap in placeholders(self.module, received_only, self.device):
            self._adopt(swap)
        if split is not None:
            mesh = tensor_parallel.mesh_of(self.groups.tensor_group, self.device)
            for index in self._local_blocks():
                prefix = f"{blocks.path}.{index}"

                def in_block(name: str, tensor: torch.Tensor, prefix=prefix) -> bool:
                    return (name == prefix or name.startswith(prefix + ".")) and wanted(name, tensor)

                for swap in place_on_device(self.module, self.device, in_block, self.initial):
                    self._adopt(swap)
                for old, new in tensor_parallel.parallelize_block(blocks.blocks[index], split, mesh):
                    self._adopt_parameter(old, new)
        for swap in place_on_device(self.module, self.device, wanted, self.initial):
            self._adopt(swap)

    def _local_blocks(self) -> list[int]:
        """Indices of the blocks this rank's stages hold (all of them in a plan of one stage)."""
        return [i for s in self.plan.stages_of_group(self.groups.stage_index) for i in range(*self.plan.stages[s].layers)]

    def _adopt(self, swap: Swap) -> None:
        if swap.is_parameter:
            self._adopt_parameter(swap.old, swap.new)

    def _adopt_parameter(self, old: nn.Parameter, new: nn.Parameter) -> None:
        """``new`` replaced ``old`` in the module: it has its holders, and an optimizer made before
        :meth:`prepare` that names ``old`` (or what ``old`` replaced) gets ``new``."""
        if id(old) not in self._holders:
            return
        self._holders[id(new)] = self._holders.pop(id(old))
        leading = [*self._leading_to.pop(id(old), []), id(old)]
        for key in leading:  # a replaced one replaced again (meta, placed, split) leads to the last
            self._replaced[key] = (self._replaced[key][0] if key != id(old) else weakref.ref(old), new)
        self._leading_to[id(new)] = leading

    def _current(self, param: nn.Parameter) -> nn.Parameter:
        """The parameter that now stands where ``param`` stood (itself if none replaced it). Replaced ones are not
        kept alive (a block's whole weights, once split, would stay in memory), so an id counts only while the
        object it was taken of lives: a freed one's id may be a new parameter's."""
        entry = self._replaced.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else param

    def _whole_fits_probe(self) -> bool:
        """Whether the probe may run the whole module: already real on this device (an eager module on a CPU
        rank); else it runs with one real block (:func:`first_block_view`)."""
        return all(t.device == self.device for t in (*self.module.parameters(), *self.module.buffers()))

    def _agreed_analysis(self, blocks: BlockList, batch: Any, step_fn: StepFn) -> CutAnalysis:
        mine = None
        share = self._my_share()
        if len(share):
            micro = microbatch_slice(batch, 0, self.plan.microbatch_size)
            devices = [self.device] if self.device.type == "cuda" else []
            view = nullcontext() if self._whole_fits_probe() else first_block_view(
                self.module, blocks, self.device, self.initial.seed
            )
            with torch.random.fork_rng(devices=devices), view:
                mine = probe_cut(self.module, blocks, lambda: loss_of(step_fn(micro, share.start)))
        analyses: list[CutAnalysis | None] = [None] * self.plan.world_size
        dist.all_gather_object(analyses, mine)
        agreed = next(a for a in analyses if a is not None)
        if agreed.problem:
            raise CutError(
                f"the plan cuts {type(self.module).__name__} into {len(self.plan.stages)} stages, but it cannot be "
                f"cut: {agreed.problem}. Use a plan without pipeline stages (data parallel), or name the block list"
            )
        return agreed

    def local_parameters(self) -> list[nn.Parameter]:
        """Parameters this rank holds (each once), in module order (none on an idle rank); a new list each call.

        Fixed once :meth:`prepare` has placed the stage, so listed once then: walking the module's parameters
        is several host milliseconds a step on a small model, called a few times a step."""
        if self._local is not None:
            return list(self._local)
        return [p for p in self.module.parameters() if self.groups.stage_index in self._holders.get(id(p), ())]

    def _own_and_shared(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """Local parameters held by this stage alone, and those other stages hold too (a tied embedding)."""
        own = frozenset({self.groups.stage_index})
        local = self._local_with_holders()
        return [p for p, h in local if h == own], [p for p, h in local if h != own]

    def _local_with_holders(self) -> list[tuple[nn.Parameter, frozenset[int]]]:
        return [(p, self._holders[id(p)]) for p in self.local_parameters()]

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep in ``optimizer`` only what this rank steps: its stage's weights, or its shard of them."""
        for group in optimizer.param_groups:
            group["params"] = [self._current(p) for p in group["params"]]
        restrict_optimizer(optimizer, self.sharded.stepped if self.sharded else self.local_parameters())

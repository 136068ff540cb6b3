"""Cutting the user's module into this rank's stage, in place, keeping the module's code.

The user's own step runs on every rank; what changes is the blocks' ``forward``:

- blocks before the stage pass their input through (it is a meta tensor there),
  in the form the blocks return it (:mod:`~zorse_lightning.module.block_output`);
- the first local block computes on the activation received from the previous
  stage instead of its input, swapped in by a forward pre-hook that runs before
  any other (so hooks around the call, such as an emulator's, see and may
  re-run the call the block computes, with the inputs it computes on);
- the last local block of a non-last stage records its activation and raises
  :class:`StageOutput`, which ends the microbatch on this rank (the executor
  sends the output on); blocks after it are never reached.

Weights are placed by where they run (:class:`CutAnalysis`): modules before the
chain (embeddings) on the first stage, after it (norm, head) on the last, blocks
on their stage, frozen modules whose outputs the blocks receive besides the chain
(a sinusoidal table) on every stage; a weight used on both sides (tied input/output embedding) is
held by both stages and its gradient summed between them. Everything else this
rank does not hold moves to the meta device (no memory), and modules before the
chain with weights give zeros of their output's shape on later stages (no weights,
no compute), since their outputs are replaced by the received activation anyway;
what the step derives from them before the blocks (position ids, masks, rotary
embeddings) is then computed for real on every stage, as the blocks need it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from zorse_lightning.engine.activation_offload import ActivationOffload
from zorse_lightning.module.block_output import activation_of
from zorse_lightning.module.blocks import BlockList, StageOutput
from zorse_lightning.module.cut_analysis import CutAnalysis
from zorse_lightning.module.materialize import replace_parameters
from zorse_lightning.schedule.plan import Plan

META = torch.device("meta")


def _to_meta(value: Any) -> Any:
    return value.to(META) if isinstance(value, torch.Tensor) else value


@contextmanager
def _meta_state(module: nn.Module) -> Iterator[None]:
    """Temporarily give ``module`` meta stand-ins for its own parameters and buffers."""
    saved = {name: dict(getattr(module, name)) for name in ("_parameters", "_buffers")}
    for name, entries in saved.items():
        for key, value in entries.items():
            if value is not None:
                getattr(module, name)[key] = value.detach().to(META)
    try:
        yield
    finally:
        for name, entries in saved.items():
            getattr(module, name).update(entries)


def holder_stages(root: nn.Module, blocks: BlockList, analysis: CutAnalysis, plan: Plan) -> dict[int, frozenset[int]]:
    """For each parameter (by ``id``), the groups of ranks that hold it (the stages, unless interleaved:
    a group then holds the blocks of all its chunks)."""
    last = plan.group_of_stage(len(plan.stages) - 1)
    everywhere = frozenset(range(plan.num_groups))
    group_of_block = {}
    for index, stage in enumerate(plan.stages):
        for block in range(*stage.layers):
            group_of_block[block] = plan.group_of_stage(index)
    holders: dict[int, set[int]] = {}
    inside_blocks = set()
    for block_index, block in enumerate(blocks.blocks):
        inside_blocks |= {id(m) for m in block.modules()}
        for param in block.parameters():
            holders.setdefault(id(param), set()).add(group_of_block[block_index])
    region = {name: {0} for name in analysis.pre_modules if name not in analysis.side_modules}
    for name in analysis.post_modules:
        region.setdefault(name, set()).add(last)
    for name, module in root.named_modules():
        if id(module) in inside_blocks:
            continue
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), set()).update(region.get(name, everywhere))
    return {key: frozenset(value) for key, value in holders.items()}


def release_parameters(root: nn.Module, keep: Callable[[nn.Parameter], bool]) -> None:
    """Move every parameter ``keep`` rejects to the meta device; a weight shared by several modules
    (tied embeddings) gets one meta stand-in, so it stays shared."""
    replace_parameters(
        root, lambda param: not keep(param), lambda param: nn.Parameter(param.detach().to(META), param.requires_grad)
    )


def release_module(root: nn.Module) -> None:
    """Free every parameter and buffer of ``root`` (an idle rank's copy of the model: it runs none of it)."""
    release_parameters(root, lambda param: False)
    for module in root.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = buffer.to(META)


class StageCut:
    """This rank's stage of the module: patches forwards and frees what other stages hold.

    Interleaved, the rank's group holds several chunks (stages) of the blocks; the executor
    names the one each action runs in :attr:`active`, and the patched forwards follow it.
    """

    def __init__(
        self,
        root: nn.Module,
        blocks: BlockList,
        analysis: CutAnalysis,
        plan: Plan,
        stage_index: int,
        device: torch.device | None = None,
    ) -> None:
        """``stage_index``: the rank's group (its first stage); ``device``: where this stage computes
        (the stand-ins of earlier stages' modules are made there)."""
        self.root = root
        self.device = device or torch.device("cpu")
        self.blocks = blocks
        self.analysis = analysis
        self.plan = plan
        self.stage_index = stage_index
        self.stage = plan.stages[stage_index]
        self.chunks = plan.stages_of_group(stage_index)
        """The stages this rank runs, in layer order (one unless interleaved)."""
        self.last_stage = len(plan.stages) - 1
        self.is_first = 0 in self.chunks
        self.is_last = self.last_stage in self.chunks
        self.holders = holder_stages(root, blocks, analysis, plan)
        self.incoming: torch.Tensor | None = None
        self.active = self.chunks[0]
        """The stage the running action belongs to (set by the executor before each)."""
        self.offload = ActivationOffload(self.device) if self.stage.offload_activations else None
        """The stage's activation offload (its blocks' saved tensors in host memory), where the plan asks for it."""

    def layers_of(self, stage: int) -> tuple[int, int]:
        return self.plan.stages[stage].layers

    def chunk_of_block(self, index: int) -> int | None:
        """The rank's stage that holds block ``index``, or None."""
        return next((s for s in self.chunks if self.layers_of(s)[0] <= index < self.layers_of(s)[1]), None)

    def receives_at(self, index: int) -> bool:
        """Whether block ``index`` takes the received activation in the running action."""
        return self.active > 0 and index == self.layers_of(self.active)[0]

    def ends_at(self, index: int) -> bool:
        """Whether block ``index`` ends the running action's stage (before the model's end)."""
        return self.active < self.last_stage and index == self.layers_of(self.active)[1] - 1

    # -- placement ----------------------------------------------------------------------

    def is_local(self, param: nn.Parameter) -> bool:
        return self.stage_index in self.holders.get(id(param), frozenset())

    def holds_buffers_of(self, module_name: str) -> bool:
        """Whether this stage keeps the buffers of the named module: all but those of other stages' blocks."""
        prefix = f"{self.blocks.path}."
        if not module_name.startswith(prefix):
            return True
        index = list(self.blocks.container._modules).index(module_name[len(prefix):].split(".")[0])
        return self.chunk_of_block(index) is not None

    def apply(self) -> None:
        """Free other stages' weights and patch the forwards (once, before training)."""
        release_parameters(self.root, self.is_local)
        self._free_outside_buffers()
        for index, block in enumerate(self.blocks.blocks):
            block.forward = self._block_forward(index, block, block.forward)
        for stage in self.chunks:
            if stage > 0:
                start = self.layers_of(stage)[0]
                self.blocks.blocks[start].register_forward_pre_hook(self._swap_in_received(start), prepend=True)
        for name in self.analysis.pre_modules:
            module = self.root.get_submodule(name)
            if module._parameters and name not in self.analysis.side_modules:  # weights only the first stage uses
                module.forward = self._stand_in_forward(module, module.forward)

    def _free_outside_buffers(self) -> None:
        for index, block in enumerate(self.blocks.blocks):
            if self.chunk_of_block(index) is None:
                for module in block.modules():
                    for key, buffer in module._buffers.items():
                        if buffer is not None:
                            module._buffers[key] = buffer.to(META)

    # -- patched forwards ---------------------------------------------------------------

    def _stand_in_forward(self, module: nn.Module, original: Callable) -> Callable:
        """Outside the first stage: zeros of the module's output shapes on the device, without its
        weights (shapes from a meta run).

        What the rest of the step computes from them before the blocks (position
        ids, masks, rotary embeddings: the side inputs every block receives) is then
        real on this stage, and exact, since it depends on shapes and the batch
        only; the first local block swaps the zeros for the received activation.
        """

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.active == 0:
                return original(*args, **kwargs)
            with _meta_state(module):
                shaped = original(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
            return tree_map(self._zeros_like, shaped)

        return forward

    def _zeros_like(self, value: Any) -> Any:
        return torch.zeros(value.shape, dtype=value.dtype, device=self.device) if isinstance(value, torch.Tensor) else value

    def _swap_in_received(self, index: int) -> Callable:
        """Pre-hook of block ``index``, the first of one of this rank's stages: the received activation in
        place of its input (a stand-in passed on) while that stage runs.

        A hook, not part of the patched forward: a hook that re-runs the call
        (the emulator's calibration, on inputs resized to its own sample count)
        must find the block computing on the inputs it was given, or the block
        would mix the received microbatch with side inputs of another size.
        """

        def swap_in(module: nn.Module, args: tuple) -> tuple | None:
            if not self.receives_at(index):
                return None
            if self.incoming is None:
                raise RuntimeError(f"block {index} expects an activation from the previous stage; none was received")
            return (self.incoming, *args[1:])

        return swap_in

    def _block_forward(self, index: int, block: nn.Module, original: Callable) -> Callable:
        compute = kept_activations_forward(self.offload, index, block, original, self.stage.recompute)

        def forward(*args: Any, **kwargs: Any) -> Any:
            start, end = self.layers_of(self.active)
            if index < start:  # before the running stage: its input is a stand-in, passed on
                return self.analysis.output_form.passed_on(args, kwargs)
            if index >= end:
                raise RuntimeError(
                    f"block {index} of {self.blocks.path} was called on stage {self.active} (layers {start}..{end - 1}) "
                    f"after the stage's last block; the step caught the stage's end (StageOutput) and went on"
                )
            output = compute(*args, **kwargs)
            if self.ends_at(index):
                raise StageOutput(activation_of(output))
            return output

        return forward


def kept_activations_forward(
    offload: ActivationOffload | None, index: int, block: nn.Module, original: Callable, recompute: bool
) -> Callable:
    """Block ``index``'s forward as its stage keeps activations for the backward (the stage's blocks and a
    one-stage plan's alike): recomputed (``recompute``), and what is kept in host memory (``offload``): every
    saved tensor, or with recomputation only the block's input, which is all the checkpoint saves outside
    its own hooks."""
    compute = checkpoint_forward(original) if recompute else original
    return offload.wrap(index, block, compute) if offload is not None else compute


def checkpoint_forward(original: Callable) -> Callable:
    """Recompute the block in backward instead of keeping its activations."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    return forward

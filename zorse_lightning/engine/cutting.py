"""Cutting the user's module into this rank's stage, in place, keeping the module's code.

The user's own step runs on every rank; what changes is the blocks' ``forward``:

- blocks before the stage pass their input through (it is a meta tensor there);
- the first local block computes on the activation received from the previous
  stage instead of its input;
- the last local block of a non-last stage records its output and raises
  :class:`StageOutput`, which ends the microbatch on this rank (the executor
  sends the output on); blocks after it are never reached.

Weights are placed by where they run (:class:`CutAnalysis`): modules before the
chain (embeddings) on the first stage, after it (norm, head) on the last, blocks
on their stage; a weight used on both sides (tied input/output embedding) is
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

from zorse_lightning.module.blocks import BlockList
from zorse_lightning.module.cut_analysis import CutAnalysis
from zorse_lightning.module.materialize import replace_parameters
from zorse_lightning.planner.plan import Plan

META = torch.device("meta")


class StageOutput(Exception):
    """Raised by the last local block of a non-last stage: the microbatch ends on this rank here."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__("stage output (caught by the executor)")
        self.output = output


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
    """For each parameter (by ``id``), the stages that hold it."""
    last = len(plan.stages) - 1
    everywhere = frozenset(range(last + 1))
    stage_of_block = {}
    for index, stage in enumerate(plan.stages):
        for block in range(*stage.layers):
            stage_of_block[block] = index
    holders: dict[int, set[int]] = {}
    inside_blocks = set()
    for block_index, block in enumerate(blocks.blocks):
        inside_blocks |= {id(m) for m in block.modules()}
        for param in block.parameters():
            holders.setdefault(id(param), set()).add(stage_of_block[block_index])
    region = {name: {0} for name in analysis.pre_modules}
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
    """This rank's stage of the module: patches forwards and frees what other stages hold."""

    def __init__(
        self,
        root: nn.Module,
        blocks: BlockList,
        analysis: CutAnalysis,
        plan: Plan,
        stage_index: int,
        device: torch.device | None = None,
    ) -> None:
        """``device``: where this stage computes (the stand-ins of earlier stages' modules are made there)."""
        self.root = root
        self.device = device or torch.device("cpu")
        self.blocks = blocks
        self.analysis = analysis
        self.plan = plan
        self.stage_index = stage_index
        self.stage = plan.stages[stage_index]
        self.is_first = stage_index == 0
        self.is_last = stage_index == len(plan.stages) - 1
        self.holders = holder_stages(root, blocks, analysis, plan)
        self.incoming: torch.Tensor | None = None

    # -- placement ----------------------------------------------------------------------

    def is_local(self, param: nn.Parameter) -> bool:
        return self.stage_index in self.holders.get(id(param), frozenset())

    def holds_buffers_of(self, module_name: str) -> bool:
        """Whether this stage keeps the buffers of the named module: all but those of other stages' blocks."""
        start, end = self.stage.layers
        prefix = f"{self.blocks.path}."
        if not module_name.startswith(prefix):
            return True
        index = list(self.blocks.container._modules).index(module_name[len(prefix):].split(".")[0])
        return start <= index < end

    def apply(self) -> None:
        """Free other stages' weights and patch the forwards (once, before training)."""
        release_parameters(self.root, self.is_local)
        self._free_outside_buffers()
        for index, block in enumerate(self.blocks.blocks):
            block.forward = self._block_forward(index, block.forward)
        if not self.is_first:
            for name in self.analysis.pre_modules:
                module = self.root.get_submodule(name)
                if module._parameters:  # weights this stage does not hold; buffer-only modules run for real
                    module.forward = self._stand_in_forward(module, module.forward)

    def _free_outside_buffers(self) -> None:
        start, end = self.stage.layers
        for index, block in enumerate(self.blocks.blocks):
            if not start <= index < end:
                for module in block.modules():
                    for key, buffer in module._buffers.items():
                        if buffer is not None:
                            module._buffers[key] = buffer.to(META)

    # -- patched forwards ---------------------------------------------------------------

    def _stand_in_forward(self, module: nn.Module, original: Callable) -> Callable:
        """Zeros of the module's output shapes on the device, without its weights (shapes from a meta run).

        What the rest of the step computes from them before the blocks (position
        ids, masks, rotary embeddings: the side inputs every block receives) is then
        real on this stage, and exact, since it depends on shapes and the batch
        only; the first local block swaps the zeros for the received activation.
        """

        def forward(*args: Any, **kwargs: Any) -> Any:
            with _meta_state(module):
                shaped = original(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
            return tree_map(self._zeros_like, shaped)

        return forward

    def _zeros_like(self, value: Any) -> Any:
        return torch.zeros(value.shape, dtype=value.dtype, device=self.device) if isinstance(value, torch.Tensor) else value

    def _block_forward(self, index: int, original: Callable) -> Callable:
        start, end = self.stage.layers
        receives = index == start and not self.is_first
        ends_stage = index == end - 1 and not self.is_last
        compute = checkpoint_forward(original) if self.stage.recompute else original

        def passthrough(*args: Any, **kwargs: Any) -> Any:
            return args[0]

        def local(*args: Any, **kwargs: Any) -> Any:
            if receives:
                if self.incoming is None:
                    raise RuntimeError(f"block {index} expects an activation from the previous stage; none was received")
                args = (self.incoming, *args[1:])
            output = compute(*args, **kwargs)
            if ends_stage:
                raise StageOutput(output)
            return output

        def unreachable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"block {index} of {self.blocks.path} was called on stage {self.stage_index} (layers {start}..{end - 1}) "
                f"after the stage's last block; the step caught the stage's end (StageOutput) and went on"
            )

        if index < start:
            return passthrough
        return local if index < end else unreachable


def checkpoint_forward(original: Callable) -> Callable:
    """Recompute the block in backward instead of keeping its activations."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    return forward

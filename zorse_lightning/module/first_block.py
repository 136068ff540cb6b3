"""Running the user's step with one real block: how start-up profiles and probes a model no device holds whole.

Inside :func:`first_block_view` the first block and every module outside the
block list (embeddings, final norm, head) hold real tensors on the device, and
the other blocks pass their input through. The user's step then runs as it is:
block 0 receives exactly what it receives in a real forward (activation, masks,
rotary embeddings as keyword arguments), the edges run on real values, and the
device holds the edges and one block, never the model. Blocks of one list share
a class (:mod:`.blocks`), so block 0's time and memory stand for each of them.

Tensors are materialized on the device where the module was built on the meta
device (initialised as :mod:`.materialize` says, so values are sane), or moved
there from the host; on exit every slot holds what it held before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from zorse_lightning.module.block_output import OutputForm
from zorse_lightning.module.blocks import BlockList
from zorse_lightning.module.materialize import materialize, move_to_device, undo


def _view_tensor_ids(root: nn.Module, blocks: BlockList) -> set[int]:
    """Ids of the tensors of block 0 and of every module outside the block list."""
    later = {id(m) for block in blocks.blocks[1:] for m in block.modules()}
    return {
        id(t)
        for module in root.modules()
        if id(module) not in later
        for t in (*module._parameters.values(), *module._buffers.values())
        if t is not None
    }


class FirstBlockView:
    """What the view learns while the step runs in it: the form block 0 returns its activation in, which the
    blocks after it return too (:mod:`.block_output`)."""

    def __init__(self) -> None:
        self.output_form = OutputForm()

    def learn(self, _module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.output_form = OutputForm.of(output, args, kwargs) or OutputForm()

    def pass_on(self, *args: Any, **kwargs: Any) -> Any:
        return self.output_form.passed_on(args, kwargs)


@contextmanager
def first_block_view(
    root: nn.Module, blocks: BlockList, device: torch.device, seed: int = 0
) -> Iterator[FirstBlockView]:
    """Inside: block 0 and the modules outside the block list real on ``device``, blocks 1.. pass through
    (in the form block 0 returned, learnt at each of its calls)."""
    ids = _view_tensor_ids(root, blocks)
    swaps = materialize(root, device, seed, wanted=lambda name, tensor: id(tensor) in ids, strict=False)
    swaps += move_to_device(root, device, ids)
    view = FirstBlockView()
    handle = blocks.blocks[0].register_forward_hook(view.learn, with_kwargs=True)
    patched = [block for block in blocks.blocks[1:] if "forward" not in block.__dict__]
    for block in patched:
        block.forward = view.pass_on
    try:
        yield view
    finally:
        handle.remove()
        for block in patched:
            del block.forward
        undo(swaps)

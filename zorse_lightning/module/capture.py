"""What a module's own step hands to its parts, seen from hooks on one real call.

Profiling needs inputs as a real forward makes them (a block's input is the
previous block's output, not something a profiler could guess from the batch),
so they are captured from the user's step and the step is stopped as soon as
the value is seen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zorse_lightning.module.blocks import BlockList, CutError
from zorse_lightning.module.call_inputs import replace_tensors


class _Seen(Exception):
    """Stops the step once the first block has its input: nothing after it is needed."""


def first_block_call(first_block: nn.Module, run: Callable[[], Any]) -> tuple[tuple, dict]:
    """The call ``first_block`` receives when ``run()`` (the user's step) calls it: ``(args, kwargs)``, tensors
    detached; the activation first, then what else a real forward passes (masks, rotary embeddings, a cache)."""
    captured: list[tuple[tuple, dict]] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured.append(replace_tensors((args, kwargs), lambda t: t.detach()))
        raise _Seen

    handle = first_block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        run()
    except _Seen:
        pass
    finally:
        handle.remove()
    if not captured or not captured[0][0] or not isinstance(captured[0][0][0], torch.Tensor):
        raise CutError(
            f"the training step did not call the block list's first block ({type(first_block).__name__}) with the "
            f"activation as its first positional argument; name the blocks the step runs with "
            f"ZorseStrategy(block_path=...)"
        )
    return captured[0]


def first_block_input(first_block: nn.Module, run: Callable[[], Any]) -> torch.Tensor:
    """The activation ``first_block`` receives when ``run()`` calls it, detached."""
    return first_block_call(first_block, run)[0][0]


def edge_parameter_ids(root: nn.Module, blocks: BlockList, run: Callable[[], Any]) -> tuple[set[int], set[int]]:
    """Ids of the parameters of modules that run before the first block and after it (head, final norm).

    A parameter in both sets is shared between the two ends (a tied embedding
    and head), which the planner must synchronise between the first and last stage.
    """
    inside = {id(m) for b in blocks.blocks for m in b.modules()}
    seen_block = [False]
    before: set[int] = set()
    after: set[int] = set()

    def hook(module: nn.Module, args: tuple) -> None:
        if id(module) in inside:
            seen_block[0] = True
        else:
            (after if seen_block[0] else before).update(id(p) for p in module.parameters(recurse=False))

    handles = [m.register_forward_pre_hook(hook) for m in root.modules()]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return before, after

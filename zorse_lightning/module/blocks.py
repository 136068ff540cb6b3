"""Finding the block list of a user's module, without running it.

The block list is the chain the pipeline cuts: the longest ``nn.ModuleList`` or
``nn.Sequential`` whose entries are all of one class (transformer layers), or the
attribute the user names. Two equally long lists of different classes (an
encoder's layers and a decoder's) mean values other than the chain would cross a
cut, so the module is reported as not cuttable, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from zorse_lightning.errors import PlanningError

MIN_BLOCKS = 2


class CutError(PlanningError):
    """The module cannot be cut into pipeline stages; the message says why and what to do."""


class StageOutput(Exception):
    """Raised by the last local block of a non-last stage: the microbatch ends on this rank here (raised by the
    engine's cut, caught by its executor; an emulated rank's hooks pass it on)."""

    def __init__(self, output: Any) -> None:
        super().__init__("stage output (caught by the executor)")
        self.output = output


@dataclass(frozen=True)
class BlockList:
    path: str
    """Attribute path from the root module (``"blocks"``, ``"model.layers"``)."""
    container: nn.Module
    block_class: str

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.container.children())

    def __len__(self) -> int:
        return len(self.blocks)


def _candidates(root: nn.Module) -> list[BlockList]:
    found = []
    for path, module in root.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        classes = {type(child) for child in children}
        if len(children) >= MIN_BLOCKS and len(classes) == 1:
            found.append(BlockList(path, module, type(children[0]).__name__))
    return found


def find_block_list(root: nn.Module, path: str | None = None) -> BlockList:
    """The block list of ``root`` (or the one at ``path``); raises :class:`CutError` with the reason."""
    if path is not None:
        try:
            container = root.get_submodule(path)
        except AttributeError as error:
            raise CutError(
                f"block_path={path!r} names no submodule of {type(root).__name__} ({error}); "
                f"give the attribute path of the list of repeated blocks, e.g. 'model.layers'"
            ) from None
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(list(container.children())) < 1:
            raise CutError(
                f"block_path={path!r} is a {type(container).__name__}, not a non-empty nn.ModuleList or "
                f"nn.Sequential of blocks; name the list that holds the repeated layers"
            )
        children = list(container.children())
        return BlockList(path, container, type(children[0]).__name__)
    candidates = _candidates(root)
    if not candidates:
        raise CutError(
            f"{type(root).__name__} has no nn.ModuleList or nn.Sequential of at least {MIN_BLOCKS} modules of one "
            f"class, so it cannot be cut into pipeline stages; it trains data parallel. To pipeline it, keep "
            f"the repeated layers in such a list and pass its attribute path as block_path"
        )
    longest = max(len(c) for c in candidates)
    top = [c for c in candidates if len(c) == longest]
    if len({c.block_class for c in top}) > 1:
        names = ", ".join(f"{c.path} ({longest} x {c.block_class})" for c in top)
        raise CutError(
            f"{type(root).__name__} has several block lists of equal length: {names}. This is the shape of an "
            f"encoder-decoder, where values other than the block chain cross any cut, so it trains data "
            f"parallel. If one list is the whole chain, pass its path as block_path"
        )
    return top[0]


def find_block_list_or_none(root: nn.Module, path: str | None = None) -> BlockList | None:
    """The block list :func:`find_block_list` finds in ``root``, or None where that raises :class:`CutError`.

    For callers that carry on without a chain (the emulator then emulates each
    part of the model whole) rather than refuse the model, so that they and the
    cut agree on which list the blocks are.
    """
    try:
        return find_block_list(root, path)
    except CutError:
        return None

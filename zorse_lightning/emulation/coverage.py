"""Which modules of a model an emulator instruments: pieces that cover its compute without nesting.

Apart from the emulator (:mod:`.emulator`: how an instrumented module is slowed and charged), because
start-up's profiles and a rank's stage pick their modules here too, and all of them must name the same
pieces for costs calibrated once to serve every one.
"""

from __future__ import annotations

from torch import nn

from zorse_lightning.module.blocks import find_block_list_or_none


def emulated_modules(root: nn.Module) -> list[nn.Module]:
    """The modules of :func:`named_emulated_modules`, without their names."""
    return [module for _, module in named_emulated_modules(root)]


def named_emulated_modules(root: nn.Module, block_path: str | None = None) -> list[tuple[str, nn.Module]]:
    """Modules that cover the compute of ``root`` without nesting, with their names in ``root``: the blocks,
    and the other parts whole.

    The block list is the one :func:`~zorse_lightning.module.blocks.find_block_list`
    finds (at ``block_path`` where the user names it), so the emulator and the cut
    agree on what a block is; each block is emulated alone, so a pipeline stage pays for its own
    blocks. Every other child that holds parameters (embeddings, head, final
    norm) is emulated as one piece; parameterless children (activations, dropout,
    metrics) cost little and are left alone. Without a block list to cut (none,
    or an encoder-decoder's two), each such child is emulated whole.
    """
    found = find_block_list_or_none(root, block_path)
    blocks = found.container if found is not None else None
    covered: list[tuple[str, nn.Module]] = []

    def cover(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if child is blocks:
                covered.extend((f"{prefix}{name}.{n}", block) for n, block in child.named_children())
            elif blocks is not None and any(m is blocks for m in child.modules()):
                cover(child, f"{prefix}{name}.")
            elif any(True for _ in child.parameters()):
                covered.append((f"{prefix}{name}", child))

    cover(root, "")
    return covered

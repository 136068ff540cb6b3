"""Checking, on one real microbatch, that the block chain is the only value crossing cuts.

The probe runs the user's step once on the whole module with hooks that record
which parameterised modules run before the first block (embeddings: first stage
only), after the last (final norm, head: last stage only), and what each block
receives. From the autograd graph it then checks that

- blocks run once each, in order, and block ``i+1`` receives block ``i``'s output
  itself (an operation between blocks would be lost at a cut);
- no block receives, besides the chain, a value computed from trainable weights before
  the blocks or from a block output (the decoder of an encoder-decoder receives the
  encoder's output); a module before the blocks whose weights are all frozen and
  whose output the blocks receive so (RoFormer's sinusoidal table) runs on every
  stage (:attr:`CutAnalysis.side_modules`);
- the loss depends on the embeddings and earlier blocks only through the last
  block's output (no skip connection around the chain).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zorse_lightning.module.block_output import OutputForm, activation_of
from zorse_lightning.module.blocks import BlockList


@dataclass(frozen=True)
class CutAnalysis:
    """Where each parameterised module runs relative to the block chain."""

    block_path: str
    num_blocks: int
    pre_modules: tuple[str, ...]
    """Modules (with their own parameters or buffers) that run before the first block."""
    post_modules: tuple[str, ...]
    """Modules that run after the last block."""
    problem: str | None = None
    """Why the module cannot be cut (None: it can)."""
    output_form: OutputForm = OutputForm()
    """How the blocks return their activation (what a block passing its input on returns)."""
    side_modules: tuple[str, ...] = ()
    """Modules of ``pre_modules`` whose weights are all frozen and whose outputs the blocks receive besides the
    chain: every stage holds their weights and runs them for real, as it runs modules of buffers only."""


def _owns_state(module: nn.Module) -> bool:
    return bool(module._parameters) or bool(module._buffers)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def _frozen(module: nn.Module) -> bool:
    """Whether ``module`` has weights of its own and none is trained."""
    weights = [p for p in module._parameters.values() if p is not None]
    return bool(weights) and not any(p.requires_grad for p in weights)


@contextmanager
def _frozen_traced(modules: list[nn.Module]) -> Iterator[None]:
    """The frozen weights of ``modules`` requiring grad while the probe runs, so that the graph shows where
    their outputs go; frozen again after."""
    weights = [p for m in modules if _frozen(m) for p in m._parameters.values() if p is not None and p.is_floating_point()]
    for weight in weights:
        weight.requires_grad_(True)
    try:
        yield
    finally:
        for weight in weights:
            weight.requires_grad_(False)


def _reaches(starts: list[torch.Tensor], targets: set, stop: set, weights: frozenset[int] = frozenset()) -> bool:
    """Whether the autograd graph behind ``starts`` contains a node of ``targets`` or accumulates into one of
    ``weights`` (ids of parameters; not walking past ``stop``)."""
    pending = [t.grad_fn for t in starts if t.grad_fn is not None]
    seen = set()
    while pending:
        node = pending.pop()
        if node in seen or node in stop:
            continue
        if node in targets or id(getattr(node, "variable", None)) in weights:
            return True
        seen.add(node)
        pending.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return False


class _Recorder:
    def __init__(self, root: nn.Module, blocks: BlockList) -> None:
        block_ids = {id(m) for block in blocks.blocks for m in block.modules()} | {id(blocks.container)}
        self.watched = [(n, m) for n, m in root.named_modules() if _owns_state(m) and id(m) not in block_ids]
        self.blocks = blocks.blocks
        self.block_calls: list[tuple[int, tuple, dict, Any]] = []
        self.module_calls: list[tuple[str, int]] = []
        """(module name, number of blocks that had run when it was called)."""
        self.pre_outputs: dict[str, list[torch.Tensor]] = {}
        """The outputs of each module called before the first block."""
        self.handles = []

    def __enter__(self) -> _Recorder:
        for name, module in self.watched:
            self.handles.append(module.register_forward_hook(self._module_hook(name)))
        for index, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_hook(self._block_hook(index), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _module_hook(self, name: str):
        def hook(module, args, output):
            self.module_calls.append((name, len(self.block_calls)))
            if not self.block_calls:
                self.pre_outputs.setdefault(name, []).extend(_tensors(output))

        return hook

    def _block_hook(self, index: int):
        def hook(module, args, kwargs, output):
            self.block_calls.append((index, args, kwargs, output))

        return hook


def probe_cut(root: nn.Module, blocks: BlockList, run_step: Callable[[], Any]) -> CutAnalysis:
    """Run ``run_step`` (the user's step on one microbatch, returning the loss) and analyse it."""
    with _Recorder(root, blocks) as rec, _frozen_traced([m for _, m in rec.watched]), torch.enable_grad():
        loss = run_step()
    count = len(blocks)
    pre = tuple(dict.fromkeys(n for n, calls in rec.module_calls if calls == 0))
    post = tuple(dict.fromkeys(n for n, calls in rec.module_calls if calls == count))

    forms = [OutputForm.of(output, args, kwargs) for _, args, kwargs, output in rec.block_calls]

    side: tuple[str, ...] = ()  # known once the checks pass

    def analysis(problem: str | None) -> CutAnalysis:
        return CutAnalysis(blocks.path, count, pre, post, problem, forms[0] if forms and forms[0] else OutputForm(), side)

    order = [index for index, *_ in rec.block_calls]
    if order != list(range(count)):
        return analysis(f"the blocks of {blocks.path} ran in the order {order}, not once each in order 0..{count - 1}")
    between = sorted({n for n, calls in rec.module_calls if 0 < calls < count})
    if between:
        return analysis(f"modules {between} run between blocks of {blocks.path}; their weights would be needed on every stage")
    if None in forms:
        odd = next(output for (*_, output), form in zip(rec.block_calls, forms) if form is None)
        return analysis(
            f"the blocks of {blocks.path} return {type(odd).__name__}, neither a tensor nor a tuple or list that "
            f"starts with one (the activation passed to the next block)"
        )
    if len(set(forms)) > 1:
        return analysis(f"the blocks of {blocks.path} return their activation in different forms: {sorted(set(map(str, forms)))}")
    outputs = [activation_of(output) for *_, output in rec.block_calls]
    for index, args, kwargs, _ in rec.block_calls[1:]:
        if not args or args[0] is not outputs[index - 1]:
            return analysis(
                f"block {index} of {blocks.path} does not receive block {index - 1}'s output itself as its first "
                f"argument; an operation between blocks would be lost at a cut"
            )
    frozen = {name for name, module in rec.watched if _frozen(module)}
    nodes = {name: {t.grad_fn for t in ts if t.grad_fn is not None} for name, ts in rec.pre_outputs.items()}
    chain = {o.grad_fn for o in outputs if o.grad_fn is not None}
    earlier = chain.union(*(n for name, n in nodes.items() if name not in frozen))
    trained = frozenset(id(p) for name, module in rec.watched if name in pre for p in module._parameters.values() if p is not None and p.requires_grad)
    extras = [_tensors((args[1:], kwargs)) if args else _tensors(kwargs) for _, args, kwargs, _ in rec.block_calls]
    for index, extra in enumerate(extras):
        if _reaches(extra, chain, stop=set(), weights=trained):
            return analysis(
                f"block {index} of {blocks.path} receives, besides the chain, a value computed from the embeddings "
                f"or other blocks (as in an encoder-decoder); it would have to cross the cut"
            )
    side = tuple(name for name in pre if name in frozen and any(_reaches(extra, nodes.get(name, set()), stop=chain) for extra in extras))
    loss_tensors = _tensors(loss)
    last = outputs[-1].grad_fn
    if last is not None and _reaches(loss_tensors, earlier - {last}, stop={last}):
        return analysis(
            f"the loss depends on the embeddings or earlier blocks other than through the last block of "
            f"{blocks.path} (a skip connection around the chain); such values would have to cross the cut"
        )
    return analysis(None)

"""Real tensors for a module built on the meta device, only where a rank needs them, with reproducible values.

A model that no single GPU holds is built on the meta device (Lightning's
``configure_model`` hook, or ``Trainer.init_module(empty_init=True)``): shapes
without memory. After planning, each rank gives real tensors to what its stage
holds, and nothing else. The values must not depend on which part a rank
materializes, or pipelined training could never equal single-process training,
so each module is initialised on its own random stream, seeded by the run's seed
and the module's name (:func:`module_seed`):

- the submodule's own ``reset_parameters()`` where it has one (torch's convention:
  ``Linear``, ``Embedding``, ``LayerNorm``...; FSDP materializes the same way);
- then the initialiser of the deepest module around it that defines one: our
  ``initialize_submodule(name, module)`` (a model's own initialisation, called once
  per submodule that owns tensors; the project's GPT has one), else Hugging
  Face's ``_init_weights(module)`` (which also computes rotary ``inv_freq``);
- a submodule with its own tensors and neither is refused, naming it.

A reference that materializes the whole module the same way (:func:`materialize`
with no filter, on one process) starts from exactly the same values. A weight
shared by several modules (a tied embedding and head) is one tensor, initialised
by the first module in order that owns it.
"""

from __future__ import annotations

import os
import zlib
from functools import partial
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from zorse_lightning.errors import ZorseUserError
from zorse_lightning.module.stage_weights import WeightSource, read_into

INIT_HOOK = "initialize_submodule"
"""Name of the optional per-submodule initialiser a model defines: ``initialize_submodule(name, module)``, ``name``
relative to the model (the deepest enclosing model that defines it is asked)."""

Wanted = Callable[[str, torch.Tensor], bool]
"""``wanted(module_name, tensor)``: whether this rank materializes ``tensor`` (a parameter or buffer)."""


def module_seed(seed: int, name: str) -> int:
    """The random seed of submodule ``name``: independent of which other modules a rank materializes."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


FREED_SHAPE = "_zorse_freed_shape"
"""Attribute of a parameter whose values sharding released between steps (``engine.sharding.settle``): its
real shape, while the tensor itself is empty."""


def holds_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has values on this rank: not on the meta device, and not a weight whose values
    sharding freed (``engine.sharding``)."""
    if tensor.is_meta or hasattr(tensor, FREED_SHAPE):
        return False
    return not (tensor.numel() and tensor.untyped_storage().nbytes() == 0)


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


@dataclass(frozen=True)
class Swap:
    """One tensor slot of a module replaced by :func:`materialize` (``kind`` is ``_parameters`` or ``_buffers``)."""

    module: nn.Module
    kind: str
    key: str
    old: torch.Tensor
    new: torch.Tensor

    @property
    def is_parameter(self) -> bool:
        return self.kind == "_parameters"


def _init_hook(root: nn.Module, name: str) -> Callable[[nn.Module], None] | None:
    """The initialiser of submodule ``name`` defined by its deepest enclosing module (the root included):
    ``initialize_submodule(name, module)``, else Hugging Face's ``_init_weights(module)``."""
    path = name.split(".") if name else []
    hook = None
    owner = root
    for depth in range(len(path) + 1):
        if depth:
            owner = getattr(owner, path[depth - 1])
        relative = ".".join(path[depth:])
        if callable(getattr(owner, INIT_HOOK, None)):
            hook = partial(getattr(owner, INIT_HOOK), relative)
        elif callable(getattr(owner, "_init_weights", None)):
            hook = getattr(owner, "_init_weights")
    return hook


def _initialise(root: nn.Module, name: str, module: nn.Module, strict: bool) -> None:
    """The submodule's ``reset_parameters()`` (sane defaults: a norm's ones), then its enclosing model's
    initialiser over it; with neither, an error (``strict``) or zeros."""
    hook = _init_hook(root, name)
    reset = getattr(module, "reset_parameters", None)
    if not callable(hook) and not callable(reset):
        if not strict:
            for tensor in (*module._parameters.values(), *module._buffers.values()):
                if tensor is not None:
                    tensor.zero_()
            return
        raise ZorseUserError(
            f"module {name or '<root>'} ({type(module).__name__}) was built on the meta device and owns tensors "
            f"{sorted([*module._parameters, *module._buffers])}, but it has no reset_parameters() and no module "
            f"around it defines {INIT_HOOK}(name, module) (or Hugging Face's _init_weights(module)): nothing says "
            f"what its values are. Define {type(root).__name__}.{INIT_HOOK}(self, name, module) (called for each "
            f"submodule owning tensors), pass pretrained weights, or build the module on the host (not under "
            f"init_module(empty_init=True) or configure_model)"
        )
    if callable(reset):
        reset()
    if callable(hook):
        hook(module)


def materialize(
    root: nn.Module, device: torch.device | str, seed: int = 0, wanted: Wanted | None = None,
    strict: bool = True,
) -> list[Swap]:
    """Give every meta parameter and buffer of ``root`` that ``wanted`` accepts (default: all) a tensor on
    ``device``, initialised per submodule (see the module's docstring); returns what was replaced.

    ``strict=False`` gives zeros to a submodule nothing initialises: where
    values need only be finite (timing) or pretrained weights overwrite them.
    """
    device = torch.device(device)
    done: dict[int, nn.Parameter] = {}
    swaps: list[Swap] = []
    for name, module in root.named_modules():
        fresh: list[nn.Parameter] = []
        for key, param in list(module._parameters.items()):
            if param is None or not param.is_meta or not (wanted is None or wanted(name, param)):
                continue
            new = done.get(id(param))
            if new is None:
                new = done[id(param)] = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
                fresh.append(new)
            module._parameters[key] = new
            swaps.append(Swap(module, "_parameters", key, param, new))
        buffers = 0
        for key, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta and (wanted is None or wanted(name, buffer)):
                module._buffers[key] = torch.empty_like(buffer, device=device)
                swaps.append(Swap(module, "_buffers", key, buffer, module._buffers[key]))
                buffers += 1
        if fresh or buffers:
            _initialise_keeping_shared(root, name, module, fresh, seed, strict)
    return swaps


@torch.no_grad()
def _initialise_keeping_shared(
    root: nn.Module, name: str, module: nn.Module, fresh: list[nn.Parameter], seed: int, strict: bool
) -> None:
    """Initialise ``module`` on its own stream; a shared weight an earlier module initialised keeps its values."""
    fresh_ids = {id(p) for p in fresh}
    earlier = [(p, p.detach().clone()) for p in module._parameters.values() if p is not None and id(p) not in fresh_ids]
    devices = [p.device for p in fresh if p.device.type == "cuda"]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(module_seed(seed, name))
        _initialise(root, name, module, strict)
    for param, values in earlier:
        param.copy_(values)


def replace_parameters(
    root: nn.Module, chosen: Callable[[nn.Parameter], bool], make: Callable[[nn.Parameter], nn.Parameter]
) -> list[Swap]:
    """Replace each parameter ``chosen`` accepts by ``make(parameter)``; a weight shared by several modules (tied
    embeddings) gets one replacement, so it stays shared. Returns what was replaced."""
    made: dict[int, nn.Parameter] = {}
    swaps: list[Swap] = []
    for module in root.modules():
        for key, param in list(module._parameters.items()):
            if param is None or not chosen(param):
                continue
            if id(param) not in made:
                made[id(param)] = make(param)
            module._parameters[key] = made[id(param)]
            swaps.append(Swap(module, "_parameters", key, param, made[id(param)]))
    return swaps


def move_to_device(root: nn.Module, device: torch.device, ids: set[int] | None = None) -> list[Swap]:
    """Put the real tensors (among ``ids``; default all) elsewhere than ``device`` on it; a tied weight stays one tensor."""
    moved: dict[int, torch.Tensor] = {}
    swaps: list[Swap] = []
    for module in root.modules():
        for kind in ("_parameters", "_buffers"):
            slots = getattr(module, kind)
            for key, tensor in list(slots.items()):
                if tensor is None or tensor.is_meta or (ids is not None and id(tensor) not in ids) or tensor.device == device:
                    continue
                new = moved.get(id(tensor))
                if new is None:
                    data = tensor.detach().to(device)
                    new = moved[id(tensor)] = (
                        nn.Parameter(data, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else data
                    )
                slots[key] = new
                swaps.append(Swap(module, kind, key, tensor, new))
    return swaps


@dataclass(frozen=True)
class InitialValues:
    """Where a rank's tensors get their first values when they reach its device."""

    seed: int = 0
    """Of the per-submodule initialisation of tensors built on the meta device."""
    weights: WeightSource | Mapping[str, torch.Tensor] | str | os.PathLike[str] | None = None
    """Pretrained weights, or a resumed checkpoint's ``state_dict``: read for the tensors placed (only those),
    instead of initialising them."""
    weights_prefix: str | None = None
    """Module name = prefix + name in ``weights``; None: detected (:func:`~.stage_weights.detect_prefix`)."""


def place_on_device(root: nn.Module, device: torch.device, wanted: Wanted, initial: InitialValues) -> list[Swap]:
    """Put on ``device`` every tensor ``wanted`` accepts: built on the meta device (initialised, or read from
    ``initial.weights``) or held on the host (moved); real tensors elsewhere than the device are all moved."""
    # Initialised also when weights follow: a buffer no state dict holds (rotary inv_freq) gets its value so.
    swaps = materialize(root, device, initial.seed, wanted, strict=initial.weights is None)
    swaps += move_to_device(root, torch.device(device))
    if initial.weights is not None:
        placed = {id(s.new) for s in swaps}
        names = [n for n, t in root.state_dict(keep_vars=True).items() if id(t) in placed]
        read_into(root, initial.weights, names, prefix=initial.weights_prefix)
    return swaps


def undo(swaps: list[Swap]) -> None:
    """Put back what :func:`materialize` (or a move to a device) replaced: the new tensors are freed."""
    for swap in reversed(swaps):
        getattr(swap.module, swap.kind)[swap.key] = swap.old

"""The inputs of one module call: tensors inside containers, and state objects a call may change.

A block receives more than its activation: masks, rotary embeddings, and objects
such as a key/value cache that the call appends to. Profiling and calibration
run a block several times on a captured call; each run must start from the
captured state, or runs would see each other's keys (and reach each other's
freed autograd graphs: "backward through the graph a second time"), and the real
call's cache would grow by the profiler's runs. The same holds for state a block's own layers keep as
plain tensor attributes (:func:`own_state_kept`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

_PLAIN = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size)


def flatten_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors inside nested tuples, lists and dicts, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in flatten_tensors(item)]
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in flatten_tensors(value)]
    return []


def _map_leaves(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` with nested tuples (named ones too), lists and dicts rebuilt and ``leaf`` applied to the rest."""
    if isinstance(obj, tuple):
        items = [_map_leaves(item, leaf) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [_map_leaves(item, leaf) for item in obj]
    if isinstance(obj, dict):
        return type(obj)((key, _map_leaves(value, leaf)) for key, value in obj.items())
    return leaf(obj)


def replace_tensors(obj: Any, replace: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with each tensor ``t`` replaced by ``replace(t)``, containers rebuilt (named tuples too)."""
    return _map_leaves(obj, lambda value: replace(value) if isinstance(value, torch.Tensor) else value)


def _held(obj: Any, seen: set[int]) -> list[Any]:
    """Tensors and modules reachable from ``obj`` through containers and attributes (each object once)."""
    if id(obj) in seen or isinstance(obj, _PLAIN) or callable(obj) and not hasattr(obj, "__dict__"):
        return []
    seen.add(id(obj))
    if isinstance(obj, (torch.Tensor, nn.Module)):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    else:
        items = list(getattr(obj, "__dict__", {}).values())
    return [t for item in items for t in _held(item, seen)]


def _is_state_module(value: Any) -> bool:
    """A module without parameters passed to a call: state, such as a key/value cache (transformers 4's
    ``Cache`` classes are modules), not one of the model's layers."""
    return isinstance(value, nn.Module) and next(value.parameters(), None) is None


def _fresh_object(obj: Any) -> Any:
    """A deep copy of a state object whose tensors are detached copies (a tensor inside a graph cannot be
    deep-copied as it is) and whose modules are the same; the object itself where it cannot be copied."""
    inside = _held(vars(obj), {id(obj)}) if isinstance(obj, nn.Module) else _held(obj, set())
    memo = {id(x): x if isinstance(x, nn.Module) else x.detach().clone() for x in inside}
    try:
        return copy.deepcopy(obj, memo)
    except (TypeError, RuntimeError, copy.Error):
        return obj


def fresh_side_state(call: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every object that is neither a tensor, a container nor a plain value copied
    afresh (see the module's docstring); tensors are the same objects, containers rebuilt."""

    def fresh(value: Any) -> Any:
        if _is_state_module(value):
            return _fresh_object(value)
        if isinstance(value, (torch.Tensor, *_PLAIN)) or callable(value):
            return value
        return _fresh_object(value)

    return _map_leaves(call, fresh)


@contextmanager
def own_state_kept(module: nn.Module) -> Iterator[None]:
    """One run of a captured call of ``module`` from the state its layers hold now, leaving them holding it.

    A layer may keep tensors as plain attributes and replace them in its forward (RecurrentGemma's recurrent
    and convolution states, which its model resets before the layers): a second run would start from the
    first's graph, freed by then, and the real call would start from the runs' state. During the run each
    tensor attribute is a detached copy; after it, every attribute of every layer is the one it held before.
    Parameters, buffers and submodules live in dicts that stay the same objects."""
    held = [(layer, dict(vars(layer))) for layer in module.modules()]
    for layer, attributes in held:
        vars(layer).update((name, value.detach().clone()) for name, value in attributes.items() if isinstance(value, torch.Tensor))
    try:
        yield
    finally:
        for layer, attributes in held:
            vars(layer).clear()
            vars(layer).update(attributes)

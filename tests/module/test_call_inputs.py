"""The inputs of a captured block call, re-run by profiling and calibration: state objects a call changes
(a key/value cache) are copied afresh for every run, so no run sees another's keys and the real call's
cache never grows; the model's own layers passed to a call are not copied."""

from __future__ import annotations

import torch
from torch import nn

from zorse_lightning.module.call_inputs import fresh_side_state


class _ListCache:
    """As transformers 5's caches: a plain object holding a list of tensors that each call appends to."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []


class _ModuleCache(nn.Module):
    """As transformers 4's caches, which are modules without parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[torch.Tensor] = [torch.ones(1)]


def test_caches_are_copied_afresh_for_every_run_plain_objects_and_modules_alike():
    for cache in (_ListCache(), _ModuleCache()):
        before = list(cache.keys)
        args, kwargs = fresh_side_state(((torch.zeros(2),), {"past_key_value": cache}))
        copy = kwargs["past_key_value"]
        assert copy is not cache and type(copy) is type(cache)
        copy.keys.append(torch.full((2,), 3.0))
        assert cache.keys == before  # the real call's cache is unchanged
        assert all(torch.equal(a, b) for a, b in zip(copy.keys, before))


def test_a_module_with_parameters_passed_to_a_call_is_the_same_module():
    layer, x = nn.Linear(2, 2), torch.zeros(2)
    args, kwargs = fresh_side_state(((x,), {"shared": layer}))
    assert kwargs["shared"] is layer and args[0] is x

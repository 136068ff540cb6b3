"""Activation offload: what backward keeps of a stage's blocks lives in host memory between a
microbatch's forward and its backward (the plan's ``StagePlan.offload_activations``).

Why not ``torch.autograd.graph.save_on_cpu``: its pack copies each saved tensor into
pinned memory with a blocking ``copy_`` (the host waits for every copy, against "the
host never waits inside a step") and its unpack brings a tensor back only when the
backward asks for it (no copy ahead of the compute that needs it). The hooks here do
what it does with two changes, on CUDA only:

- **out**: the device-to-host copy runs on a side stream, after the compute stream's
  work so far, into a pinned buffer from torch's caching host allocator (allocated on
  the first step, reused after); the saved device tensor is kept alive for the side
  stream by ``record_stream``, so the compute stream never waits for the copy;
- **back**: the saved tensors of one block call are brought back together on the side
  stream when the backward first needs one of them, and with them those of the block
  before it (prefetch one block ahead), so the next block's copy runs under this
  block's backward; the compute stream waits on the copy's event, not the host.

On a CPU device (tests, emulated ranks) the same path runs with plain copies: every
saved tensor is copied to a separate host buffer and given back from it, so a
mistake in grouping or ordering shows as a wrong gradient.

Tensors that share storage with the stage's parameters (a weight saved by a linear
layer, or a view of it) are not copied: they are on the device anyway.

What is brought back is let go as soon as it is used: a block call drops its device copies
once the backward has taken every tensor it saved, and nothing here holds a block call
strongly (the autograd graph does, until its backward), so the device holds at most the
block whose backward runs and the one prefetched: the two layers the memory model budgets
(:func:`~zorse_lightning.planner.cost.memory.offload_working_bytes`). Holding the last
forward's chain strongly kept a whole microbatch's activations on the device after its
backward, through the reduction and the optimizer step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(eq=False)
class _BlockCall:
    """The saved tensors of one block's forward on one microbatch, in the order they were saved (each call is
    itself: compared and hashed by identity)."""

    host: list[torch.Tensor] = field(default_factory=list)
    previous: weakref.ref[_BlockCall] | None = None
    """The block call before this one in the same forward: the backward needs it next. Weak: that call lives
    as long as its own saved tensors do in the graph, and no longer."""
    loaded: list[torch.Tensor] | None = None
    """Device copies, from when they are brought back until the backward has taken every one of them."""
    handed_back: int = 0
    """Saved tensors the backward has taken since they were brought back."""
    ready: Any = None
    """CUDA event of the copy back (None on CPU, where copies are done on return)."""

    def loaded_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.loaded or ())


@dataclass(frozen=True)
class _Kept:
    """A saved tensor not copied (a parameter's storage): handed back as it is."""

    tensor: torch.Tensor


class ActivationOffload:
    """Saved-tensor hooks for the blocks of one rank's stage (one instance per rank)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._last: tuple[int, weakref.ref[_BlockCall]] | None = None
        """(block index, call) of the last block call: the next block's predecessor (weak, as ``previous``)."""
        self._calls: weakref.WeakSet[_BlockCall] = weakref.WeakSet()
        """Every block call still alive (in a graph not yet backwarded): what :meth:`held_device_bytes` counts."""
        self.offloaded_bytes = 0
        """Bytes copied out since construction (tests and benches read it)."""

    def held_device_bytes(self) -> int:
        """Bytes of the device copies brought back and not yet let go (tests and benches read it)."""
        return sum(call.loaded_bytes() for call in self._calls)

    def wrap(self, index: int, block: nn.Module, forward: Callable) -> Callable:
        """``forward`` of block ``index`` (module ``block``) with its saved tensors offloaded. The block's
        parameter storages are read per call: sharded stages gather their weights anew each step."""

        def offloaded(*args: Any, **kwargs: Any) -> Any:
            call = _BlockCall(previous=self._previous_of(index))
            self._last = (index, weakref.ref(call))
            self._calls.add(call)
            weights = frozenset(p.untyped_storage().data_ptr() for p in block.parameters())
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(call, weights, t), self._unpack):
                return forward(*args, **kwargs)

        return offloaded

    def _previous_of(self, index: int) -> weakref.ref[_BlockCall] | None:
        """The call of block ``index - 1`` if it ran just before (the same microbatch's forward)."""
        if self._last is not None and self._last[0] == index - 1:
            return self._last[1]
        return None

    def _pack(self, call: _BlockCall, weights: frozenset[int], tensor: torch.Tensor) -> Any:
        if tensor.device != self.device or tensor.untyped_storage().data_ptr() in weights:
            return _Kept(tensor)
        if self.cuda:
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)
        else:
            host = torch.empty_like(tensor).copy_(tensor)
        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        call.host.append(host)
        return call, len(call.host) - 1

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.tensor
        call, position = packed
        self._load(call)
        previous = call.previous() if call.previous is not None else None
        if previous is not None:
            self._load(previous)
        if call.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(call.ready)
        tensor = call.loaded[position]
        call.handed_back += 1
        if call.handed_back == len(call.host):  # the backward has it all: the autograd nodes hold what they use
            call.loaded, call.ready, call.handed_back = None, None, 0  # a second backward brings them back again
        return tensor

    def _load(self, call: _BlockCall) -> None:
        """Start bringing ``call``'s tensors back to the device (once)."""
        if call.loaded is not None:
            return
        if not self.cuda:
            call.loaded = [h.to(self.device) for h in call.host]
            return
        with torch.cuda.stream(self.stream):
            call.loaded = [h.to(self.device, non_blocking=True) for h in call.host]
            call.ready = torch.cuda.Event()
            call.ready.record(self.stream)
        for tensor in call.loaded:
            tensor.record_stream(torch.cuda.current_stream(self.device))

"""Host copies of a rank's held state, taken after an optimizer step: what survivors keep when their state is on
a GPU.

Under NCCL a collective that a dead peer never joins blocks the CUDA stream, so
a device-to-host copy made when the loss is noticed would wait forever. The
copies are therefore made after optimizer steps, into reused pinned buffers,
and keeping writes them without touching the device
(:class:`~.survivors.SurvivorKeeper`). As PyTorch's asynchronous
checkpointing and CheckFreq do, a copy runs on a side stream after an event
recorded at the end of the optimizer step, so it overlaps the next step's
forward and backward; the host never waits for it, and the next optimizer step
waits (on the device) for it to finish before it changes the weights.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from zorse_lightning.engine.checkpoint.shards import held_module_entries, held_optimizer_entries


@dataclass(frozen=True)
class HostCopy:
    """A rank's held state of one step in host memory: the layout of ``{"state_dict": ..., "optimizers":
    [...]}`` and its leaves, CPU tensors (buffers a later snapshot may refill) and copies of the rest."""

    spec: TreeSpec
    leaves: list[Any]

    def fits(self, spec: TreeSpec, leaves: list[Any]) -> bool:
        """Whether these buffers can take ``leaves`` in place: same layout, tensors of the same shapes and dtypes."""
        return spec == self.spec and all(
            not isinstance(new, torch.Tensor)
            or (isinstance(old, torch.Tensor) and old.shape == new.shape and old.dtype == new.dtype)
            for old, new in zip(self.leaves, leaves)
        )

    def held(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The module state and the optimizers' states, as ``held_module_state``/``held_optimizer_state`` give them."""
        tree = tree_unflatten(self.leaves, self.spec)
        return tree["state_dict"], tree["optimizers"]


def lives_off_host(tensors: list[torch.Tensor]) -> bool:
    return any(t.device.type != "cpu" for t in tensors)


def held_on_device(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """What ``held_module_state`` and ``held_optimizer_state`` copy, not copied, except buffers: cloned on the
    device now. Parameters and optimizer state change only in the optimizer step, which waits for the copy;
    buffers may change in the next forward (batch norm's running statistics), which does not."""
    parameters = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    state = {
        name: value.clone() if isinstance(value, torch.Tensor) and value.is_cuda and name not in parameters else value
        for name, value in held_module_entries(module).items()
    }
    return {"state_dict": state, "optimizers": [held_optimizer_entries(o, module) for o in optimizers]}


def _host_buffer(value: Any) -> torch.Tensor | None:
    """An empty host tensor for ``value`` (None for a non-tensor), pinned when CUDA is there (faster transfers)."""
    if not isinstance(value, torch.Tensor):
        return None
    return torch.empty(value.shape, dtype=value.dtype, pin_memory=torch.cuda.is_available())


class CopyDone:
    """When a host copy is complete: at once on the host; on a GPU when its side stream has run it."""

    def __init__(self, start: torch.cuda.Event | None = None, end: torch.cuda.Event | None = None,
                 elapsed_ms: float = 0.0) -> None:
        self._start, self._end, self._elapsed_ms = start, end, elapsed_ms

    def query(self) -> bool:
        """Whether the copy has completed (never waits)."""
        return self._end is None or self._end.query()

    def wait(self) -> None:
        """The host waits until the copy has completed (a snapshot due before its predecessor finished)."""
        if self._end is not None:
            self._end.synchronize()

    def make_current_stream_wait(self) -> None:
        """The current stream's later work (the next optimizer step) runs after the copy; the host goes on."""
        if self._end is not None:
            torch.cuda.current_stream().wait_event(self._end)

    def elapsed_ms(self) -> float | None:
        """How long the copy took, once complete (None before)."""
        if self._end is None:
            return self._elapsed_ms
        return self._start.elapsed_time(self._end) if self._end.query() else None


def copy_to_host(tree: dict[str, Any], spare: HostCopy | None, stream: Any = None) -> tuple[HostCopy, CopyDone]:
    """``tree`` copied to host memory, into ``spare``'s buffers when they fit (no allocation in steady state).

    Device tensors are copied on ``stream`` (a side CUDA stream) after what the current stream has queued so
    far, without waiting: the copy is complete when the returned :class:`CopyDone` says so. Host tensors
    are copied at once."""
    leaves, spec = tree_flatten(tree)
    buffers = spare.leaves if spare is not None and spare.fits(spec, leaves) else [_host_buffer(v) for v in leaves]
    on_device = [isinstance(v, torch.Tensor) and v.is_cuda for v in leaves]
    copied = [
        copy.deepcopy(value) if not isinstance(value, torch.Tensor) else buffer if device else buffer.copy_(value.detach())
        for buffer, value, device in zip(buffers, leaves, on_device)
    ]
    if not any(on_device):
        return HostCopy(spec, copied), CopyDone()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        start.record()
        for buffer, value, device in zip(buffers, leaves, on_device):
            if device:
                buffer.copy_(value.detach(), non_blocking=True)
                value.record_stream(stream)  # its memory is not reused before the copy has read it
        end.record()
    return HostCopy(spec, copied), CopyDone(start, end)

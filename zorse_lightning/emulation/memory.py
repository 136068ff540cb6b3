"""Counting the bytes an emulated rank really holds, and enforcing its memory budget.

A CPU rank that emulates a GPU must run out of memory where that GPU would, or
a plan that does not fit would pass every test here. The count comes from the
tensors themselves, never from the planner's cost model: parameters, their
gradients and the optimizer's state are read from the objects that hold them,
and saved activations are the tensors autograd keeps for backward while an
instrumented module runs, seen through ``torch.autograd.graph.saved_tensors_hooks``.
Bytes are counted per storage, so tied weights, views and a saved tensor that
is also a parameter count once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zorse_lightning.module.tensor_parallel import local
from zorse_lightning.units import bytes_to_gib


class EmulatedOutOfMemoryError(RuntimeError):
    """An emulated rank holds more bytes than its GPU type's budget (as ``torch.OutOfMemoryError`` would)."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes held at one instant, each storage counted once, in the order of the fields."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int
    """Saved for backward by instrumented modules, and not already counted above."""

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes + self.activation_bytes


def _storage_key_and_bytes(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The storage a tensor keeps alive (this rank's slice of one split over a TP group); None for tensors that
    hold no memory here (meta, sparse)."""
    tensor = local(tensor)
    if tensor.is_meta or tensor.layout is not torch.strided:
        return None
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return storage._cdata, storage.nbytes()  # the storage itself: the same while resized (sharding frees so)


def _count_new(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the storages among ``tensors`` not in ``seen`` (which it extends)."""
    total = 0
    for tensor in tensors:
        entry = _storage_key_and_bytes(tensor)
        if entry is not None and entry[0] not in seen:
            seen.add(entry[0])
            total += entry[1]
    return total


class _SavedTensor:
    """What autograd stores instead of a saved tensor: the tensor, plus a reference count in the meter.

    Autograd drops it when the graph node is freed (after backward, or when the
    graph is discarded), so its ``__del__`` is the moment the bytes stop being held.
    """

    __slots__ = ("tensor", "_meter", "_key")

    def __init__(self, tensor: torch.Tensor, meter: MemoryMeter) -> None:
        self.tensor = tensor
        self._meter = meter
        # A parameter is state, counted as such while it holds values (sharding may free it before backward).
        entry = None if isinstance(tensor, nn.Parameter) else _storage_key_and_bytes(tensor)
        self._key = None if entry is None else entry[0]
        if entry is not None:
            meter._hold(entry[0], local(tensor).untyped_storage())

    def __del__(self) -> None:
        if self._key is not None:
            self._meter._release(self._key)


@dataclass(frozen=True)
class _StateCount:
    """The parameters, gradients and optimizer state counted at one instant, and what they were."""

    signature: tuple
    parameters: tuple[nn.Parameter, ...]
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    storages: frozenset[int]


class MemoryMeter:
    """Bytes held by one rank's training state and saved activations; keeps the peak."""

    def __init__(self) -> None:
        self._modules: tuple[nn.Module, ...] = ()
        self._optimizers: tuple[torch.optim.Optimizer, ...] = ()
        self._saved: dict[int, list] = {}
        """Storage key -> [the storage, number of saved tensors on it]; its bytes are read when measured (a
        weight's storage that sharding resized to nothing while autograd keeps a view of it holds nothing)."""
        self._state: _StateCount | None = None
        self.peak_bytes = 0
        self.peak_breakdown: MemoryBreakdown | None = None

    @property
    def is_tracking(self) -> bool:
        return bool(self._modules)

    def track(self, modules: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        self._modules = tuple(modules)
        self._optimizers = tuple(optimizers)
        self._state = None

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """A context in which every tensor autograd saves is counted until autograd drops it."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> _SavedTensor:
        return _SavedTensor(tensor, self)

    def _hold(self, key: int, storage: torch.UntypedStorage) -> None:
        entry = self._saved.setdefault(key, [storage, 0])
        entry[1] += 1

    def _release(self, key: int) -> None:
        entry = self._saved[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._saved[key]

    def _signature(self, parameters: tuple[nn.Parameter, ...]) -> tuple:
        """Which gradient tensors exist, where each parameter's values are (sharding frees and gathers them)
        and how many parameters have optimizer state: what changes the state's bytes during a step."""
        return (
            tuple(id(p.grad) for p in parameters),
            tuple(local(p).untyped_storage().data_ptr() for p in parameters if not p.is_meta),
            tuple(len(o.state) for o in self._optimizers),
        )

    def _count_state(self) -> _StateCount:
        params: dict[int, nn.Parameter] = {}
        for module in self._modules:
            params.update((id(p), p) for p in module.parameters())
        parameters = tuple(params.values())
        seen: set[int] = set()
        parameter_bytes = _count_new(parameters, seen)
        gradient_bytes = _count_new((p.grad for p in parameters if p.grad is not None), seen)
        optimizer_state_bytes = _count_new(
            (
                value
                for optimizer in self._optimizers
                for state in optimizer.state.values()
                for value in state.values()
                if isinstance(value, torch.Tensor)
            ),
            seen,
        )
        return _StateCount(
            self._signature(parameters), parameters, parameter_bytes, gradient_bytes, optimizer_state_bytes,
            frozenset(seen),
        )

    def measure(self, recount: bool = True) -> MemoryBreakdown:
        """The bytes held now; also raises the recorded peak.

        ``recount=False`` (the emulator's check at every module call) keeps the
        last count of parameters, gradients and optimizer state while no
        gradient was allocated or freed and the optimizer made no new state:
        recounting ~250 tensors took 0.5 ms on a small GPT, more than the
        emulated time of its small modules, so an emulated A100 overran its
        deadlines by 90 ms a step. Activations are always counted afresh.
        """
        state = self._state
        if recount or state is None or self._signature(state.parameters) != state.signature:
            state = self._state = self._count_state()
        activation_bytes = sum(storage.nbytes() for key, (storage, _) in self._saved.items() if key not in state.storages)
        breakdown = MemoryBreakdown(
            state.parameter_bytes, state.gradient_bytes, state.optimizer_state_bytes, activation_bytes
        )
        if breakdown.total_bytes > self.peak_bytes:
            self.peak_bytes = breakdown.total_bytes
            self.peak_breakdown = breakdown
        return breakdown


def out_of_memory_message(gpu_type: str, budget_bytes: int, held: MemoryBreakdown) -> str:
    """Say which budget was exceeded, by what, and what to change."""
    return (
        f"emulated {gpu_type} ran out of memory: it holds {held.total_bytes} bytes "
        f"({bytes_to_gib(held.total_bytes):.4f} GiB: parameters {held.parameter_bytes}, gradients "
        f"{held.gradient_bytes}, optimizer state {held.optimizer_state_bytes}, saved activations "
        f"{held.activation_bytes}) but its budget is {budget_bytes} bytes ({bytes_to_gib(budget_bytes):.4f} GiB). "
        f"Use a smaller microbatch, shard the optimizer state, enable recomputation, give this rank fewer "
        f"layers in the plan, or raise the GPU's `memory_gib` in the cluster config"
    )


def _unpack(saved: _SavedTensor) -> torch.Tensor:
    return saved.tensor

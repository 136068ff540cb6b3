"""What a real GPU holds beside what torch allocates: the CUDA context and the allocator's fragmentation
(the reserve, :func:`reserve_gib`), and the buffers NCCL allocates for each communicator
(:class:`NcclBuffers`), of which the plan gives a rank four or five (:func:`nccl_communicators`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from zorse_lightning.errors import PlanningError

DEFAULT_RESERVE_GIB = 0.5
"""CUDA context and allocator fragmentation on a real GPU (NCCL's buffers apart: :class:`NcclBuffers`)."""

NCCL_BUFFSIZE_DEFAULT_BYTES = 4 * 1024 * 1024
"""NCCL's ``NCCL_BUFFSIZE`` where unset: the buffer of one channel toward one peer."""
NCCL_CHANNELS_DEFAULT = 2
"""Channels NCCL gives a communicator over PCIe or the network (two per ring it finds); NVLink machines get
more, which ``NCCL_MIN_NCHANNELS`` states for the pricing and start-up's measurement shows on a real GPU."""


@dataclass(frozen=True)
class NcclBuffers:
    """The device memory NCCL allocates for each communicator, outside torch's caching allocator (no torch
    statistic shows it, and it appears when the communicator is made: at setup, not in the profile): for
    each channel, a buffer of ``NCCL_BUFFSIZE`` toward each neighbour of the rank in the channel's ring."""

    buffer_bytes: int = NCCL_BUFFSIZE_DEFAULT_BYTES
    channels: int = NCCL_CHANNELS_DEFAULT

    @property
    def communicator_bytes(self) -> int:
        return 2 * self.channels * self.buffer_bytes

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> NcclBuffers:
        """What NCCL reads from ``environ`` (the ranks' environment): ``NCCL_BUFFSIZE``, and the channels
        between ``NCCL_MIN_NCHANNELS`` and ``NCCL_MAX_NCHANNELS`` (:data:`NCCL_CHANNELS_DEFAULT` within them)."""
        buffer_bytes = _positive_int(environ, "NCCL_BUFFSIZE", NCCL_BUFFSIZE_DEFAULT_BYTES)
        fewest = _positive_int(environ, "NCCL_MIN_NCHANNELS", 1)
        most = _positive_int(environ, "NCCL_MAX_NCHANNELS", max(fewest, NCCL_CHANNELS_DEFAULT))
        return cls(buffer_bytes, min(max(NCCL_CHANNELS_DEFAULT, fewest), most))


def _positive_int(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise PlanningError(
            f"{name}={value!r} is not a positive whole number, which NCCL needs (and the memory model prices "
            f"NCCL's buffers by); set it to one, or unset it for NCCL's default"
        )
    return number


def nccl_communicators(
    group_widths: tuple[int, ...], group_index: int | None, pipelined: bool, tensor_parallel: int = 1
) -> int:
    """The NCCL communicators the engine makes for one rank (``engine.groups.build_groups``, every one made at
    setup), of groups of at least two ranks: the default group; its data-parallel group (its stage's ranks, or
    under tensor parallelism those of its TP index); the groups of the stages that may share a weight (per TP
    index): the first and last groups (tied embeddings) and, with three groups or more, all of them; the pipeline
    group (every rank) where ``pipelined`` (the plan has stages to pass between); and its TP group where
    ``tensor_parallel`` > 1. ``group_widths``: ranks per group (the stages' ranks; an interleaved plan's groups);
    an idle rank (``group_index`` None) is in the default and pipeline groups only. The host group is gloo: no
    NCCL communicator."""
    world = sum(group_widths) + (group_index is None)
    count = (world > 1) + (pipelined and world > 1)
    if group_index is None:
        return count
    last = len(group_widths) - 1
    count += group_widths[group_index] // tensor_parallel > 1
    if last > 0 and group_index in (0, last):
        count += 1
    return count + (last > 1) + (tensor_parallel > 1)


def reserve_gib(gpu_memory_gib: float, type_memory_gib: float, emulated: bool, reserve_override_gib: float | None) -> float:
    """Framework reserve: the override if given, else 0.5 GiB, scaled by budget / type
    memory on emulated clusters (whose budgets are scaled down copies of real GPUs)."""
    if reserve_override_gib is not None:
        return reserve_override_gib
    if emulated:
        return DEFAULT_RESERVE_GIB * gpu_memory_gib / type_memory_gib
    return DEFAULT_RESERVE_GIB

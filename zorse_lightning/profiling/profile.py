"""What the planner knows about a model: per-block sizes, and times on each GPU type.

A *block* is a unit the planner may place on a stage: the embedding, each entry of
the model's block list (transformer layers), and the head. Pipeline cuts fall
between layers; the embedding always sits with the first layer and the head with
the last. Times are per microbatch, as a function of microbatch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from zorse_lightning.errors import PlanningError

MIN_BLOCK_TIME_MS = 1e-3
"""Floor for fitted times: some reference fits have negative intercepts."""


class ProfileSource(str, Enum):
    """Where a GPU type's times came from, most trusted first."""

    MEASURED = "measured"
    REFERENCE = "reference"
    REFERENCE_SCALED = "reference_scaled"
    """Reference data of the same GPU at another dtype or sequence length, rescaled."""
    ESTIMATED = "estimated"


@dataclass(frozen=True)
class TimeCurve:
    """Time of one block for a microbatch of ``b`` samples: measured points, else a line."""

    slope_ms: float
    """Milliseconds per extra sample."""
    intercept_ms: float
    measured_ms: tuple[float, ...] = ()
    """Measured times at microbatch sizes 1, 2, ...; preferred over the line where present."""

    def at(self, microbatch_size: int) -> float:
        if 1 <= microbatch_size <= len(self.measured_ms):
            return max(self.measured_ms[microbatch_size - 1], MIN_BLOCK_TIME_MS)
        return max(self.slope_ms * microbatch_size + self.intercept_ms, MIN_BLOCK_TIME_MS)

    def scaled(self, factor: float) -> TimeCurve:
        return TimeCurve(self.slope_ms * factor, self.intercept_ms * factor, tuple(t * factor for t in self.measured_ms))


@dataclass(frozen=True)
class BlockTimes:
    forward: TimeCurve
    backward: TimeCurve

    def scaled(self, factor: float) -> BlockTimes:
        return BlockTimes(self.forward.scaled(factor), self.backward.scaled(factor))


@dataclass(frozen=True)
class BlockShape:
    """Sizes of one block, independent of the device."""

    name: str
    parameters: int
    activation_bytes_per_sample: int
    """Bytes saved for backward per sample (freed by recomputation, except the block input)."""
    output_bytes_per_sample: int
    """Bytes of the block's output per sample: what crosses a pipeline cut after it."""
    forward_flops_per_sample: float


@dataclass(frozen=True)
class DeviceTimes:
    """Times of every block of a model on one GPU type."""

    gpu_type: str
    source: ProfileSource
    embedding: BlockTimes
    layers: tuple[BlockTimes, ...]
    head: BlockTimes
    optimizer_ms_per_million_parameters: float | None = None
    """Optimizer step time per million parameters it updates, measured on the device;
    None: the planner estimates it from the GPU type's memory bandwidth
    (:func:`zorse_lightning.planner.update.optimizer_step_ms`)."""

    def __post_init__(self) -> None:
        rate = self.optimizer_ms_per_million_parameters
        if rate is not None and not 0 <= rate < float("inf"):
            raise PlanningError(
                f"times of GPU type {self.gpu_type!r}: optimizer_ms_per_million_parameters={rate!r} must be a "
                f"finite number >= 0 (a measured step time per million parameters), or None to estimate it"
            )


@dataclass(frozen=True)
class ModelProfile:
    model: str
    """Name or signature of the model (plans record it; a plan for another model is refused)."""
    seq_len: int
    dtype: str
    """Training precision the times were taken at: float16, bfloat16 or float32."""
    embedding: BlockShape
    layers: tuple[BlockShape, ...]
    head: BlockShape
    devices: dict[str, DeviceTimes]
    """By catalog GPU type name."""
    tied_embedding_head: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def total_parameters(self) -> int:
        return self.embedding.parameters + self.head.parameters * (not self.tied_embedding_head) + sum(
            l.parameters for l in self.layers
        )

    def times(self, gpu_type: str) -> DeviceTimes:
        try:
            return self.devices[gpu_type]
        except KeyError:
            raise KeyError(
                f"profile of {self.model!r} has no times for GPU type {gpu_type!r} "
                f"(has: {', '.join(sorted(self.devices))})"
            ) from None

    @property
    def sources(self) -> dict[str, ProfileSource]:
        return {name: d.source for name, d in self.devices.items()}

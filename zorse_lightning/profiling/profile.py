"""What the planner knows about a model: per-block sizes, and times on each GPU type.

A *block* is a unit the planner may place on a stage: the embedding, each entry of
the model's block list (transformer layers), and the head. Pipeline cuts fall
between layers; the embedding always sits with the first layer and the head with
the last. Times are per microbatch, as a function of microbatch size.
"""

from __future__ import annotations

from functools import cached_property
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
    """Measured times at :attr:`sizes`; preferred over the line where present."""
    measured_sizes: tuple[int, ...] = ()
    """The microbatch sizes of ``measured_ms``, increasing; empty: 1, 2, ... (reference data)."""

    @property
    def sizes(self) -> tuple[int, ...]:
        """The microbatch sizes measured."""
        return self.measured_sizes or tuple(range(1, len(self.measured_ms) + 1))

    @cached_property
    def _at_measured(self) -> dict[int, float]:
        return {b: max(t, MIN_BLOCK_TIME_MS) for b, t in zip(self.sizes, self.measured_ms)}

    def at(self, microbatch_size: int) -> float:
        """The measured time at a measured size; between two measured sizes, on the segment joining them
        (start-up measures every size it lets the planner use, so this prices sizes a caller asks for
        directly); elsewhere the fitted line. (The planner asks this hundreds of thousands of times a plan:
        a measured size is one lookup.)"""
        measured = self._at_measured.get(microbatch_size)
        if measured is not None:
            return measured
        sizes = self.sizes
        if sizes and sizes[0] <= microbatch_size <= sizes[-1]:
            upper = next(i for i, b in enumerate(sizes) if b >= microbatch_size)
            if sizes[upper] == microbatch_size:
                return max(self.measured_ms[upper], MIN_BLOCK_TIME_MS)
            (b0, t0), (b1, t1) = (sizes[upper - 1], self.measured_ms[upper - 1]), (sizes[upper], self.measured_ms[upper])
            return max(t0 + (t1 - t0) * (microbatch_size - b0) / (b1 - b0), MIN_BLOCK_TIME_MS)
        return max(self.slope_ms * microbatch_size + self.intercept_ms, MIN_BLOCK_TIME_MS)

    def scaled(self, factor: float) -> TimeCurve:
        return TimeCurve(
            self.slope_ms * factor, self.intercept_ms * factor, tuple(t * factor for t in self.measured_ms),
            self.measured_sizes,
        )


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
    activation_bytes_per_microbatch: int = 0
    """Bytes saved for backward per microbatch whatever its size (the intercept of the measured line):
    under autocast, the low-precision copies of the weights that the block's matrix products keep."""
    transient_bytes_per_sample: int = 0
    """Bytes held only while a microbatch runs, beyond those saved (the head's: its logits' gradients, a
    loss's upcast copies), once per rank whatever the microbatches in flight; measured on CUDA at start-up."""
    transient_bytes_per_microbatch: int = 0


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
    (:func:`zorse_lightning.planner.cost.update.optimizer_step_ms`)."""
    action_overhead_ms: float | None = None
    """The engine's own time per action (one microbatch's forward or backward on a stage) beyond the
    blocks' compute, measured at start-up on this type's device; None: not measured (reference and
    estimated profiles), priced as nothing."""
    host_overlaps_device: bool = False
    """True where the device computes asynchronously from the host (CUDA): the engine's host time per
    action then hides under the device's compute, and an action takes the longer of the two, not the sum
    (on one H100, summed, the 168M Llama's step was predicted 23 % long)."""

    tensor_parallel_efficiency: tuple[tuple[int, float], ...] = ()
    """(degree ``t``, efficiency) measured on ``t`` GPUs of this type: one-GPU block time / (``t`` x the split
    block's compute, collectives apart); a degree not listed is priced at the type's catalogued efficiency
    (:attr:`~zorse_lightning.cluster.gpu_type.GpuType.tensor_parallel_efficiency`)."""

    def __post_init__(self) -> None:
        for degree, efficiency in self.tensor_parallel_efficiency:
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 2 or not 0 < efficiency < float("inf"):
                raise PlanningError(
                    f"times of GPU type {self.gpu_type!r}: tensor_parallel_efficiency entry ({degree!r}, {efficiency!r}) "
                    f"must pair a whole degree >= 2 with a positive finite efficiency (as measured); leave the degree "
                    f"out to price it at the type's catalogued efficiency"
                )
        for name in ("optimizer_ms_per_million_parameters", "action_overhead_ms"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < float("inf"):
                raise PlanningError(
                    f"times of GPU type {self.gpu_type!r}: {name}={value!r} must be a finite number >= 0 "
                    f"(a measured time), or None to leave it to the planner's estimate"
                )


@dataclass(frozen=True)
class OptimizerProfile:
    """The user's optimizer as it ran at start-up on a sample of the model's parameter shapes."""

    name: str
    """Its class, qualified (``torch.optim.adamw.AdamW``): a plan says which optimizer it priced."""
    state_bytes_per_parameter: float
    """State it keeps per parameter after a step (AdamW: two moments; plain SGD: none)."""
    step_bytes_per_parameter: float
    """Temporary bytes per parameter at its step, above the state (foreach AdamW: about one copy of the
    parameters per tensor group); measured on CUDA, estimated from the kind of step elsewhere."""

    def __post_init__(self) -> None:
        for name in ("state_bytes_per_parameter", "step_bytes_per_parameter"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise PlanningError(
                    f"optimizer profile of {self.name}: {name}={value!r} must be a finite number >= 0 (bytes measured "
                    f"per parameter)"
                )


NO_TENSOR_PARALLEL_PLAN = (
    "the profile does not say which tensor-parallel degrees its blocks admit (no TP plan known); a measured profile "
    "of a module with a TP plan, or a reference model's, says it"
)


@dataclass(frozen=True)
class TensorParallelSupport:
    """Which tensor-parallel degrees the model's blocks admit (their TP plan applies: heads, key/value heads and
    every split width divisible by the degree), so the planner prices only those; and what a split leaves whole."""

    degrees: tuple[int, ...] = ()
    """Degrees ``t > 1`` every block admits, increasing; empty: none (the planner keeps every stage at TP 1)."""
    reason: str = NO_TENSOR_PARALLEL_PLAN
    """Why there are no degrees, or none beyond the largest (for a plan's notes)."""
    replicated_parameters_per_layer: int = 0
    """Parameters of a layer its TP plan leaves whole on every rank of a group (norms, row-wise biases); the
    layers are alike (one block class), so one count serves all."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "degrees", tuple(self.degrees))
        bad = [t for t in self.degrees if isinstance(t, bool) or not isinstance(t, int) or t < 2]
        if bad or list(self.degrees) != sorted(set(self.degrees)):
            raise PlanningError(
                f"tensor-parallel degrees {list(self.degrees)} must be distinct whole numbers >= 2 in increasing order "
                f"(TP 1 is always admitted and not listed)"
            )
        if self.replicated_parameters_per_layer < 0:
            raise PlanningError(
                f"replicated_parameters_per_layer={self.replicated_parameters_per_layer!r} must be >= 0 (a count of "
                f"parameters every rank of a TP group holds whole)"
            )

    def admits(self, degree: int) -> bool:
        return degree == 1 or degree in self.degrees


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
    weight_dtype: str | None = None
    """The dtype the weights and gradients are held in while training (float32 under autocast, whatever
    ``dtype``); None: the mixed-precision accounting of :mod:`zorse_lightning.planner.cost.memory` for ``dtype``."""
    optimizer: OptimizerProfile | None = None
    """The user's optimizer as measured; None: Adam's state and no step temporaries assumed."""
    tensor_parallel: TensorParallelSupport = TensorParallelSupport()
    """The TP degrees the blocks admit; default: none (a profile that does not say)."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def total_parameters(self) -> int:
        """Every parameter of the model, a tied head's once (computed once: the search's bounds ask for it
        thousands of times)."""
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
    def measured_sizes(self) -> tuple[int, ...] | None:
        """The microbatch sizes every measured GPU type timed its blocks at (None: no type holds measured points,
        e.g. a profile given as lines); the planner prices no other size on a measured profile."""
        sizes = [
            set(layer.forward.sizes)
            for d in self.devices.values() if d.source is ProfileSource.MEASURED
            for layer in d.layers if layer.forward.measured_ms
        ]
        return tuple(sorted(set.intersection(*sizes))) if sizes else None

    @property
    def sources(self) -> dict[str, ProfileSource]:
        return {name: d.source for name, d in self.devices.items()}

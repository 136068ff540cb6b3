"""Measured profiles: time one block of a real module on the local device (the most trusted source).

Start-up (and the plan app, which profiles a module the same way:
:mod:`zorse_lightning.startup.device_profile`) captures what block 0 receives
in the user's own step at each microbatch size and passes those calls here.
The block is timed on them, at each size up to the first that does not fit
(the one harness of :mod:`.timing`: CUDA events on a GPU, warm-up until the
time settles, the median of back-to-back repeats), forward and backward
separately, every forward inside the precision plugin's forward context
(autocast: the precision that trains); the measured points are kept and a line
is fitted through them. Sizes come from the real module: parameters counted,
activation bytes from the tensors autograd saves for backward
(``saved_tensors_hooks``; parameters excluded, each storage counted once) as a
line with its intercept (autocast's weight copies, once per microbatch),
output bytes from the output, FLOPs from ``torch.utils.flop_counter``. The
parts of the step outside the block list are timed around the whole step
(:mod:`zorse_lightning.startup.step_costs`), not here. Torch is imported
inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zorse_lightning.errors import PlanningError
from zorse_lightning.profiling.profile import BlockShape, BlockTimes, DeviceTimes, ModelProfile, ProfileSource, TimeCurve
from zorse_lightning.profiling.timing import PhaseMarks, TimingOptions, time_phases

MAX_WARMUP = 8
"""Warm-up runs at most while the time has not settled (:class:`~.timing.TimingOptions`)."""

ForwardContext = Callable[[], AbstractContextManager]
"""The precision plugin's ``forward_context``: what every timed forward runs inside, as in training."""

if TYPE_CHECKING:
    import torch



@dataclass(frozen=True)
class MeasureOptions:
    """How long a block is timed at each size (the sizes are the calls given)."""

    warmup: int = 2
    """Untimed runs per block and size (allocator, cuDNN autotuning, lazy init)."""
    repeats: int = 5
    """Timed runs per block and size; the median is kept."""

    @property
    def timing(self) -> TimingOptions:
        """The harness's options: at least ``warmup`` untimed runs, more until the time settles."""
        return TimingOptions(min_warmup=self.warmup, max_warmup=max(self.warmup, MAX_WARMUP) if self.warmup else 0,
                             repeats=self.repeats)

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.repeats < 1:
            raise PlanningError(
                f"MeasureOptions(warmup={self.warmup}, repeats={self.repeats}): need warmup >= 0 and repeats >= 1"
            )


@dataclass(frozen=True)
class MeasuredBlocks:
    """What one device type measured: its times, and the (device-independent) block sizes."""

    signature: str
    """:func:`model_signature` of the block measured: measurements of other blocks are not assembled."""
    seq_len: int
    dtype: str
    times: DeviceTimes
    embedding: BlockShape
    layers: tuple[BlockShape, ...]
    head: BlockShape


def model_signature(blocks: Sequence[Any]) -> str:
    """Hash of module class names and parameter names, shapes and dtypes (16 hex digits)."""
    parts = []
    for module in blocks:
        parts.append("block:" + ",".join(type(m).__qualname__ for m in module.modules()))
        parts.extend(f"{n}{tuple(p.shape)}{p.dtype}" for n, p in module.named_parameters())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _first_tensor(output: Any, name: str, module: Any) -> torch.Tensor:
    from zorse_lightning.module.block_output import activation_of

    activation = activation_of(output)
    if activation is None:
        raise PlanningError(
            f"cannot profile {name} ({type(module).__name__}): it returned {type(output).__name__}, "
            f"neither a tensor nor a tuple or list that starts with one; wrap it in a module "
            f"that returns the activation tensor passed to the next block"
        )
    return activation


Call = tuple[tuple, dict]
"""A block call as captured: ``(args, kwargs)``, the activation first."""


def _call(module: Any, call: Call, x: torch.Tensor) -> Any:
    """``module`` on ``call`` with ``x`` as the activation; state objects of the call and of its layers afresh."""
    from zorse_lightning.module.call_inputs import fresh_side_state, own_state_kept  # imports torch: kept out of module import

    args, kwargs = fresh_side_state(call)
    with own_state_kept(module):
        return module(x, *args[1:], **kwargs)


def _time_one(
    module: Any, call: Call, name: str, options: MeasureOptions, device: torch.device, forward_context: ForwardContext
):
    """Median forward and backward ms of ``module`` on ``call`` (the forward inside ``forward_context``, as
    training runs it), and its (detached) output."""
    import torch

    x = call[0][0]
    last: list[torch.Tensor] = []
    backward_ran = [False]

    def run(marks: PhaseMarks) -> None:
        inp = x.detach().requires_grad_(x.is_floating_point())
        with forward_context():
            out = _first_tensor(_call(module, call, inp), name, module)
        marks.mark()
        backward_ran[0] = out.requires_grad
        if out.requires_grad:
            out.backward(torch.ones_like(out))
        last[:] = [out.detach()]

    forward_ms, backward_ms = time_phases(run, device, 2, options.timing)
    return forward_ms, backward_ms if backward_ran[0] else 0.0, last[0]


def _saved_bytes(module: Any, call: Call, forward_context: ForwardContext) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for the backward of ``module`` on ``call``,
    its forward inside ``forward_context``: under autocast these include the low-precision copies of the
    weights a matrix product keeps for its backward (one set per microbatch: the intercept of
    :attr:`~.profile.BlockShape.activation_bytes_per_microbatch`), and activations in the autocast dtype."""
    import torch

    parameter_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    x = call[0][0]
    inp = x.detach().requires_grad_(x.is_floating_point())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), forward_context():
        _call(module, call, inp)
    return sum(seen.values())


def _flops(module: Any, call: Call, forward_context: ForwardContext) -> float:
    """The forward's FLOPs, counted with gradients on as training runs it: under ``no_grad`` the counter's
    module tracker fails on a view of a parameter passed to a submodule (Mamba's convolution weight)."""
    from torch.utils.flop_counter import FlopCounterMode

    import torch

    counter = FlopCounterMode(display=False)
    with counter, torch.enable_grad(), forward_context():
        _call(module, call, call[0][0].detach())
    return float(counter.get_total_flops())


def _fit(sizes: Sequence[int], times_ms: Sequence[float]) -> TimeCurve:
    """Least-squares line through (size, time), kept beside the measured points (which :meth:`TimeCurve.at`
    prefers); a line through the origin from one point."""
    if len(sizes) == 1:
        return TimeCurve(times_ms[0] / sizes[0], 0.0, tuple(times_ms), tuple(sizes))
    mean_b, mean_t = statistics.fmean(sizes), statistics.fmean(times_ms)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in zip(sizes, times_ms)) / sum((b - mean_b) ** 2 for b in sizes)
    return TimeCurve(slope, mean_t - slope * mean_b, tuple(times_ms), tuple(sizes))


_ZERO_TIMES = BlockTimes(TimeCurve(0.0, 0.0), TimeCurve(0.0, 0.0))


@dataclass(frozen=True)
class _ChainMeasurement:
    sizes: tuple[int, ...]
    """The sizes measured: the asked ones up to the first that did not fit."""
    forward_ms: list[list[float]]
    """Per module, per size."""
    backward_ms: list[list[float]]
    block_sizes: list[tuple[int, int, int, float, int]]
    """Per module: parameters, activation bytes per sample, output bytes per sample, forward FLOPs per sample,
    activation bytes per microbatch whatever its size (the intercept)."""


def out_of_memory_errors() -> tuple[type[BaseException], ...]:
    """What a device raises when a size does not fit: CUDA's out-of-memory, or an emulated rank's budget."""
    import torch

    from zorse_lightning.emulation.memory import EmulatedOutOfMemoryError

    return (torch.OutOfMemoryError, EmulatedOutOfMemoryError)


def _measure_chain(
    chain: list[tuple[str, Any]], first_call: Callable[[int], Call], sizes: tuple[int, ...], options: MeasureOptions,
    device: torch.device, forward_context: ForwardContext = nullcontext,
) -> _ChainMeasurement:
    """The chain timed and sized at each microbatch size, smallest first, up to the first size that does
    not fit on the device; ``first_call(b)`` is the first module's call at size ``b``, each later module
    receives the output of the one before."""
    import torch

    forward_ms: list[list[float]] = [[] for _ in chain]
    backward_ms: list[list[float]] = [[] for _ in chain]
    saved: list[dict[int, int]] = [{} for _ in chain]
    outputs: list[int] = [0] * len(chain)
    flops: list[float] = [0.0] * len(chain)
    grads = [(p, p.grad) for _, m in chain for p in m.parameters()]
    measured: list[int] = []
    try:
        for b in sorted(sizes):
            try:
                call = first_call(b)
                row = []
                for i, (name, module) in enumerate(chain):
                    saved_bytes = _saved_bytes(module, call, forward_context)
                    if not measured:
                        flops[i] = _flops(module, call, forward_context) / b
                    fwd, bwd, x = _time_one(module, call, name, options, device, forward_context)
                    row.append((saved_bytes, fwd, bwd))
                    if not measured:
                        outputs[i] = x.numel() * x.element_size() // b
                    call = ((x,), {})
            except out_of_memory_errors() as error:
                if not measured:
                    raise PlanningError(
                        f"a microbatch of {b} sample(s) does not fit on {device} while profiling "
                        f"({type(error).__name__}: {error}); the smallest microbatch must fit: give the run GPUs "
                        f"with more memory or a shorter sequence"
                    ) from error
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                break
            measured.append(b)
            for i, (saved_bytes, fwd, bwd) in enumerate(row):
                saved[i][b] = saved_bytes
                forward_ms[i].append(fwd)
                backward_ms[i].append(bwd)
    finally:
        for p, g in grads:
            p.grad = g
    block_sizes = []
    for i, (_, m) in enumerate(chain):
        per_sample, per_microbatch = _activation_line(saved[i], measured)
        block_sizes.append((sum(p.numel() for p in m.parameters()), per_sample, outputs[i], flops[i], per_microbatch))
    return _ChainMeasurement(tuple(measured), forward_ms, backward_ms, block_sizes)


def _activation_line(saved: dict[int, int], sizes: list[int]) -> tuple[int, int]:
    """(bytes per sample, bytes per microbatch) through the smallest and largest size's saved bytes.

    The intercept is kept: it holds what a microbatch saves whatever its size
    (autocast's low-precision weight copies, above all); one size measured gives
    it all to the samples.
    """
    low, high = sizes[0], sizes[-1]
    if high == low:
        return max(0, round(saved[low] / low)), 0
    per_sample = max(0, round((saved[high] - saved[low]) / (high - low)))
    return per_sample, max(0, saved[low] - per_sample * low)


def measure_block_calls(
    block: Any, calls: Mapping[int, Call], *, device: torch.device, gpu_type: str,
    options: MeasureOptions = MeasureOptions(), forward_context: ForwardContext = nullcontext, dtype: str | None = None,
) -> MeasuredBlocks:
    """Time and size one block on calls captured from the user's step: ``calls[b]`` at microbatch size ``b``
    (the activation and the keyword arguments a real forward gives it: masks, rotary embeddings, a cache),
    each forward inside ``forward_context`` (the precision plugin's, as training runs it).

    Start-up profiles this way: one block stands for all blocks of its list,
    measured on exactly what it receives, never on guessed inputs. ``dtype``
    records the precision the step computes in (default: the activation's).
    The sizes measured are the times' ``measured_sizes``: those of ``calls``
    up to the first that did not fit.
    """
    x = calls[min(calls)][0][0]
    measured = _measure_chain(
        [("layer0", block)], lambda b: calls[b], tuple(calls), options, device, forward_context
    )
    times = BlockTimes(_fit(measured.sizes, measured.forward_ms[0]), _fit(measured.sizes, measured.backward_ms[0]))
    zero_shape = BlockShape("none", 0, 0, 0, 0.0)
    return MeasuredBlocks(
        signature=model_signature([block]),
        seq_len=x.shape[1] if x.ndim >= 2 else 1,
        dtype=dtype or str(x.dtype).removeprefix("torch."),
        times=DeviceTimes(gpu_type, ProfileSource.MEASURED, _ZERO_TIMES, (times,), _ZERO_TIMES),
        embedding=zero_shape,
        layers=(BlockShape("layer0", *measured.block_sizes[0]),),
        head=zero_shape,
    )


def assemble_profile(
    measurements: Iterable[MeasuredBlocks], model: str = "", tied_embedding_head: bool = False
) -> ModelProfile:
    """One :class:`ModelProfile` from the measurements of several GPU types (one each) of the same model."""
    items = list(measurements)
    if not items:
        raise PlanningError("assemble_profile needs at least one measurement")
    first = items[0]
    devices: dict[str, DeviceTimes] = {}
    for m in items:
        if (m.signature, m.seq_len, m.dtype) != (first.signature, first.seq_len, first.dtype):
            raise PlanningError(
                f"measurement on {m.times.gpu_type!r} is of model {m.signature} at seq_len={m.seq_len}, {m.dtype}; "
                f"expected {first.signature} at seq_len={first.seq_len}, {first.dtype}: "
                f"profile every rank with the same model, sequence length and dtype"
            )
        if m.times.gpu_type in devices:
            raise PlanningError(f"two measurements for GPU type {m.times.gpu_type!r}: give one per type")
        devices[m.times.gpu_type] = m.times
    return ModelProfile(
        model=model or first.signature,
        seq_len=first.seq_len,
        dtype=first.dtype,
        embedding=first.embedding,
        layers=first.layers,
        head=first.head,
        devices=devices,
        tied_embedding_head=tied_embedding_head,
    )

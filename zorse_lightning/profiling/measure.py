"""Measured profiles: time the blocks of a real module on the local device (the most trusted source).

The caller (the engine, on each rank) finds the model's block list and passes
it here with one example sample. Each block is timed on the output of the
block before it, at microbatch sizes 1..n (warm-up runs, then the median of
the repeats), forward and backward separately, and a line is fitted through
the medians. Sizes come from the real module: parameters counted, activation
bytes from the tensors autograd saves for backward (``saved_tensors_hooks``;
parameters excluded, each storage counted once), output bytes from the output,
FLOPs from ``torch.utils.flop_counter``.

Choice for the parts outside the block list: ``before`` (e.g. the embedding)
and ``after`` (e.g. the head and loss) are optional modules; when given they
are timed and sized like blocks, ``before`` receiving the example input; when
left out they are zero-size blocks with zero time (``TimeCurve`` floors them at
``MIN_BLOCK_TIME_MS``) and the example input goes straight to the first block.

Results are cached on disk as JSON, keyed by the model signature (hash of the
module class names and parameter names, shapes and dtypes), GPU type, dtype,
sequence length and microbatch range, so a restart does not re-measure. Torch
is imported inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zorse_lightning.errors import PlanningError
from zorse_lightning.profiling.measure_cache import DEFAULT_CACHE_DIR, cache_path, from_json, to_json
from zorse_lightning.profiling.profile import BlockShape, BlockTimes, DeviceTimes, ModelProfile, ProfileSource, TimeCurve

if TYPE_CHECKING:
    import torch



@dataclass(frozen=True)
class MeasureOptions:
    max_microbatch_size: int = 4
    """Times are taken at microbatch sizes 1..this."""
    warmup: int = 2
    """Untimed runs per block and size (allocator, cuDNN autotuning, lazy init)."""
    repeats: int = 5
    """Timed runs per block and size; the median is kept."""

    def __post_init__(self) -> None:
        if self.max_microbatch_size < 1 or self.warmup < 0 or self.repeats < 1:
            raise PlanningError(
                f"MeasureOptions{(self.max_microbatch_size, self.warmup, self.repeats)}: need "
                f"max_microbatch_size >= 1, warmup >= 0 and repeats >= 1"
            )


@dataclass(frozen=True)
class MeasuredBlocks:
    """What one device type measured: its times, and the (device-independent) block sizes."""

    signature: str
    seq_len: int
    dtype: str
    times: DeviceTimes
    embedding: BlockShape
    layers: tuple[BlockShape, ...]
    head: BlockShape
    from_cache: bool = False


def model_signature(blocks: Sequence[Any], before: Any = None, after: Any = None) -> str:
    """Hash of module class names and parameter names, shapes and dtypes (16 hex digits)."""
    parts = []
    for role, modules in (("before", [before]), ("block", blocks), ("after", [after])):
        for module in modules:
            if module is None:
                continue
            parts.append(role + ":" + ",".join(type(m).__qualname__ for m in module.modules()))
            parts.extend(f"{n}{tuple(p.shape)}{p.dtype}" for n, p in module.named_parameters())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a host clock reads the device's time."""
    import torch

    getattr(torch, device.type).synchronize()


def _first_tensor(output: Any, name: str, module: Any) -> torch.Tensor:
    import torch

    if not isinstance(output, torch.Tensor):
        raise PlanningError(
            f"cannot profile {name} ({type(module).__name__}): it returned {type(output).__name__}, "
            f"not a tensor; wrap it in a module "
            f"that returns the activation tensor passed to the next block"
        )
    return output


Call = tuple[tuple, dict]
"""A block call as captured: ``(args, kwargs)``, the activation first."""


def _call(module: Any, call: Call, x: torch.Tensor) -> Any:
    """``module`` on ``call`` with ``x`` as the activation; state objects of the call copied afresh."""
    from zorse_lightning.module.call_inputs import fresh_side_state  # imports torch: kept out of module import

    args, kwargs = fresh_side_state(call)
    return module(x, *args[1:], **kwargs)


def _time_one(module: Any, call: Call, name: str, options: MeasureOptions, device: torch.device):
    """Median forward and backward ms of ``module`` on ``call``, and its (detached) output."""
    import torch

    x = call[0][0]
    forward_ms, backward_ms = [], []
    for run in range(options.warmup + options.repeats):
        inp = x.detach().requires_grad_(x.is_floating_point())
        synchronize(device)
        start = time.perf_counter()
        out = _first_tensor(_call(module, call, inp), name, module)
        synchronize(device)
        middle = time.perf_counter()
        if out.requires_grad:
            out.backward(torch.ones_like(out))
        synchronize(device)
        end = time.perf_counter()
        if run >= options.warmup:
            forward_ms.append((middle - start) * 1e3)
            backward_ms.append((end - middle) * 1e3 if out.requires_grad else 0.0)
    return statistics.median(forward_ms), statistics.median(backward_ms), out.detach()


def _saved_bytes(module: Any, call: Call) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for the backward of ``module`` on ``call``."""
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
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _call(module, call, inp)
    return sum(seen.values())


def _flops(module: Any, call: Call) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    import torch

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        _call(module, call, call[0][0])
    return float(counter.get_total_flops())


def _fit(sizes: Sequence[int], times_ms: Sequence[float]) -> TimeCurve:
    """Least-squares line through (size, time); a line through the origin from one point."""
    if len(sizes) == 1:
        return TimeCurve(times_ms[0] / sizes[0], 0.0, tuple(times_ms))
    mean_b, mean_t = statistics.fmean(sizes), statistics.fmean(times_ms)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in zip(sizes, times_ms)) / sum((b - mean_b) ** 2 for b in sizes)
    return TimeCurve(slope, mean_t - slope * mean_b, tuple(times_ms))


_ZERO_TIMES = BlockTimes(TimeCurve(0.0, 0.0), TimeCurve(0.0, 0.0))


def _default_gpu_type(device: torch.device) -> str:
    from zorse_lightning.cluster.catalog import DEFAULT_CATALOG
    from zorse_lightning.cluster.detection import local_device_report

    report = local_device_report(device)
    if report is None:
        return device.type
    found = DEFAULT_CATALOG.find(report.name)
    return found.name if found is not None else report.name


def measure_blocks(
    blocks: Sequence[Any],
    example_input: torch.Tensor,
    *,
    device: torch.device | str = "cpu",
    dtype: str = "float32",
    gpu_type: str | None = None,
    seq_len: int | None = None,
    before: Any = None,
    after: Any = None,
    options: MeasureOptions = MeasureOptions(),
    cache_dir: str | Path | None = DEFAULT_CACHE_DIR,
) -> MeasuredBlocks:
    """Time and size each block of ``blocks`` (modules already on ``device`` in ``dtype``).

    ``example_input``: one sample (batch dimension of size 1) for ``before``, or
    for the first block when ``before`` is None; floating inputs are cast to
    ``dtype``. ``gpu_type`` names the times (default: the catalog name of the CUDA
    device, else the device type, e.g. ``"cpu"``; emulated ranks pass the type
    they emulate). ``seq_len`` defaults to the input's second dimension.
    ``cache_dir=None`` disables the cache.
    """
    import torch

    from zorse_lightning.profiling.estimate import bytes_per_element

    bytes_per_element(dtype)
    device = torch.device(device)
    if example_input.ndim < 1 or example_input.shape[0] != 1:
        raise PlanningError(
            f"example_input has shape {tuple(example_input.shape)}: "
            f"give one sample, with a leading batch dimension of 1"
        )
    if not blocks:
        raise PlanningError("measure_blocks needs at least one block (the model's repeated layers)")
    seq_len = seq_len or (example_input.shape[1] if example_input.ndim >= 2 else 1)
    signature = model_signature(blocks, before, after)
    gpu_type = gpu_type or _default_gpu_type(device)
    path = None if cache_dir is None else cache_path(Path(cache_dir), signature, gpu_type, dtype, seq_len, options)
    if path is not None and path.exists():
        return from_json(json.loads(path.read_text()))

    x = example_input.to(device)
    if x.is_floating_point():
        x = x.to(getattr(torch, dtype))
    chain = [("embedding", before)] if before is not None else []
    chain += [(f"layer{i}", b) for i, b in enumerate(blocks)]
    chain += [("head", after)] if after is not None else []
    sizes = tuple(range(1, options.max_microbatch_size + 1))
    measured = _measure_chain(chain, lambda b: ((torch.cat([x] * b),), {}), sizes, options, device)
    times = [
        BlockTimes(_fit(measured.sizes, f), _fit(measured.sizes, b))
        for f, b in zip(measured.forward_ms, measured.backward_ms)
    ]
    shapes = [BlockShape(name, *sizes) for (name, _), sizes in zip(chain, measured.block_sizes)]
    zero_shape = BlockShape("none", 0, 0, 0, 0.0)
    first, last = int(before is not None), len(chain) - int(after is not None)
    result = MeasuredBlocks(
        signature=signature,
        seq_len=seq_len,
        dtype=dtype,
        times=DeviceTimes(
            gpu_type,
            ProfileSource.MEASURED,
            times[0] if before is not None else _ZERO_TIMES,
            tuple(times[first:last]),
            times[-1] if after is not None else _ZERO_TIMES,
        ),
        embedding=shapes[0] if before is not None else zero_shape,
        layers=tuple(shapes[first:last]),
        head=shapes[-1] if after is not None else zero_shape,
    )
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(to_json(result)))
        os.replace(tmp, path)
    return result


@dataclass(frozen=True)
class _ChainMeasurement:
    sizes: tuple[int, ...]
    forward_ms: list[list[float]]
    """Per module, per size."""
    backward_ms: list[list[float]]
    block_sizes: list[tuple[int, int, int, float]]
    """Per module: parameters, activation and output bytes per sample, forward FLOPs per sample."""


def _measure_chain(
    chain: list[tuple[str, Any]], first_call: Callable[[int], Call], sizes: tuple[int, ...], options: MeasureOptions,
    device: torch.device,
) -> _ChainMeasurement:
    """The chain timed and sized at each microbatch size; ``first_call(b)`` is the first module's call at size
    ``b``, each later module receives the output of the one before."""
    forward_ms: list[list[float]] = [[] for _ in chain]
    backward_ms: list[list[float]] = [[] for _ in chain]
    saved: list[dict[int, int]] = [{} for _ in chain]
    outputs: list[int] = [0] * len(chain)
    flops: list[float] = [0.0] * len(chain)
    grads = [(p, p.grad) for _, m in chain for p in m.parameters()]
    try:
        for b in sizes:
            call = first_call(b)
            for i, (name, module) in enumerate(chain):
                if b in (1, sizes[-1]):
                    saved[i][b] = _saved_bytes(module, call)
                if b == 1:
                    flops[i] = _flops(module, call)
                fwd, bwd, x = _time_one(module, call, name, options, device)
                forward_ms[i].append(fwd)
                backward_ms[i].append(bwd)
                if b == 1:
                    outputs[i] = x.numel() * x.element_size()
                call = ((x,), {})
    finally:
        for p, g in grads:
            p.grad = g
    n = sizes[-1]
    per_sample = [max(0, round((s[n] - s[1]) / (n - 1))) if n > 1 else s[1] for s in saved]
    block_sizes = [
        (sum(p.numel() for p in m.parameters()), per_sample[i], outputs[i], flops[i]) for i, (_, m) in enumerate(chain)
    ]
    return _ChainMeasurement(sizes, forward_ms, backward_ms, block_sizes)


def measure_block_calls(
    block: Any, calls: Sequence[Call], *, device: torch.device, gpu_type: str, options: MeasureOptions = MeasureOptions()
) -> MeasuredBlocks:
    """Time and size one block on calls captured from the user's step: ``calls[b - 1]`` at microbatch size ``b``
    (the activation and the keyword arguments a real forward gives it: masks, rotary embeddings, a cache).

    Start-up profiles this way: one block stands for all blocks of its list,
    measured on exactly what it receives, never on guessed inputs.
    """
    x = calls[0][0][0]
    dtype = str(x.dtype).removeprefix("torch.")
    measured = _measure_chain(
        [("layer0", block)], lambda b: calls[b - 1], tuple(range(1, len(calls) + 1)), options, device
    )
    times = BlockTimes(_fit(measured.sizes, measured.forward_ms[0]), _fit(measured.sizes, measured.backward_ms[0]))
    zero_shape = BlockShape("none", 0, 0, 0, 0.0)
    return MeasuredBlocks(
        signature=model_signature([block]),
        seq_len=x.shape[1] if x.ndim >= 2 else 1,
        dtype=dtype,
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

"""One GPU type's profile, measured at start by the first rank of that type on its own device.

Block 0 stands for every block (one list holds one class, and start-up runs
the step with only block 0 real: :mod:`~zorse_lightning.module.first_block`);
it is timed in place on the calls captured from the user's step (its
gradients are put back after),
then what a step spends outside them (embedding, head, loss: :mod:`.step_costs`)
with gradients, the user's own optimizer on block 0's parameter shapes and the
engine's own time per action. Every forward runs inside the precision plugin's
forward context, so the times and activation bytes are those of the precision
that trains, and the profile records that precision. On an emulated cluster every measurement goes through
the rank's emulator on the costs calibrated once for the whole run: every type
is timed on the same CPU cost, so the profile's ratios between types are exactly
their speed ratios, and the run's emulation charges what was profiled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch

from zorse_lightning.emulation.emulator import named_emulated_modules
from zorse_lightning.emulation.rank import RankEmulation
from zorse_lightning.emulation.timing import CallCost
from zorse_lightning.module.blocks import BlockList
from zorse_lightning.module.microbatch import samples_in
from zorse_lightning.profiling.measure import Call, ForwardContext, MeasureOptions, MeasuredBlocks, measure_block_calls
from zorse_lightning.profiling.profile import BlockShape, OptimizerProfile
from zorse_lightning.profiling.timing import TimingOptions
from zorse_lightning.startup.step_costs import OptimizerFactory, measure_optimizer, measure_step_edges

PROFILE_TIMING = TimingOptions(min_warmup=2, max_warmup=6, repeats=3)
"""Short: profiling runs at every start, at every microbatch size the batch allows."""

PROFILE_OPTIONS = MeasureOptions(warmup=PROFILE_TIMING.min_warmup, repeats=PROFILE_TIMING.repeats)
"""The block timings' options (their sizes are the calls given)."""


@dataclass(frozen=True)
class TypeProfile:
    """What the first rank of a GPU type measured at start-up."""

    blocks: MeasuredBlocks
    """Every block's times (block 0's, repeated), the edges' times, the optimizer's rate."""
    sizes: tuple[int, ...]
    """Microbatch sizes measured for blocks and edges alike."""
    refused_size: int | None
    """The first size asked for that did not fit on this type (None: every size asked fitted)."""
    embedding_activation_bytes: tuple[int, int]
    """(per sample, per microbatch) the step saves for backward before the first block."""
    head_activation_bytes: tuple[int, int]
    transient_bytes: tuple[int, int]
    """(per sample, per microbatch) a step holds at its peak beyond what it saves (CUDA only)."""
    optimizer: OptimizerProfile | None
    """The user's optimizer as measured (None: the module has none at start-up)."""


def block_names(blocks: BlockList) -> list[str]:
    """Each block's name in the whole model (what calibrated costs are keyed by)."""
    return [f"{blocks.path}.{name}" for name, _ in blocks.container.named_children()]


def view_modules(root: torch.nn.Module, blocks: BlockList) -> list[tuple[str, torch.nn.Module]]:
    """The emulated modules that compute in the first-block view: all but blocks 1.. (they pass through)."""
    later = {id(b) for b in blocks.blocks[1:]}
    return [(n, m) for n, m in named_emulated_modules(root, blocks.path) if id(m) not in later]


def _as_every_block(measured: MeasuredBlocks, count: int) -> MeasuredBlocks:
    """Block 0's measurement repeated for each of ``count`` blocks."""
    times = replace(measured.times, layers=measured.times.layers * count)
    layers = tuple(replace(measured.layers[0], name=f"layer{i}") for i in range(count))
    return replace(measured, layers=layers, times=times)


def measure_type_profile(
    root: torch.nn.Module,
    blocks: BlockList,
    calls: Mapping[int, Call],
    batch: Any,
    run_step: Callable[[Any], Any],
    device: torch.device,
    gpu_type: str,
    emulation: RankEmulation | None,
    costs: Mapping[str, CallCost] | None,
    *,
    forward_context: ForwardContext = nullcontext,
    dtype: str | None = None,
    optimizer: OptimizerFactory | None = None,
    refused_size: int | None = None,
) -> TypeProfile:
    """Blocks, step edges, optimizer and the engine's time per action on this rank's GPU type (through
    ``emulation`` where given), in the precision that trains.

    ``run_step(microbatch)`` runs the user's training step inside ``forward_context`` (and returns its loss);
    ``calls[b]`` is what block 0 receives at microbatch size ``b``
    (:func:`~zorse_lightning.module.capture.first_block_call`), ``refused_size`` the first size whose call
    could not be captured (it did not fit). Runs inside the first-block view; block 0 is timed in place
    (its gradients are put back after). ``optimizer`` builds the user's optimizer on given parameters.
    """
    block = blocks.blocks[0]
    emulator = None
    if emulation is not None:
        emulator = emulation.instrumented(root, costs, named=[(block_names(blocks)[0], block)])
    asked = sorted(calls) + ([refused_size] if refused_size is not None else [])
    try:
        measured = measure_block_calls(
            block, calls, device=device, gpu_type=gpu_type, options=PROFILE_OPTIONS,
            forward_context=forward_context, dtype=dtype,
        )
    finally:
        if emulator is not None:
            emulator.remove()

    step_emulator = emulation.instrumented(root, costs, named=view_modules(root, blocks)) if emulation is not None else None

    def step(micro: Any) -> Any:
        if step_emulator is not None:
            step_emulator.batch_samples = samples_in(micro)
        return run_step(micro)

    try:
        edges = measure_step_edges(step, blocks, batch, device, measured.times.layers[0].forward.sizes, PROFILE_TIMING)
    finally:
        if step_emulator is not None:
            step_emulator.remove()
    sizes = edges.sizes
    measured = _restricted(measured, sizes)
    optimizer_profile, rate = None, None
    if optimizer is not None:
        result = measure_optimizer(optimizer, list(block.parameters()), device, PROFILE_TIMING)
        optimizer_profile, rate = result.profile, result.ms_per_million_parameters
    times = replace(measured.times, embedding=edges.embedding, head=edges.head, optimizer_ms_per_million_parameters=rate)
    refused = next((b for b in asked if b not in sizes), None)
    return TypeProfile(
        _as_every_block(replace(measured, times=times), len(blocks)), sizes, refused,
        edges.embedding_activation_bytes, edges.head_activation_bytes, edges.transient_bytes, optimizer_profile,
    )


def _restricted(measured: MeasuredBlocks, sizes: tuple[int, ...]) -> MeasuredBlocks:
    """Block 0's times at ``sizes`` only (the edges stopped earlier: a size the step cannot run is no size)."""
    layer = measured.times.layers[0]
    if layer.forward.sizes == sizes:
        return measured

    def keep(curve: Any) -> Any:
        points = dict(zip(curve.sizes, curve.measured_ms))
        return replace(curve, measured_ms=tuple(points[b] for b in sizes), measured_sizes=sizes)

    times = replace(measured.times, layers=(replace(layer, forward=keep(layer.forward), backward=keep(layer.backward)),))
    return replace(measured, times=times)


def edge_shape(
    name: str, parameters: int, activation: tuple[int, int], output_bytes_per_sample: int,
    transient: tuple[int, int] = (0, 0),
) -> BlockShape:
    """An edge's shape (embedding or head) with what it saves for backward and holds while it runs."""
    return BlockShape(name, parameters, activation[0], output_bytes_per_sample, 0.0, activation[1], *transient)

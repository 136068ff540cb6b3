"""Profiling a module on one device, the one way: start-up's part on each rank, and the plan app's profile.

Why one path: the plan app once profiled through its own (blocks fed a
repeated sample at sizes 1 and 2, no step edges, no optimizer, no time per
action) and planned from a profile start-up would never have measured. Both
now run :func:`measure_on_device`: inside the first-block view
(:mod:`~zorse_lightning.module.first_block`) block 0's calls are captured from
the user's step at every microbatch size
:func:`~.profiled_sizes.sizes_to_profile` gives, up to the first that does not
fit; the engine's time per action is timed; and, where asked, the GPU type's
blocks, step edges and optimizer (:mod:`.type_profile`) and the edges'
parameters. :func:`model_profile` makes one :class:`ModelProfile` of one
device's measurement (the plan app: :func:`profile_on_device`) or of every
rank's (start-up, once gathered).

Nothing here calls torch.distributed: start-up passes its collective
calibration in (``calibrate``) and gathers the measurements itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from zorse_lightning.emulation.calibration import as_every_block, calibrate_modules
from zorse_lightning.emulation.rank import RankEmulation
from zorse_lightning.emulation.timing import CallCost
from zorse_lightning.errors import PlanningError
from zorse_lightning.module.blocks import BlockList, CutError
from zorse_lightning.module.capture import edge_parameter_ids, first_block_call
from zorse_lightning.module.first_block import first_block_view
from zorse_lightning.module.microbatch import microbatch_slice, samples_in
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.profiling.measure import Call, ForwardContext, assemble_profile, out_of_memory_errors
from zorse_lightning.profiling.profile import ModelProfile
from zorse_lightning.startup.profiled_sizes import ProfiledModel, sizes_to_profile
from zorse_lightning.startup.step_costs import OptimizerFactory, measure_action_overhead_ms
from zorse_lightning.startup.type_profile import (
    PROFILE_TIMING,
    TypeProfile,
    block_names,
    edge_shape,
    measure_type_profile,
    view_modules,
)

Calibrate = Callable[..., Mapping[str, CallCost]]
"""``calibrate(named_modules, run, batch_samples=...)``: the emulated modules' CPU costs
(:func:`~zorse_lightning.emulation.calibration.calibrate_modules` alone, or ``calibrate_in_turn`` over the
ranks at start-up)."""


@dataclass(frozen=True)
class DeviceInputs:
    """What profiling a module on one device needs."""

    module: nn.Module
    """The user's module, whole (its own ``training_step`` is what runs)."""
    blocks: BlockList
    device: torch.device
    gpu_type: str
    """The name its times get: the rank's GPU type (the emulated one on an emulated rank), ``cpu`` in the plan app."""
    options: PlannerOptions
    """The planner's options: their candidate and pinned microbatch sizes are measured."""
    forward_context: ForwardContext = nullcontext
    """The precision plugin's forward context (autocast under mixed precision): every timed forward runs in it."""
    optimizer: OptimizerFactory | None = None
    """Builds the user's optimizer on given parameters; None: none known, the planner estimates an AdamW step."""
    emulation: RankEmulation | None = None
    """The emulation of the GPU type this device stands in for; None on a real device (and in the plan app)."""
    init_seed: int = 0
    """Seed of the values a module built on the meta device gets (:mod:`~zorse_lightning.module.materialize`)."""


@dataclass(frozen=True)
class EdgeParameters:
    """Parameters of the modules that run before the blocks (embedding) and after them (head)."""

    embedding: int
    head: int
    tied: bool
    """One weight in both (a tied embedding and head): the planner all-reduces it between the end stages."""


@dataclass(frozen=True)
class DeviceMeasurement:
    """What one device measured (each rank's at start-up, sent to rank 0)."""

    gpu_type: str
    samples: int
    """Samples in the batch it profiled on (a rank's batch): no larger microbatch was measured."""
    action_overhead_ms: float
    """The engine's own time per action on this device (host time)."""
    host_overlaps_device: bool
    """True on CUDA: the host's time per action hides under the device's compute."""
    output_bytes_per_sample: int
    """Bytes per sample of the activation block 0 receives (what the embedding passes on)."""
    weight_dtype: str
    type_profile: TypeProfile | None
    """The GPU type's blocks, edges and optimizer (None: another rank of its type measured them)."""
    edge_parameters: EdgeParameters | None
    """None where not counted (start-up counts them on rank 0 alone)."""
    calibrated_costs: Mapping[str, CallCost] | None = None
    """The emulated modules' CPU costs the measurement was charged on (None when not emulated)."""


def block_calls(
    blocks: BlockList, first_samples: Callable[[int], Callable[[], Any]], sizes: tuple[int, ...]
) -> tuple[dict[int, Call], int | None]:
    """What block 0 receives in the user's step at each of ``sizes`` (in the first-block view), up to the
    first size whose step does not fit on the device, and that size (None: all fitted).

    A step that fails there (a block that cannot run on what the others pass
    through) is reported as a cut problem naming the block list, not as a
    traceback from inside the model.
    """
    calls: dict[int, Call] = {}
    try:
        first_samples(min(sizes))()  # the whole step once: what follows the blocks must run on what they pass on
        for size in sizes:
            try:
                calls[size] = first_block_call(blocks.blocks[0], first_samples(size))
            except out_of_memory_errors():
                if not calls:
                    raise
                return calls, size
        return calls, None
    except (CutError, PlanningError):
        raise
    except out_of_memory_errors():
        raise
    except Exception as error:
        raise CutError(
            f"start-up runs the training step with {blocks.path}[0] the only real block (the other blocks of "
            f"{blocks.path} pass their input through), and it failed: {type(error).__name__}: {error}. Each block "
            f"of the list must take the activation as its first argument and return a tensor of its shape; name "
            f"the list that does with ZorseStrategy(block_path=...)"
        ) from error


def training_dtypes(forward_context: ForwardContext, block: nn.Module, device: torch.device) -> tuple[str, str]:
    """(the dtype the step computes in, the dtype its weights are held in): a matrix product of the
    weights' dtype inside the precision plugin's forward context says the first (autocast's, or the
    weights' own), block 0's parameters the second."""
    weight = next((p.dtype for p in block.parameters() if p.is_floating_point()), torch.float32)
    probe = torch.ones(2, 2, dtype=weight, device=device)
    with torch.no_grad(), forward_context():
        computed = (probe @ probe).dtype
    return str(computed).removeprefix("torch."), str(weight).removeprefix("torch.")


def _edge_parameters(root: nn.Module, blocks: BlockList, run: Callable[[], Any]) -> EdgeParameters:
    """The parameters of the modules that run before and after the blocks.

    The blocks' profile has no embedding or head; without their parameters the
    planner would count no memory for them and no all-reduce of a tied
    embedding/head weight between the first and last stage.
    """
    before, after = edge_parameter_ids(root, blocks, run)
    sizes = {id(p): p.numel() for p in root.parameters()}
    return EdgeParameters(sum(sizes[i] for i in before), sum(sizes[i] for i in after), bool(before & after))


def measure_on_device(
    inputs: DeviceInputs, batch: Any, run_step: Callable[[Any], Any], *,
    profile_type: bool = True, count_edges: bool = True, calibrate: Calibrate = calibrate_modules,
) -> DeviceMeasurement:
    """Measure ``inputs.module`` on ``inputs.device`` with the first batch ``batch`` (already there).

    ``run_step(microbatch)`` runs the user's training step on ``microbatch`` with
    its logs discarded, inside the forward context, and returns its loss.
    Every call captures block 0's inputs and times the engine's time per action;
    ``profile_type`` adds the GPU type's profile, ``count_edges`` the edges'
    parameters (start-up asks each of the first rank of each type, and of rank 0
    only). With an emulation, ``calibrate`` gives the CPU costs it charges.
    """
    blocks, device = inputs.blocks, inputs.device
    samples = samples_in(batch)

    def first_samples(size: int) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                return run_step(microbatch_slice(batch, 0, size))

        return run

    one_sample = first_samples(1)
    with first_block_view(inputs.module, blocks, device, inputs.init_seed) as view:
        if inputs.emulation is not None:
            meter = inputs.emulation.meter
            if not meter.is_tracking:  # a module built on the host: the device holds what the view made real
                meter.track([m for _, m in view_modules(inputs.module, blocks)])
            meter.measure()  # the view's tensors are new: count them before its first call
        calls, refused = block_calls(blocks, first_samples, sizes_to_profile(inputs.options, samples))
        example = calls[min(calls)][0][0]
        computed, weights = training_dtypes(inputs.forward_context, blocks.blocks[0], device)
        overhead_ms = measure_action_overhead_ms(run_step, blocks, batch, device, PROFILE_TIMING, view.output_form)
        costs = None
        if inputs.emulation is not None:
            calibrated = calibrate(view_modules(inputs.module, blocks), one_sample, batch_samples=1)
            names = block_names(blocks)
            costs = as_every_block(calibrated, names[0], names[1:])
        type_profile = None
        if profile_type:
            type_profile = measure_type_profile(
                inputs.module, blocks, calls, batch, run_step, device, inputs.gpu_type, inputs.emulation, costs,
                forward_context=inputs.forward_context, dtype=computed, optimizer=inputs.optimizer,
                refused_size=refused,
            )
        edges = _edge_parameters(inputs.module, blocks, one_sample) if count_edges else None
    return DeviceMeasurement(
        gpu_type=inputs.gpu_type, samples=samples, action_overhead_ms=overhead_ms,
        host_overlaps_device=device.type == "cuda",
        output_bytes_per_sample=example.numel() * example.element_size() // example.shape[0],
        weight_dtype=weights, type_profile=type_profile, edge_parameters=edges, calibrated_costs=costs,
    )


def _common_sizes(measured: list[TypeProfile], samples: int) -> tuple[tuple[int, ...], str]:
    """The sizes every type measured, and why larger ones were not (for the plan's notes)."""
    common = sorted(set.intersection(*(set(m.sizes) for m in measured)))
    reasons = [f"{samples} samples per rank in the first batch"]
    reasons += [
        f"{m.refused_size} did not fit on {m.blocks.times.gpu_type}" for m in measured if m.refused_size is not None
    ]
    return tuple(common), "; ".join(reasons)


def model_profile(measured: Sequence[DeviceMeasurement], model: str) -> ProfiledModel:
    """One profile of every GPU type's measurement, with the edges' shapes and each type's time per action
    (its slowest device's: a stage waits for it; hidden under the compute where the device runs
    asynchronously from the host), and the sizes every type measured.

    The first measurement must hold a type profile and the edges' parameters (start-up's rank 0).
    """
    first = measured[0]
    if first.type_profile is None or first.edge_parameters is None:
        raise ValueError("model_profile: the first measurement must hold a type profile and the edges' parameters")
    types = [m.type_profile for m in measured if m.type_profile is not None]
    overheads: dict[str, float] = {}
    for m in measured:
        overheads[m.gpu_type] = max(overheads.get(m.gpu_type, 0.0), m.action_overhead_ms)
    asynchronous = {m.gpu_type: m.host_overlaps_device for m in measured}
    edges = first.edge_parameters
    profile = assemble_profile([t.blocks for t in types], model=model, tied_embedding_head=edges.tied)
    devices = {
        name: replace(times, action_overhead_ms=overheads[name], host_overlaps_device=asynchronous[name])
        for name, times in profile.devices.items()
    }
    own = first.type_profile
    profile = replace(
        profile,
        embedding=edge_shape("embedding", edges.embedding, own.embedding_activation_bytes, first.output_bytes_per_sample),
        head=edge_shape("head", edges.head, own.head_activation_bytes, 0, own.transient_bytes),
        devices=devices,
        weight_dtype=first.weight_dtype,
        optimizer=own.optimizer,
    )
    sizes, why_not = _common_sizes(types, first.samples)
    return ProfiledModel(profile, sizes, why_not)


def profile_on_device(inputs: DeviceInputs, batch: Any, run_step: Callable[[Any], Any]) -> ProfiledModel:
    """The module's profile for ``inputs.gpu_type`` measured on this one device, as start-up measures it
    (single process: the plan app's profile of a LightningModule)."""
    return model_profile([measure_on_device(inputs, batch, run_step)], type(inputs.module).__name__)

"""Start-up as one pass: the user's step and the cluster in, a :class:`StartupResult` out.

Every rank calls :func:`run_startup` with the first batch (on its device). The
step runs with block 0 the only real block (:mod:`~zorse_lightning.module.first_block`):
the device holds the edges and one block, never the whole model, and nothing
is left on it after.

1. on an emulated cluster, every rank calibrates the CPU cost of the model's
   modules in turn, and all keep the minimum (the run's emulation reuses them);
2. every rank times the engine's own work per action (the step with every block
   passing its input on), all at once as they will run; the first rank of each
   GPU type profiles the blocks, the step's edges (with gradients) and the user's
   optimizer on its own device (:mod:`.type_profile`), inside the precision
   plugin's forward context, at every microbatch size the batch allows up to the
   first that does not fit; an emulated rank does so through its emulation, so
   it is never told its speed;
3. each machine's ranks time an all-reduce of the model's gradient bytes
   (:mod:`.link_probe`): the planner prices synchronisation at the measured rate
   where it is below the configured one;
4. rank 0 plans, and every rank receives the plan.

A module that cannot be cut, or that optimises by hand, gets a data-parallel
plan without profiling, and the plan's notes say why. Nothing is written back
onto the strategy: what the run needs later is in the result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.emulation.calibration import as_every_block, calibrate_in_turn
from zorse_lightning.emulation.rank import RankEmulation
from zorse_lightning.emulation.timing import CallCost
from zorse_lightning.errors import PlanningError
from zorse_lightning.module.blocks import BlockList, CutError, find_block_list
from zorse_lightning.module.capture import edge_parameter_ids, first_block_call
from zorse_lightning.module.first_block import first_block_view
from zorse_lightning.module.microbatch import microbatch_slice, samples_in
from zorse_lightning.planner.baselines import unprofiled_data_parallel
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.planner.plan import Plan
from zorse_lightning.planner.search import make_plan
from zorse_lightning.profiling.measure import Call, ForwardContext, assemble_profile, out_of_memory_errors
from zorse_lightning.profiling.profile import ModelProfile
from zorse_lightning.startup.link_probe import probe_bytes, probe_machines, with_measured_rates
from zorse_lightning.startup.step_costs import OptimizerFactory, measure_action_overhead_ms
from zorse_lightning.startup.type_profile import (
    PROFILE_TIMING,
    TypeProfile,
    block_names,
    edge_shape,
    measure_type_profile,
    view_modules,
)

MANUAL_OPTIMIZATION_REASON = (
    "the module optimises by hand (automatic_optimization=False), so the engine cannot own its backward and "
    "optimizer steps across pipeline stages; optimizer state is not sharded, every rank steps every weight"
)
"""The note's reason in a plan made for such a module (``data parallel only: <reason>``)."""


@dataclass(frozen=True)
class StartupInputs:
    """What the start-up pass needs to know of the run, given by the strategy."""

    module: nn.Module
    """The user's module, whole (its own ``training_step`` is what gets timed)."""
    inventory: ClusterInventory
    rank: int
    world_size: int
    device: torch.device
    global_batch_size: int
    """Samples per optimizer step over all ranks (a resumed checkpoint's, or the loader's batch times the ranks)."""
    planner_options: PlannerOptions
    block_path: str | None = None
    emulation: RankEmulation | None = None
    """This rank's emulation of its GPU type; None on real devices."""
    automatic_optimization: bool = True
    init_seed: int = 0
    """Seed of the values a module built on the meta device gets (:mod:`~zorse_lightning.module.materialize`)."""
    forward_context: ForwardContext = nullcontext
    """The precision plugin's forward context (autocast under mixed precision): every timed forward runs in
    it, as training does."""
    optimizer: OptimizerFactory | None = None
    """Builds the user's optimizer (class and settings from ``configure_optimizers``) on given parameters;
    None: none known, the planner estimates an AdamW step."""


@dataclass(frozen=True)
class StartupResult:
    """What start-up found: the plan every rank runs, and what rank 0 planned from."""

    plan: Plan
    calibrated_costs: Mapping[str, CallCost] | None = None
    """Emulated modules' CPU costs, alike on every rank (None when not emulated): the run's emulation reuses
    them, so it charges what the profile measured."""
    profile: ModelProfile | None = None
    """The measured profile (rank 0 only)."""
    inventory: ClusterInventory | None = None
    """The cluster as the planner saw it: intra-machine rates as measured where slower (rank 0 only)."""


def sizes_to_profile(options: PlannerOptions, samples: int) -> tuple[int, ...]:
    """Microbatch sizes start-up measures: 1, 2, 4, ... and the planner's candidates up to the ``samples`` a
    rank's batch holds, that number itself (one microbatch of the whole local batch), and a pinned size.

    Measuring every size the planner may choose is what lets it choose: a line
    through two small sizes once read a per-call overhead as a per-sample saving
    (and, on a GPU, missed the large microbatch that was twice as fast).
    """
    sizes = {1 << k for k in range(samples.bit_length())} | {m for m in options.microbatch_sizes if m <= samples}
    sizes.add(samples)
    if options.microbatch_size is not None:
        sizes.add(options.microbatch_size)
    return tuple(sorted(sizes))


def within_profiled_sizes(
    options: PlannerOptions, measured: tuple[int, ...] | None = None, why_not: str = ""
) -> tuple[PlannerOptions, str | None]:
    """The planner's candidates: the sizes measured on every GPU type (the largest, one microbatch of the
    whole local batch, among them), with a note naming those left out; a pinned size not measured is refused.

    ``why_not`` says why larger sizes were not measured (the batch's samples per rank, a type's memory).
    Nothing is priced off the measured points: a size beyond them is never planned. ``measured`` None
    (sizes not known yet) leaves the options as they are: the planner itself keeps to the sizes a measured
    profile holds (:attr:`~zorse_lightning.profiling.profile.ModelProfile.measured_sizes`), without a note.
    """
    if measured is None:
        return options, None
    if options.microbatch_size is not None:
        if options.microbatch_size not in measured:
            raise PlanningError(
                f"planner microbatch_size={options.microbatch_size} was not measured at start-up (measured: "
                f"{list(measured)}{'; ' + why_not if why_not else ''}), and the planner prices only measured sizes; "
                f"pin one of {list(measured)}, or give the loader a batch that holds {options.microbatch_size} samples"
            )
        return options, None
    largest = max(measured)
    kept = tuple(sorted({m for m in options.microbatch_sizes if m in measured} | {largest}))
    dropped = [m for m in options.microbatch_sizes if m not in measured]
    note = None
    if dropped:
        note = (f"microbatch sizes {dropped} not considered: start-up measured sizes {list(measured)}"
                f"{' (' + why_not + ')' if why_not else ''}; pin planner microbatch_size to one of them")
    return replace(options, microbatch_sizes=kept), note


def _edge_parameters(root: nn.Module, blocks: BlockList, run: Callable[[], Any]) -> tuple[int, int, bool]:
    """(embedding, head, tied) parameters: those of the modules that run before and after the blocks.

    The blocks' profile has no embedding or head; without their parameters the
    planner would count no memory for them and no all-reduce of a tied
    embedding/head weight between the first and last stage.
    """
    before, after = edge_parameter_ids(root, blocks, run)
    sizes = {id(p): p.numel() for p in root.parameters()}
    return sum(sizes[i] for i in before), sum(sizes[i] for i in after), bool(before & after)


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


def _first_of_its_type(inventory: ClusterInventory, rank: int) -> bool:
    my_type = inventory.gpus[rank].gpu_type.name
    return next(r for r, g in enumerate(inventory.gpus) if g.gpu_type.name == my_type) == rank


def _common_sizes(measured: list[TypeProfile], samples: int) -> tuple[tuple[int, ...], str]:
    """The sizes every type measured, and why larger ones were not (for the plan's notes)."""
    common = sorted(set.intersection(*(set(m.sizes) for m in measured)))
    reasons = [f"{samples} samples per rank in the first batch"]
    reasons += [
        f"{m.refused_size} did not fit on {m.blocks.times.gpu_type}" for m in measured if m.refused_size is not None
    ]
    return tuple(common), "; ".join(reasons)


def _profile_of(
    measured: list[TypeProfile], edges: tuple[int, int, bool], overheads: dict[str, float],
    asynchronous: dict[str, bool], model: str, output_bytes: int, weight_dtype: str,
) -> ModelProfile:
    """One profile from every type's measurement, with the edges' shapes and each type's time per action
    (hidden under the compute where the device runs asynchronously from the host)."""
    embedding_parameters, head_parameters, tied = edges
    profile = assemble_profile([m.blocks for m in measured], model=model, tied_embedding_head=tied)
    first = measured[0]
    devices = {
        name: replace(times, action_overhead_ms=overheads[name], host_overlaps_device=asynchronous[name])
        for name, times in profile.devices.items()
    }
    return replace(
        profile,
        embedding=edge_shape("embedding", embedding_parameters, first.embedding_activation_bytes, output_bytes),
        head=edge_shape("head", head_parameters, first.head_activation_bytes, 0, first.transient_bytes),
        devices=devices,
        weight_dtype=weight_dtype,
        optimizer=first.optimizer,
    )


def run_startup(inputs: StartupInputs, batch: Any, run_step: Callable[[Any], Any]) -> StartupResult:
    """Profile, plan on rank 0, broadcast (collective: every rank calls it, with its own first batch).

    ``run_step(microbatch)`` runs the user's training step on ``microbatch`` with
    its logs discarded, inside the precision plugin's forward context, and
    returns its loss; ``batch`` is already on ``inputs.device``.
    """
    inventory, options = inputs.inventory, inputs.planner_options
    if not inputs.automatic_optimization:
        return StartupResult(unprofiled_data_parallel(
            inventory, inputs.global_batch_size, MANUAL_OPTIMIZATION_REASON, shard_optimizer=False
        ))
    try:
        blocks = find_block_list(inputs.module, inputs.block_path)
    except CutError as error:
        return StartupResult(unprofiled_data_parallel(inventory, inputs.global_batch_size, str(error)))
    samples = samples_in(batch)

    def first_samples(size: int) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                return run_step(microbatch_slice(batch, 0, size))

        return run

    one_sample = first_samples(1)

    with first_block_view(inputs.module, blocks, inputs.device, inputs.init_seed):
        if inputs.emulation is not None:
            meter = inputs.emulation.meter
            if not meter.is_tracking:  # a module built on the host: the device holds what the view made real
                meter.track([m for _, m in view_modules(inputs.module, blocks)])
            meter.measure()  # the view's tensors are new: count them before its first call
        calls, refused = block_calls(blocks, first_samples, sizes_to_profile(options, samples))
        example = calls[min(calls)][0][0]
        computed, weights = training_dtypes(inputs.forward_context, blocks.blocks[0], inputs.device)
        overhead_ms = measure_action_overhead_ms(run_step, blocks, batch, inputs.device, PROFILE_TIMING)
        costs = None
        if inputs.emulation is not None:
            calibrated = calibrate_in_turn(view_modules(inputs.module, blocks), one_sample, batch_samples=1)
            names = block_names(blocks)
            costs = as_every_block(calibrated, names[0], names[1:])
        mine = None
        gpu_type = inventory.gpus[inputs.rank].gpu_type.name
        if _first_of_its_type(inventory, inputs.rank):
            mine = measure_type_profile(
                inputs.module, blocks, calls, batch, run_step, inputs.device, gpu_type, inputs.emulation, costs,
                forward_context=inputs.forward_context, dtype=computed, optimizer=inputs.optimizer,
                refused_size=refused,
            )
        edges = _edge_parameters(inputs.module, blocks, one_sample) if inputs.rank == 0 else None
    measured: list[Any] = [None] * inputs.world_size
    dist.all_gather_object(measured, (mine, gpu_type, overhead_ms, inputs.device.type == "cuda"))
    probes = probe_machines(inventory, inputs.rank, inputs.device, probe_bytes(inputs.module))
    if inputs.rank != 0:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, 0)
        if isinstance(box[0], PlanningError):  # every rank stops with rank 0's reason, not a lost connection
            raise box[0]
        return StartupResult(box[0], costs)
    overheads: dict[str, float] = {}
    asynchronous: dict[str, bool] = {}
    for _, type_name, ms, cuda in measured:  # the slowest rank of a type: its stage waits for it
        overheads[type_name] = max(overheads.get(type_name, 0.0), ms)
        asynchronous[type_name] = cuda
    types = [m for m, _, _, _ in measured if m is not None]
    profile = _profile_of(
        types, edges, overheads, asynchronous, type(inputs.module).__name__,
        example.numel() * example.element_size() // example.shape[0], weights,
    )
    planned_on = with_measured_rates(inventory, probes)
    common, why_not = _common_sizes(types, samples)
    try:
        options, size_note = within_profiled_sizes(options, common, why_not)
        plan = make_plan(planned_on, profile, inputs.global_batch_size, options)
    except PlanningError as error:
        dist.broadcast_object_list([error], 0)
        raise
    notes = (*(p.note() for p in probes if p.slower_than_configured), *([size_note] if size_note else []))
    plan = replace(plan, notes=(*plan.notes, *notes))
    dist.broadcast_object_list([plan], 0)
    return StartupResult(plan, costs, profile, planned_on)

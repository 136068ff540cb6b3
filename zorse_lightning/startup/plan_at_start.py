"""Start-up as one pass: the user's step and the cluster in, a :class:`StartupResult` out.

Every rank calls :func:`run_startup` with the first batch (on its device). The
step runs with block 0 the only real block (:mod:`~zorse_lightning.module.first_block`):
the device holds the edges and one block, never the whole model, and nothing
is left on it after.

1. on an emulated cluster, every rank calibrates the CPU cost of the model's
   modules in turn, and all keep the minimum (the run's emulation reuses them);
2. the first rank of each GPU type profiles the blocks, the step's edges and the
   optimizer on its own device (:mod:`.type_profile`); an emulated rank does so
   through its emulation, so it is never told its speed;
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
from zorse_lightning.profiling.measure import Call, assemble_profile
from zorse_lightning.profiling.profile import BlockShape, ModelProfile
from zorse_lightning.startup.link_probe import probe_bytes, probe_machines, with_measured_rates
from zorse_lightning.startup.type_profile import PROFILE_OPTIONS, block_names, measure_type_profile, view_modules

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


def within_profiled_sizes(options: PlannerOptions) -> tuple[PlannerOptions, str | None]:
    """Microbatch sizes up to the largest profiled, unless the user pins one; with a note when some are dropped.

    Beyond the measured sizes the planner extrapolates a line through two
    points, and a per-call overhead then reads as a per-sample saving that grows
    with the size (seen on cpu_sim4: a 32-sample microbatch given to the A100
    alone, the three other ranks idle, predicted faster than a balanced split).
    """
    if options.microbatch_size is not None:
        return options, None
    largest = PROFILE_OPTIONS.max_microbatch_size
    kept = tuple(m for m in options.microbatch_sizes if m <= largest)
    if not kept:
        raise PlanningError(
            f"planner microbatch_sizes={list(options.microbatch_sizes)} are all above {largest}, the largest size "
            f"profiled at start, where the planner's times would be extrapolated; include a size <= {largest}, "
            f"or pin one with microbatch_size=... (the planner then prices it as measured at {largest})"
        )
    dropped = [m for m in options.microbatch_sizes if m > largest]
    note = None
    if dropped:
        note = (f"microbatch sizes {dropped} not considered: start-up profiles sizes up to {largest}; "
                f"pin planner microbatch_size to use a larger one")
    return replace(options, microbatch_sizes=kept), note


def _edge_shapes(root: nn.Module, blocks: BlockList, run: Callable[[], Any], example: torch.Tensor):
    """(embedding, head, tied) sizes: the parameters of the modules that run before and after the blocks.

    The blocks' profile has no embedding or head; without their parameters the
    planner would count no memory for them and no all-reduce of a tied
    embedding/head weight between the first and last stage.
    """
    before, after = edge_parameter_ids(root, blocks, run)
    sizes = {id(p): p.numel() for p in root.parameters()}
    embedding = BlockShape("embedding", sum(sizes[i] for i in before), 0, example.numel() * example.element_size(), 0.0)
    head = BlockShape("head", sum(sizes[i] for i in after), 0, 0, 0.0)
    return embedding, head, bool(before & after)


def block_calls(blocks: BlockList, first_samples: Callable[[int], Callable[[], Any]], largest: int) -> list[Call]:
    """What block 0 receives in the user's step at microbatch sizes 1..``largest`` (in the first-block view).

    A step that fails there (a block that cannot run on what the others pass
    through) is reported as a cut problem naming the block list, not as a
    traceback from inside the model.
    """
    try:
        first_samples(1)()  # the whole step once: what follows the blocks must run on what they pass on
        return [first_block_call(blocks.blocks[0], first_samples(size)) for size in range(1, largest + 1)]
    except (CutError, PlanningError):
        raise
    except Exception as error:
        raise CutError(
            f"start-up runs the training step with {blocks.path}[0] the only real block (the other blocks of "
            f"{blocks.path} pass their input through), and it failed: {type(error).__name__}: {error}. Each block "
            f"of the list must take the activation as its first argument and return a tensor of its shape; name "
            f"the list that does with ZorseStrategy(block_path=...)"
        ) from error


def _first_of_its_type(inventory: ClusterInventory, rank: int) -> bool:
    my_type = inventory.gpus[rank].gpu_type.name
    return next(r for r, g in enumerate(inventory.gpus) if g.gpu_type.name == my_type) == rank


def run_startup(inputs: StartupInputs, batch: Any, run_step: Callable[[Any], Any]) -> StartupResult:
    """Profile, plan on rank 0, broadcast (collective: every rank calls it, with its own first batch).

    ``run_step(microbatch)`` runs the user's training step on ``microbatch`` with
    its logs discarded; ``batch`` is already on ``inputs.device``.
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
    options, size_note = within_profiled_sizes(options)

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
        calls = block_calls(blocks, first_samples, min(PROFILE_OPTIONS.max_microbatch_size, samples_in(batch)))
        example = calls[0][0][0]
        costs = None
        if inputs.emulation is not None:
            calibrated = calibrate_in_turn(view_modules(inputs.module, blocks), one_sample, batch_samples=1)
            names = block_names(blocks)
            costs = as_every_block(calibrated, names[0], names[1:])
        mine = None
        if _first_of_its_type(inventory, inputs.rank):
            gpu_type = inventory.gpus[inputs.rank].gpu_type.name
            mine = measure_type_profile(
                inputs.module, blocks, calls, batch, run_step, inputs.device, gpu_type, inputs.emulation, costs
            )
        edges = _edge_shapes(inputs.module, blocks, one_sample, example) if inputs.rank == 0 else None
    measured: list[Any] = [None] * inputs.world_size
    dist.all_gather_object(measured, mine)
    probes = probe_machines(inventory, inputs.rank, inputs.device, probe_bytes(inputs.module))
    if inputs.rank != 0:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, 0)
        if isinstance(box[0], PlanningError):  # every rank stops with rank 0's reason, not a lost connection
            raise box[0]
        return StartupResult(box[0], costs)
    embedding, head, tied = edges
    profile = assemble_profile(
        [m for m in measured if m is not None], model=type(inputs.module).__name__, tied_embedding_head=tied
    )
    profile = replace(profile, embedding=embedding, head=head)
    planned_on = with_measured_rates(inventory, probes)
    try:
        plan = make_plan(planned_on, profile, inputs.global_batch_size, options)
    except PlanningError as error:
        dist.broadcast_object_list([error], 0)
        raise
    notes = (*(p.note() for p in probes if p.slower_than_configured), *([size_note] if size_note else []))
    plan = replace(plan, notes=(*plan.notes, *notes))
    dist.broadcast_object_list([plan], 0)
    return StartupResult(plan, costs, profile, planned_on)

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
   it is never told its speed. Each rank's part is
   :func:`~.device_profile.measure_on_device`, the measurement the plan app
   makes of a module on its CPU: one path, one profile;
3. each machine's ranks time an all-reduce of the model's gradient bytes
   (:mod:`.link_probe`): the planner prices synchronisation at the measured rate
   where it is below the configured one;
4. rank 0 reads the tensor-parallel degrees the module's blocks admit on this
   cluster (:mod:`.tensor_parallel_support`; the plan's notes say why where
   none), plans, and every rank receives the plan.

No rank waits for another inside a collective while that one profiles or plans:
the first rank of a type profiles for as long as its model takes, and a gather's
timeout (NCCL's, the group's) would fire first. So the ranks first meet
(``StartupInputs.meet``: counted in the store, no timeout, ended only by the
start-up watchdog's verdict on a lost or failed rank), and only then gather, over
the gloo host group: start-up's pickles never go through a device collective.

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

from zorse_lightning.capabilities import P2PRules
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.emulation.calibration import calibrate_in_turn
from zorse_lightning.emulation.rank import RankEmulation
from zorse_lightning.emulation.timing import CallCost
from zorse_lightning.engine.p2p_rules import rules_from_environment
from zorse_lightning.errors import PlanningError
from zorse_lightning.module.blocks import CutError, find_block_list
from zorse_lightning.module.tensor_parallel import Style
from zorse_lightning.planner.unprofiled import unprofiled_data_parallel
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.schedule.plan import Plan
from zorse_lightning.planner.search import make_plan
from zorse_lightning.profiling.measure import ForwardContext
from zorse_lightning.profiling.profile import ModelProfile
from zorse_lightning.startup.device_profile import DeviceInputs, measure_on_device, model_profile
from zorse_lightning.startup.link_probe import (
    MAX_PROBE_BYTES, MIN_PROBE_BYTES, probe_bytes, probe_machines, with_measured_rates,
)
from zorse_lightning.startup.profiled_sizes import unsaid, within_profiled_sizes
from zorse_lightning.startup.step_costs import OptimizerFactory
from zorse_lightning.startup.tensor_parallel_support import module_tensor_parallel

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
    meet: Callable[[str], None] | None = None
    """Returns once every rank has called it with the same name, with no timeout (the start-up watchdog's
    :meth:`~zorse_lightning.engine.faults.Watchdog.meet`): start-up meets before each gather that follows one
    rank's long work (a GPU type's profile, rank 0's planning). None: the gathers wait by themselves (one rank)."""
    host_group: Any = None
    """The gloo group the run sends its host tensors over (the engine's activation headers:
    :func:`~zorse_lightning.engine.host_group.host_group`), so that the link probe times the header on the
    group that will carry it. None: the default group where it is gloo; else the probe makes a gloo group of
    its own from the environment's ``MASTER_ADDR`` with the default timeout, not the strategy's address and
    timeout, and one more group every rank must make and connect at start-up. Start-up's gathers go over it
    too: never a device collective."""
    tp_plan: Mapping[str, Style] | None = None
    """The strategy's ``tp_plan`` (how a block splits over a tensor-parallel group), which the engine splits by;
    None: the module's own or its Hugging Face model's (:mod:`zorse_lightning.module.tensor_parallel`). Rank 0
    reads the TP degrees the blocks admit with it, for the profile the planner prices."""


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
    p2p_rules: P2PRules | None = None
    """The point-to-point rules the planner priced the run's messages under (rank 0 only; see
    :func:`run_p2p_rules`), for whatever prices the plan again (the train app's timeline)."""


def run_p2p_rules(options: PlannerOptions) -> P2PRules:
    """The rules this run's messages between stages keep, which the plan is priced under: the options' where
    given, else NCCL's on NCCL and on gloo under ``ZORSE_P2P_RULES=nccl`` (:mod:`~zorse_lightning.engine.p2p_rules`),
    gloo's own otherwise. Needs the default process group."""
    if options.p2p_rules is not None:
        return options.p2p_rules
    return P2PRules.NCCL if dist.get_backend() == "nccl" or rules_from_environment() else P2PRules.GLOO


def _first_of_its_type(inventory: ClusterInventory, rank: int) -> bool:
    my_type = inventory.gpus[rank].gpu_type.name
    return next(r for r, g in enumerate(inventory.gpus) if g.gpu_type.name == my_type) == rank


def _meet(inputs: StartupInputs, name: str) -> None:
    if inputs.meet is not None:
        inputs.meet(name)


def run_startup(inputs: StartupInputs, batch: Any, run_step: Callable[[Any], Any]) -> StartupResult:
    """Profile, plan on rank 0, broadcast (collective: every rank calls it, with its own first batch).

    ``run_step(microbatch)`` runs the user's training step on ``microbatch`` with
    its logs discarded, inside the precision plugin's forward context, and
    returns its loss; ``batch`` is already on ``inputs.device``.
    """
    inventory, options = inputs.inventory, inputs.planner_options
    options = replace(options, p2p_rules=run_p2p_rules(options))
    if not inputs.automatic_optimization:
        return StartupResult(unprofiled_data_parallel(
            inventory, inputs.global_batch_size, MANUAL_OPTIMIZATION_REASON, shard_optimizer=False
        ))
    try:
        blocks = find_block_list(inputs.module, inputs.block_path)
    except CutError as error:
        return StartupResult(unprofiled_data_parallel(inventory, inputs.global_batch_size, str(error)))
    gpu_type = inventory.gpus[inputs.rank].gpu_type.name
    device_inputs = DeviceInputs(
        inputs.module, blocks, inputs.device, gpu_type, options, inputs.forward_context, inputs.optimizer,
        inputs.emulation, inputs.init_seed,
    )
    mine = measure_on_device(
        device_inputs, batch, run_step, profile_type=_first_of_its_type(inventory, inputs.rank),
        count_edges=inputs.rank == 0, calibrate=calibrate_in_turn,
    )
    costs = mine.calibrated_costs
    measured: list[Any] = [None] * inputs.world_size
    _meet(inputs, "profiled")
    # calibrated costs are alike on every rank: not sent
    dist.all_gather_object(measured, replace(mine, calibrated_costs=None), group=inputs.host_group)
    # between machines, the largest message a stage boundary could pass (a rank's whole batch of activations),
    # within the probe's bounds; the same on every rank (both ends allocate it)
    largest = max(m.output_bytes_per_sample * m.samples for m in measured)
    boundary_bytes = int(min(max(largest, MIN_PROBE_BYTES), MAX_PROBE_BYTES))
    probes = probe_machines(
        inventory, inputs.rank, inputs.device, probe_bytes(inputs.module), boundary_bytes, inputs.host_group
    )
    if inputs.rank != 0:
        box: list[Any] = [None]
        _meet(inputs, "planned")
        dist.broadcast_object_list(box, 0, group=inputs.host_group)
        if isinstance(box[0], PlanningError):  # every rank stops with rank 0's reason, not a lost connection
            raise box[0]
        return StartupResult(box[0], costs)
    profiled = model_profile(measured, type(inputs.module).__name__)
    tensor_parallel = module_tensor_parallel(inputs.module, blocks, inventory, options, inputs.tp_plan)
    profiled = replace(
        profiled, profile=replace(profiled.profile, tensor_parallel=tensor_parallel.support),
        tensor_parallel_note=tensor_parallel.note,
    )
    planned_on = with_measured_rates(inventory, probes)
    try:
        options, size_note = within_profiled_sizes(options, profiled.sizes, profiled.why_not)
        plan = make_plan(planned_on, profiled.profile, inputs.global_batch_size, options)
    except PlanningError as error:
        _meet(inputs, "planned")
        dist.broadcast_object_list([error], 0, group=inputs.host_group)
        raise
    notes = (*(note for p in probes for note in p.notes()), *([size_note] if size_note else []))
    notes += unsaid(profiled.tensor_parallel_note, profiled.profile.tensor_parallel.reason, plan.notes)
    plan = replace(plan, notes=(*plan.notes, *notes))
    _meet(inputs, "planned")
    dist.broadcast_object_list([plan], 0, group=inputs.host_group)
    return StartupResult(plan, costs, profiled.profile, planned_on, options.p2p_rules)

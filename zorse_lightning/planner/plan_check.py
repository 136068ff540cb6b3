"""One check of a plan before it runs: against the launched ranks, the cluster, and the user's module.

A plan given to the strategy (a :class:`Plan` or a plan file) or made at start
must have the world size that was launched, the GPU types the cluster lists at
its ranks, a predicted memory that fits each rank's GPU, and a cut that this
module's block list allows, each stage's training state fitting its GPUs. Each
error says what is wrong and what to do. Pure: the module is seen through
:class:`ModelBlocks`, which the strategy reads from it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from zorse_lightning.capabilities import Sharding
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.cost.memory import host_memory_overruns, stage_state_bytes
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.schedule.plan import Plan
from zorse_lightning.units import bytes_to_gib


@dataclass(frozen=True)
class ModelBlocks:
    """What a plan's cut is checked against in the user's module."""

    model: str
    """The module's class name, for messages."""
    parameters: tuple[int, ...] = ()
    """Weights of each block of its block list, in order."""
    dtype: str = "float32"
    """The blocks' weight dtype (``"bfloat16"``...)."""
    problem: str | None = None
    """Why the module has no block list to cut (None: it has one)."""


def resolve_plan(source: Plan | str | Path, world_size: int) -> Plan:
    """A given plan (or plan file), for the ``world_size`` ranks launched."""
    plan = source if isinstance(source, Plan) else Plan.load(source)
    if plan.world_size != world_size:
        raise PlanningError(
            f"the plan is for {plan.world_size} ranks but {world_size} processes were launched "
            f"({'more' if world_size > plan.world_size else 'fewer'} than the plan has); launch {plan.world_size} "
            f"(Trainer(devices=..., num_nodes=...), torchrun --nproc-per-node) or re-plan for this cluster"
        )
    return plan


def check_plan(plan: Plan, inventory: ClusterInventory | None, blocks: ModelBlocks | None = None) -> None:
    """The plan against the cluster (ranks, GPU types, predicted memory) and against the module's blocks."""
    if inventory is not None:
        _check_ranks(plan, inventory)
        check_predicted_memory(plan, inventory)
    if blocks is not None:
        _check_cut(plan, blocks, inventory)


def _check_ranks(plan: Plan, inventory: ClusterInventory) -> None:
    """The plan's ranks must have the GPU types the cluster lists at those ranks."""
    if plan.world_size != inventory.world_size:
        raise PlanningError(
            f"the plan is for {plan.world_size} ranks but cluster {inventory.name!r} has {inventory.world_size}; "
            f"re-plan for this cluster"
        )
    for index, stage in enumerate(plan.stages):
        for rank, gpu_type in zip(stage.ranks, stage.gpu_types):
            actual = inventory.gpus[rank].gpu_type.name
            if gpu_type != actual:
                raise PlanningError(
                    f"stage {index} of the plan puts a {gpu_type} at rank {rank}, but cluster {inventory.name!r} "
                    f"has a {actual} there; the plan was made for another cluster: re-plan for this one"
                )
        for group in stage.replicas if stage.tensor_parallel > 1 else ():
            machines = sorted({inventory.gpus[r].machine for r in group})
            if len(machines) > 1:
                raise PlanningError(
                    f"stage {index} of the plan makes ranks {list(group)} one TP group (tensor_parallel="
                    f"{stage.tensor_parallel}), but cluster {inventory.name!r} has them on machines {machines}: a TP "
                    f"group exchanges every block's activations, so it lives on one machine; list the stage's ranks "
                    f"replica by replica, each run of {stage.tensor_parallel} on one machine, or lower tensor_parallel"
                )


def check_predicted_memory(plan: Plan, inventory: ClusterInventory) -> None:
    """The plan's own prediction of each rank's peak memory must fit that rank's GPU."""
    if plan.predicted is None:
        return
    gpus = inventory.gpus
    for rank, need_gib in enumerate(plan.predicted.memory_gib[: len(gpus)]):
        have_gib = gpus[rank].memory_gib
        if need_gib > have_gib:
            raise PlanningError(
                f"the plan predicts {need_gib:.2f} GiB on rank {rank}, but that {gpus[rank].gpu_type.name} "
                f"has {have_gib:.2f} GiB; re-plan for this cluster (the plan was made for other memory budgets)"
            )
    over = host_memory_overruns(inventory, dict(enumerate(plan.predicted.host_memory_gib)))
    for machine, excess_gib in over.items():
        allowed = next(m for m in inventory.machines if m.name == machine).pinnable_host_gib
        raise PlanningError(
            f"the plan's activation offload would pin {allowed + excess_gib:.2f} GiB of host memory on machine "
            f"{machine!r}, more than the {allowed:.2f} GiB it may pin (half its host_memory_gib: pinned memory cannot "
            f"be swapped out); re-plan with fewer microbatches in flight or without offload on that machine's stages, "
            f"or give the machine's real host_memory_gib in the cluster config"
        )


def _check_cut(plan: Plan, blocks: ModelBlocks, inventory: ClusterInventory | None) -> None:
    """A pipelined plan must split this module's block list, and each stage's blocks must fit its GPUs."""
    if len(plan.stages) == 1:
        return  # data parallel: nothing is split, any module fits the plan's shape
    if blocks.problem is not None:
        raise PlanningError(
            f"the plan cuts the model into {len(plan.stages)} stages, but {blocks.model} cannot be cut "
            f"({blocks.problem}); use a data-parallel plan or name the block list (block_path=...)"
        )
    if len(blocks.parameters) != plan.num_layers:
        made_for = f" (made for model {plan.model!r})" if plan.model else ""
        raise PlanningError(
            f"the plan{made_for} splits {plan.num_layers} blocks, but {blocks.model} has {len(blocks.parameters)}; "
            f"it was made for another model: re-plan for this one (omit plan=... to plan at start)"
        )
    if inventory is not None:
        _check_state_fits(plan, blocks, inventory)


def _check_state_fits(plan: Plan, blocks: ModelBlocks, inventory: ClusterInventory) -> None:
    """Weights, gradients and optimizer state of a rank's blocks alone (a lower bound of its memory),
    summed over its stages (several when interleaved); a rank of a TP group counts its share of them (it holds
    at least that: the parts its group does not split are whole on every rank)."""
    dtype = blocks.dtype if blocks.dtype != "float64" else "float32"
    need_gib: dict[int, float] = {}
    held: dict[int, list[str]] = {}
    for stage in plan.stages:
        parameters = sum(blocks.parameters[slice(*stage.layers)]) / stage.tensor_parallel
        whole, sharded = stage_state_bytes(parameters, dtype, stage.sharding)
        fractions = stage.effective_shard_fractions() if stage.sharding is not Sharding.NONE else (0.0,) * len(stage.ranks)
        for rank, fraction in zip(stage.ranks, fractions):
            need_gib[rank] = need_gib.get(rank, 0.0) + bytes_to_gib(whole + fraction * sharded)
            held.setdefault(rank, []).append(f"{stage.layers[0]}-{stage.layers[1] - 1}")
    for rank, need in need_gib.items():
        have_gib = inventory.gpus[rank].memory_gib
        if need > have_gib:
            raise PlanningError(
                f"stage {plan.stage_of_rank(rank)} (blocks {', '.join(held[rank])}) needs at least {need:.2f} GiB "
                f"for its training state on rank {rank}, but that {inventory.gpus[rank].gpu_type.name} has "
                f"{have_gib:.2f} GiB; re-plan for this cluster, shard the optimizer state, or give fewer blocks "
                f"to that stage"
            )


def with_schedule(options: PlannerOptions, schedule: str | None) -> PlannerOptions:
    """``options`` with ``schedule`` pinned, so the planner prices the schedule that runs."""
    if schedule is None:
        return options
    if options.schedule is not None and options.schedule.value != schedule:
        raise PlanningError(
            f"schedule={schedule!r} contradicts planner_options.schedule={options.schedule.value!r}; give one of them"
        )
    return replace(options, schedule=schedule)


def check_schedule(plan: Plan, options: PlannerOptions) -> None:
    """A given plan runs as planned: a pinned schedule that differs is an error, never a silent swap."""
    if options.schedule is not None and options.schedule != plan.schedule:
        raise PlanningError(
            f"the given plan was made for schedule {plan.schedule.value!r} but schedule={options.schedule.value!r} "
            f"was asked for; re-plan with that schedule (python -m zorse_lightning.plan planner.schedule="
            f"{options.schedule.value} ...), or drop schedule= to run the plan as it is"
        )

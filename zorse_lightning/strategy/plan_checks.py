"""A plan given to the strategy (a :class:`Plan` or a plan file), checked against the launched ranks and the cluster."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.plan import Plan
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.strategy.validation import check_predicted_memory


def resolve_plan(source: Plan | str | Path, inventory: ClusterInventory | None, world_size: int) -> Plan:
    plan = source if isinstance(source, Plan) else Plan.load(source)
    if plan.world_size != world_size:
        raise PlanningError(
            f"the plan is for {plan.world_size} ranks but {world_size} processes were launched "
            f"({'more' if world_size > plan.world_size else 'fewer'} than the plan has); launch {plan.world_size} "
            f"(Trainer(devices=..., num_nodes=...), torchrun --nproc-per-node) or re-plan for this cluster"
        )
    return plan


def check_plan_against(plan: Plan, inventory: ClusterInventory) -> None:
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
    check_predicted_memory(plan, inventory)


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

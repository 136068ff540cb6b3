"""A plan given to the strategy (a :class:`Plan` or a plan file), checked against the launched ranks and the cluster."""

from __future__ import annotations

from pathlib import Path

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.plan import Plan
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

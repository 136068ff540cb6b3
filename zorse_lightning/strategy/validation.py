"""Checks of what the user gave against what is really there, before any step runs.

A plan is checked against the cluster by :func:`plan_checks.check_plan_against`
(ranks, GPU types, predicted memory); here against the module (a plan made for
another model, a stage whose training state cannot fit its GPUs). The inventory
is checked against the devices the ranks detect by the cluster layer
(:func:`zorse_lightning.cluster.detection.check_detected_devices`). Each error
says what is wrong and what to do; nothing here needs a process group.
"""

from __future__ import annotations

from torch import nn

from zorse_lightning.capabilities import Sharding
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.module.blocks import CutError, find_block_list
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.memory import stage_state_bytes
from zorse_lightning.planner.plan import Plan
from zorse_lightning.units import bytes_to_gib


def check_plan_for_module(plan: Plan, module: nn.Module, block_path: str | None, inventory: ClusterInventory | None) -> None:
    """A pipelined plan must split this module's block list, and each stage's blocks must fit its GPUs."""
    if len(plan.stages) == 1:
        return  # data parallel: nothing is split, any module fits the plan's shape
    try:
        blocks = find_block_list(module, block_path).blocks
    except CutError as error:
        raise PlanningError(
            f"the plan cuts the model into {len(plan.stages)} stages, but {type(module).__name__} cannot be cut "
            f"({error}); use a data-parallel plan or name the block list (block_path=...)"
        ) from None
    if len(blocks) != plan.num_layers:
        made_for = f" (made for model {plan.model!r})" if plan.model else ""
        raise PlanningError(
            f"the plan{made_for} splits {plan.num_layers} blocks, but {type(module).__name__} has {len(blocks)}; "
            f"it was made for another model: re-plan for this one (omit plan=... to plan at start)"
        )
    if inventory is not None:
        _check_state_fits(plan, blocks, inventory)


def _check_state_fits(plan: Plan, blocks: list[nn.Module], inventory: ClusterInventory) -> None:
    """Weights, gradients and optimizer state of a rank's blocks alone (a lower bound of its memory),
    summed over its stages (several when interleaved)."""
    dtype = str(next(blocks[0].parameters()).dtype).removeprefix("torch.")
    need_gib: dict[int, float] = {}
    held: dict[int, list[str]] = {}
    for stage in plan.stages:
        parameters = sum(p.numel() for b in blocks[slice(*stage.layers)] for p in b.parameters())
        whole, sharded = stage_state_bytes(parameters, dtype if dtype != "float64" else "float32", stage.sharding)
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

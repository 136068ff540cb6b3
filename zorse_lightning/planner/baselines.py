"""Baselines, printed beside every plan, each predicted as the plan is (:func:`.choice.price`).

* ``data_parallel_equal``: what ``Trainer(strategy="ddp")`` does: every GPU the same
  batch, one stage, no sharding, accumulating gradients over equal microbatches
  where one microbatch per GPU does not fit (or is slower), as DDP users do;
* ``fastest_type_alone``: the planner on the GPUs of the fastest type only (the
  plan's ranks are those of a sub-cluster; its notes name the GPUs);
* ``proportional_heuristic``: the Zorse paper's public code: one stage per machine,
  layers and microbatches in proportion to speed, rounded, state ZeRO-sharded;
* ``cephalo``: data parallel only, batches by speed, optimizer state sharded by
  free memory (Cephalo).

The plans are built by :mod:`.baseline_plans`, which the search offers as candidates too (so the
planner's plan is never slower than one of them in its own prediction). Each returns a priced
:class:`Plan`, or None when it does not fit. :func:`unprofiled_data_parallel` is the same data-parallel
rule for a module that has no profile (it cannot be cut, or it optimises by hand): speeds from the
datasheet, unpriced.
"""

from __future__ import annotations

from dataclasses import replace

from zorse_lightning.capabilities import Schedule, Sharding
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner import baseline_plans
from zorse_lightning.planner.choice import price
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.schedule.plan import Plan, StagePlan
from zorse_lightning.planner.rounding import proportional_counts
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.planner.search import make_plan
from zorse_lightning.profiling.profile import ModelProfile


def _priced(plan: Plan | None, ctx: CostContext) -> Plan | None:
    return plan and price(ctx, plan)


def data_parallel_equal(
    inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions = PlannerOptions()
) -> Plan | None:
    """See :func:`.baseline_plans.data_parallel_equal`; the note says the accumulation, e.g.
    ``accumulating 4 microbatches of 8``."""
    ctx = CostContext.build(inventory, profile, options.memory_reserve_gib, options.p2p_rules)
    return _priced(baseline_plans.data_parallel_equal(ctx, global_batch_size, options), ctx)


def cephalo(
    inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions = PlannerOptions()
) -> Plan | None:
    """One stage, microbatches by speed (accumulated), optimizer state sharded by free memory."""
    ctx = CostContext.build(inventory, profile, options.memory_reserve_gib, options.p2p_rules)
    return _priced(baseline_plans.cephalo(ctx, global_batch_size, options), ctx)


def proportional_heuristic(
    inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions = PlannerOptions()
) -> Plan | None:
    """One stage per machine, fastest machines first; layers and microbatches by speed."""
    ctx = CostContext.build(inventory, profile, options.memory_reserve_gib, options.p2p_rules)
    return _priced(baseline_plans.proportional_heuristic(ctx, global_batch_size, options), ctx)


def fastest_type_alone(
    inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions = PlannerOptions()
) -> Plan | None:
    """The planner on the fastest GPU type's GPUs only (a sub-cluster with its own ranks)."""
    sub, _ = baseline_plans.fastest_type_cluster(CostContext.build(inventory, profile, options.memory_reserve_gib, options.p2p_rules))
    try:
        plan = make_plan(sub, profile, global_batch_size, replace(options, stage_layout=None, layer_counts=None))
    except PlanningError:
        return None
    return replace(plan, notes=(*plan.notes, f"baseline: only the {len(sub.gpus)} {sub.gpus[0].gpu_type.name} GPUs (ranks of the sub-cluster)"))


def all_baselines(
    inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions = PlannerOptions()
) -> dict[str, Plan | None]:
    """Every baseline by name, in the order reports print them."""
    return {
        "data_parallel_equal": data_parallel_equal(inventory, profile, global_batch_size, options),
        "fastest_type_alone": fastest_type_alone(inventory, profile, global_batch_size, options),
        "proportional_heuristic": proportional_heuristic(inventory, profile, global_batch_size, options),
        "cephalo": cephalo(inventory, profile, global_batch_size, options),
    }


def unprofiled_data_parallel(
    inventory: ClusterInventory, global_batch_size: int, reason: str, shard_optimizer: bool = True
) -> Plan:
    """Cephalo's rule without a profile: one stage of every rank, microbatches by datasheet peak speed,
    optimizer state sharded by memory (unless ``shard_optimizer`` is False: a module optimising by hand
    steps every weight on every rank).

    For modules the planner cannot profile block by block; one stage has no
    layer split to balance, so peak speeds suffice. Microbatches are as large as
    leaves each rank about four of them, so the speed split can be fine-grained.
    The plan's notes say ``data parallel only: <reason>``.
    """
    world = inventory.world_size
    microbatch_size = max(d for d in range(1, global_batch_size + 1)
                          if global_batch_size % d == 0 and global_batch_size // d >= min(4 * world, global_batch_size))
    counts = proportional_counts(global_batch_size // microbatch_size, [g.gpu_type.peak_tflops for g in inventory.gpus])
    memory = [g.memory_gib for g in inventory.gpus]
    sharded = shard_optimizer and world > 1
    stage = StagePlan(
        ranks=tuple(range(world)),
        gpu_types=tuple(g.gpu_type.name for g in inventory.gpus),
        machines=tuple(g.machine for g in inventory.gpus),
        layers=(0, 1),
        microbatches_per_rank=tuple(counts),
        sharding=Sharding.OPTIMIZER if sharded else Sharding.NONE,
        shard_fractions=tuple(m / sum(memory) for m in memory) if sharded else (),
    )
    return Plan(
        model="", cluster=inventory.name, num_layers=1, world_size=world, global_batch_size=global_batch_size,
        microbatch_size=microbatch_size, schedule=Schedule.ONE_F_ONE_B, stages=(stage,),
        notes=(f"data parallel only: {reason}",),
    )

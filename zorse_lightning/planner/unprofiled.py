"""The plan of a module the planner has no profile of (it cannot be cut into blocks, or it optimises by
hand): Cephalo's data-parallel rule with the datasheet's speeds, unpriced."""

from __future__ import annotations

from zorse_lightning.capabilities import Schedule, Sharding
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.planner.rounding import proportional_counts
from zorse_lightning.schedule.plan import Plan, StagePlan


def unprofiled_data_parallel(
    inventory: ClusterInventory, global_batch_size: int, reason: str, shard_optimizer: bool = True
) -> Plan:
    """Cephalo's rule without a profile: one stage of every rank, microbatches by datasheet peak speed,
    optimizer state sharded by memory (unless ``shard_optimizer`` is False: a module optimising by hand
    steps every weight on every rank).

    For modules the planner cannot profile block by block; one stage has no layer split to balance, so
    peak speeds suffice. Microbatches are as large as leaves each rank about four of them, so the speed
    split can be fine-grained. The plan's notes say ``data parallel only: <reason>``.
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

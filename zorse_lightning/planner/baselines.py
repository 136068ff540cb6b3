"""Baselines in the same cost model, printed beside every plan.

* ``data_parallel_equal``: what ``Trainer(strategy="ddp")`` does: every GPU the same
  batch, one stage, no sharding, accumulating gradients over equal microbatches
  where one microbatch per GPU does not fit (or is slower), as DDP users do;
* ``fastest_type_alone``: the planner on the GPUs of the fastest type only (the
  plan's ranks are those of a sub-cluster; its notes name the GPUs);
* ``proportional_heuristic``: the Zorse paper's public code: one stage per machine,
  layers and microbatches in proportion to speed, rounded, state ZeRO-sharded;
* ``cephalo``: data parallel only, batches by speed, optimizer state sharded by
  free memory (Cephalo).

Each returns a priced :class:`Plan`, or None when it does not fit.
:func:`unprofiled_data_parallel` is the same data-parallel rule for a module
that has no profile (it cannot be cut, or it optimises by hand): speeds from
the datasheet, unpriced.
"""

from __future__ import annotations

from dataclasses import replace

from zorse_lightning.capabilities import Schedule, Sharding
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.heuristic import HEURISTIC, priced, proportional_plan, speed_by_type
from zorse_lightning.planner.plan import Plan, StagePlan
from zorse_lightning.planner.problem import layout_plan, stage_plan
from zorse_lightning.planner.rounding import proportional_counts
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.planner.search import make_plan
from zorse_lightning.planner.cost.simulate import with_simulated_prediction
from zorse_lightning.profiling.profile import ModelProfile

def _best(plans) -> Plan | None:
    fitting = [p for p in plans if p is not None]
    return min(fitting, key=lambda p: p.predicted.iteration_ms, default=None)


def _sizes(global_batch_size: int, options: PlannerOptions, profile: ModelProfile) -> list[int]:
    """Candidate sizes dividing the global batch, measured ones only on a measured profile (as the search)."""
    measured = profile.measured_sizes
    return [m for m in options.microbatch_sizes if global_batch_size % m == 0 and (measured is None or m in measured)]


def data_parallel_equal(
    inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions = PlannerOptions()
) -> Plan | None:
    """One stage, the same batch on every GPU, no sharding, no recomputation: the fastest of
    the per-GPU batch in one microbatch and, accumulating gradients, in equal microbatches of
    each size of ``options.microbatch_sizes`` that divides it; None when none fits.

    The note says the accumulation, e.g. ``accumulating 4 microbatches of 8``.
    """
    ctx = CostContext.build(inventory, profile, options.memory_reserve_gib)
    world = inventory.world_size
    if global_batch_size % world:
        return None
    per_gpu = global_batch_size // world
    plans = []
    measured = profile.measured_sizes
    wanted = {per_gpu, *(m for m in options.microbatch_sizes if per_gpu % m == 0)}
    for m in sorted((m for m in wanted if measured is None or m in measured), reverse=True):
        count = per_gpu // m
        stage = stage_plan(ctx, tuple(range(world)), (0, profile.num_layers), (count,) * world, Sharding.NONE, False)
        how = "one microbatch" if count == 1 else f"accumulating {count} microbatches of {m}"
        notes = (f"baseline: data parallel, equal batches ({how})",)
        plans.append(priced(ctx, layout_plan(ctx, [stage], global_batch_size, m, Schedule.ONE_F_ONE_B, solver=HEURISTIC, notes=notes)))
    return _best(plans)


def _best_proportional(ctx, layout, global_batch_size: int, options: PlannerOptions, note: str, **kwargs) -> Plan | None:
    """The best proportional split of ``layout`` over the microbatch sizes, with and without recomputation."""
    plans = [
        priced(ctx, proportional_plan(ctx, layout, m, global_batch_size, recompute=recompute, **kwargs))
        for m in _sizes(global_batch_size, options, ctx.profile)
        for recompute in (False, True)
    ]
    best = _best(plans)
    return best and replace(best, notes=(note,))


def cephalo(
    inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions = PlannerOptions()
) -> Plan | None:
    """One stage, microbatches by speed (accumulated), optimizer state sharded by free memory."""
    ctx = CostContext.build(inventory, profile, options.memory_reserve_gib)
    layout = (tuple(range(inventory.world_size)),)
    note = "baseline: Cephalo (data parallel, batches by speed, state sharded by memory)"
    return _best_proportional(ctx, layout, global_batch_size, options, note)


def proportional_heuristic(
    inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions = PlannerOptions()
) -> Plan | None:
    """One stage per machine, fastest machines first; layers and microbatches by speed."""
    ctx = CostContext.build(inventory, profile, options.memory_reserve_gib)
    speeds = speed_by_type(ctx)
    groups = sorted(inventory.ranks_by_machine.values(), key=lambda ranks: -sum(speeds[inventory.gpus[r].gpu_type.name] for r in ranks) / len(ranks))
    if len(groups) > profile.num_layers:
        return None
    layout = tuple(tuple(g) for g in groups)
    note = "baseline: proportional heuristic (Zorse public code), one stage per machine"
    return _best_proportional(ctx, layout, global_batch_size, options, note, speeds=speeds)


def fastest_type_alone(
    inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions = PlannerOptions()
) -> Plan | None:
    """The planner on the fastest GPU type's GPUs only (a sub-cluster with its own ranks)."""
    speeds = speed_by_type(CostContext.build(inventory, profile))
    fastest = max(speeds, key=speeds.get)
    machines = []
    for machine in inventory.machines:
        keep = [i for i, t in enumerate(machine.gpu_types) if t.name == fastest]
        if keep:
            machines.append(
                replace(
                    machine,
                    gpu_types=tuple(machine.gpu_types[i] for i in keep),
                    memory_budget_gib=tuple(machine.memory_budget_gib[i] for i in keep) if machine.memory_budget_gib else (),
                )
            )
    names = {m.name for m in machines}
    sub = replace(
        inventory,
        name=f"{inventory.name}[{fastest} only]",
        machines=tuple(machines),
        machine_links=tuple(l for l in inventory.machine_links if {l.machine_a, l.machine_b} <= names),
        datacenter_links=tuple(
            l for l in inventory.datacenter_links
            if {l.datacenter_a, l.datacenter_b} <= {m.datacenter for m in machines}
        ),
    )
    try:
        plan = make_plan(sub, profile, global_batch_size, replace(options, stage_layout=None, layer_counts=None))
    except PlanningError:
        return None
    return replace(plan, notes=(*plan.notes, f"baseline: only the {len(sub.gpus)} {fastest} GPUs (ranks of the sub-cluster)"))


def all_baselines(
    inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions = PlannerOptions()
) -> dict[str, Plan | None]:
    """Every baseline by name, in the order reports print them, each predicted as the plan is: by the
    simulation of the engine's programs (:func:`.cost.simulate.with_simulated_prediction`)."""
    ctx = CostContext.build(inventory, profile, options.memory_reserve_gib)

    def simulated(plan: Plan | None) -> Plan | None:
        return None if plan is None else with_simulated_prediction(ctx, plan)

    return {
        "data_parallel_equal": simulated(data_parallel_equal(inventory, profile, global_batch_size, options)),
        "fastest_type_alone": fastest_type_alone(inventory, profile, global_batch_size, options),  # a make_plan's
        "proportional_heuristic": simulated(proportional_heuristic(inventory, profile, global_batch_size, options)),
        "cephalo": simulated(cephalo(inventory, profile, global_batch_size, options)),
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

"""Baselines, printed beside every plan and offered to the search as candidates, so that no plan the
planner returns is slower than one it prints, in its own prediction, by construction.

* ``data_parallel_equal``: what ``Trainer(strategy="ddp")`` does: every GPU the same batch, one stage, no
  sharding, accumulating equal microbatches where one per GPU does not fit (or is slower), as DDP users do;
* ``fastest_type_alone``: the planner on the GPUs of the fastest type only, through the planning function
  the caller passes in;
* ``proportional_heuristic``: the Zorse paper's public code: one stage per machine, layers and
  microbatches in proportion to speed, rounded, state ZeRO-sharded;
* ``cephalo``: data parallel only, batches by speed, optimizer state sharded by free memory (Cephalo).

Each is built in a cost context (:func:`builders`) and priced in the closed form, or None when it does not
fit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from zorse_lightning.capabilities import Schedule, Sharding
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.planner.search.heuristic import HEURISTIC, priced, proportional_plan, speed_by_type
from zorse_lightning.planner.search.layouts import unused_ranks
from zorse_lightning.planner.search.problem import layout_plan, stage_plan
from zorse_lightning.schedule.plan import Plan

def _best(plans) -> Plan | None:
    return min((p for p in plans if p is not None), key=lambda p: p.predicted.iteration_ms, default=None)


def _sizes(ctx: CostContext, global_batch_size: int, options: PlannerOptions) -> list[int]:
    """Candidate sizes dividing the global batch, measured ones only on a measured profile (as the search)."""
    measured = ctx.profile.measured_sizes
    return [m for m in options.microbatch_sizes if global_batch_size % m == 0 and (measured is None or m in measured)]


def data_parallel_equal(ctx: CostContext, global_batch_size: int, options: PlannerOptions) -> Plan | None:
    """One stage, the same batch on every GPU, no sharding, no recomputation: the fastest of the per-GPU
    batch in one microbatch and, accumulating gradients, in equal microbatches of each size of
    ``options.microbatch_sizes`` that divides it. The note says the accumulation."""
    world = ctx.inventory.world_size
    if global_batch_size % world:
        return None
    per_gpu = global_batch_size // world
    measured = ctx.profile.measured_sizes
    sizes = {per_gpu, *(m for m in options.microbatch_sizes if per_gpu % m == 0)}
    plans = []
    for m in sorted((m for m in sizes if measured is None or m in measured), reverse=True):
        count = per_gpu // m
        stage = stage_plan(ctx, tuple(range(world)), (0, ctx.profile.num_layers), (count,) * world, Sharding.NONE, False)
        how = "one microbatch" if count == 1 else f"accumulating {count} microbatches of {m}"
        notes = (f"baseline: data parallel, equal batches ({how})",)
        plans.append(priced(ctx, layout_plan(ctx, [stage], global_batch_size, m, Schedule.ONE_F_ONE_B, solver=HEURISTIC, notes=notes)))
    return _best(plans)


def _best_proportional(ctx, layout, global_batch_size: int, options: PlannerOptions, note: str, **kwargs) -> Plan | None:
    """The best proportional split of ``layout`` over the microbatch sizes, with and without recomputation."""
    best = _best(
        priced(ctx, proportional_plan(ctx, layout, m, global_batch_size, recompute=recompute, **kwargs))
        for m in _sizes(ctx, global_batch_size, options)
        for recompute in (False, True)
    )
    return best and replace(best, notes=(note,))


def cephalo(ctx: CostContext, global_batch_size: int, options: PlannerOptions) -> Plan | None:
    """One stage, microbatches by speed (accumulated), optimizer state sharded by free memory."""
    note = "baseline: Cephalo (data parallel, batches by speed, state sharded by memory)"
    return _best_proportional(ctx, (tuple(range(ctx.inventory.world_size)),), global_batch_size, options, note)


def proportional_heuristic(ctx: CostContext, global_batch_size: int, options: PlannerOptions) -> Plan | None:
    """One stage per machine, fastest machines first; layers and microbatches by speed."""
    inventory, speeds = ctx.inventory, speed_by_type(ctx)
    groups = sorted(inventory.ranks_by_machine.values(), key=lambda ranks: -sum(speeds[inventory.gpus[r].gpu_type.name] for r in ranks) / len(ranks))
    if len(groups) > ctx.profile.num_layers:
        return None
    note = "baseline: proportional heuristic (Zorse public code), one stage per machine"
    return _best_proportional(ctx, tuple(tuple(g) for g in groups), global_batch_size, options, note, speeds=speeds)


def builders(
    ctx: CostContext, global_batch_size: int, options: PlannerOptions, plan_cluster: Callable[[ClusterInventory], Plan]
) -> dict[str, tuple[tuple[int, ...], Callable[[], Plan | None]]]:
    """Every baseline by name, in the order reports print them: the ranks it may use, and what builds its
    plan. ``plan_cluster`` is the planner, which plans the fastest type alone on its sub-cluster (the plan's
    ranks are the sub-cluster's; its note names the GPUs)."""
    sub, ranks = fastest_type_cluster(ctx)

    def alone() -> Plan | None:
        try:
            plan = plan_cluster(sub)
        except PlanningError:
            return None
        return replace(plan, notes=(*plan.notes, f"baseline: only the {len(sub.gpus)} {sub.gpus[0].gpu_type.name} GPUs (ranks of the sub-cluster)"))

    every = tuple(range(ctx.inventory.world_size))
    return {
        "data_parallel_equal": (every, lambda: data_parallel_equal(ctx, global_batch_size, options)),
        "fastest_type_alone": (ranks, alone),
        "proportional_heuristic": (every, lambda: proportional_heuristic(ctx, global_batch_size, options)),
        "cephalo": (every, lambda: cephalo(ctx, global_batch_size, options)),
    }


def fastest_type_cluster(ctx: CostContext) -> tuple[ClusterInventory, tuple[int, ...]]:
    """The sub-cluster of the fastest GPU type's GPUs (its own ranks 0..n-1), and their ranks in the whole
    cluster, in the sub-cluster's order."""
    inventory = ctx.inventory
    speeds = speed_by_type(ctx)
    fastest = max(speeds, key=speeds.get)
    machines = []
    for machine in inventory.machines:
        keep = [i for i, t in enumerate(machine.gpu_types) if t.name == fastest]
        if keep:
            machines.append(replace(
                machine,
                gpu_types=tuple(machine.gpu_types[i] for i in keep),
                memory_budget_gib=tuple(machine.memory_budget_gib[i] for i in keep) if machine.memory_budget_gib else (),
            ))
    names, datacenters = {m.name for m in machines}, {m.datacenter for m in machines}
    sub = replace(
        inventory, name=f"{inventory.name}[{fastest} only]", machines=tuple(machines),
        machine_links=tuple(l for l in inventory.machine_links if {l.machine_a, l.machine_b} <= names),
        datacenter_links=tuple(l for l in inventory.datacenter_links if {l.datacenter_a, l.datacenter_b} <= datacenters),
    )
    return sub, tuple(r for r, g in enumerate(inventory.gpus) if g.gpu_type.name == fastest)


def onto_cluster(ctx: CostContext, plan: Plan | None, ranks: tuple[int, ...]) -> Plan | None:
    """A plan of :func:`fastest_type_cluster`'s sub-cluster on the whole cluster: sub-cluster rank ``i`` is
    ``ranks[i]``, every other rank idle; priced again in ``ctx`` (None when it does not fit there)."""
    if plan is None:
        return None
    stages = tuple(replace(s, ranks=tuple(ranks[r] for r in s.ranks)) for s in plan.stages)
    moved = replace(
        plan, cluster=ctx.inventory.name, world_size=ctx.inventory.world_size, stages=stages,
        idle_ranks=unused_ranks(ctx.inventory.world_size, tuple(s.ranks for s in stages)), predicted=None,
    )
    return priced(ctx, moved)

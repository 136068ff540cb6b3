"""Proportional plans: layers and microbatches in proportion to speed, rounded.

The Zorse paper's public code splits this way; the search uses it as a quick upper
bound for each candidate before running the integer program, and the baselines
use it as is.
"""

from __future__ import annotations

from dataclasses import replace

from zorse_lightning.capabilities import Schedule, Sharding
from zorse_lightning.planner.compute import per_sample_layer_ms
from zorse_lightning.planner.evaluate import CostContext, memory_overruns, plan_cost, prediction
from zorse_lightning.planner.plan import Plan, SolverRecord
from zorse_lightning.planner.problem import layout_plan, stage_plan, with_free_memory_shards
from zorse_lightning.planner.rounding import proportional_counts


def speed_by_type(ctx: CostContext) -> dict[str, float]:
    """Sample-layers per millisecond of each GPU type of the cluster."""
    return {t.name: 1.0 / per_sample_layer_ms(ctx.profile.times(t.name)) for t in ctx.inventory.gpu_types}


HEURISTIC = SolverRecord("heuristic", "not an optimisation")


def proportional_plan(
    ctx: CostContext,
    layout: tuple[tuple[int, ...], ...],
    microbatch_size: int,
    global_batch_size: int,
    *,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    sharding: Sharding = Sharding.OPTIMIZER,
    recompute: bool = False,
    speeds: dict[str, float] | None = None,
) -> Plan:
    """Layers per stage in proportion to the stage's summed speed, microbatches per GPU in
    proportion to its speed (largest-remainder rounding); not priced yet."""
    speeds = speeds or speed_by_type(ctx)
    speed = [[speeds[ctx.inventory.gpus[r].gpu_type.name] for r in ranks] for ranks in layout]
    layer_counts = proportional_counts(ctx.profile.num_layers, [sum(s) for s in speed], minimum=1)
    num_m = global_batch_size // microbatch_size
    stages, start = [], 0
    for ranks, stage_speed, count in zip(layout, speed, layer_counts):
        microbatches = proportional_counts(num_m, stage_speed)
        stages.append(stage_plan(ctx, ranks, (start, start + count), microbatches, sharding, recompute))
        start += count
    plan = layout_plan(ctx, stages, global_batch_size, microbatch_size, schedule, solver=HEURISTIC)
    return with_free_memory_shards(ctx, plan)


def priced(ctx: CostContext, plan: Plan) -> Plan | None:
    """The plan with its prediction, or None when some GPU overflows."""
    cost = plan_cost(ctx, plan)
    if memory_overruns(ctx, plan, cost):
        return None
    return replace(plan, predicted=prediction(ctx, plan, cost))



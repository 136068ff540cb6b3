"""Proportional plans: layers and microbatches in proportion to speed, rounded.

The Zorse paper's public code splits this way, and the baselines use it as is.
The search uses it as a quick upper bound for each candidate before running the
integer program, and also tries the same microbatch split with layers that
balance the stages' busy time (:func:`balanced_layer_counts`): speed alone
ignores the embedding and head the end stages hold and the per-microbatch
intercepts, and a poor upper bound misleads which candidates get a program.
"""

from __future__ import annotations

import heapq
from dataclasses import replace

from zorse_lightning.capabilities import Schedule, Sharding
from zorse_lightning.planner.compute import per_sample_layer_ms
from zorse_lightning.planner.evaluate import CostContext, memory_overruns, plan_cost, prediction
from zorse_lightning.planner.plan import Plan, SolverRecord
from zorse_lightning.planner.problem import WindowCosts, block_extras, layout_plan, stage_plan, with_free_memory_shards
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
    windows: WindowCosts | None = None,
) -> Plan:
    """Microbatches per GPU in proportion to its speed (largest-remainder rounding); layers
    per stage in proportion to the stage's summed speed, or, given ``windows``, by
    :func:`balanced_layer_counts`. Not priced yet."""
    speeds = speeds or speed_by_type(ctx)
    speed = [[speeds[ctx.inventory.gpus[r].gpu_type.name] for r in ranks] for ranks in layout]
    num_m = global_batch_size // microbatch_size
    microbatches = [proportional_counts(num_m, stage_speed) for stage_speed in speed]
    if windows is None:
        layer_counts = proportional_counts(ctx.profile.num_layers, [sum(s) for s in speed], minimum=1)
    else:
        layer_counts = balanced_layer_counts(ctx, windows, layout, microbatch_size, microbatches, recompute)
    stages, start = [], 0
    for ranks, stage_microbatches, count in zip(layout, microbatches, layer_counts):
        stages.append(stage_plan(ctx, ranks, (start, start + count), stage_microbatches, sharding, recompute))
        start += count
    plan = layout_plan(ctx, stages, global_batch_size, microbatch_size, schedule, solver=HEURISTIC)
    return with_free_memory_shards(ctx, plan)


def balanced_layer_counts(
    ctx: CostContext,
    windows: WindowCosts,
    layout: tuple[tuple[int, ...], ...],
    microbatch_size: int,
    microbatches: list[list[int]],
    recompute: bool,
) -> list[int]:
    """Layers per stage (at least one each) minimising the busiest stage's compute, the
    embedding and head included, for the given microbatches per GPU.

    Greedy: every next layer goes to the stage that is least busy with it. A stage's
    busy time is convex in its layer count (a maximum over its GPUs of linear
    functions), so the greedy split is optimal for this min-max.
    """
    num_layers, num_stages = ctx.profile.num_layers, len(layout)
    busiest = []  # per stage: (gpu type, most microbatches on one GPU of that type)
    for ranks, counts in zip(layout, microbatches):
        most: dict[str, int] = {}
        for rank, n in zip(ranks, counts):
            gpu_type = ctx.inventory.gpus[rank].gpu_type.name
            most[gpu_type] = max(most.get(gpu_type, 0), n)
        busiest.append(list(most.items()))

    def busy_ms(stage: int, layers: int) -> float:
        first, last = stage == 0, stage == num_stages - 1
        return max(
            n * (windows.time_ms(t, microbatch_size, recompute)[layers - 1] + block_extras(ctx, t, microbatch_size, first, last)[0])
            for t, n in busiest[stage]
        )

    counts = [1] * num_stages
    heap = [(busy_ms(s, 2), s) for s in range(num_stages) if num_layers > num_stages]
    heapq.heapify(heap)
    for _ in range(num_layers - num_stages):
        _, s = heapq.heappop(heap)
        counts[s] += 1
        if counts[s] < num_layers:
            heapq.heappush(heap, (busy_ms(s, counts[s] + 1), s))
    return counts


def priced(ctx: CostContext, plan: Plan) -> Plan | None:
    """The plan with its prediction, or None when some GPU overflows."""
    cost = plan_cost(ctx, plan)
    if memory_overruns(ctx, plan, cost):
        return None
    return replace(plan, predicted=prediction(ctx, plan, cost))



"""Proportional plans: layers and microbatches in proportion to speed, rounded.

The Zorse paper's public code splits this way, and the baselines use it as is.
The search prices a quick split of each candidate before running the integer
program, as an upper bound and a fallback plan: the same microbatches with layers
that balance the stages' busy time (:func:`balanced_plan`), since speed alone
ignores the embedding and head the end stages hold and the per-microbatch
intercepts, and a poor upper bound misleads which candidates get a program.
"""

from __future__ import annotations

import heapq

from zorse_lightning.capabilities import Schedule, Sharding
from zorse_lightning.planner.cost.compute import per_sample_layer_ms
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.evaluate import memory_overruns, plan_cost, prediction
from zorse_lightning.planner.cost.tensor_parallel import layer_terms
from zorse_lightning.planner.search.ilp import AssignmentProblem, layer_options
from zorse_lightning.schedule.plan import Plan, SolverRecord
from zorse_lightning.planner.search.problem import (
    SEARCH_SHARDING,
    WindowCosts,
    block_extras,
    layout_plan,
    receive_wait_ms,
    stage_plan,
    with_free_memory_shards,
)
from zorse_lightning.planner.rounding import proportional_counts


def speed_by_type(ctx: CostContext) -> dict[str, float]:
    """Sample-layers per millisecond of each GPU type of the cluster."""
    return {t.name: 1.0 / per_sample_layer_ms(ctx.profile.times(t.name)) for t in ctx.inventory.gpu_types}


HEURISTIC = SolverRecord("heuristic", "not an optimisation")


def microbatch_split(
    ctx: CostContext, layout: tuple[tuple[int, ...], ...], num_microbatches: int, speeds: dict[str, float],
    degrees: tuple[int, ...] | None = None,
) -> list[list[int]]:
    """Per stage, microbatches per GPU in proportion to its speed (largest-remainder rounding); a stage of TP
    degree ``t`` > 1 (``degrees``, per stage) per replica of ``t`` GPUs, which each of them repeats."""
    out = []
    for ranks, t in zip(layout, degrees or (1,) * len(layout)):
        replicas = [ranks[i : i + t] for i in range(0, len(ranks), t)]
        counts = proportional_counts(num_microbatches, [sum(speeds[ctx.inventory.gpus[r].gpu_type.name] for r in g) for g in replicas])
        out.append([n for n in counts for _ in range(t)])
    return out


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
    stage_speeds = [sum(speeds[ctx.inventory.gpus[r].gpu_type.name] for r in ranks) for ranks in layout]
    layer_counts = proportional_counts(ctx.profile.num_layers, stage_speeds, minimum=1)
    microbatches = microbatch_split(ctx, layout, global_batch_size // microbatch_size, speeds)
    return _split_plan(ctx, layout, layer_counts, microbatches, microbatch_size, global_batch_size, schedule, sharding, recompute)


def balanced_plan(
    ctx: CostContext,
    windows: WindowCosts,
    layout: tuple[tuple[int, ...], ...],
    microbatch_size: int,
    global_batch_size: int,
    *,
    schedule: Schedule,
    recompute: bool,
    speeds: dict[str, float],
    fit: tuple[AssignmentProblem, list[list[tuple[int, ...]]]] | None = None,
    degrees: tuple[int, ...] | None = None,
    shards_by_memory: bool = True,
) -> Plan | None:
    """Microbatches as :func:`proportional_plan`, layers by :func:`balanced_layer_counts`,
    state sharded as the search shards it (:data:`.problem.SEARCH_SHARDING`); not priced yet. ``fit``: the candidate's integer program and rank
    groups, to cap each stage's layers at what its memory holds in the program's
    (conservative) memory model; None when no split then fits. ``degrees``: each stage's TP degree, its ranks
    listed replica by replica (None: none). ``shards_by_memory`` False: state sharded evenly, not by each GPU's
    free memory (a draft that only keys the search's queue: the free memory costs every stage's memory)."""
    microbatches = microbatch_split(ctx, layout, global_batch_size // microbatch_size, speeds, degrees)
    max_layers = None if fit is None else _max_layers_that_fit(*fit, layout, microbatches)
    counts = balanced_layer_counts(ctx, windows, layout, microbatch_size, microbatches, recompute, max_layers, degrees)
    if counts is None:
        return None
    return _split_plan(
        ctx, layout, counts, microbatches, microbatch_size, global_batch_size, schedule, SEARCH_SHARDING, recompute, degrees,
        shards_by_memory,
    )


def _split_plan(
    ctx, layout, layer_counts, microbatches, microbatch_size, global_batch_size, schedule, sharding, recompute, degrees=None,
    shards_by_memory: bool = True,
) -> Plan:
    stages, start = [], 0
    for ranks, stage_microbatches, count, t in zip(layout, microbatches, layer_counts, degrees or (1,) * len(layout)):
        stages.append(stage_plan(ctx, ranks, (start, start + count), stage_microbatches, sharding, recompute, tensor_parallel=t))
        start += count
    plan = layout_plan(ctx, stages, global_batch_size, microbatch_size, schedule, solver=HEURISTIC)
    return with_free_memory_shards(ctx, plan) if shards_by_memory else plan


def _max_layers_that_fit(
    problem: AssignmentProblem, groups: list[list[tuple[int, ...]]], layout: tuple[tuple[int, ...], ...], microbatches: list[list[int]]
) -> list[int]:
    """Per stage, the most layers its GPUs hold with these microbatches (0: not even one)."""
    out = []
    for s, (stage_groups, ranks, counts) in enumerate(zip(groups, layout, microbatches)):
        per_rank = dict(zip(ranks, counts))
        busiest = [max(per_rank[r] for r in group) for group in stage_groups]
        fitting = [k for k, limits in layer_options(problem, s).items() if all(q <= cap for q, cap in zip(busiest, limits))]
        out.append(max(fitting, default=0))
    return out


def balanced_layer_counts(
    ctx: CostContext,
    windows: WindowCosts,
    layout: tuple[tuple[int, ...], ...],
    microbatch_size: int,
    microbatches: list[list[int]],
    recompute: bool,
    max_layers: list[int] | None = None,
    degrees: tuple[int, ...] | None = None,
) -> list[int] | None:
    """Layers per stage (at least one each, at most ``max_layers``) minimising the busiest
    stage's busy time, the embedding and head and the transfers its GPUs wait for
    (:func:`.problem.receive_wait_ms`) included, for the given microbatches per GPU (a TP stage's
    layers split over its groups, their all-reduces added: :func:`.tensor_parallel.layer_terms`); None
    when the caps leave no split.

    Greedy: every next layer goes to the stage that is least busy with it. A stage's
    busy time is convex in its layer count (a maximum over its GPUs of linear
    functions), so the greedy split is optimal for this min-max, caps included.
    """
    num_layers, num_stages = ctx.profile.num_layers, len(layout)
    caps = max_layers or [num_layers - num_stages + 1] * num_stages
    if min(caps) < 1 or sum(caps) < num_layers:
        return None
    message_bytes = max(b.output_bytes_per_sample for b in ctx.profile.layers) * microbatch_size
    busiest = []  # per stage and GPU type: most microbatches on one GPU, its layer times, TP terms, extras and waits
    for s, (ranks, counts, degree) in enumerate(zip(layout, microbatches, degrees or (1,) * num_stages)):
        by_type: dict[str, list[int]] = {}
        most: dict[str, int] = {}
        for rank, n in zip(ranks, counts):
            gpu_type = ctx.inventory.gpus[rank].gpu_type.name
            by_type.setdefault(gpu_type, []).append(rank)
            most[gpu_type] = max(most.get(gpu_type, 0), n)
        busiest.append([
            (most[t], windows.time_ms(t, microbatch_size, recompute), *layer_terms(ctx, of_type[:degree], degree, microbatch_size, recompute),
             block_extras(ctx, t, microbatch_size, s == 0, s == num_stages - 1)[0], receive_wait_ms(ctx, layout, s, tuple(of_type), message_bytes))
            for t, of_type in by_type.items()
        ])

    def busy_ms(stage: int, layers: int) -> float:  # asked once a layer per stage: its terms looked up above
        return max(
            n * (times[layers - 1] * factor + layers * collectives_ms + extras_ms + wait)
            for n, times, factor, collectives_ms, extras_ms, wait in busiest[stage]
        )

    counts = [1] * num_stages
    heap = [(busy_ms(s, 2), s) for s in range(num_stages) if caps[s] > 1]
    heapq.heapify(heap)
    for _ in range(num_layers - num_stages):
        _, s = heapq.heappop(heap)
        counts[s] += 1
        if counts[s] < caps[s]:
            heapq.heappush(heap, (busy_ms(s, counts[s] + 1), s))
    return counts


def priced(ctx: CostContext, plan: Plan) -> Plan | None:
    """The plan with its prediction, or None when some GPU overflows."""
    cost = plan_cost(ctx, plan)
    if memory_overruns(ctx, plan, cost):
        return None
    return plan.with_prediction(prediction(ctx, plan, cost))



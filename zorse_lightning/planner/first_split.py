"""The search's first price of a candidate: its heuristic split, fitted, and unsharded where that is free.

A candidate (stage layout, microbatch size, schedule) gets the first of its quick splits that fits
(:func:`heuristic_plan`): an upper bound the search prunes and orders its integer programs by, and a
valid plan should no program beat it. Every plan the search keeps is left unsharded where its stage
fits unsharded and its longer optimizer step does not lengthen the iteration
(:func:`priced_unsharded_where_free`).
"""

from __future__ import annotations

from dataclasses import replace

from zorse_lightning.capabilities import Sharding
from zorse_lightning.planner.choice import Choice
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.evaluate import (
    PlanCost,
    memory_overruns,
    plan_cost,
    prediction,
    stage_memory,
    stage_own_sync_ms,
    stage_update_ms,
    with_stage_costs,
)
from zorse_lightning.planner.heuristic import balanced_plan
from zorse_lightning.planner.offload_choice import offloaded_where_over
from zorse_lightning.schedule.plan import Plan, StagePlan
from zorse_lightning.planner.problem import SEARCH_SHARDING, Candidate, build_problem


def heuristic_plan(ctx, windows, layout, m, schedule, global_batch_size, speeds, options, choice: Choice) -> Plan | None:
    """The first of a candidate's quick splits (:func:`quick_splits`) that fits, priced:
    an upper bound, and a fallback plan. Pinned layer counts are applied by the
    integer program only.

    Where the first split (without recomputation, then with it) does not fit, the same split
    offloading activations on the stages over memory (:func:`.offload_choice.offloaded_where_over`;
    with recomputation, their inputs) is offered to ``choice`` beside it: the alternative to
    recomputation (or to layers moved off the small GPUs) that the choice keeps only where it is
    faster, or where nothing else fits. Only there, so that plans that fit without it cost the
    search nothing more."""
    if options.layer_counts is not None:
        return None
    for recompute in (False, True):
        for tried, plan in enumerate(quick_splits(ctx, windows, layout, m, schedule, global_batch_size, speeds, recompute)):
            cost = plan and plan_cost(ctx, plan)
            fitting = plan and priced_unsharded_where_free(ctx, plan, cost)
            if fitting is not None:
                return fitting
            if plan is not None and tried == 0 and options.allow_offload:
                offloaded = offloaded_where_over(ctx, plan, cost)
                choice.offer(offloaded and priced_unsharded_where_free(ctx, offloaded))
    return None


def quick_splits(ctx, windows, layout, m, schedule, global_batch_size, speeds, recompute):
    """Balanced layers, else balanced layers within each stage's memory (in the integer
    program's model, whose building costs more: made only when needed)."""
    common = dict(schedule=schedule, recompute=recompute, speeds=speeds)
    yield balanced_plan(ctx, windows, layout, m, global_batch_size, **common)
    candidate = Candidate(layout, m, schedule, SEARCH_SHARDING, recompute)
    fit = build_problem(ctx, windows, candidate, global_batch_size, None)
    yield balanced_plan(ctx, windows, layout, m, global_batch_size, fit=fit, **common)


def priced_unsharded_where_free(ctx: CostContext, plan: Plan, cost: PlanCost | None = None) -> Plan | None:
    """The plan, priced, with its stages unsharded where they fit and that is no slower
    (fewer collectives to get wrong); None when it does not fit even sharded.

    Unsharding a stage changes only what it does after its last backward: an
    all-reduce instead of a reduce-scatter and an all-gather (the same traffic at
    ``optimizer_gradients``) and a longer optimizer step (each GPU steps all of the
    stage's parameters). The iteration is the pipeline plus the longest such tail of
    any stage, so unsharding costs nothing while the stage's new tail stays within
    the plan's longest (another stage's, since its own only grows). ``cost``: the plan's, where the
    caller priced it already.
    """
    cost = cost or plan_cost(ctx, plan)
    if memory_overruns(ctx, plan, cost):
        return None
    stages, stage_costs = list(plan.stages), list(cost.stages)
    for i, stage in enumerate(plan.stages):
        if stage.sharding is Sharding.NONE or stage.gather_per_microbatch:
            continue
        unsharded = _unsharded(stage)
        shared_sync_ms = cost.stage_sync_ms(i) - cost.stages[i].sync_ms  # a tied weight's, unchanged
        own_sync_ms = stage_own_sync_ms(ctx, plan, i, unsharded)
        update_ms = stage_update_ms(ctx, plan, i, unsharded)
        if shared_sync_ms + own_sync_ms + max(update_ms) > cost.tail_ms:
            continue
        memory = stage_memory(ctx, plan, i, tuple(0.0 for _ in stage.ranks), unsharded)
        if all(used.total_bytes <= ctx.capacity_bytes(r) for r, used in zip(stage.ranks, memory)):
            # Sharding changes none of the stage's times, only what follows its last backward.
            stages[i], stage_costs[i] = unsharded, replace(cost.stages[i], sync_ms=own_sync_ms, update_ms=update_ms, memory=memory)
    if stages == list(plan.stages):
        return replace(plan, predicted=prediction(ctx, plan, cost))
    unsharded_plan = replace(plan, stages=tuple(stages))
    return replace(unsharded_plan, predicted=prediction(ctx, unsharded_plan, with_stage_costs(cost, tuple(stage_costs))))


def _unsharded(stage: StagePlan) -> StagePlan:
    return replace(stage, sharding=Sharding.NONE, shard_fractions=())

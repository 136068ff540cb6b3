"""Where the search and the interleaving choice offer activation offload: on the groups of ranks a plan
overruns (issue 31).

Offload is offered as a remedy, never by default: a plan that fits without it has nothing to gain
from it (its copies hide at best). Where a plan does not fit, the same plan offloading on the groups
over memory is priced like any other (the copies over each GPU type's host link, the pinned host memory
each machine allows), and the caller keeps it only where it is the fastest plan that fits.
"""

from __future__ import annotations

from dataclasses import replace

from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.evaluate import PlanCost, memory_overruns
from zorse_lightning.schedule.plan import Plan


def offloaded_where_over(ctx: CostContext, plan: Plan, cost: PlanCost) -> Plan | None:
    """``plan`` (priced with its memory as ``cost``) with activations offloaded on every chunk of each group
    of ranks over memory, unpriced (a group that recomputes offloads what recomputation keeps, its blocks'
    inputs); None where that changes nothing (no group over, or only groups that gather per microbatch
    or offload already)."""
    over = {plan.rank_groups[group].ranks for group, _, _ in memory_overruns(ctx, plan, cost)}
    stages = tuple(
        replace(s, offload_activations=True) if s.ranks in over and not s.gather_per_microbatch else s
        for s in plan.stages
    )
    return replace(plan, stages=stages, predicted=None) if stages != plan.stages else None

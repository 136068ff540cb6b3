"""Layer 3: the planner. Pure functions over inventories and profiles; no torch, no process groups.

Entry points: :func:`make_plan` (the search, :mod:`.search`), :func:`all_baselines` (the baselines of
:mod:`.baselines`, predicted as the plan is), :func:`simulate` (the engine's programs of a plan as a
timeline), and the cost model (:func:`plan_cost`, :class:`CostContext`), whose parts live in :mod:`.cost`.
"""

from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.evaluate import PlanCost, memory_overruns, plan_cost, prediction
from zorse_lightning.planner.cost.simulate import EventKind, Timeline, TimelineEvent, simulate
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.planner.search import all_baselines, make_plan
from zorse_lightning.schedule.plan import Plan, Prediction, SolverRecord, StagePlan

__all__ = [
    "CostContext",
    "EventKind",
    "Plan",
    "PlanCost",
    "PlannerOptions",
    "Prediction",
    "SolverRecord",
    "StagePlan",
    "Timeline",
    "TimelineEvent",
    "all_baselines",
    "make_plan",
    "memory_overruns",
    "plan_cost",
    "prediction",
    "simulate",
]

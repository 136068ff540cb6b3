"""Interleaving a plan: each group of ranks keeps its share of the layers, cut into V chunks.

The layer split of a plain plan already balances the groups by speed; interleaving
keeps each group's layer count and deals its chunks out round-robin (chunk ``c`` of
group ``g`` is virtual stage ``c G + g``), so the work per group is unchanged while
the fill and drain shrink about V-fold, at the price of V times the activation
transfers between groups. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import replace

from zorse_lightning.errors import PlanningError
from zorse_lightning.schedule.plan import Plan, StagePlan


def chunk_sizes(num_layers: int, degree: int) -> list[int]:
    """``num_layers`` cut into ``degree`` near-equal chunks, larger ones first."""
    return [num_layers // degree + (c < num_layers % degree) for c in range(degree)]


def interleave(plan: Plan, degree: int) -> Plan:
    """``plan`` (not interleaved) with each group's layers cut into ``degree`` chunks."""
    if plan.interleave != 1:
        raise PlanningError(f"interleave() takes a plain plan; this one has interleave={plan.interleave}")
    if degree == 1:
        return plan
    groups = plan.stages
    if len(groups) < 2:
        raise PlanningError("interleaving needs a pipeline of at least 2 stages; this plan has 1")
    thin = [i for i, stage in enumerate(groups) if stage.num_layers < degree]
    if thin:
        raise PlanningError(
            f"interleave={degree} needs at least {degree} layers per stage; stages {thin} have fewer "
            f"({[groups[i].num_layers for i in thin]}); choose a lower degree"
        )
    stages = _dealt(groups, [s.num_layers for s in groups], degree)
    return replace(plan, stages=tuple(stages), interleave=degree, predicted=None)


def with_layer_counts(plan: Plan, counts: list[int]) -> Plan:
    """``plan`` with its groups of ranks holding ``counts`` layers, in order, each cut into the plan's
    chunks as :func:`interleave` cuts them (unpriced)."""
    return replace(plan, stages=tuple(_dealt(plan.rank_groups, counts, plan.interleave)), predicted=None)


def _dealt(groups: tuple[StagePlan, ...], counts: list[int], degree: int) -> list[StagePlan]:
    """Stages of ``groups`` (each holding ``counts`` layers) cut into ``degree`` chunks each, dealt out
    round-robin: chunk ``c`` of group ``g`` is virtual stage ``c G + g``."""
    sizes = [chunk_sizes(count, degree) for count in counts]
    stages, start = [], 0
    for chunk in range(degree):
        for group, stage in enumerate(groups):
            end = start + sizes[group][chunk]
            stages.append(replace(stage, layers=(start, end)))
            start = end
    return stages


def degrees(plan: Plan, most: int) -> list[int]:
    """Interleaving degrees ``plan`` admits, up to ``most``: every group needs a layer per chunk, which
    a split of the layers gives each group up to ``num_layers // groups`` (the plan's own split may not:
    the planner moves layers to its thin groups first)."""
    if len(plan.stages) < 2:
        return [1]
    return list(range(1, min(most, plan.num_layers // len(plan.stages)) + 1))

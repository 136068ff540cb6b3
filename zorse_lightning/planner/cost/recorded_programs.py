"""The engine's programs of a plan and what each rank posts to its peers, recorded once per plan shape in a
cost context: the memory of interleaved plans (:func:`.stage_state.rank_activation_bytes`) and the simulation
(:mod:`.simulate`) read them, and recording takes seconds at 1024 GPUs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zorse_lightning.schedule.actions import Action
from zorse_lightning.schedule.p2p_batches import P2PBatch, rank_batches
from zorse_lightning.schedule.plan import Plan
from zorse_lightning.schedule.programs import played_programs

if TYPE_CHECKING:
    from zorse_lightning.planner.cost.context import CostContext


def schedule_programs(ctx: CostContext, plan: Plan) -> tuple[tuple[Action, ...], ...]:
    """The engine's programs of ``plan`` (:func:`..schedule.played_programs`: covered, and played to
    the end), once per plan shape in this context: the order of a rank's actions follows its stages'
    ranks and microbatch shares, not their layers, sharding, activations or prediction (the remedies of
    an interleaving degree that does not fit, layers moved or activations offloaded, record none again)."""
    return _played(ctx, plan).programs


def schedule_batches(ctx: CostContext, plan: Plan) -> tuple[tuple[P2PBatch, ...], ...]:
    """What each rank of ``plan`` posts to its peers, in order (:func:`..p2p_batches.rank_batches`, as
    :func:`..schedule.build_schedule` gives the engine), once per plan shape in this context, as
    :func:`schedule_programs`: only the plans whose messages are played under NCCL's rules need them."""
    played = _played(ctx, plan)
    if played.batches is None:
        played.batches = rank_batches(plan, played.programs, played.grid)
    return played.batches


@dataclass
class _Played:
    """One plan shape's programs and unit-step grid (:func:`..schedule.played_programs`), and its batches
    once asked for."""

    programs: tuple[tuple[Action, ...], ...]
    grid: tuple[tuple[Action | None, ...], ...]
    batches: tuple[tuple[P2PBatch, ...], ...] | None = None


def programs_recorded(ctx: CostContext, plan: Plan) -> bool:
    """Whether ``plan``'s shape has its programs recorded in ``ctx`` already (pricing it records none)."""
    return _shape(plan) in ctx._programs


def _shape(plan: Plan) -> tuple:
    return plan.schedule, plan.interleave, plan.microbatch_size, tuple((s.ranks, s.microbatches_per_rank) for s in plan.stages)


def _played(ctx: CostContext, plan: Plan) -> _Played:
    key = _shape(plan)
    if key not in ctx._programs:
        ctx._programs[key] = _Played(*played_programs(plan))
    return ctx._programs[key]

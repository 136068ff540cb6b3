"""The engine's programs of a plan and what each rank posts to its peers, recorded once per plan shape in a
cost context: the memory of interleaved plans (:func:`.stage_state.rank_activation_bytes`) and the simulation
(:mod:`.simulate`) read them, and recording takes seconds at 1024 GPUs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zorse_lightning.capabilities import Schedule
from zorse_lightning.schedule.actions import Action
from zorse_lightning.schedule.p2p_batches import P2PBatch, rank_batches
from zorse_lightning.schedule.plan import Plan
from zorse_lightning.schedule.programs import lane_batches_of, lane_programs_of, lane_template, lanes, played_programs, waited_receives

if TYPE_CHECKING:
    from zorse_lightning.planner.cost.context import CostContext


def schedule_programs(ctx: CostContext, plan: Plan) -> tuple[tuple[Action, ...], ...]:
    """The engine's programs of ``plan`` (:func:`..schedule.played_programs`: covered, and played to
    the end), once per plan shape in this context (:func:`_shape`): the order of a rank's actions follows
    its stage's place, width and microbatch shares, not its ranks, layers, sharding, activations or
    prediction (the remedies of an interleaving degree that does not fit, layers moved or activations
    offloaded, and the same groups in another order, record none again)."""
    return _played(ctx, plan).programs


def schedule_batches(ctx: CostContext, plan: Plan) -> tuple[tuple[P2PBatch, ...], ...]:
    """What each rank of ``plan`` posts to its peers, in order (:func:`..p2p_batches.rank_batches`, as
    :func:`..schedule.build_schedule` gives the engine), once per plan in this context from its shape's
    recording: only the plans whose messages are played under NCCL's rules need them."""
    played = _played(ctx, plan)
    if played.batches is None and played.lane is not None:
        template, programs = lane_programs(ctx, plan.schedule, plan.num_groups, plan.interleave, played.lane)
        batches = ctx.memo(("lane batches", plan.schedule, plan.num_groups, plan.interleave, played.lane), lambda: rank_batches(template, programs))
        played.batches = lane_batches_of(plan, played.lane, batches)
    elif played.batches is None:
        played.batches = rank_batches(plan, played.programs)
    return played.batches


@dataclass
class _Played:
    """One plan's programs (:func:`..schedule.played_programs`), and its batches once asked for."""

    programs: tuple[tuple[Action, ...], ...]
    batches: tuple[tuple[P2PBatch, ...], ...] | None = None
    lane: int | None = None
    """A plan of lanes without TP (:func:`..schedule.programs.lanes`): each replica's microbatches; its programs
    and batches are its lane template's, moved to its ranks and microbatches."""


def action_orders(ctx: CostContext, plan: Plan) -> tuple[tuple[Action, ...], ...]:
    """Each rank's actions in the order it runs them, as far as their stages and kinds go (a rank's peak of
    activations reads no more): a plan of lanes (:func:`..schedule.programs.lanes`) takes its group's program of
    the lane template, recorded once per groups, chunks and count; any other its own programs."""
    count = lanes(plan)
    if count is None:
        return schedule_programs(ctx, plan)
    programs = lane_programs(ctx, plan.schedule, plan.num_groups, plan.interleave, count)[1]
    out: list[tuple[Action, ...]] = [()] * plan.world_size
    for g, group in enumerate(plan.rank_groups):
        for rank in group.ranks:
            out[rank] = programs[g]
    return tuple(out)


def lane_programs(ctx: CostContext, schedule: Schedule, groups: int, chunks: int, microbatches: int):
    """:func:`..schedule.programs.lane_template` and its programs, once per arguments in ``ctx``."""
    return ctx.memo(("lane template", schedule, groups, chunks, microbatches), lambda: lane_template(schedule, groups, chunks, microbatches))


def waited_shares(ctx: CostContext, schedule: Schedule, groups: int, chunks: int, microbatches: int) -> tuple[float, ...]:
    """Per group of lanes of ``groups`` x ``chunks`` running ``microbatches`` each: the share of a rank's received
    messages it waits for under NCCL's rules (:func:`..schedule.programs.waited_receives`). Past four rounds of
    ``groups`` microbatches, the counts of the third and fourth rounds (at the same remainder) go on a round at a
    time: Megatron's order repeats round by round once warm (exact for 2-6 groups at 1-4 chunks; at 8 groups
    its warm-up is longer, and shares came up to 0.11 off), and a 1024-GPU search met counts up to 128, whose templates took 9 % of its time."""
    def counts(n: int) -> tuple[tuple[int, int], ...]:
        return ctx.memo(("waited receives", schedule, groups, chunks, n), lambda: waited_receives(*lane_programs(ctx, schedule, groups, chunks, n)))

    if microbatches <= 4 * groups:
        rows = counts(microbatches)
    else:
        third = 3 * groups + microbatches % groups
        rounds = (microbatches - third) // groups
        rows = tuple((w + rounds * (w2 - w), r + rounds * (r2 - r)) for (w, r), (w2, r2) in zip(counts(third), counts(third + groups)))
    return tuple(w / max(r, 1) for w, r in rows)


def programs_recorded(ctx: CostContext, plan: Plan) -> bool:
    """Whether pricing ``plan`` records no programs: its shape's are recorded in ``ctx`` already, or it is lanes
    (:func:`action_orders`)."""
    return _shape(plan) in ctx._programs or lanes(plan) is not None


def _shape(plan: Plan) -> tuple:
    """What a plan's programs and their unit-step play depend on: each stage's width, shares and TP degree
    in order, not which ranks it holds (the recording and its play walk the stages' ranks by position, and
    each channel carries one sender's messages in its order), so plans of the same groups in other orders,
    or on other GPUs, share one recording."""
    return plan.schedule, plan.interleave, plan.microbatch_size, tuple(
        (len(s.ranks), s.microbatches_per_rank, s.tensor_parallel) for s in plan.stages
    )


def _played(ctx: CostContext, plan: Plan) -> _Played:
    """``plan``'s programs: recorded once per shape, given to each plan of the shape rank for rank (its batches
    are its own: an instant's receives keep the order of their senders' ranks); a plan of lanes without TP
    takes its lane template's, recorded on one GPU a group (four groups of four x3, 8 microbatches a rank: 49 ms
    to record the plan's programs and batches, 4 ms the template's and 3 ms to move them)."""
    count = lanes(plan)
    if count is not None and all(s.tensor_parallel == 1 for s in plan.stages):
        def moved() -> _Played:
            return _Played(lane_programs_of(plan, count, lane_programs(ctx, plan.schedule, plan.num_groups, plan.interleave, count)[1]), lane=count)
        return ctx.memo(("lane plan", plan.schedule, plan.interleave, count, tuple(s.ranks for s in plan.stages)), moved)
    key = _shape(plan)
    if key not in ctx._programs:
        ctx._programs[key] = (plan, played_programs(plan)[0], {})
    source, programs, mine = ctx._programs[key]
    ranks = tuple(s.ranks for s in plan.stages)
    if ranks not in mine:
        mine[ranks] = _Played(_moved(programs, source, plan))
    return mine[ranks]


def _moved(rows: tuple[tuple, ...], source: Plan, plan: Plan) -> tuple[tuple, ...]:
    """``source``'s per-rank ``rows`` given to ``plan``'s ranks, stage position for position."""
    if source is plan:
        return rows
    out = [()] * plan.world_size
    for before, after in zip(source.stages, plan.stages):
        for old, new in zip(before.ranks, after.ranks):
            out[new] = rows[old]
    return tuple(out)

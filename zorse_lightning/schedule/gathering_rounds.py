"""Rounds of a stage that gathers its weights block by block for each microbatch (``full`` sharding,
``StagePlan.gather_per_microbatch``), as data: the engine runs them (:mod:`..engine.block_gathering`) and the
step's collectives (:mod:`.step_collectives`) place them for the rendezvous play.

Every rank of such a stage makes the same gathers in the same order: one round per forward or backward,
the same sequence of rounds on every rank. A rank with fewer microbatches than the stage's busiest makes
empty rounds (the collectives alone) where the busiest has rounds its own actions do not take
(:func:`padded_program`, by one of the rules of :class:`Padding`).

Inside a pipeline a round is also a meeting point between the stage's ranks, each of which waits on other
stages for its own microbatch: a rank's round of a real action starts once the action's messages arrived
(they are taken before its blocks run); an empty round after the rank has posted what its actions so far
made (a rank never holds back a message a peer may wait for while it waits in a round). Whether those
meetings and the pipeline's messages can wait on each other in a cycle depends on the shares, widths,
schedule and where the empty rounds sit: :func:`..programs.build_schedule` keeps the first padding rule
whose rounds the rendezvous play (:func:`.p2p_batches.play_rendezvous`) passes, and refuses a plan for
which none does (about one random pipeline in twenty with uneven shares; ``PipelineSchedule.rounds``
holds what the engine runs).

Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from zorse_lightning.errors import PlanningError
from zorse_lightning.schedule.actions import Action
from zorse_lightning.schedule.p2p_batches import HostCollective, P2PBatch
from zorse_lightning.schedule.plan import Plan

EMPTY_ROUND = -1
"""``Action.microbatch`` of a round without a microbatch (only the collectives)."""


class Padding(str, Enum):
    """Which round of its kind each action of a rank with fewer microbatches takes, in program order, among
    those that leave rounds for the actions after it (:func:`padded_program`)."""

    ALIGNED = "aligned"
    """The first at or after the unit step the action runs at in the schedule's play: a round meets the peers
    about when the pipeline brings its microbatch (a rank that ran its one backward at the first backward
    round would wait there for a gradient the next stage sends only after one the busiest rank receives)."""
    EARLIEST = "earliest"
    """The first: a rank's own actions first, its empty rounds after them."""
    LATEST = "latest"
    """The last: its empty rounds first."""


PADDINGS = tuple(Padding)
"""The rules :func:`..programs.build_schedule` tries in turn, keeping the first whose rounds the rendezvous
play passes: no one rule suits every pipeline (each hangs some random plans another runs)."""


def padded_program(
    program: Sequence[Action], busiest: Sequence[Action], steps: Sequence[int], busiest_steps: Sequence[int],
    padding: Padding = Padding.ALIGNED,
) -> list[Action]:
    """``program`` with empty rounds where the stage's busiest rank has rounds this rank's actions do not take
    (by ``padding``), so that every rank's sequence of forward and backward rounds is the busiest one's.
    ``steps``, ``busiest_steps``: the unit step of each action of ``program`` and ``busiest`` in the play."""
    latest, position = [0] * len(program), len(busiest)
    for i in range(len(program) - 1, -1, -1):  # the last round each action may take, the rest fitting after it
        position = next((p for p in range(position - 1, -1, -1) if busiest[p].kind is program[i].kind), -1)
        if position < i:
            raise PlanningError(
                f"a stage gathering per microbatch pads each rank's program to one rank's rounds, but the rounds "
                f"{[str(a) for a in busiest]} cannot hold {[str(a) for a in program]} (another order of the same "
                f"kinds); give the stage's ranks shares whose programs nest, or gather once per step"
            )
        latest[i] = position
    padded = [Action(a.stage, a.kind, EMPTY_ROUND) for a in busiest]
    after = -1
    for action, step, last in zip(program, steps, latest):
        fitting = [p for p in range(after + 1, last + 1) if busiest[p].kind is action.kind]
        if padding is Padding.ALIGNED:
            after = next((p for p in fitting if busiest_steps[p] >= step), last)
        else:
            after = fitting[0] if padding is Padding.EARLIEST else last
        padded[after] = action
    return padded


def gathering_programs(
    plan: Plan, programs: Sequence[Sequence[Action]], grid: Sequence[Sequence[Action | None]], padding: Padding
) -> tuple[tuple[Action, ...], ...]:
    """Every rank's rounds: its program, padded to its stage's busiest rank where the stage gathers per
    microbatch (:func:`padded_program`; every rank of the stage pads to the same one), unchanged elsewhere."""

    def steps(of: int) -> list[int]:
        return [t for t, action in enumerate(grid[of]) if action is not None]

    rounds = [tuple(program) for program in programs]
    for stage in plan.rank_groups:
        if stage.gather_per_microbatch:
            busiest = _reference_rank(stage.ranks, stage.microbatches_per_rank, programs)
            for rank in stage.ranks:
                if rank != busiest:
                    rounds[rank] = tuple(padded_program(programs[rank], programs[busiest], steps(rank), steps(busiest), padding))
    return tuple(rounds)


def _reference_rank(ranks: Sequence[int], counts: Sequence[int], programs: Sequence[Sequence[Action]]) -> int:
    """The rank whose rounds every rank of the stage follows: of the busiest, the first in stage order whose
    sequence of forwards and backwards holds every other rank's (1F1B records equal shares in different
    orders); the first busiest where none does (padding then names the rank it cannot hold)."""
    most = max(counts)
    busiest = [r for r, n in zip(ranks, counts) if n == most]
    return next((b for b in busiest if all(_holds(programs[b], programs[r]) for r in ranks)), busiest[0])


def _holds(rounds: Sequence[Action], program: Sequence[Action]) -> bool:
    """Whether ``program``'s kinds are a subsequence of ``rounds``' kinds."""
    kinds = iter(a.kind for a in rounds)
    return all(any(k is a.kind for k in kinds) for a in program)


def round_collectives(
    plan: Plan, rank: int, rounds: Sequence[Action], batches: Sequence[P2PBatch]
) -> list[HostCollective]:
    """The rank's ``rounds`` (:func:`gathering_programs`) of gathers over its stage's group, in order, each where
    the engine makes it: a real action's once the actions before it ran and the batches due before it were
    posted (after its receives: the play runs an action only once they completed); an empty round once the
    batches due after the actions before it were posted too. None where the rank's stage does not gather per
    microbatch or has one rank."""
    if rank in plan.idle_ranks:
        return []
    stage = plan.stages[plan.stage_of_rank(rank)]
    if not stage.gather_per_microbatch or len(stage.ranks) == 1:
        return []

    def posted(actions: int) -> int:
        return sum(1 for batch in batches if batch.before <= actions)

    calls, ran = [], 0
    for action in rounds:
        if action.microbatch == EMPTY_ROUND:
            what = f"an empty round of gathers ({action.kind.name.lower()}) of stage {action.stage}"
            calls.append(HostCollective(stage.ranks, what, ran, posted(ran)))
            continue
        what = f"the gathers of {action} over stage {action.stage}'s ranks"
        calls.append(HostCollective(stage.ranks, what, ran + 1, posted(ran)))
        ran += 1
    return calls

"""The closed form's chain (:mod:`.compute`) for a priced plan: the latency and busy time of
each group of ranks and of each boundary between them, from the stages' and boundaries'
costs (:mod:`.evaluate`). A plain plan is the case V = 1: its groups are its stages."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zorse_lightning.capabilities import P2PRules, Schedule
from zorse_lightning.planner.cost.boundaries import BoundaryCost, receive_ms_per_microbatch, shared_link_ms
from zorse_lightning.planner.cost.compute import receiving_busy_ms, round_trip_busy_ms, stage_busy_ms, stage_latency_ms
from zorse_lightning.planner.cost.memory import microbatches_in_flight
from zorse_lightning.planner.cost.recorded_programs import waited_shares
from zorse_lightning.schedule.plan import Plan
from zorse_lightning.schedule.one_f_one_b import group_round, interleaving_rounds
from zorse_lightning.schedule.programs import one_f_one_b_limit

if TYPE_CHECKING:
    from zorse_lightning.planner.cost.context import CostContext, StageCost


PHASE_WAIT_SHARE = 0.5
"""The share of the lockstep waits of an interleaved plan's chunk phases (:func:`_phases_ms` less a group's own
work) that a rank pays: about half, as a rank runs ahead on the chunks it holds. No closed form says what the
chunks in flight absorb, so it is measured. Single H100 groups whose chunks differ most (3 and 1 layers against
1 and 3; three groups, 3-1-1 rotated; four, 1-2-5-2 rotated), at 2 to 16 rounds, played 0.94-1.06 of the closed
form with it but for three groups at 2 rounds, 1.11 (0.78-0.95 with the whole excess, 0.88-1.00 with three
quarters). The 82 interleaved plans twenty searches played on seven clusters came at a median 1.016 of it, 47
within 2 % (with :func:`_with_short_rounds`). The estimate it replaced, one round's waits (the excess over the
rank's rounds), played up to 1.43x (the four groups at 16 rounds), and on the searches a median 1.040, 24
within 2 %: four machines of four types, GPT 2.7B, chunks of 1 to 5 layers x3 and x4, played 1.05-1.14x it,
and the search spent its budget playing them before it came to the peers' structure."""


def pipeline_elements(
    ctx: CostContext, plan: Plan, stages: tuple[StageCost, ...], boundaries: tuple[BoundaryCost, ...]
) -> tuple[list[float], list[float]]:
    """(latency, busy time) of each element of the closed form's chain (:mod:`.compute`): group
    0, the boundary to group 1, group 1, ...; interleaved, then the boundary from the last group
    back to the first (the next chunk).

    A group's busy time is its slowest rank's work on all its chunks; its latency in the fill
    and drain is one chunk's (the group's latency over V): a microbatch passes the other groups
    chunk by chunk, so each adds 1/V of its work, hence about ``(M + (S - 1) / V) t`` for S equal
    groups. A boundary's busy time sums its V crossings (every microbatch crosses it once per
    chunk, over the same links); its latency stays one transfer each way. Each rank also waits
    for its messages of every chunk (:func:`receiving_busy_ms`; under NCCL's rules those it takes
    ahead of need partly, :func:`_waited`) and, under 1F1B, for the
    round trips of the chunk-forwards it may keep in flight (:func:`round_trip_busy_ms`): over a
    slow link these V-fold transfers are what interleaving costs. Interleaved, a group also waits for
    the chunks other groups hold heavier than its own (:func:`_phases_ms`, :data:`PHASE_WAIT_SHARE`), and
    for the round trip its short last round leaves uncovered (:func:`_with_short_rounds`).
    """
    groups, degree = plan.num_groups, plan.interleave
    chunks = [plan.stages_of_group(g) for g in range(groups)]
    totals = [
        [t.total_ms for t in stages[g].times] if degree == 1
        else [sum(stages[s].times[k].total_ms for s in chunks[g]) for k in range(len(plan.stages[g].ranks))]
        for g in range(groups)
    ]
    latencies, busy = [], []
    links = shared_link_ms(boundaries)
    for g in range(groups):
        counts = list(plan.stages[g].microbatches_per_rank)
        latencies.append(stage_latency_ms(totals[g], counts) / degree)
        busy.append(stages[g].busy_ms if degree == 1 else stage_busy_ms(totals[g], counts))
        crossings = [boundaries[b] for b in chunks[g] if b < len(boundaries)]
        if crossings:
            latencies.append(2 * crossings[0].transfer_ms)
            shared = max(links[key] for b in crossings for key, _ in b.link_ms)
            busy.append(max(sum(b.busy_ms for b in crossings), shared))
    round_of = interleaving_rounds(plan) if degree > 1 else {}
    receive = receive_ms_per_microbatch(plan, boundaries, ctx.p2p_rules)
    round_trips = _round_trips_ms(plan, stages, boundaries) if degree > 1 else []
    phases = _phases_ms(plan, stages) if degree > 1 else 0.0  # plain: no waits (own + (0 - own) * share <= own)
    trip = _round_trip_backward_ms(plan, stages) if degree > 1 else 0.0
    for g in range(groups):
        element = 2 * g  # groups and boundaries alternate
        counts = list(plan.stages[g].microbatches_per_rank)
        waits = receive[g] if degree == 1 else [sum(chunk) for chunk in zip(*(receive[s] for s in chunks[g]))]
        round_size = group_round(plan, g, round_of)
        limit = {n: _in_flight(plan, g, n, round_size) for n in set(counts)}  # alike GPUs of a wide stage: one count each
        in_flight = [limit[n] for n in counts]
        counted = sum(latencies[element + 1 :])
        waiting = round_trip_busy_ms(totals[g], counts, in_flight, round_trips[g] if degree > 1 else counted, counted)
        work = busy[element]
        own = work if degree == 1 else _with_short_rounds(plan, stages, g, round_of, trip)
        others = max(own, waiting, own + (phases - work) * PHASE_WAIT_SHARE)
        receiving = receiving_busy_ms(totals[g], counts, waits, degree)
        if receiving > others and degree > 1:  # what it waits for of them, only where that could decide
            receiving = receiving_busy_ms(totals[g], counts, _waited(ctx, plan, stages, g, waits), degree)
        busy[element] = max(others, receiving)
    return latencies, busy


def _waited(ctx: CostContext, plan: Plan, stages: tuple[StageCost, ...], group: int, waits: list[float]) -> list[float]:
    """Interleaved: of each rank of ``group``'s transfers per microbatch (``waits``, its chunks' summed), what it
    waits for. Under gloo's rules, every one. Under NCCL's, a message the next action needs as its batch receives
    it whole (:func:`.recorded_programs.waited_shares` of lanes of its groups and count), and one received an
    action or more ahead only for what of it that action, at least the rank's shortest chunk-forward, does not
    cover: the later groups of Megatron's order take most of their messages ahead. Four machines of four GPUs,
    GPT 6.7B x3: its last group was charged 231 ms a step it never waits (the closed form 1.7 % over the play,
    0.0 % now)."""
    if ctx.p2p_rules is not P2PRules.NCCL:
        return waits
    out = []
    for k, (ms, n) in enumerate(zip(waits, plan.stages[group].microbatches_per_rank)):
        if n == 0:
            out.append(ms)
            continue
        share = waited_shares(ctx, plan.schedule, plan.num_groups, plan.interleave, n)[group]
        covered = 2 * plan.interleave * min(stages[s].times[k].forward_ms for s in plan.stages_of_group(group))
        out.append(share * ms + (1 - share) * max(ms - covered, 0.0))
    return out


def _with_short_rounds(plan: Plan, stages: tuple[StageCost, ...], group: int, rounds: dict[int, int], trip: float) -> float:
    """Interleaved: group ``group``'s busiest rank's work with what its last round, where short, leaves it idle.

    A rank takes each chunk's backwards of a round once the round's first microbatch has come back through
    every other group: a chunk-backward on a rank of each group, the round trip. A round of ``q``
    (:func:`interleaving_rounds`) covers it; its last round holds the ``r`` microbatches left (``n`` mod ``q``),
    and at each of the ``V - 1`` changes of chunk the rank waits for what of the round trip its ``r``
    chunk-backwards do not cover; its forwards' such waits are filled by backwards still due. Equal single-GPU
    groups of two layers a chunk, 2 to 4 groups, 2 to 4 chunks, 2 to 16 microbatches: where they are no
    multiple of the groups the play came up to 1.25x the closed form without it (1.44x with fewer microbatches
    than groups), within 5 % with it (1.14x). A narrow group fed by a wider one has a longer round and a shorter
    trip (lab4's widths 1, 2, 1 at 3 chunks: no wait, as played)."""
    chunks = plan.stages_of_group(group)
    busiest = 0.0
    for k, (rank, n) in enumerate(zip(plan.stages[group].ranks, plan.stages[group].microbatches_per_rank)):
        if n == 0:
            continue
        work = sum(n * stages[s].times[k].total_ms for s in chunks)
        last = n % rounds[rank]
        idle = max(trip - last * _chunk_backward_ms(plan, stages, group, k), 0.0) if last else 0.0
        busiest = max(busiest, work + (plan.interleave - 1) * idle)
    return busiest


def _round_trip_backward_ms(plan: Plan, stages: tuple[StageCost, ...]) -> float:
    """One microbatch's chunk-backward on the slowest working rank of each group, summed: a round trip
    (:func:`_with_short_rounds`)."""
    return sum(
        max((_chunk_backward_ms(plan, stages, g, k) for k, n in enumerate(plan.stages[g].microbatches_per_rank) if n > 0), default=0.0)
        for g in range(plan.num_groups)
    )


def _chunk_backward_ms(plan: Plan, stages: tuple[StageCost, ...], group: int, rank_index: int) -> float:
    """One microbatch's backward through one of ``group``'s chunks on its rank ``rank_index``, chunks averaged."""
    return sum(stages[s].times[rank_index].backward_ms for s in plan.stages_of_group(group)) / plan.interleave


def _phases_ms(plan: Plan, stages: tuple[StageCost, ...]) -> float:
    """Interleaved: the sum over chunks of the longest any group takes on that chunk's microbatches.

    A rank runs its microbatches in rounds of one per group (Megatron's order, :mod:`..schedule.one_f_one_b`):
    each chunk's forwards of the round's microbatches, then the next chunk's once they have passed every group.
    So a group whose chunk is light where another group's is heavy waits for it, round after round: were the
    groups in lockstep, each would be busy this sum. It is not: a rank runs ahead on what it holds, and the
    closed form charges :data:`PHASE_WAIT_SHARE` of the sum's excess over the group's own work."""
    groups = plan.num_groups
    return sum(max(stages[s].busy_ms for s in range(chunk * groups, (chunk + 1) * groups)) for chunk in range(plan.interleave))


def _in_flight(plan: Plan, group: int, microbatches: int, round_size: int) -> int:
    """Forwards (chunk-forwards, interleaved) a rank of ``group`` with ``microbatches`` keeps in flight."""
    if plan.interleave == 1:
        return microbatches_in_flight(plan.schedule, tuple(len(s.replicas) for s in plan.stages), group, microbatches)
    forwards = microbatches * plan.interleave
    return forwards if plan.schedule is Schedule.GPIPE else min(forwards, one_f_one_b_limit(plan, group, round_size))


def _round_trips_ms(plan: Plan, stages: tuple[StageCost, ...], boundaries: tuple[BoundaryCost, ...]) -> list[float]:
    """Per group: the sum over its chunks of the latency after the chunk, to the end of the
    virtual pipeline and back (every later stage's and each later boundary's two transfers)."""
    after = [0.0] * len(stages)
    for s in range(len(stages) - 2, -1, -1):
        after[s] = after[s + 1] + stages[s + 1].latency_ms + 2 * boundaries[s].transfer_ms
    return [sum(after[s] for s in plan.stages_of_group(g)) for g in range(plan.num_groups)]

"""From a candidate to plans that fit: its split, and the one :func:`fit` every plan goes through.

A split gives each group of ranks its layers and microbatches: the heuristic balances the stages' busy
time (:func:`heuristic_split`), the integer program optimises it in its own conservative model
(:func:`program_split`), a gathered stage shares its microbatches evenly (:func:`gathered_draft`), an
interleaving cuts a plain plan's groups into chunks (:func:`interleaved_draft`). :func:`fit` then applies
the remedies in one order to plain and interleaved plans alike, each only where the plan is still over
memory: shard the groups of several GPUs (unsharded again where that is free), offload activations (kept
beside the plan without it: the choice keeps it only where it is faster), move layers off the groups over
memory, and last recompute.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from zorse_lightning.capabilities import P2PRules, Sharding
from zorse_lightning.errors import PlanningError
from zorse_lightning.units import bytes_to_gib
from zorse_lightning.planner.cost.boundaries import receive_ms_per_microbatch
from zorse_lightning.planner.cost.chain import PHASE_WAIT_SHARE
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.evaluate import (
    PlanCost, memory_overruns, plan_cost, prediction, with_stage_costs,
)
from zorse_lightning.planner.cost.stage_state import stage_memory, stage_own_sync_ms, stage_update_ms
from zorse_lightning.planner.cost.simulate import simulate
from zorse_lightning.planner.interleaving import interleave, with_layer_counts
from zorse_lightning.planner.rounding import proportional_counts
from zorse_lightning.planner.search.heuristic import balanced_plan
from zorse_lightning.planner.search.ilp import solve_assignment
from zorse_lightning.planner.search.problem import (
    SEARCH_SHARDING, Candidate as ProgramCandidate, build_problem, layout_plan, level_with, stage_plan, to_plan,
    with_free_memory_shards,
)
from zorse_lightning.planner.search.space import Search, structure
from zorse_lightning.schedule.plan import Plan, SolverRecord
from zorse_lightning.schedule.programs import build_schedule

Past = Callable[[Plan], bool]
"""Whether a plan priced in the closed form (without its memory) can no longer change the choice."""

EVEN_SPLIT = SolverRecord("even split", "stages gathered per microbatch: microbatches split evenly")


def split_draft(search: Search, layout, m: int, degrees: tuple[int, ...] = ()) -> Plan | None:
    """The candidate's balanced split, unpriced and unfitted, its state sharded evenly (it keys the queue)."""
    return _balanced(search, layout, m, False, False, degrees, shards_by_memory=False)


def heuristic_split(search: Search, layout, m: int, degrees: tuple[int, ...], draft: Plan | None) -> list[Plan]:
    """The candidate's balanced split (its ``draft``, sharded by free memory) made to fit; its layers moved by
    capping each stage at what its memory holds in the integer program's model (not with TP, which that model
    does not hold), and with recomputation the same again."""
    moved = (lambda plan, *_: _balanced(search, layout, m, plan.stages[0].recompute, True)) if not degrees else (lambda *_: None)  # noqa: E731
    start = draft and with_free_memory_shards(search.ctx, draft.with_prediction(None))
    return fit(search, start, None, moved, lambda _: _balanced(search, layout, m, True, False, degrees))


def _balanced(
    search: Search, layout, m: int, recompute: bool, within_memory: bool, degrees: tuple[int, ...] = (), shards_by_memory: bool = True,
) -> Plan | None:
    program = within_memory and build_problem(search.ctx, search.windows, _program(search, layout, m, recompute), search.global_batch_size, None)
    return balanced_plan(
        search.ctx, search.windows, layout, m, search.global_batch_size, schedule=search.schedule, recompute=recompute,
        speeds=search.speeds, fit=program or None, degrees=degrees or None, shards_by_memory=shards_by_memory,
    )


def program_split(search: Search, layout, m: int, start: Plan | None) -> tuple[Plan | None, int]:
    """The integer program's split of the candidate (warm-started from ``start`` where it recomputes alike),
    without recomputation and, where that has no solution, with it; and the programs solved."""
    for solved, recompute in enumerate((False, True), 1):
        candidate = _program(search, layout, m, recompute)
        problem, groups = build_problem(search.ctx, search.windows, candidate, search.global_batch_size, search.options.layer_counts)
        warm = _start_from(start, groups) if start is not None and start.stages[0].recompute == recompute else None
        assignment = solve_assignment(problem, search.options.solver_time_limit_s, warm)
        if assignment is not None:
            plan = to_plan(search.ctx, candidate, assignment, groups, search.global_batch_size)
            return unsharded_where_free(search, plan), solved
    return None, 2


def gathered_draft(search: Search, layout, m: int, recompute: bool = False) -> Plan | None:
    """Every stage's parameters sharded and gathered block by block for each microbatch, priced in the closed
    form (unfitted): the stage's GPUs meet in each block's gathers, so a round of microbatches lasts as long
    as its slowest GPU's and the fewest rounds are best: microbatches split evenly (the remainder to the
    fastest GPUs); layers as the heuristic split balances them."""
    plain = _balanced(search, layout, m, False, False)
    if plain is None:
        return None
    stages = []
    for stage in plain.stages:
        order = sorted(stage.ranks, key=lambda r: -search.speeds[search.gpu_type(r)])
        shares = dict(zip(order, proportional_counts(sum(stage.microbatches_per_rank), [1.0] * len(order))))
        stages.append(stage_plan(search.ctx, stage.ranks, stage.layers, [shares[r] for r in stage.ranks], Sharding.FULL, recompute, True))
    plan = layout_plan(search.ctx, stages, search.global_batch_size, m, search.schedule, solver=EVEN_SPLIT)
    return _closed_form(search, with_free_memory_shards(search.ctx, plan))


def gathered_fit(search: Search, draft: Plan) -> list[Plan]:
    """A gathered draft made to fit (recomputing where it does not otherwise); a pipeline's plan kept only
    where the rendezvous play finds an order of its gathering rounds and messages that cannot hang."""
    recomputed = lambda _: gathered_draft(search, tuple(s.ranks for s in draft.stages), draft.microbatch_size, True)  # noqa: E731
    return [plan if len(plan.stages) == 1 else _calibrated(search, plan) for plan in fit(search, draft, None, recomputed=recomputed)
            if len(plan.stages) == 1 or _runs(plan)]


def _calibrated(search: Search, plan: Plan) -> Plan:
    """A gathered pipeline predicted by its closed form times what the simulation of the same pipeline
    without gathers says of its closed form: the simulation does not play the gathers, and the closed form
    alone misses what the pipeline's links cost (a slow link between stages most)."""
    plain = replace(plan, stages=tuple(replace(s, gather_per_microbatch=False) for s in plan.stages))
    played = simulate(search.ctx, plain)
    ms = plan.predicted.iteration_ms * played.makespan_ms / played.predicted_iteration_ms
    return plan.predicted_at(ms, plan.predicted.iteration_ms)


def _runs(plan: Plan) -> bool:
    try:
        return build_schedule(plan) is not None
    except PlanningError:
        return False


def interleaved_draft(search: Search, plain: Plan, degree: int, busy_ms: list[float]) -> Plan:
    """``plain`` with each group's layers cut into ``degree`` chunks, priced in the closed form without its
    memory (unfitted); a group holding fewer layers than the degree first gets layers from the groups then
    busiest (``busy_ms``: each group's busy time in ``plain``'s closed form; else a slow group holding few
    layers would rule the degree out). Its groups sharded as the search shards them: where ``plain`` left one
    unsharded because its step ended within the drain after it, an interleaved plan's drain (one chunk's
    backward on each group before) is shorter (:func:`unsharded_where_free`)."""
    key = ("sharded as searched", plain.schedule, plain.microbatch_size, plain.stages)  # once for all its degrees
    plain = search.ctx.memo(key, lambda: _sharded(search, plain) or plain)
    counts = _chunked_counts(plain, degree, busy_ms)
    return _closed_form(search, interleave(with_layer_counts(plain, counts) if counts != [s.num_layers for s in plain.stages] else plain, degree))


def _chunked_counts(plain: Plan, degree: int, busy_ms: list[float]) -> list[int]:
    """Each group's layers in ``plain`` interleaved at ``degree``: a group holding fewer than the degree gets
    layers from the groups then busiest (``busy_ms`` scaled by layers as they move)."""
    busy = list(busy_ms)
    counts = [stage.num_layers for stage in plain.stages]
    for thin in (g for g in range(len(counts)) if counts[g] < degree):
        while counts[thin] < degree:
            donor = max((g for g in range(len(counts)) if counts[g] > degree), key=lambda g: busy[g])
            busy[donor] *= (counts[donor] - 1) / counts[donor]
            busy[thin] *= (counts[thin] + 1) / counts[thin]
            counts[donor] -= 1
            counts[thin] += 1
    return counts


def tensor_parallel_best_case_ms(base: PlanCost, degree: int) -> float:
    """No less than a plan priced plain in ``base`` with its stages' layers split over TP groups of ``degree``
    GPUs: its fill and drain's compute at most ``degree`` times shorter (their transfers stay, one each way, as
    the closed form counts them), no GPU's own work smaller (a TP group's GPUs each run every microbatch of
    their replica, each layer at the one-GPU time over the degree at an efficiency of at most 1)."""
    transfers_ms = sum(2 * boundary.transfer_ms for boundary in base.boundaries)
    return base.iteration_ms - max(base.fill_ms - transfers_ms, 0.0) * (1 - 1 / degree)


def interleaved_best_case_ms(ctx: CostContext, plain: Plan, base: PlanCost, degree: int) -> float:
    """No more than the closed form of ``plain`` (priced plain in ``base``) interleaved at ``degree``, short of
    drafting it (most interleavings the search opens lose: their drafts were a fifth of planning a mixed
    cluster). The chain of :mod:`..cost.chain` from ``base``'s elements: each group's latency over the degree,
    each boundary's busy time ``V``-fold, each rank waiting for its messages of every chunk over the same links
    (:func:`~..cost.compute.receiving_busy_ms` with ``V`` times the waits) and, for its share
    (:data:`~..cost.chain.PHASE_WAIT_SHARE`), for the group whose chunks are heaviest
    (:func:`~..cost.chain._phases_ms`, at least the busiest group's work), its
    work scaled by its layers where layers move (:func:`_chunked_counts`; the first and last groups' only down,
    as their embedding and head stay). Then the tail: each group whose layers stay synchronises and steps
    after its last backward, which comes before the end by no more than in ``plain`` (its drain passes one
    chunk of each group before it); an unsharded group's step left out, as the interleaving shards it. Under
    NCCL's rules the draft waits for a share of its messages only (:func:`~..cost.chain._waited`, from
    recorded programs), so the tail is added to a pipeline whose waits lack what a chunk-forward or two may
    cover, else the estimate is the pipeline alone. Without the tail it was a median 1.37x short of the draft
    at mix32 Llama 7B (global batch 128): 259 interleavings drafted and 99 splits fitted, now 103 and 47. (Under
    NCCL's rules the pipeline alone came over the draft in 24 of 1,898 drafts of the shipped clusters' searches,
    by 4.9 % at most, with the tail or without: the draft's waited shares are no recording's here.)
    Made once per structure and degree: a split is keyed by the least over its degrees, again wherever a
    floor falls."""
    return ctx.memo(("best case", structure(plain), degree), lambda: _best_case_ms(ctx, plain, base, degree))


def _best_case_ms(ctx: CostContext, plain: Plan, base: PlanCost, degree: int) -> float:
    waits = receive_ms_per_microbatch(plain, base.boundaries, ctx.p2p_rules)
    counts = _chunked_counts(plain, degree, [stage.busy_ms for stage in base.stages])
    latencies = [2 * boundary.transfer_ms for boundary in base.boundaries]
    excess = [boundary.busy_ms * degree - latency for boundary, latency in zip(base.boundaries, latencies)]
    nccl = ctx.p2p_rules is P2PRules.NCCL
    covered = list(excess) if nccl else excess  # under gloo's rules no wait is covered: the same pipeline
    scales = [min(k / s.num_layers, 1.0) if g in (0, len(counts) - 1) else k / s.num_layers for g, (k, s) in enumerate(zip(counts, plain.stages))]
    own = [cost.busy_ms * scale for cost, scale in zip(base.stages, scales)]
    for stage, cost, scale, work, waited, k in zip(plain.stages, base.stages, scales, own, waits, counts):
        latencies.append(cost.latency_ms * scale / degree)
        ahead = 2 * max(k / stage.num_layers, 1.0) / degree  # under NCCL: a chunk-forward or two may cover a wait
        phases = work + (max(own) - work) * PHASE_WAIT_SHARE
        ranks = {(n, t.total_ms, t.forward_ms, x) for t, n, x in zip(cost.times, stage.microbatches_per_rank, waited) if n > 0}  # alike ranks once
        for out, cover in ((excess, 0.0), (covered, ahead))[: 1 + nccl]:
            receiving = max((n * total * scale + (n * degree - 1) * max(x - cover * forward, 0.0) for n, total, forward, x in ranks), default=0.0)
            out.append(max(receiving, phases) - latencies[-1])
    tails = [0.0] + [
        base.stage_sync_ms(g) + (base.stage_update_ms(g) if stage.sharding is not Sharding.NONE else 0.0) - base.drain_ms[g]
        for g, (stage, k) in enumerate(zip(plain.stages, counts)) if k == stage.num_layers
    ]
    return sum(latencies) + max(max(excess), max(covered) + max(tails))


def interleaved_fit(search: Search, draft: Plan, busy: list[float], past: Past, refused: list[str]) -> list[Plan]:
    """An interleaved draft made to fit, remedies in the module's order (no layer moved where the layer counts
    are pinned; moved to the groups least busy in the plain plan, ``busy``); ``refused`` receives why it gave
    nothing."""
    overran: set[int] = set()
    recompute = lambda p: replace(p, stages=tuple(replace(s, recompute=True) for s in p.stages), predicted=None)  # noqa: E731
    moved = (lambda p, cost, over: _layer_moved(p, cost, over, busy, overran)) if search.options.layer_counts is None else (lambda *_: None)
    plans = fit(search, draft, past, moved, recompute)
    if not plans:
        priced = _priced(search, draft)
        group, rank, gib = max(priced[2], key=lambda o: o[2]) if priced and priced[2] else (0, draft.stages[0].ranks[0], 0.0)
        refused.append(f"x{draft.interleave} does not fit (rank {rank} of group {group} {gib:.2f} GiB over: more activations in flight)")
    return plans


def fit(
    search: Search, plan: Plan | None, past: Past | None, moved: Callable[..., Plan | None] = lambda *_: None,
    recomputed: Callable[[Plan], Plan | None] = lambda _: None,
) -> list[Plan]:
    """``plan`` priced where it fits, else the remedies of the module's order, each on what the ones before
    left over memory: the plans that fit, priced (the choice keeps the fastest); none where no remedy helps.
    ``past``: where given, no layer is moved once the plan could no longer change the choice. ``moved``
    (given the plan, its cost and overruns) and ``recomputed``: how this kind of plan moves layers and
    recomputes."""
    fitting: list[Plan] = []
    for recomputing in (False, True):
        attempt = (recomputed(plan) if plan is not None else None) if recomputing else plan  # recomputed only once needed
        chain = _priced(search, attempt)
        if chain is not None and chain[2]:
            chain = _priced(search, _sharded(search, chain[0])) or chain
        if chain is not None and chain[2] and search.options.allow_offload:
            fitting += [p for p in [_fitting(search, _priced(search, _offloaded(*chain)))] if p]
        while chain is not None and chain[2]:
            shifted = moved(*chain)
            if shifted is None or shifted.stages == chain[0].stages or (past and past(_closed_form(search, shifted))):
                break
            chain = _priced(search, shifted)
        if chain is not None and not chain[2]:
            return [*fitting, _fitting(search, chain)]
    return fitting


def unsharded_where_free(search: Search, plan: Plan, cost: PlanCost | None = None) -> Plan | None:
    """The plan, priced, with its stages unsharded where they fit and that is no slower (fewer collectives to
    get wrong); None when it does not fit even sharded.

    Unsharding a stage changes only what it does after its last backward: an all-reduce instead of a
    reduce-scatter and an all-gather (the same traffic at ``optimizer_gradients``) and a longer optimizer
    step. The iteration is the pipeline plus the most any stage's tail adds to it (a tail starts at the stage's
    last backward, :attr:`~..cost.evaluate.PlanCost.drain_ms` before the pipeline's end), so unsharding costs
    nothing while what the stage's new tail adds stays within that. Interleaved plans keep their sharding:
    unsharding a group of ranks changes every chunk of it, and where measured it played slower than the closed
    form then said (four16 Llama 3B x2, groups unsharded where free: 4765.4 to 4788.5 ms)."""
    ctx = search.ctx
    cost = cost or plan_cost(ctx, plan)
    if memory_overruns(ctx, plan, cost):
        return None
    stages, stage_costs = list(plan.stages), list(cost.stages)
    for i, stage in enumerate(plan.stages):
        if stage.sharding is Sharding.NONE or stage.gather_per_microbatch or plan.interleave > 1:
            continue
        unsharded = replace(stage, sharding=Sharding.NONE, shard_fractions=())
        shared_sync_ms = cost.stage_sync_ms(i) - cost.stages[i].sync_ms  # a tied weight's, unchanged
        own_sync_ms = stage_own_sync_ms(ctx, plan, i, unsharded)
        update_ms = stage_update_ms(ctx, plan, i, unsharded)
        if shared_sync_ms + own_sync_ms + max(update_ms) - cost.drain_ms[i] > cost.tail_ms:
            continue
        memory = stage_memory(ctx, plan, i, tuple(0.0 for _ in stage.ranks), unsharded)
        if all(used.total_bytes <= ctx.capacity_bytes(r) for r, used in zip(stage.ranks, memory)):
            stages[i], stage_costs[i] = unsharded, replace(cost.stages[i], sync_ms=own_sync_ms, update_ms=update_ms, memory=memory)
    if stages == list(plan.stages):
        return plan.with_prediction(prediction(ctx, plan, cost))
    unsharded_plan = replace(plan, stages=tuple(stages))
    return unsharded_plan.with_prediction(prediction(ctx, unsharded_plan, with_stage_costs(cost, tuple(stage_costs))))


def _priced(search: Search, plan: Plan | None) -> tuple[Plan, PlanCost, list] | None:
    """``plan`` with its cost and memory overruns; None for no plan, or one no 1F1B order exists for."""
    if plan is None:
        return None
    try:
        cost = plan_cost(search.ctx, plan)
    except PlanningError:
        return None
    return plan, cost, memory_overruns(search.ctx, plan, cost)


def _fitting(search: Search, priced: tuple[Plan, PlanCost, list] | None) -> Plan | None:
    if priced is None or priced[2]:
        return None
    plan, cost, _ = priced
    return unsharded_where_free(search, plan, cost) if plan.interleave == 1 else plan.with_prediction(prediction(search.ctx, plan, cost))


def _closed_form(search: Search, plan: Plan) -> Plan:
    """``plan`` predicted by its closed form without memory (no programs recorded)."""
    return plan.with_prediction(prediction(search.ctx, plan, plan_cost(search.ctx, plan, memory=False)))


def _sharded(search: Search, plan: Plan) -> Plan | None:
    """``plan`` with its unsharded stages of several replicas sharded as the search shards them, a TP stage
    at a level TP runs (None: none)."""
    stages = tuple(
        replace(s, sharding=level_with(SEARCH_SHARDING, s.tensor_parallel))
        if len(s.replicas) > 1 and s.sharding is Sharding.NONE else s for s in plan.stages
    )
    return with_free_memory_shards(search.ctx, replace(plan, stages=stages, predicted=None)) if stages != plan.stages else None


def _offloaded(plan: Plan, cost: PlanCost, over: list) -> Plan | None:
    """``plan`` offloading activations on every chunk of each group of ranks over memory (a group that
    recomputes offloads what recomputation keeps, its blocks' inputs; not a TP stage, which the engine does
    not offload yet); None where that changes nothing."""
    groups = {plan.rank_groups[group].ranks for group, _, _ in over}
    stages = tuple(
        replace(s, offload_activations=True) if s.ranks in groups and not s.gather_per_microbatch and s.tensor_parallel == 1 else s
        for s in plan.stages
    )
    return replace(plan, stages=stages, predicted=None) if stages != plan.stages else None


def _layer_moved(plan: Plan, cost: PlanCost, over: list[tuple[int, int, float]], busy: list[float], overran: set[int]) -> Plan | None:
    """``plan`` (interleaved) with layers moved off the group most over memory, as many whole layers as its
    excess over its memory per layer (which counts its fixed memory too: a move never overshoots), at least
    one, each to the group never over memory (``overran`` collects them, so no layer moves back) then least
    busy (``busy``: the plain plan's busy time per group, scaled by layers); None where no group can give one
    (each needs a layer per chunk) or take one."""
    counts = [sum(plan.stages[s].num_layers for s in plan.stages_of_group(g)) for g in range(plan.num_groups)]
    donor, rank, excess_gib = max(over, key=lambda o: o[2])
    group = plan.rank_groups[donor]
    used_gib = bytes_to_gib(cost.stages[plan.stages_of_group(donor)[0]].memory[group.ranks.index(rank)].total_bytes)
    overran.update(g for g, _, _ in over)
    takers = [g for g in range(len(counts)) if g not in overran]
    moving = min(max(1, math.floor(excess_gib / (used_gib / counts[donor]))), counts[donor] - plan.interleave)
    if moving < 1 or not takers:
        return None
    for _ in range(moving):
        taker = min(takers, key=lambda g: busy[g] * (counts[g] + 1) / counts[g])
        counts[donor] -= 1
        counts[taker] += 1
    return with_layer_counts(plan, counts)


def _program(search: Search, layout, m: int, recompute: bool) -> ProgramCandidate:
    return ProgramCandidate(layout, m, search.schedule, SEARCH_SHARDING, recompute)


def _start_from(plan: Plan, groups: list[list[tuple[int, ...]]]) -> tuple:
    """A plan's layer counts and per-group microbatches, as a start for the program."""
    counts = tuple(s.num_layers for s in plan.stages)
    shares = tuple(
        tuple(sum(dict(zip(stage.ranks, stage.microbatches_per_rank))[r] for r in group) for group in stage_groups)
        for stage, stage_groups in zip(plan.stages, groups)
    )
    return counts, shares

"""The planner's entry point: enumerate the outer choices, solve the most promising with
the integer program, price every plan in the cost model, keep the fastest in the simulation.

Candidates: stage layout and order (:mod:`.grouping`, and, where allowed, layouts
that leave the slowest GPU types idle), microbatch size and schedule. Two phases:

1. In increasing order of a lower bound on the iteration time (see
   :func:`.bound.lower_bound_ms`), each candidate gets a heuristic split priced
   (:mod:`.heuristic`: microbatches by speed, layers balancing the stages' compute,
   within each stage's memory when they do not fit otherwise): an upper bound and a
   valid fallback plan.
   Candidates whose bound reaches the best plan so far are skipped (a plan that leaves
   GPUs idle must beat every plan using them all by a margin: :mod:`.choice`).
2. The integer program runs for the candidates with the best heuristic splits,
   warm-started from them, at most ``max_programs`` times and only while their
   bound is below the best plan, skipping those where it has nothing to choose
   (one stage of identical GPUs). It runs with optimizer state and gradients sharded
   (:data:`.problem.SEARCH_SHARDING`: it saves memory, each GPU steps only its shard,
   and it moves no more than an unsharded all-reduce) and without recomputation, and
   with recomputation only when that does not fit; stages that also fit unsharded, and
   whose longer optimizer step does not lengthen the iteration, are then left unsharded.
3. One-stage plans with every parameter sharded and gathered block by block for each
   microbatch (``full``, ``gather_per_microbatch``: the least memory, the most
   traffic), for the one-stage layouts whose bound is below the best plan: they win
   where nothing else fits, or where what fits otherwise is slower still
   (:func:`_gathered_per_microbatch`).

4. Every other order of the chosen plan's stage groups, where it has at most
   :data:`MOST_ORDERED_GROUPS` (:func:`_offer_other_orders`).

5. Every baseline the planner prints (:mod:`.baseline_plans`: data parallel, Cephalo, the proportional
   heuristic, and the fastest GPU type alone, planned on its sub-cluster) is offered as a candidate, so
   no plan is slower than a baseline by construction.

The candidates are priced in the closed form, which needs no programs; the plan is predicted, and the
candidates that could be chosen are ranked, by the simulation of the engine's programs
(:mod:`.choice`: the plan held is simulated before it prunes anything, and the plans within 2x of it in
the closed form are simulated while a budget allows; plans too large to simulate within planning time, or
beyond the search's budget of simulation, are ranked by their closed form). The note says by how much the
two disagree on the plan, and how many plans were simulated.

GPipe is tried only when pinned: its time equals 1F1B's and its memory is never
smaller (see :mod:`.cost.compute`).

To measure what the integer programs add, pass a :class:`ProgramLog` to
:func:`make_plan`: it receives one :class:`ProgramRun` per program solved (the
heuristic split it started from and its own solution, both priced).
"""

from __future__ import annotations

import gc
import time
from itertools import permutations
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from zorse_lightning.capabilities import GATHER_PER_MICROBATCH_MAX_STAGES, Schedule, Sharding
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.diagnose import infeasible_error
from zorse_lightning.planner.bound import any_layout_lower_bound_ms, lower_bound_ms
from zorse_lightning.planner import baseline_plans
from zorse_lightning.planner.choice import MOST_SIMULATED_WORK, Choice, price, work_of
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.first_split import heuristic_plan, priced_unsharded_where_free
from zorse_lightning.planner.search_inputs import check_inputs, microbatch_sizes
from zorse_lightning.planner.grouping import Layout, candidate_layouts, fastest_type_subsets
from zorse_lightning.planner.heuristic import HEURISTIC, priced, speed_by_type
from zorse_lightning.planner.ilp import SOLVER_NAME, solve_assignment
from zorse_lightning.planner.interleave_choice import FINALISTS, GAINING_FINALISTS, REACH, best_case_ms, interleaved_if_faster
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.schedule.plan import Plan, SolverRecord
from zorse_lightning.planner.problem import (
    SEARCH_SHARDING,
    Candidate,
    WindowCosts,
    build_problem,
    layout_plan,
    stage_groups,
    stage_plan,
    to_plan,
    with_free_memory_shards,
)
from zorse_lightning.planner.program_log import ProgramLog, ProgramRun
from zorse_lightning.planner.rounding import proportional_counts
from zorse_lightning.profiling.profile import ModelProfile


def make_plan(
    inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions = PlannerOptions(),
    programs: ProgramLog | None = None,
) -> Plan:
    """The fastest plan the search finds; raises :class:`PlanningError` when none fits.

    ``programs``, when given, receives a :class:`ProgramRun` per integer program solved."""
    with _collector_paused():
        return _search(inventory, profile, global_batch_size, options, programs)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off while the search runs (as it was after). The search allocates millions
    of small records (plans, actions, events) that reference counting frees, and the collector walked every
    live one, the simulated timelines among them, again and again: 10 % of planning at 32 GPUs, 11 % at
    1024 (CPU time, this 2-core machine)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _search(
    inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions,
    programs: ProgramLog | None,
) -> Plan:
    started = time.perf_counter()
    check_inputs(inventory, profile, global_batch_size, options)
    ctx = CostContext.build(inventory, profile, options.memory_reserve_gib, options.p2p_rules)
    windows = WindowCosts(ctx)
    notes = () if options.allow_pipeline else (f"data parallel only: {options.no_pipeline_reason}",)
    layouts = _layouts(ctx, options)
    sizes = microbatch_sizes(global_batch_size, options, profile)
    schedules = [options.schedule] if options.schedule is not None else [Schedule.ONE_F_ONE_B]
    speeds = speed_by_type(ctx)
    bounded = sorted(
        (lower_bound_ms(ctx, layout, m, global_batch_size), i, layout, m, schedule)
        for i, (layout, m, schedule) in enumerate((l, m, sc) for l in layouts for m in sizes for sc in schedules)
    )
    choice, scored = Choice(ctx), []
    world = ctx.inventory.world_size
    for bound, i, layout, m, schedule in bounded:
        if _past(choice, bound, uses_every_gpu=True):
            break
        if _past(choice, bound, _uses(layout, world)):
            continue
        heuristic = heuristic_plan(ctx, windows, layout, m, schedule, global_batch_size, speeds, options, choice)
        choice.offer(heuristic)
        scored.append((heuristic.predicted.iteration_ms if heuristic else float("inf"), bound, i, layout, m, schedule, heuristic))
    solves = 0
    for _, bound, _, layout, m, schedule, heuristic in sorted(scored, key=lambda item: item[:3]):
        if choice.chosen is not None and (solves >= options.max_programs or _past(choice, bound, _uses(layout, world))):
            continue
        if heuristic is not None and _nothing_to_choose(ctx, layout):
            continue
        for recompute in (False, True):
            candidate = Candidate(layout, m, schedule, SEARCH_SHARDING, recompute)
            problem, groups = build_problem(ctx, windows, candidate, global_batch_size, options.layer_counts)
            start = _start_from(heuristic, groups) if heuristic and heuristic.stages[0].recompute == recompute else None
            assignment = solve_assignment(problem, options.solver_time_limit_s, start)
            solves += 1
            found = assignment and priced_unsharded_where_free(
                ctx, to_plan(ctx, candidate, assignment, groups, global_batch_size, notes)
            )
            if programs is not None:
                programs.add(ProgramRun(
                    len(layout), m, recompute, heuristic and heuristic.predicted.iteration_ms, start is not None,
                    found and found.predicted.iteration_ms, choice.chosen and choice.chosen.predicted.iteration_ms,
                ))
            if assignment is not None:
                choice.offer(found)
                break
    _gathered_per_microbatch(ctx, layouts, sizes, schedules[0], global_batch_size, speeds, choice, notes)
    _offer_other_orders(ctx, windows, set(layouts), sizes, global_batch_size, speeds, options, choice)
    if _unpinned(options):
        _offer_baselines(ctx, profile, global_batch_size, options, sizes, choice)
    choice.finalists()
    best = choice.chosen
    if best is None:
        raise infeasible_error(ctx, layouts, sizes, schedules[0], global_batch_size, options)
    found_by = best.solver.status if best.solver.name != HEURISTIC.name else "no program beat the heuristic split"
    record = SolverRecord(
        SOLVER_NAME, f"{found_by}; {solves} programs solved; {choice.simulated} of {len(choice.pool)} plans simulated",
        best.solver.objective_ms,
    )
    baseline = next((n.removeprefix("baseline: ") for n in best.notes if n.startswith("baseline: ")), None)
    if baseline:
        notes = (*notes, f"a baseline's plan ({baseline}): no candidate of the search beat it")
    if any(s.gather_per_microbatch for s in best.stages):
        rounds = max(best.stages[0].microbatches_per_rank)
        notes = (*notes, f"every parameter sharded and gathered block by block for each microbatch ({rounds} "
                         f"round{'s' * (rounds != 1)} of gathers a step): the fastest plan that fits")
    idle_note = choice.idle_note(lambda rank: inventory.gpus[rank].gpu_type.name)
    best, interleave_note = interleaved_if_faster(
        ctx, best, options.max_interleave, _finalists(ctx, choice, options.max_interleave), options.allow_offload,
        options.layer_counts is not None,
    )
    best = price(ctx, best)
    notes = (*notes, *(note for note in (idle_note, interleave_note, _prediction_note(best, choice)) if note))
    return replace(best, planner_seconds=time.perf_counter() - started, solver=record, notes=notes)


def _past(choice: Choice, bound: float, uses_every_gpu: bool) -> bool:
    """Whether a candidate of lower bound ``bound`` cannot change the choice, against the simulated time of
    the plan the choice holds (:meth:`.choice.Choice.settle` simulates it first, where it was not)."""
    if bound < choice.threshold_ms(uses_every_gpu):
        return False
    choice.settle()
    return bound >= choice.threshold_ms(uses_every_gpu)


def _unpinned(options: PlannerOptions) -> bool:
    """No part of the plan pinned: the baselines' plans are then candidates of the search."""
    return all(pin is None for pin in (options.stage_layout, options.layer_counts, options.microbatch_size, options.schedule))


def _offer_baselines(
    ctx: CostContext, profile: ModelProfile, global_batch_size: int, options: PlannerOptions, sizes: list[int],
    choice: Choice,
) -> None:
    """Offer ``choice`` every baseline the planner prints (:mod:`.baseline_plans`), so that none is faster
    than the plan by construction: the fastest GPU type alone is planned on its sub-cluster (as
    :func:`.baselines.fastest_type_alone` prints it) where the plan may leave GPUs idle and the cluster has
    several types, unless no plan of its GPUs at any of the ``sizes`` could change the choice
    (:func:`.bound.any_layout_lower_bound_ms`; a quarter of planning on a 32-GPU cluster of four types)."""
    choice.offer(baseline_plans.data_parallel_equal(ctx, global_batch_size, options))
    choice.offer(baseline_plans.cephalo(ctx, global_batch_size, options))
    if options.allow_pipeline:
        choice.offer(baseline_plans.proportional_heuristic(ctx, global_batch_size, options))
    if options.allow_idle_ranks and len(ctx.inventory.gpu_types) > 1:
        sub, ranks = baseline_plans.fastest_type_cluster(ctx)
        if all(_past(choice, any_layout_lower_bound_ms(ctx, ranks, m, global_batch_size), False) for m in sizes):
            return
        try:
            alone = make_plan(sub, profile, global_batch_size, options)
        except PlanningError:
            return
        only = f"baseline: only the {len(ranks)} {sub.gpus[0].gpu_type.name} GPUs"
        choice.offer(baseline_plans.onto_cluster(ctx, replace(alone, notes=(only,)), ranks))


def _finalists(ctx: CostContext, choice: Choice, most: int) -> list[Plan]:
    """The plans after the chosen one whose interleaving is tried: the :data:`FINALISTS` fastest, and the
    :data:`GAINING_FINALISTS` whose time interleaving could bring lowest (:func:`.interleave_choice.best_case_ms`).
    Either alone misses plans the other finds (Llama 7B on 4 A100s and 4 V100s at 8 samples a GPU: a fast
    finalist, 3.2 % faster at x3; Llama 3B on four machines of four types: a slower one at microbatch 8,
    4 % faster at x2); the degrees' estimates decide which are checked (their closed forms cost little)."""
    fastest = choice.runners_up(FINALISTS)
    gaining = choice.runners_up(GAINING_FINALISTS, lambda plan: best_case_ms(ctx, plan, most), REACH)
    return fastest + [plan for plan in gaining if all(plan is not kept for kept in fastest)]


def _prediction_note(plan: Plan, choice: Choice) -> str:
    """How the plan is predicted, and by how much the closed form the search screens with disagrees."""
    simulated = f"{choice.simulated} of {len(choice.pool)} plans the search priced were simulated ({choice.simulated_work:,} units of 2 V M R)"
    if plan.predicted.closed_form_ms is None:
        why = "its stage gathers parameters per microbatch, which the simulation does not play" if any(
            s.gather_per_microbatch for s in plan.stages
        ) else f"simulating its programs (2 V M R = {work_of(plan):,} > {MOST_SIMULATED_WORK:,}) would take longer than planning may"
        return f"predicted by the cost model's closed form: {why}; {simulated}"
    closed, ms = plan.predicted.closed_form_ms, plan.predicted.iteration_ms
    return (
        f"predicted by the simulation of the engine's programs: {ms:.1f} ms; the closed form says {closed:.1f} ms "
        f"({closed / ms - 1:+.1%}); {simulated}"
    )


def _uses(layout: Layout, world_size: int) -> bool:
    """Whether ``layout`` puts every GPU of the cluster to work."""
    return sum(len(ranks) for ranks in layout) == world_size


def _start_from(plan: Plan, groups: list[list[tuple[int, ...]]]) -> tuple:
    """A plan's layer counts and per-group microbatches, as a start for the program."""
    counts = tuple(s.num_layers for s in plan.stages)
    shares = tuple(
        tuple(sum(dict(zip(stage.ranks, stage.microbatches_per_rank))[r] for r in group) for group in stage_groups)
        for stage, stage_groups in zip(plan.stages, groups)
    )
    return counts, shares


EVEN_SPLIT = SolverRecord("even split", "one stage gathered per microbatch: microbatches split evenly")


def _gathered_per_microbatch(
    ctx: CostContext, layouts: list[Layout], sizes: list[int], schedule: Schedule, global_batch_size: int,
    speeds: dict[str, float], choice: Choice, notes: tuple[str, ...],
) -> None:
    """Offer ``choice`` the one-stage plans that gather parameters block by block per microbatch.

    Every GPU of such a stage meets the others in each block's gathers, so a round of
    microbatches lasts as long as its slowest GPU's, and each GPU makes as many rounds as
    the busiest has microbatches: the microbatches are split evenly (the remainder to
    the fastest GPUs), the fewest rounds. Where slow GPUs would hold the others back, the
    layouts that leave them idle compete. Recomputation only where the plan does not fit
    without it; layouts whose bound cannot change the choice are skipped.
    """
    if GATHER_PER_MICROBATCH_MAX_STAGES < 1:
        return
    num_layers = ctx.profile.num_layers
    for (ranks,) in (l for l in layouts if len(l) == 1 and len(l[0]) > 1):
        order = sorted(ranks, key=lambda r: -speeds[ctx.inventory.gpus[r].gpu_type.name])
        for m in sizes:
            if _past(choice, lower_bound_ms(ctx, (ranks,), m, global_batch_size), len(ranks) == ctx.inventory.world_size):
                continue
            shares = dict(zip(order, proportional_counts(global_batch_size // m, [1.0] * len(order))))
            for recompute in (False, True):
                stage = stage_plan(ctx, ranks, (0, num_layers), [shares[r] for r in ranks], Sharding.FULL, recompute, True)
                plan = layout_plan(ctx, [stage], global_batch_size, m, schedule, solver=EVEN_SPLIT, notes=notes)
                plan = priced(ctx, with_free_memory_shards(ctx, plan))
                if plan is not None:
                    choice.offer(plan)
                    break


MOST_ORDERED_GROUPS = 4
"""Stage groups up to which every order of the chosen plan's groups is tried (24 at four). The orders of
:func:`.grouping.stage_orders` follow rules (fastest boundaries, fastest first or last, most memory first),
and where the links between the groups are alike the best order is set by where the embedding and head
land and by the activations each group holds in flight, which no rule weighs: on four machines of four
types, Llama tiny runs 0.7 % faster in an order none of the rules gives."""


def _offer_other_orders(
    ctx: CostContext, windows: WindowCosts, tried: set[Layout], sizes: list[int], global_batch_size: int,
    speeds: dict[str, float], options: PlannerOptions, choice: Choice,
) -> None:
    """Offer ``choice`` the heuristic split of each order of the chosen plan's stage groups that the search
    did not try (``tried``), at each microbatch size of ``sizes`` (the best order at one size may be the
    one that interleaves best at another), where it has 2 to :data:`MOST_ORDERED_GROUPS` groups and neither
    the layout nor the layer counts are pinned; orders whose bound cannot change the choice are skipped."""
    if options.stage_layout is not None or options.layer_counts is not None:
        return
    choice.settle()
    chosen = choice.chosen
    if chosen is None or not 2 <= len(chosen.stages) <= MOST_ORDERED_GROUPS or any(s.gather_per_microbatch for s in chosen.stages):
        return
    world = ctx.inventory.world_size
    for order in (o for o in permutations(tuple(s.ranks for s in chosen.stages)) if o not in tried):
        for m in sizes:
            if _past(choice, lower_bound_ms(ctx, order, m, global_batch_size), _uses(order, world)):
                continue
            choice.offer(heuristic_plan(ctx, windows, order, m, chosen.schedule, global_batch_size, speeds, options, choice))


def _nothing_to_choose(ctx: CostContext, layout: Layout) -> bool:
    """One stage of identical GPUs: the even split is the program's only solution, and
    the heuristic plan already has it (a program would only use up the budget)."""
    return len(layout) == 1 and len(stage_groups(ctx, layout[0])) == 1


def _layouts(ctx: CostContext, options: PlannerOptions) -> list[Layout]:
    num_layers = ctx.profile.num_layers
    speeds = speed_by_type(ctx)
    if options.stage_layout is not None:
        layouts = [tuple(tuple(sorted(s)) for s in options.stage_layout)]
    else:
        subsets = fastest_type_subsets(ctx.inventory, speeds) if options.allow_idle_ranks else [tuple(range(ctx.inventory.world_size))]
        if options.allow_pipeline:
            max_stages = min(options.max_stages, num_layers)
            layouts = [l for ranks in subsets for l in candidate_layouts(ctx.inventory, ctx.links, speeds, max_stages, ranks)]
        else:
            layouts = [(ranks,) for ranks in subsets]
    if options.layer_counts is not None:
        layouts = [l for l in layouts if len(l) == len(options.layer_counts)]
    if not layouts or any(len(l) > num_layers for l in layouts):
        raise PlanningError(
            f"no stage layout matches the pins: {num_layers} layers, pinned layer_counts "
            f"{options.layer_counts and list(options.layer_counts)}, pinned stage_layout "
            f"{options.stage_layout and [list(s) for s in options.stage_layout]}; give as many layer counts as "
            f"stages, and no more stages than layers"
        )
    if not options.allow_pipeline and len(layouts[0]) > 1:
        raise PlanningError("allow_pipeline=False allows only one stage, but the pinned stage_layout has more")
    return layouts


__all__ = ["ProgramLog", "ProgramRun", "make_plan"]

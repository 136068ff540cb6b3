"""Whether the search's plan runs faster interleaved: its own plan's or one of its finalists', at which degree.

The search prices plain plans only (interleaving needs a plan to interleave, and each
interleaved candidate's memory needs its programs recorded: seconds at 1024 GPUs,
too much inside the search). Its chosen plan and the :data:`FINALISTS` fastest after it
in the simulation (:meth:`.choice.Choice.runners_up`) are then interleaved at each degree
2 .. ``max_interleave``: the best plain plan is not always the best to interleave (a
finalist whose fill and drain weigh more gains more). Each keeps its groups' layer counts,
so only the fill and drain (about V-fold shorter), the transfers (V-fold) and the
activations in flight change; a group holding fewer layers than the degree first gets
layers from the busiest groups (:func:`_thick_enough`), else a slow group holding few
layers would rule the degree out. Where a degree does not fit, the groups of several GPUs
are sharded as the search shards them (:data:`.problem.SEARCH_SHARDING`) and it is priced
again.

The closed form (the cost model's, which counts the fill and drain as Megatron's interleaved
order does, :mod:`.cost.chain`) screens the degrees: its ratio of interleaved to plain time,
applied to the plain plan's simulated time, is each degree's estimate, and only the
:data:`MOST_CHECKED` best estimates that would beat the chosen plan are checked. The event
simulation of the engine's own programs decides, as it ranks the search's plans: the fastest
checked degree is taken where it beats the chosen plan's simulated time by
:data:`.choice.INTERLEAVE_MARGIN`. The simulation is the judge because the programs are
recorded from a play in unit steps: where their order departs from Megatron's (uneven
shares, a rank's microbatches not a multiple of the groups, backwards twice the forwards)
they keep less of the gain, sometimes none. The plan's note leads with the simulated gain
(the one of what runs) and gives the closed form's beside it, or why interleaving lost.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zorse_lightning import capabilities
from zorse_lightning.capabilities import Sharding
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.choice import INTERLEAVE_MARGIN, work_of
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.evaluate import PlanCost, memory_overruns, plan_cost, prediction
from zorse_lightning.planner.interleaving import degrees, interleave, with_layer_counts
from zorse_lightning.planner.offload_choice import offloaded_where_over
from zorse_lightning.schedule.plan import Plan
from zorse_lightning.planner.problem import SEARCH_SHARDING, with_free_memory_shards
from zorse_lightning.planner.cost.simulate import simulate

MOST_RECORDING_WORK = 2**21
"""Largest ``2 V M R`` (the actions of every program, ``2 V M`` per group of ranks, times the ``R``
working ranks each step of the recording play looks at) recorded in all, the degrees of every finalist
together: about 8 s on one core today (``bench/plan_scaling.py``'s 1024 GPUs need 1 M at degree 4).
Beyond it a degree is not tried, to keep the planning-time goals (60 s at 1024 GPUs)."""
MOST_CHECKED = 4
"""Degrees whose memory is priced and which are simulated, best estimate first, over every finalist
(each records and plays every rank's program: seconds at 1024 GPUs), while their recording work
summed stays within :data:`MOST_RECORDING_WORK`: one degree at 1024 GPUs (about 7 s a degree there),
four wherever recording is cheap (the chosen plan's two best degrees and two of the finalists')."""
ESTIMATE_SLACK = 0.05
"""A degree is checked where its estimate comes within this of the target: the closed form's ratio of an
interleaved plan to its plain one can miss the simulation's by several per cent (Llama 3B on A10G, L4 and T4
machines: 0.8 % gained in the closed form, 4.7 % in the simulation, the best of every machine order)."""
CHECKED_WORK = 2**15
"""Degrees beyond :data:`MOST_CHECKED`, and those whose estimate is only within :data:`ESTIMATE_SLACK` of
the target, are checked while the work of every check so far (programs recorded for memory, simulations)
stays within this (about 0.25 s here): small plans get more of their degrees simulated, large ones the
four best estimates."""
FINALISTS = 2
"""The fastest plans after the chosen one whose interleaving is tried (:meth:`.choice.Choice.runners_up`)."""
GAINING_FINALISTS = 8
"""The plans whose time interleaving could bring lowest (:func:`best_case_ms`), among those within
:data:`REACH` of the chosen one, whose interleaving is tried too: each costs a closed form per degree (and
a simulation where the search had not simulated it); every other order of the chosen plan's groups at every
microbatch size crowds them, and at four four-GPU groups the best (Llama 3B, microbatch 8) ranked sixth."""
REACH = 1.1
"""How much slower plain than the chosen plan a plan not simulated by the search may be and still be
interleaved as a finalist: interleaving gained at most 6 % on the shipped and peers' clusters (each such
finalist costs a simulation and a closed form per degree)."""
REMEDY_SLACK = 0.05
"""A degree made to fit by a remedy (:func:`_fitting`) is estimated again, and simulated unless that estimate
misses the target by more than this: the closed form and the simulation of an interleaved plan differ by
a few percent (2.2 % on the peers' Llama 7B structure, which fits only with a layer moved), while unhidden
offload copies cost tens of percent (50 % on the same cluster), and simulations are few (:data:`MOST_CHECKED`)."""


@dataclass
class Trial:
    """One degree of interleaving of one plain plan, priced."""

    degree: int
    plan: Plan
    cost: PlanCost
    """Its time, and its memory once :func:`_fitting` has priced it."""
    plain: Plan
    """The plain plan it interleaves, as the search split it."""
    finalist: int
    """Which: 0 the chosen plan, ``k`` the ``k``-th finalist after it."""
    base: PlanCost
    """The plain plan's closed form."""
    estimate_ms: float
    """The plain plan's simulated time times the closed form's ratio of this plan's time to it."""
    refused: str | None = None
    """Why it cannot run (does not fit, no 1F1B order); None: it can."""
    simulated_ms: float | None = None
    """Its time in the event simulation (None: not simulated)."""

    @property
    def ms(self) -> float:
        return self.cost.iteration_ms

    @property
    def label(self) -> str:
        """Which plain plan and degree, for the note: ``x2``, or ``#1 x3`` for the first finalist."""
        return f"#{self.finalist} x{self.degree}" if self.finalist else f"x{self.degree}"


def interleaved_if_faster(
    ctx: CostContext, plan: Plan, most: int, finalists: list[Plan] = (), allow_offload: bool = True,
    keep_layer_counts: bool = False,
) -> tuple[Plan, str | None]:
    """``plan``, or the fastest interleaving of it or of one of ``finalists`` (plain plans idling the same
    ranks, fastest first) in the simulation where that beats ``plan`` by the margin; with a note (None: not
    tried, because the engine does not run interleaved plans, ``most`` < 2 or no plan has two stages).

    ``allow_offload``: a degree over memory may offload activations on its groups over memory;
    ``keep_layer_counts``: the groups keep the plan's layer counts (pinned by the user), so no layers
    are moved to thin groups or off groups over memory.

    Every degree's time is priced first (no programs needed); only the :data:`MOST_CHECKED`
    best estimates, within a recording budget, get their memory priced (their programs recorded)
    and are simulated."""
    plains = [(k, p) for k, p in enumerate((plan, *finalists)) if p.interleave == 1 and len(degrees(p, most)) > 1]
    if not (capabilities.SUPPORTS_INTERLEAVING and plains):
        return plan, None
    plain_ms = _simulated_ms(ctx, plan)
    target_ms = plain_ms * (1 - INTERLEAVE_MARGIN)
    timed, reasons = [], {}
    for finalist, plain in plains:
        trials, reason = _timed_degrees(ctx, plain, most, finalist, target_ms, keep_layer_counts)
        timed += trials
        if reason:
            reasons[reason] = None
    reach_ms = target_ms * (1 + ESTIMATE_SLACK)
    promising = sorted((t for t in timed if t.refused is None and t.estimate_ms < reach_ms), key=lambda t: t.estimate_ms)
    reasons.update({_why_not(t, target_ms): None for t in timed if t not in promising})
    checked, budget, spent = [], MOST_RECORDING_WORK, 0
    for trial in promising:
        work = work_of(trial.plan)
        beyond = trial.estimate_ms >= target_ms or sum(t.simulated_ms is not None for t in checked) >= MOST_CHECKED
        if work > budget or (beyond and spent + work > CHECKED_WORK):
            reasons[f"{trial.label} estimated {trial.estimate_ms:.1f} ms, not checked (the budget went to better estimates)"] = None
            continue
        limit_ms = target_ms * (1 + REMEDY_SLACK)
        fitting, work = _fitting(ctx, trial, allow_offload, not keep_layer_counts, budget, limit_ms)
        budget -= work
        spent += work + (work_of(fitting.plan) if fitting.refused is None else 0)
        if fitting.refused is None:
            # A remedy (offload's copies, layers moved) may cost what the degree gained: estimated again
            # before it takes one of the simulations, which go to the degrees still promising.
            fitting.estimate_ms = _estimate_ms(trial, fitting.cost)
            if fitting.estimate_ms >= limit_ms:
                fitting.refused = f"{trial.label} fits only at {fitting.estimate_ms:.1f} ms estimated ({_remedy(trial, fitting)})"
            else:
                fitting.simulated_ms = simulate(ctx, fitting.plan).makespan_ms
        checked.append(fitting)
    runs = sorted((t for t in checked if t.simulated_ms is not None), key=lambda t: t.simulated_ms)
    if runs and runs[0].simulated_ms < target_ms:
        best = runs[0]
        chosen = replace(best.plan, predicted=prediction(ctx, best.plan, best.cost))
        closed_gain = _gain(best.ms, plan_cost(ctx, plan, memory=False).iteration_ms)
        return chosen, (
            f"interleaved x{best.degree}{_origin(best)}: each group of ranks holds {best.degree} layer chunks; the "
            f"engine's programs, simulated, {_gain(best.simulated_ms, plain_ms):.1%} faster than the plan without "
            f"({best.simulated_ms:.1f} against {plain_ms:.1f} ms; the closed form's gain: {closed_gain:.1%})"
        )
    reasons.update({_why_not(t, target_ms): None for t in checked})
    listed = "; ".join(reasons)
    return plan, f"not interleaved (each must beat {plain_ms:.1f} ms, the plan's simulated time, by {INTERLEAVE_MARGIN:.1%}): {listed}"


def _simulated_ms(ctx: CostContext, plan: Plan) -> float:
    """``plan``'s time in the event simulation (its prediction where the search simulated it)."""
    if plan.predicted is not None and plan.predicted.closed_form_ms is not None:
        return plan.predicted.iteration_ms
    return simulate(ctx, plan).makespan_ms


def _timed_degrees(
    ctx: CostContext, plain: Plan, most: int, finalist: int, target_ms: float, keep_layer_counts: bool
) -> tuple[list[Trial], str | None]:
    """``plain`` interleaved at each degree it admits whose programs can be recorded, timed; or why none
    is worth timing (its fill and drain leave too little to gain, or recording would take too long)."""
    tried = degrees(plain, most)[1:]
    if keep_layer_counts:  # pinned: a group thinner than the degree cannot be given layers
        tried = [d for d in tried if min(s.num_layers for s in plain.stages) >= d]
        if not tried:
            return [], "the pinned layer counts give some group fewer layers than two chunks"
    prefix = f"#{finalist} " if finalist else ""
    base = plan_cost(ctx, plain, memory=False)
    plain_ms = _simulated_ms(ctx, plain)
    ceiling = _most_gained(base, tried[-1])
    if plain_ms * (1 - ceiling) >= target_ms:
        return [], (
            f"{prefix}the pipeline's fill and drain ({base.fill_ms:.1f} of {base.iteration_ms:.1f} ms in the closed form) "
            f"leave at most {ceiling:.1%} of its {plain_ms:.1f} ms to gain at x{tried[-1]}"
        )
    working = sum(len(group.ranks) for group in plain.rank_groups)
    recordable = [d for d in tried if 2 * d * plain.num_microbatches * working <= MOST_RECORDING_WORK]
    if not recordable:
        return [], (
            f"{prefix}recording the programs of x{tried[0]} ({plain.num_microbatches} microbatches on {working} GPUs) would "
            f"take longer than planning may (2 V M R = {2 * tried[0] * plain.num_microbatches * working:,} > "
            f"{MOST_RECORDING_WORK:,}); pin fewer microbatches to try it"
        )
    trials = []
    for degree in recordable:
        candidate = interleave(_thick_enough(plain, degree, base), degree)
        cost = plan_cost(ctx, candidate, memory=False)
        trials.append(Trial(degree, candidate, cost, plain, finalist, base, plain_ms * cost.iteration_ms / base.iteration_ms))
    return trials, None


def _most_gained(base: PlanCost, degree: int) -> float:
    """The largest share of a plain plan's time (closed form ``base``) interleaving at ``degree`` can save:
    its fill and drain made ``degree`` times shorter."""
    return base.fill_ms * (1 - 1 / degree) / base.iteration_ms


def best_case_ms(ctx: CostContext, plain: Plan, most: int) -> float:
    """``plain``'s time (simulated where it was) less the most interleaving up to ``most`` could save of
    it: how the search ranks its plans for :data:`FINALISTS` (a plan a little slower plain, with more fill
    and drain to shorten, can come out ahead interleaved: 4 % on Llama 3B on four machines of four types,
    at microbatch 8 where the plain plans are best at 4)."""
    top = degrees(plain, most)[-1]
    if top < 2 or plain.interleave > 1:
        return plain.predicted.iteration_ms
    return plain.predicted.iteration_ms * (1 - _most_gained(plan_cost(ctx, plain, memory=False), top))


def _thick_enough(plain: Plan, degree: int, base: PlanCost) -> Plan:
    """``plain`` with every group holding at least ``degree`` layers: each layer a thin group lacks comes
    from the group that is then busiest (busy time scaled by its layers; the simulation judges the result),
    which is where the plain split loses least. ``plain`` itself where no group is thin."""
    counts = [stage.num_layers for stage in plain.stages]
    if min(counts) >= degree:
        return plain
    busy = [cost.busy_ms for cost in base.stages]
    for thin in (g for g in range(len(counts)) if counts[g] < degree):
        while counts[thin] < degree:
            donor = max((g for g in range(len(counts)) if counts[g] > degree), key=lambda g: busy[g])
            busy[donor] *= (counts[donor] - 1) / counts[donor]
            busy[thin] *= (counts[thin] + 1) / counts[thin]
            counts[donor] -= 1
            counts[thin] += 1
    return with_layer_counts(plain, counts)


def _origin(trial: Trial) -> str:
    """Where the interleaved plan comes from, where not the chosen plan as the search split it."""
    counts = [sum(s.num_layers for s in trial.plan.stages if s.ranks == g.ranks) for g in trial.plain.stages]
    parts = [f"finalist #{trial.finalist} of the search ({len(counts)} groups, microbatch {trial.plan.microbatch_size})"] if trial.finalist else []
    if counts != [s.num_layers for s in trial.plain.stages]:
        parts.append(f"layers re-split to {counts} so that each group holds a chunk and fits")
    offloading = [g for g, s in enumerate(trial.plan.rank_groups) if s.offload_activations and not trial.plain.stages[g].offload_activations]
    if offloading:
        parts.append(f"offloading activations on groups {offloading}, which do not fit otherwise")
    return f" ({'; '.join(parts)})" if parts else ""


def _remedy(trial: Trial, fitting: Trial) -> str:
    """What made ``trial`` fit, as ``fitting`` is priced."""
    moved = [sum(s.num_layers for s in fitting.plan.stages if s.ranks == g.ranks) for g in fitting.plan.rank_groups]
    parts = ["sharded"] if any(a.sharding != b.sharding for a, b in zip(trial.plan.stages, fitting.plan.stages)) else []
    parts += ["offloading"] if any(s.offload_activations for s in fitting.plan.stages) else []
    parts += [f"layers {moved}"] if moved != [sum(s.num_layers for s in trial.plan.stages if s.ranks == g.ranks) for g in trial.plan.rank_groups] else []
    return ", ".join(parts) or "as it is"


def _gain(ms: float, plain_ms: float) -> float:
    return 1 - ms / plain_ms


def _fitting(
    ctx: CostContext, timed: Trial, allow_offload: bool, move_layers: bool, budget: int, limit_ms: float
) -> tuple[Trial, int]:
    """``timed`` with its memory priced, and the recording work that took. Where it does not fit (more
    activations in flight), the remedies the search itself uses are priced: its groups of several GPUs
    sharded as the search shards them (:data:`.problem.SEARCH_SHARDING`), and from there, each apart,
    activations offloaded on the groups still over memory (where ``allow_offload``) and, unless the
    layer counts are pinned (``move_layers`` False), up to :data:`MOST_LAYERS_MOVED` layers moved off the group most over memory, one at a time, each to the
    group then least busy (the peers' structure of four whole machines at Llama 7B fits only so); the
    fastest that fits is kept. Each pricing records the programs, so the remedies stop where ``budget``
    runs out, and an offload or a move is first timed without its memory (no programs recorded): one
    whose estimate (:func:`_estimate_ms`) reaches ``limit_ms`` is not priced further, and no layer is
    moved after it. Refused where none fits, or where its programs cannot be recorded."""
    plan, work = timed.plan, work_of(timed.plan)
    try:
        cost = plan_cost(ctx, plan)
    except PlanningError as error:  # no 1F1B order exists for it
        return replace(timed, refused=f"{timed.label}: {error}"), work
    first_over = over = memory_overruns(ctx, plan, cost)
    fitting, too_slow = [], []

    def priced(candidate: Plan | None, screened: bool = True) -> tuple[Plan, PlanCost, list] | None:
        nonlocal work
        if candidate is None or work + work_of(candidate) > budget:
            return None
        if screened and _estimate_ms(timed, plan_cost(ctx, candidate, memory=False)) >= limit_ms:
            too_slow.append(candidate)
            return None
        work += work_of(candidate)
        candidate_cost = plan_cost(ctx, candidate)
        candidate_over = memory_overruns(ctx, candidate, candidate_cost)
        if not candidate_over:
            fitting.append((candidate, candidate_cost))
        return candidate, candidate_cost, candidate_over

    if over and (sharded := priced(_sharded(ctx, plan), screened=False)) is not None:
        plan, cost, over = sharded
    if over and allow_offload:
        priced(offloaded_where_over(ctx, plan, cost))
    moved = (plan, cost, over)
    for _ in range(MOST_LAYERS_MOVED if over and move_layers else 0):
        moved = priced(_layer_moved(timed, *moved))
        if moved is None or not moved[2]:
            break
    if not over:
        return replace(timed, plan=plan, cost=cost), work
    if fitting:
        plan, cost = min(fitting, key=lambda f: f[1].iteration_ms)
        return replace(timed, plan=plan, cost=cost), work
    group, rank, gib = max(first_over, key=lambda o: o[2])
    slow = "; what would make it fit costs more than it gains" if too_slow else ""
    return replace(timed, cost=cost, refused=(
        f"{timed.label} does not fit (rank {rank} of group {group} {gib:.2f} GiB over: more activations in flight{slow})"
    )), work


def _estimate_ms(trial: Trial, cost: PlanCost) -> float:
    """``trial``'s estimate for its plan changed to one priced ``cost`` (the closed form's ratio of the two)."""
    return trial.estimate_ms * cost.iteration_ms / trial.cost.iteration_ms


MOST_LAYERS_MOVED = 3
"""Layers :func:`_fitting` moves off a group over memory before it gives an interleaving degree up."""


def _sharded(ctx: CostContext, plan: Plan) -> Plan | None:
    """``plan`` with its unsharded groups of several GPUs sharded as the search shards them (None: none)."""
    shardable = [i for i, s in enumerate(plan.stages) if len(s.ranks) > 1 and s.sharding is Sharding.NONE]
    if not shardable:
        return None
    sharded = replace(plan, stages=tuple(
        replace(s, sharding=SEARCH_SHARDING) if i in shardable else s for i, s in enumerate(plan.stages)
    ))
    return with_free_memory_shards(ctx, sharded)


def _layer_moved(timed: Trial, plan: Plan, cost: PlanCost, over: list[tuple[int, int, float]]) -> Plan | None:
    """``plan`` (interleaved) with one layer moved off the group most over memory to the group not over
    memory that is then least busy (busy time of the plain plan scaled by layers, as :func:`_thick_enough`
    weighs it); None where no group can give one (each needs a layer per chunk) or take one."""
    del cost  # the moves follow the plain plan's busy times; the argument keeps the remedies alike
    counts = [sum(plan.stages[s].num_layers for s in plan.stages_of_group(g)) for g in range(plan.num_groups)]
    donor = max(over, key=lambda o: o[2])[0]
    full = {group for group, _, _ in over}
    busy = [c.busy_ms * n / max(1, s.num_layers) for c, s, n in zip(timed.base.stages, timed.plain.stages, counts)]
    takers = [g for g in range(len(counts)) if g not in full]
    if counts[donor] <= plan.interleave or not takers:
        return None
    taker = min(takers, key=lambda g: busy[g] * (counts[g] + 1) / counts[g])
    counts[donor] -= 1
    counts[taker] += 1
    return with_layer_counts(plan, counts)


def _why_not(trial: Trial, target_ms: float) -> str:
    """Why ``trial`` lost: it does not fit, or where its time goes against its plain plan's."""
    if trial.refused is not None:
        return trial.refused
    base = trial.base
    head = f"{trial.label} {trial.ms:.1f} against {base.iteration_ms:.1f} ms in the closed form"
    if trial.simulated_ms is not None:
        return f"{head}, {trial.simulated_ms:.1f} ms in the simulation of the engine's programs (needed below {target_ms:.1f})"
    fill = trial.cost.fill_ms - base.fill_ms
    busiest = (trial.cost.pipeline_ms - trial.cost.fill_ms) - (base.pipeline_ms - base.fill_ms)
    tail = trial.cost.tail_ms - base.tail_ms
    why = f" (estimated {trial.estimate_ms:.1f} ms; fill and drain {fill:+.1f} ms, busiest group or link {busiest:+.1f} ms"
    why += f", synchronisation and step {tail:+.1f} ms)" if abs(tail) > 1e-9 else ")"
    if busiest > 0:
        why += ": its activations cross every chunk boundary"
    return head + why

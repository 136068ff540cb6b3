"""Whether the search's best plan runs faster interleaved, and at which degree.

The search prices plain plans only (interleaving needs a plan to interleave, and each
interleaved candidate's memory needs its programs recorded: seconds at 1024 GPUs,
too much inside the search). Its best plan is then interleaved at each degree 2 ..
``max_interleave`` it admits (every group needs a layer per chunk,
:func:`.interleaving.degrees`); each keeps its groups' layer counts, so only the fill
and drain (about V-fold shorter), the transfers (V-fold) and the activations in
flight change. Where a degree does not fit, the groups of several GPUs are sharded
as the search shards them (:data:`.problem.SEARCH_SHARDING`) and it is priced again.

Two models must agree on the gain, by :data:`.choice.INTERLEAVE_MARGIN`: the closed
form (the cost model's, which counts the fill and drain as Megatron's interleaved
order does, :mod:`.cost.chain`) and the event simulation of the engine's own programs,
the plain plan's against the interleaved one's (:mod:`.cost.simulate`, the same model on
both sides, so the comparison is fair even where the simulation and the closed form
differ on both). The simulation is the check because the programs are recorded from a
play in unit steps: where their order departs from Megatron's (uneven shares, a rank's
microbatches not a multiple of the groups, backwards twice the forwards) they keep
less of the gain, sometimes none. The plan is predicted by that simulation, like every
plan the search returns; its note leads with the simulated gain (the one of what runs)
and gives the closed form's beside it, or why interleaving lost.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zorse_lightning import capabilities
from zorse_lightning.capabilities import Sharding
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.choice import INTERLEAVE_MARGIN
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.evaluate import PlanCost, memory_overruns, plan_cost, prediction
from zorse_lightning.planner.interleaving import degrees, interleave
from zorse_lightning.planner.plan import Plan
from zorse_lightning.planner.problem import SEARCH_SHARDING, with_free_memory_shards
from zorse_lightning.planner.cost.simulate import simulate

MOST_RECORDING_WORK = 2**21
"""Largest ``2 V M R`` (the actions of every program, ``2 V M`` per group of ranks, times the ``R``
working ranks each step of the recording play looks at) for which a degree's programs are recorded:
about 8 s on one core today (``bench/plan_scaling.py``'s 1024 GPUs need 1 M at degree 4). Beyond
it the degree is not tried, to keep the planning-time goals (60 s at 1024 GPUs)."""
MOST_CHECKED = 2
"""Degrees whose memory is priced and which are simulated, fastest in the closed form first
(each records and plays every rank's program: seconds at 1024 GPUs), while their recording work
summed stays within :data:`MOST_RECORDING_WORK`: one degree at 1024 GPUs (about 7 s a degree
there), two wherever recording is cheap."""


@dataclass
class Trial:
    """One degree of interleaving, priced."""

    degree: int
    plan: Plan
    cost: PlanCost
    """Its time, and its memory once :func:`_fitting` has priced it."""
    refused: str | None = None
    """Why it cannot run (does not fit, no 1F1B order); None: it can."""
    simulated_gain: float | None = None
    """Its gain over the plain plan in the event simulation (None: not simulated)."""

    @property
    def ms(self) -> float:
        return self.cost.iteration_ms


def interleaved_if_faster(ctx: CostContext, plan: Plan, most: int) -> tuple[Plan, str | None]:
    """``plan``, or it interleaved where that wins in both models; with a note (None: not tried,
    because the engine does not run interleaved plans, ``most`` < 2 or the plan has one stage).

    Every degree's time is priced first (no programs needed); only the :data:`MOST_CHECKED`
    fastest that gain in the closed form, within a recording budget, get their memory priced (their
    programs recorded) and are simulated, fastest first, until one wins."""
    tried = degrees(plan, most)[1:] if plan.interleave == 1 else []
    if not (capabilities.SUPPORTS_INTERLEAVING and tried):
        return plan, None
    base = plan_cost(ctx, plan)
    ceiling = base.fill_ms * (1 - 1 / tried[-1]) / base.iteration_ms
    if ceiling <= INTERLEAVE_MARGIN:
        return plan, (
            f"not interleaved: the pipeline's fill and drain ({base.fill_ms:.1f} of {base.iteration_ms:.1f} ms) leave at most "
            f"{ceiling:.1%} to gain at degree {tried[-1]} (interleaving must win by {INTERLEAVE_MARGIN:.0%})"
        )
    working = sum(len(group.ranks) for group in plan.rank_groups)
    recordable = [d for d in tried if 2 * d * plan.num_microbatches * working <= MOST_RECORDING_WORK]
    if not recordable:
        return plan, (
            f"not interleaved: recording the programs of x{tried[0]} ({plan.num_microbatches} microbatches on {working} GPUs) "
            f"would take longer than planning may (2 V M R = {2 * tried[0] * plan.num_microbatches * working:,} > "
            f"{MOST_RECORDING_WORK:,}); pin fewer microbatches to try it"
        )
    tried = recordable
    timed = [_timed(ctx, plan, degree) for degree in tried]
    promising = sorted((t for t in timed if t.refused is None and _gain(t.ms, base.iteration_ms) > INTERLEAVE_MARGIN), key=lambda t: t.ms)
    reasons = {t.degree: _why_not(t, base) for t in timed if t not in promising}
    plain_simulated_ms = None
    checked, budget = [], MOST_RECORDING_WORK
    for timing in promising:
        work = 2 * timing.degree * plan.num_microbatches * working
        if len(checked) == MOST_CHECKED or work > budget:
            reasons[timing.degree] = f"x{timing.degree} {timing.ms:.1f} ms, not checked (slower than those checked)"
            continue
        checked.append(timing.degree)
        budget -= work
        trial = _fitting(ctx, timing)
        if trial.refused is None and _gain(trial.ms, base.iteration_ms) > INTERLEAVE_MARGIN:
            plain_simulated_ms = plain_simulated_ms or simulate(ctx, plan).makespan_ms
            trial.simulated_gain = _gain(simulate(ctx, trial.plan).makespan_ms, plain_simulated_ms)
            if trial.simulated_gain > INTERLEAVE_MARGIN:
                chosen = replace(trial.plan, predicted=prediction(ctx, trial.plan, trial.cost))
                simulated_ms = plain_simulated_ms * (1 - trial.simulated_gain)
                return chosen, (
                    f"interleaved x{trial.degree}: each group of ranks holds {trial.degree} layer chunks; the "
                    f"engine's programs, simulated, {trial.simulated_gain:.1%} faster than without ({simulated_ms:.1f} "
                    f"against {plain_simulated_ms:.1f} ms; the closed form's gain: "
                    f"{_gain(trial.ms, base.iteration_ms):.1%})"
                )
        reasons[trial.degree] = _why_not(trial, base)
    listed = "; ".join(reasons[d] for d in sorted(reasons))
    return plan, f"not interleaved (tried x{tried[0]}-x{tried[-1]}, each must win by {INTERLEAVE_MARGIN:.0%}): {listed}"


def _gain(ms: float, plain_ms: float) -> float:
    return 1 - ms / plain_ms


def _timed(ctx: CostContext, plan: Plan, degree: int) -> Trial:
    """``plan`` interleaved at ``degree``, its time priced (not its memory)."""
    candidate = interleave(plan, degree)
    return Trial(degree, candidate, plan_cost(ctx, candidate, memory=False))


def _fitting(ctx: CostContext, timed: Trial) -> Trial:
    """``timed`` with its memory priced; sharded as the search shards where it does not fit
    otherwise (more activations in flight); refused where that does not fit either, or where its
    programs cannot be recorded."""
    candidate, degree = timed.plan, timed.degree
    try:
        cost = plan_cost(ctx, candidate)
    except PlanningError as error:  # no 1F1B order exists for it
        return Trial(degree, candidate, timed.cost, f"x{degree}: {error}")
    over = memory_overruns(ctx, candidate, cost)
    shardable = [i for i, s in enumerate(candidate.stages) if len(s.ranks) > 1 and s.sharding is Sharding.NONE]
    if over and shardable:
        sharded = replace(candidate, stages=tuple(
            replace(s, sharding=SEARCH_SHARDING) if i in shardable else s for i, s in enumerate(candidate.stages)
        ))
        sharded = with_free_memory_shards(ctx, sharded)
        sharded_cost = plan_cost(ctx, sharded)
        if not memory_overruns(ctx, sharded, sharded_cost):
            return Trial(degree, sharded, sharded_cost)
    if over:
        group, rank, gib = max(over, key=lambda o: o[2])
        return Trial(degree, candidate, cost, f"x{degree} does not fit (rank {rank} of group {group} {gib:.2f} GiB over: more activations in flight)")
    return Trial(degree, candidate, cost)


def _why_not(trial: Trial, base: PlanCost) -> str:
    """Why ``trial`` lost: it does not fit, or where its time goes against the plain plan's."""
    if trial.refused is not None:
        return trial.refused
    head = f"x{trial.degree} {trial.ms:.1f} against {base.iteration_ms:.1f} ms"
    if trial.simulated_gain is not None:
        gain = trial.simulated_gain
        simulated = f"only {gain:.1%} faster" if gain >= 0 else f"{-gain:.1%} slower"
        return f"{head}, but {simulated} in the simulation of the engine's programs"
    fill = trial.cost.fill_ms - base.fill_ms
    busiest = (trial.cost.pipeline_ms - trial.cost.fill_ms) - (base.pipeline_ms - base.fill_ms)
    tail = trial.cost.tail_ms - base.tail_ms
    why = f" (fill and drain {fill:+.1f} ms, busiest group or link {busiest:+.1f} ms"
    why += f", synchronisation and step {tail:+.1f} ms)" if abs(tail) > 1e-9 else ")"
    if busiest > 0:
        why += ": its activations cross every chunk boundary"
    return head + why

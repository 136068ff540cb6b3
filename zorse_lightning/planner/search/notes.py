"""What a plan's notes say of how the search found it: a baseline it kept, gathering, idle GPUs, interleaving
and tensor parallelism (what each gained, or why the search did without), and how the plan is predicted."""

from __future__ import annotations

from zorse_lightning.planner.search.choice import INTERLEAVE_MARGIN, Choice, simulable
from zorse_lightning.planner.search.space import Search, structure
from zorse_lightning.planner.search.heuristic import HEURISTIC
from zorse_lightning.planner.search.ilp import SOLVER_NAME
from zorse_lightning.schedule.plan import Plan, SolverRecord


def plan_notes(search: Search, choice: Choice, refusals: dict[tuple, list[str]], best: Plan) -> list[str]:
    """The notes of ``best``, the plan the search chose (``refusals``: why each plain plan's interleavings gave
    nothing, by its structure)."""
    notes = list(search.notes)
    baseline = next((n.removeprefix("baseline: ") for n in best.notes if n.startswith("baseline: ")), None)
    if baseline:
        notes.append(f"a baseline's plan ({baseline}): no candidate of the search beat it")
    if any(s.gather_per_microbatch for s in best.stages):
        rounds = max(max(s.microbatches_per_rank) for s in best.stages)
        notes.append(f"every parameter sharded and gathered block by block for each microbatch ({rounds} "
                     f"round{'s' * (rounds != 1)} of gathers a step): the fastest plan that fits")
    return notes + [n for n in (
        choice.idle_note(search.gpu_type), _interleave_note(choice, refusals, best), _tensor_parallel_note(search, choice, best),
        _prediction_note(choice, best),
    ) if n]


def _interleave_note(choice: Choice, refusals: dict[tuple, list[str]], best: Plan) -> str | None:
    """What interleaving gained and what made it fit, or why the interleavings the search tried lost."""
    alike = lambda p: p.idle_ranks == best.idle_ranks  # noqa: E731
    plain = choice.best(lambda p: p.interleave == 1 and alike(p))
    woven = choice.best(lambda p: p.interleave > 1 and alike(p))
    if plain is None or (woven is None and not refusals.get(structure(plain))):
        return None
    plain_ms = plain.predicted.iteration_ms
    if best.interleave > 1:
        counts = [sum(best.stages[s].num_layers for s in best.stages_of_group(g)) for g in range(best.num_groups)]
        offloading = [g for g, s in enumerate(best.rank_groups) if s.offload_activations]
        fitted = f"; offloading activations on groups {offloading}" if offloading else ""
        return (
            f"interleaved x{best.interleave}: each group of ranks holds {best.interleave} layer chunks (layers "
            f"{counts}{fitted}); the engine's programs, simulated, {1 - best.predicted.iteration_ms / plain_ms:.1%} "
            f"faster than the fastest plan without ({best.predicted.iteration_ms:.1f} against {plain_ms:.1f} ms)"
        )
    tried = list(dict.fromkeys(refusals.get(structure(plain), [])))
    if woven is not None:
        how = "simulated" if woven.predicted.closed_form_ms is not None else "in the closed form"
        tried.insert(0, f"the fastest priced, x{woven.interleave}, {woven.predicted.iteration_ms:.1f} ms {how}")
    return f"not interleaved (each must beat {plain_ms:.1f} ms, the plan's time, by {INTERLEAVE_MARGIN:.1%}): {'; '.join(tried)}"


def _tensor_parallel_note(search: Search, choice: Choice, best: Plan) -> str | None:
    """Which stages split their blocks over TP groups and what that gained, or why no stage could."""
    split = lambda p: any(s.tensor_parallel > 1 for s in p.stages)  # noqa: E731
    if not split(best):
        support = search.ctx.profile.tensor_parallel
        if not support.degrees:
            return f"no tensor parallelism: {support.reason}"
        if not search.tensor_parallel_degrees:
            return None  # max_tp=1, or pinned layer counts
        fastest = choice.best(split)
        return f"not tensor parallel (each must beat {best.predicted.iteration_ms:.1f} ms by {INTERLEAVE_MARGIN:.1%}): " + (
            f"the fastest plan with TP the search priced, {fastest.predicted.iteration_ms:.1f} ms" if fastest
            else "no plan with TP could by its bound"
        )
    plain = choice.best(lambda p: not split(p))
    stages = [f"stage {i} x{s.tensor_parallel}" for i, s in enumerate(best.stages) if s.tensor_parallel > 1]
    against = "" if plain is None else (
        f", {1 - best.predicted.iteration_ms / plain.predicted.iteration_ms:.2%} faster than the fastest plan without "
        f"({best.predicted.iteration_ms:.1f} against {plain.predicted.iteration_ms:.1f} ms)"
    )
    return f"tensor parallel ({', '.join(stages)}): each block split over a TP group of GPUs of one type on one machine{against}"


def _prediction_note(choice: Choice, plan: Plan) -> str:
    """How the plan is predicted, and by how much the closed form the search screens with disagrees."""
    simulated = f"{choice.simulated} of {len(choice.pool)} plans the search priced were simulated ({choice.simulated_work:,} units of 2 V M R)"
    if choice.budget < 0:
        simulated += (f"; the budget of plays ran out: {choice.answer_plays} leading the pool in the closed form were played "
                      f"past it to settle the answer")
    if plan.predicted.closed_form_ms is None:
        return (f"predicted by the cost model's closed form: its stages gather parameters per microbatch, which the "
                f"simulation does not play; {simulated}")
    closed, ms = plan.predicted.closed_form_ms, plan.predicted.iteration_ms
    if not simulable(plan):
        return (f"predicted by the closed form ({closed:.1f} ms) times what the simulation of the same pipeline "
                f"without gathers says of its closed form: {ms:.1f} ms; {simulated}")
    return (
        f"predicted by the simulation of the engine's programs: {ms:.1f} ms; the closed form says {closed:.1f} ms "
        f"({closed / ms - 1:+.1%}); {simulated}"
    )


def refusal(degree: int, ms: float, base_ms: float, how: str = "") -> str:
    """Why an interleaving at ``degree`` gave nothing: its closed form ``ms`` (``how``: "at least ", where undrafted)
    against its plain plan's ``base_ms``."""
    crossing = ": its activations cross every chunk boundary" if ms > base_ms else ""
    return f"x{degree} {how}{ms:.1f} against {base_ms:.1f} ms in the closed form{crossing}"


def solver_record(best: Plan, solves: int, choice: Choice) -> SolverRecord:
    """The record of how the search found ``best``: by the integer program or the heuristic, with its counts."""
    found_by = best.solver.status if best.solver.name != HEURISTIC.name else "no program beat the heuristic split"
    summary = f"{found_by}; {solves} programs solved; {choice.simulated} of {len(choice.pool)} plans simulated"
    return SolverRecord(SOLVER_NAME, summary, best.solver.objective_ms)

"""The planner's entry point: one loop over the candidate space, in increasing order of a lower bound.

The candidates (:mod:`.space`) are every choice a plan makes before its split: stage groups and their
order, microbatch size, schedule, interleaving degree, gathering per microbatch, and the baselines the
planner prints (so no plan is slower than one by construction). One queue holds them by a lower bound on
any plan they can give (:mod:`.bound`), refined as the search learns (:meth:`_Loop._refined`). The loop takes
the next, drafts it in the closed form or splits and fits it (:mod:`.fit`), offers what fits to the choice
(:mod:`.choice`) and queues what that opens: the program's split, the interleavings, the gathered plan
where a remedy was needed, the other orders of the plan held, and each plan's simulation. It stops when the
next bound reaches the plan held, simulated; plans beyond its one budget (:data:`.space.WORK_PER_GPU`) keep
the closed form, but the one returned is played. GPipe is tried only when pinned: its time equals 1F1B's
and its memory is never smaller.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.planner import baselines
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.evaluate import plan_cost, prediction
from zorse_lightning.planner.cost.recorded_programs import programs_recorded
from zorse_lightning.planner.interleaving import degrees
from zorse_lightning import capabilities
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.planner.search.choice import INTERLEAVE_MARGIN, Choice, price, simulable, simulated, twin_key, work_of
from zorse_lightning.planner.search.diagnose import infeasible_error
from zorse_lightning.planner.search.fit import (
    gathered_draft, gathered_fit, heuristic_split, interleaved_best_case_ms, interleaved_draft, interleaved_fit, program_split, split_draft,
    tensor_parallel_best_case_ms,
)
from zorse_lightning.planner.search.program_log import ProgramLog, ProgramRun
from zorse_lightning.planner.search.same_ranks import SameRanks
from zorse_lightning.planner.search.notes import plan_notes, refusal, solver_record
from zorse_lightning.planner.search.space import (
    WORK_PER_GPU, Candidate, Kind, Search, first_candidates, follow_ups, held_program, other_orders, structure,
)
from zorse_lightning.profiling.profile import ModelProfile
from zorse_lightning.schedule.plan import Plan


def make_plan(
    inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions = PlannerOptions(),
    programs: ProgramLog | None = None,
) -> Plan:
    """The fastest plan the search finds; raises :class:`PlanningError` when none fits.

    ``programs``, when given, receives a :class:`ProgramRun` per layout's integer program."""
    with _collector_paused():
        started = time.perf_counter()
        search = Search.build(inventory, profile, global_batch_size, options, _planner(profile, global_batch_size, options))
        loop = _Loop(search, programs)
        loop.run()
        return loop.result(started)


def all_baselines(
    inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions = PlannerOptions(),
    names: tuple[str, ...] | None = None,
) -> dict[str, Plan | None]:
    """The baselines of ``names`` (every one by default, in the order reports print them), each predicted
    as the plan is; the fastest type alone is planned by :func:`make_plan` on its sub-cluster."""
    ctx = CostContext.build(inventory, profile, options.memory_reserve_gib, options.p2p_rules)
    built = baselines.builders(ctx, global_batch_size, options, _planner(profile, global_batch_size, options))
    plans = {name: build() for name, (_, build) in built.items() if names is None or name in names}
    return {name: plan and (plan if name == "fastest_type_alone" else price(ctx, plan)) for name, plan in plans.items()}


def _planner(profile: ModelProfile, global_batch_size: int, options: PlannerOptions):
    """:func:`make_plan` of another cluster with these options, pins of ranks and layers left out."""
    return lambda cluster: make_plan(cluster, profile, global_batch_size, replace(options, stage_layout=None, layer_counts=None))


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off while the search runs (as it was after). The search allocates millions
    of small records (plans, actions, events) that reference counting frees, and the collector walked every
    live one again and again: 10 % of planning at 32 GPUs, 11 % at 1024 (CPU time, this 2-core machine)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Loop:
    """One planning call's queue, choice and counts."""

    def __init__(self, search: Search, programs: ProgramLog | None) -> None:
        self.search, self.programs = search, programs
        self.choice = Choice(search.ctx, budget=WORK_PER_GPU * search.ctx.inventory.world_size)
        self.queue: list[tuple[float, int, Candidate]] = []
        self.seen: set = set()
        self.order = itertools.count()
        self.solves = 0
        self.bases: dict[tuple, object] = {}
        self.drafts: dict[tuple, Plan | None] = {}
        """Heuristic splits in the closed form, by layout, microbatch size and TP degrees (:meth:`_split_draft`)."""
        self.twins: set[tuple] = set()
        """Drafts fitted and plans followed, by kind and :func:`.choice.twin_key` (:meth:`_twin_seen`)."""
        self.floors = dict(self.choice.floors)
        """The floors the queue's keys were scaled by (where one of the choice's falls, every key is refreshed)."""
        self.parked: list[Candidate] = []
        """Candidates past the plan held: queued again where the floor falls."""
        self.ordered: set[tuple] = set()
        """The plans held whose other orders are queued, by structure."""
        self.programmed: set[tuple] = set()
        """The layouts and sizes an integer program was solved (or queued at the stop) for."""
        self.held_programs: set[tuple] = set()
        """The layouts and sizes of plans held whose programs run past ``max_programs`` (:meth:`_program_held`)."""
        self.waiting: list[Candidate] = []
        """Integer programs past ``max_programs`` while no plan fitted (:meth:`run`)."""
        self.unlimited = False
        self.refusals: dict[tuple, list[str]] = {}
        """Why each plain plan's interleavings gave nothing, by its structure."""
        candidates = list(first_candidates(search, [] if search.pinned else self._baselines()))
        self.same_ranks = SameRanks(candidates)
        for candidate in candidates:
            self._push(candidate)

    def _baselines(self):
        """The baselines as candidates, with the ranks each may use: the fastest type alone put back on the
        cluster's ranks, where the plan may leave GPUs idle and the cluster has several types; the
        proportional heuristic where pipelines are allowed."""
        search, ctx = self.search, self.search.ctx
        for name, (ranks, build) in baselines.builders(ctx, search.global_batch_size, search.options, search.plan_cluster).items():
            if name == "fastest_type_alone":
                if search.options.allow_idle_ranks and len(ctx.inventory.gpu_types) > 1:
                    yield ranks, lambda build=build, ranks=ranks: baselines.onto_cluster(ctx, build(), ranks), True
            elif name != "proportional_heuristic" or search.options.allow_pipeline:
                yield ranks, build, False

    def _push(self, candidate: Candidate) -> None:
        key = candidate.key
        if key is None or key not in self.seen:
            self.seen.add(key)
            heapq.heappush(self.queue, (candidate.bound_ms, next(self.order), candidate))
            self.same_ranks.queued(candidate)

    def run(self) -> None:
        """Take candidates until the next is past the plan held. Integer programs beyond ``max_programs`` wait
        (:attr:`waiting`) until nothing else is left and no plan fits: only then do they run, all of them
        (a program that finds no split costs its whole solve, and a model that fits nowhere on a large
        cluster met hundreds of them before the remedies of the other candidates found a plan)."""
        self._drain()
        if self.choice.chosen is None and self.waiting:
            self.unlimited = True
            for candidate in self.waiting:
                heapq.heappush(self.queue, (candidate.bound_ms, next(self.order), candidate))
            self._drain()

    def _drain(self) -> None:
        world = self.search.ctx.inventory.world_size
        while self.queue or self._program_held():  # the plan held's program, once every candidate is taken
            if self.choice.floors != self.floors:  # keys scaled by a floor that fell are too high: every key again
                self.floors = dict(self.choice.floors)
                self.queue = [(self._refined(c, False), order, c) for _, order, c in self.queue] + [
                    (self._refined(c, False), next(self.order), c) for c in self.parked]
                self.parked = []
                heapq.heapify(self.queue)
            bound, _, candidate = heapq.heappop(self.queue)
            if self.choice.past(bound):
                self.parked.append(candidate)
                if not self._ordered_held() and self.choice.floors == self.floors and not self._program_held():
                    return  # every candidate left is bounded as high, none with a smaller margin than 1
                continue
            refined = self._refined(candidate)
            if refined > bound:  # what the search learnt since it was queued bounds it tighter: queued again
                heapq.heappush(self.queue, (refined, next(self.order), candidate))
            elif self.choice.past(bound, candidate.handicap(world)):
                self.parked.append(candidate)
            else:
                self.same_ranks.taken(candidate)
                plans = self._plans(candidate)
                for plan in plans or ():
                    self._offered(candidate, plan)
                if plans is not None and candidate.kind in (Kind.SPLIT, Kind.PROGRAM):
                    self._follow(candidate, plans)
            self._ordered_held()

    def _ordered_held(self) -> bool:
        """Queue the other orders of the plan held once it is simulated (it may be only when the queue reaches
        it: :meth:`.choice.Choice.past`), and of the fastest simulated plan on a planned baseline's ranks (the
        baseline's own search would hold it there: :mod:`.same_ranks`); whether any were queued."""
        queued = len(self.queue)
        for held in (self.choice.chosen, *self.same_ranks.fastest(self.choice)):
            if held is None or not simulated(held) or structure(held) in self.ordered:
                continue
            self.ordered.add(structure(held))
            for order in other_orders(self.search, held):
                self._push(order)
        return len(self.queue) > queued

    def _program_held(self) -> bool:
        """At the stop, queue the plan held's layout's integer program where none was solved
        (:func:`.space.held_program`): it may refine the answer; whether it was queued."""
        program = self.choice.chosen and held_program(self.search, self.choice.chosen)
        if program is None or (program.layout, program.microbatch_size) in self.programmed:
            return False
        self.programmed.add((program.layout, program.microbatch_size))
        self.held_programs.add((program.layout, program.microbatch_size))
        self._push(program)
        return True

    def _refined(self, c: Candidate, drafting: bool = True) -> float:
        """``c``'s key with what the search knows now: no simulation came below its closed form times the lowest
        ratio of the two seen (:meth:`.choice.Choice.floor`), so a draft is queued by that (a gathered one by its
        closed form), an interleaving by the least it could be (:meth:`_best_case_ms`), a split by the least of it
        and its interleavings, a TP variant by its layout's draft without TP (none made where ``drafting`` is False)."""
        if c.kind is Kind.SIMULATED:
            return self.choice.simulation_bound_ms(c.plan)
        if c.planned:  # after the search's own candidates of its ranks at the same key
            learnt_ms = self.same_ranks.least_ms(c.layout[0], lambda q: self._refined(q, False), self.choice)
            return max(c.bound_ms, math.nextafter(learnt_ms, math.inf))
        if c.draft is None and not c.tensor_parallel and c.kind is not Kind.INTERLEAVED:
            return c.bound_ms  # nothing learnt bounds it before its draft (most of the queue, every time a floor falls)
        floor = self.choice.floor(c.kind is Kind.INTERLEAVED or None)
        if c.estimate_ms is not None:
            return max(c.bound_ms, c.estimate_ms * (1.0 if c.kind is Kind.GATHERED else floor))
        if c.kind is Kind.SPLIT and c.tensor_parallel:  # by the draft without TP, its fill shortened by the degree
            key = (c.plain_layout, c.microbatch_size, ())
            if not drafting and key not in self.drafts:
                return c.bound_ms
            plain = self._split_draft(*key)
            return max(c.bound_ms, tensor_parallel_best_case_ms(self._base(plain), max(c.tensor_parallel)) * floor) if plain else c.bound_ms
        if c.kind is Kind.INTERLEAVED:
            return max(c.bound_ms, self._best_case_ms(c.plan, c.interleave) * floor)
        return c.bound_ms

    def _estimate_ms(self, kind: Kind, draft: Plan) -> float:
        """:attr:`.space.Candidate.estimate_ms` of a candidate of ``kind`` drafted as ``draft``."""
        if kind is not Kind.SPLIT or not capabilities.SUPPORTS_INTERLEAVING:
            return draft.predicted.iteration_ms
        return min([draft.predicted.iteration_ms] + [self._best_case_ms(draft, v) for v in degrees(draft, self.search.options.max_interleave)[1:]])

    def _best_case_ms(self, plain: Plan, degree: int) -> float:
        """The least closed form interleaving ``plain`` at ``degree`` could give (:func:`.fit.interleaved_best_case_ms`)."""
        return interleaved_best_case_ms(self.search.ctx, plain, self._base(plain), degree)

    def _plans(self, c: Candidate) -> list[Plan] | None:
        """The plans ``c`` gives, made to fit; None where it was only drafted and queued again, or where only
        what it opens was queued (:meth:`_plain_past`)."""
        search, choice = self.search, self.choice
        if c.kind in (Kind.SPLIT, Kind.GATHERED, Kind.INTERLEAVED) and c.draft is None:
            draft = self._draft(c)
            if draft is not None:  # queued again, keyed by what the draft says (:meth:`_refined`)
                self._push(replace(c, draft=draft, estimate_ms=self._estimate_ms(c.kind, draft)))
                return None
            if c.kind is not Kind.SPLIT:
                return []
        if c.kind is Kind.SPLIT:  # a split with no balanced draft is fitted at once (layers capped by memory)
            if c.draft is not None and self._twin_seen(c.draft, c.kind):
                return []
            if c.draft is not None and self._plain_past(c):
                self._follow(c, [c.draft])  # only what it opens may win (:meth:`_refined`): the split itself is not fitted
                return None
            return heuristic_split(search, c.layout, c.microbatch_size, c.tensor_parallel, c.draft)
        if c.kind is Kind.GATHERED:
            return gathered_fit(search, c.draft)
        if c.kind is Kind.INTERLEAVED:
            return [] if self._twin_seen(c.draft, c.kind) else self._interleaved(c)
        if c.kind is Kind.PROGRAM:
            if self.solves >= search.options.max_programs and not self.unlimited and (c.layout, c.microbatch_size) not in self.held_programs:
                if choice.chosen is None:
                    self.waiting.append(c)
                return []
            plan, solved = program_split(search, c.layout, c.microbatch_size, c.plan)
            self.solves += solved
            self.programmed.add((c.layout, c.microbatch_size))
            if self.programs is not None:
                self.programs.add(ProgramRun(
                    len(c.layout), c.microbatch_size, bool(plan and plan.stages[0].recompute),
                    c.plan and c.plan.predicted.iteration_ms, c.plan is not None, plan and plan.predicted.iteration_ms,
                    choice.chosen and choice.chosen.predicted.iteration_ms, solved,
                ))
            return [plan] if plan else []
        if c.kind is Kind.BASELINE:
            plan = c.baseline()
            return [plan] if plan else []
        choice.simulate(c.plan)
        return []

    def _plain_past(self, c: Candidate) -> bool:
        """Whether split ``c``'s plain plan cannot change the choice (its draft times the plain floor, against the
        plan held, simulated; not before: :meth:`.choice.Choice.past`). A split is queued by the best its
        interleavings could do (:meth:`_refined`), so most could win only interleaved: those are not fitted (mix32
        Llama 7B, global batch 128: 77 fits instead of 169), their interleavings start from the draft."""
        if self.choice.chosen is None or not simulated(self.choice.chosen):
            return False
        return c.draft.predicted.iteration_ms * self.choice.floor(False) >= self.choice.threshold_ms(c.handicap(self.search.ctx.inventory.world_size))

    def _draft(self, c: Candidate) -> Plan | None:
        """``c``'s plan before it is made to fit, priced in the closed form."""
        if c.kind is Kind.SPLIT:
            return self._split_draft(c.layout, c.microbatch_size, c.tensor_parallel)
        if c.kind is Kind.GATHERED:
            return gathered_draft(self.search, c.layout, c.microbatch_size)
        draft = interleaved_draft(self.search, c.plan, c.interleave, [s.busy_ms for s in self._base(c.plan).stages])
        self._refused(c, draft.predicted.iteration_ms)
        return draft

    def _refused(self, c: Candidate, ms: float, how: str = "") -> None:
        """Note why interleaving ``c``'s plain plan gave nothing (:func:`.notes.plan_notes`)."""
        self.refusals.setdefault(structure(c.plan), []).append(refusal(c.interleave, ms, self._base(c.plan).iteration_ms, how))

    def _split_draft(self, layout, m: int, degrees: tuple[int, ...]) -> Plan | None:
        """The heuristic split of ``layout`` at size ``m`` (TP ``degrees``) in the closed form, made once: a
        layout's TP variants are keyed by its draft without TP."""
        key = (layout, m, degrees)
        if key not in self.drafts:
            plan = split_draft(self.search, layout, m, degrees)
            self.drafts[key] = plan and plan.with_prediction(prediction(self.search.ctx, plan, self._base(plan)))
        return self.drafts[key]

    def _interleaved(self, c: Candidate) -> list[Plan]:
        """An interleaved draft made to fit: the moves of its remedies only while its closed form, times the
        floor of the simulation, could still change the choice; its memory is paid from the budget where
        pricing it records programs (a shape not recorded yet: layers moved or offloaded record none)."""
        def past(plan: Plan) -> bool:
            work = 0 if programs_recorded(self.search.ctx, plan) else work_of(plan)
            estimate_ms = plan.predicted.iteration_ms * self.choice.floor(True)
            if work > self.choice.budget or self.choice.past(estimate_ms, 1 - INTERLEAVE_MARGIN):
                return True
            self.choice.budget -= work
            return False

        if past(c.draft):
            return []
        busy = [stage.busy_ms for stage in self._base(c.plan).stages]  # layers moved go where they cost least
        plans = interleaved_fit(self.search, c.draft, busy, past, self.refusals.setdefault(structure(c.plan), []))
        if not plans:  # played all the same where it is the first of its kind (:meth:`.choice.Choice.learn`)
            self.choice.learn(c.draft)
        return plans

    def _twin_seen(self, plan: Plan, kind: Kind | None) -> bool:
        """Whether a draft of candidates of ``kind`` alike to ``plan`` but for which GPUs and machines of a kind it
        holds (:func:`.choice.twin_key`) was fitted already, or (``kind`` None) such a fitted plan followed (other
        orders of a plan on alike machines): its fits and what it opens are that plan's, on other GPUs (at 128
        synthetic GPUs, 95 of 112 interleavings fitted were such twins: 3.5 of 17.7 s). Remembers ``plan``."""
        key = kind, twin_key(plan)
        seen = key in self.twins
        self.twins.add(key)
        return seen

    def _base(self, plan: Plan):
        """``plan``'s closed form without memory, priced once per structure (a split's draft and its fitted
        plan share their pipeline; only what follows the last backward may differ)."""
        key = structure(plan)
        if key not in self.bases:
            self.bases[key] = plan_cost(self.search.ctx, plan, memory=False)
        return self.bases[key]

    def _offered(self, candidate: Candidate, plan: Plan) -> None:
        self.choice.offer(plan)
        if candidate.kind is Kind.BASELINE:  # simulated at once: no plan slower than a baseline in its prediction
            self.choice.simulate(plan)
        elif simulable(plan):
            self._push(Candidate(max(candidate.bound_ms, self.choice.simulation_bound_ms(plan)), Kind.SIMULATED, plan=plan))

    def _follow(self, candidate: Candidate, plans: list[Plan]) -> None:
        """Queue what a split's plans open (:func:`.space.follow_ups`): the one without offload (None: only
        offload fits, or nothing). A pipeline gathered per microbatch is tried only where that is None: its
        prediction is the closed form, which misses what a slow link between stages costs the pipeline (the
        simulation does not play the gathers)."""
        main = plans[-1] if plans and not any(s.offload_activations for s in plans[-1].stages) else None
        if main is not None and self._twin_seen(main, None):  # what it opens, its twin opened
            return
        if main is None and candidate.kind is Kind.SPLIT and not candidate.tensor_parallel:  # the program may find a split that fits
            self._push(replace(candidate, kind=Kind.PROGRAM))
        for follow_up in follow_ups(self.search, candidate, main, self.solves < self.search.options.max_programs):
            self._push(follow_up)

    def result(self, started: float) -> Plan:
        search, choice = self.search, self.choice
        choice.settle(final=True)
        best = choice.chosen
        if best is None:
            raise infeasible_error(search.ctx, list(search.layouts), list(search.sizes), search.schedule, search.global_batch_size, search.options)
        record = solver_record(best, self.solves, choice)
        for c in [*self.parked, *(q for _, _, q in self.queue)]:
            if c.kind is Kind.INTERLEAVED and c.draft is None:  # not drafted: its estimate was past the plan held
                self._refused(c, self._best_case_ms(c.plan, c.interleave), "at least ")
        notes = plan_notes(search, choice, self.refusals, best)
        return replace(best, planner_seconds=time.perf_counter() - started, solver=record, notes=tuple(notes))


__all__ = ["ProgramLog", "ProgramRun", "all_baselines", "make_plan"]

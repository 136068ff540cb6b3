"""Which plan the search keeps: the fastest in the simulation of the engine's programs, except that
leaving GPUs idle must win by a margin.

The search prices its candidates in the cost model's closed form (cheap: no programs), but the plan it
returns is predicted by the event simulation of the engine's own programs (:mod:`.cost.simulate`, what
runs), and the two disagree: by 0.55x to 3.9x on the candidates of the shipped clusters (a slow link
between stages is where they part most). So a plan is compared with the others by its simulation
wherever it could be chosen: :meth:`Choice.settle` simulates the plan the choice holds until the one it
holds is simulated (a plan ranked ahead of it by the closed form gets simulated in turn, so pruning by
:meth:`Choice.threshold_ms` is against a simulated time), and :meth:`Choice.finalists` simulates the
other plans whose closed form comes within :data:`CLOSED_FORM_SPREAD` of it, while
:data:`FINALIST_WORK` allows. Simulating costs about ``2 V M R`` units of work (the actions of every
program times the ranks each step of the recording looks at: about 8 us a unit on this 2-core machine,
10 to 30 ms a candidate at 32 GPUs and 64 microbatches), so a plan too large to simulate within planning time
(:data:`.interleave_choice.MOST_RECORDING_WORK`), and one whose stage gathers parameters per microbatch
(the simulation does not play those gathers; the closed form prices them in lockstep), keeps its closed
form: :func:`price` is the one pricing of every plan and baseline. Beyond :data:`SEARCH_WORK` in all, the
search ranks the plans it holds by their closed form (the final plan still simulated): at 512 GPUs each
new leading plan costs up to ``2^20`` units and the lead changes many times.

A plan that leaves GPUs idle wastes hardware the user has, and no prediction of it is more exact than
of the plan using every GPU (fidelity benches: within a few per cent), so a tie is no reason to leave
GPUs out: the idle plan is kept only when it is :data:`IDLE_MARGIN` faster than the fastest plan using
every GPU, and its note says by how much.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.simulate import with_simulated_prediction
from zorse_lightning.schedule.plan import Plan

IDLE_MARGIN = 0.02
"""How much faster (a fraction of the iteration time) a plan leaving GPUs idle must be than the fastest plan
using every GPU to be chosen."""
INTERLEAVE_MARGIN = 0.005
"""How much faster, in the simulation of the engine's programs, an interleaved plan must be than the plan
the search chose without interleaving (:mod:`.interleave_choice`). The simulation prices both, and with
them what interleaving adds (V times the messages, the chunk order the engine runs), and the interleaved
plan's memory is priced from its own programs, so the margin only breaks near-ties towards the plainer
plan (fewer messages, the engine's older schedule). It was 2 %, asked of the closed form as well, when
the closed form screened the gain: that kept out a structure the simulation puts 0.9 % ahead (four
one-machine groups interleaved x3 on a cluster of four types, ``tests/planner/test_planner_ranking.py``),
which a peer planner finds."""
MOST_SIMULATED_WORK = 2**21
"""Largest ``2 V M R`` of a plan the search simulates (the limit of
:data:`.interleave_choice.MOST_RECORDING_WORK`: about 8 s of recording at 1024 GPUs); larger plans keep
the closed form and their note says so."""
SEARCH_WORK = 2**23
"""Work :meth:`Choice.settle` may spend in all: beyond it the plans held keep their closed form. A bound on
the worst case, not a setting of the search: the cases measured spend less (``bench/plan_quality.py``, every
shipped cluster, at most 184,320; ``bench/plan_scaling.py`` 450,000 at 128 GPUs, 2.2 M at 512 (planning 27 s
here), 6.0 M at 1024 (33 s: ``2 V M R`` overcounts deep pipelines, whose ranks each play a share)). Tighter
budgets rank more plans by a closed form that disagrees by up to 28 % there and lose plans: at ``2^19``
the 512-GPU plan came out 33 % slower in its simulation, at ``2^22`` the 1024-GPU one 7 %."""
FINALIST_WORK = 2**14
"""Work (``2 V M R`` summed) :meth:`Choice.finalists` may spend simulating plans beyond those
:meth:`Choice.settle` had to: 40 candidates of 32 GPUs at 64 microbatches, about 0.15 s here (8 us a unit)
beside each simulation's own cost (its plan's closed form, about 5 ms: 8 GPUs simulate about 100 plans)."""
CLOSED_FORM_SPREAD = 2.0
"""Finalists are the plans whose closed form is within this factor of the chosen plan's simulated time:
the simulation came to 0.55x the closed form at its lowest over the candidates of every shipped cluster
and reference model (``tests/planner/test_planner_ranking.py`` checks the plans it keeps)."""


def work_of(plan: Plan) -> int:
    """``2 V M R``: what simulating ``plan`` costs, in units of about 16 us here."""
    return 2 * plan.interleave * plan.num_microbatches * sum(len(group.ranks) for group in plan.rank_groups)


def simulable(plan: Plan) -> bool:
    """Whether the simulation models ``plan`` (no per-microbatch gathers) within planning time."""
    return not any(s.gather_per_microbatch for s in plan.stages) and work_of(plan) <= MOST_SIMULATED_WORK


def price(ctx: CostContext, plan: Plan) -> Plan:
    """``plan`` predicted as every plan the planner reports is: by the simulation of the engine's programs
    where :func:`simulable`, else by the closed form it carries (``predicted.closed_form_ms`` None)."""
    return with_simulated_prediction(ctx, plan) if simulable(plan) else plan


def is_priced(plan: Plan) -> bool:
    """Whether ``plan``'s prediction is final (:func:`price` would not change it)."""
    return plan.predicted.closed_form_ms is not None or not simulable(plan)


def _ms(plan: Plan) -> float:
    return plan.predicted.iteration_ms


def _structure(plan: Plan) -> tuple:
    return plan.microbatch_size, tuple((s.ranks, s.layers) for s in plan.stages)


@dataclass
class Choice:
    """The search's plans so far, the fastest overall and the fastest using every GPU among them."""

    ctx: CostContext | None
    """None: plans offered are compared as priced (tests of the margin), never simulated."""
    pool: list[Plan] = field(default_factory=list)
    """Every fitting plan offered, in its latest prediction (closed form, or simulated)."""
    fastest: Plan | None = None
    every_gpu: Plan | None = None
    simulated: int = 0
    """Plans simulated so far, and their work (``2 V M R`` summed)."""
    simulated_work: int = 0

    def offer(self, plan: Plan | None) -> None:
        if plan is None:
            return
        self.pool.append(plan)
        self._consider(plan)

    def _consider(self, plan: Plan) -> None:
        if self.fastest is None or _ms(plan) < _ms(self.fastest):
            self.fastest = plan
        if not plan.idle_ranks and (self.every_gpu is None or _ms(plan) < _ms(self.every_gpu)):
            self.every_gpu = plan

    def _simulate(self, index: int) -> None:
        plan = self.pool[index]
        self.pool[index] = price(self.ctx, plan)
        self.simulated += 1
        self.simulated_work += work_of(plan)
        self.fastest = self.every_gpu = None
        for kept in self.pool:
            self._consider(kept)

    def settle(self) -> None:
        """Simulate the plans held (:attr:`chosen` and the fastest using every GPU) until both are
        simulated: a plan that the closed form ranks ahead of one already simulated is simulated in turn
        (within :data:`SEARCH_WORK` in all)."""
        while True:
            unsettled = [
                p for p in (self.chosen, self.every_gpu)
                if p is not None and not is_priced(p) and self.simulated_work + work_of(p) <= SEARCH_WORK
            ]
            if not unsettled:
                return
            self._simulate(next(i for i, p in enumerate(self.pool) if p is unsettled[0]))

    def finalists(self) -> None:
        """Simulate, closed form first, the other plans within :data:`CLOSED_FORM_SPREAD` of the chosen
        one while :data:`FINALIST_WORK` allows; then :meth:`settle`."""
        self.settle()
        if self.chosen is None:
            return
        limit = _ms(self.chosen) / (1 - IDLE_MARGIN) * CLOSED_FORM_SPREAD
        waiting = sorted((_ms(p), i) for i, p in enumerate(self.pool) if not is_priced(p) and _ms(p) <= limit)
        budget = FINALIST_WORK
        for _, index in waiting:
            work = work_of(self.pool[index])
            if work > budget:
                continue
            budget -= work
            self._simulate(index)
        self.settle()

    def runners_up(self, count: int, key: Callable[[Plan], float] = _ms, reach: float = 0.0) -> list[Plan]:
        """Up to ``count`` plans after :attr:`chosen`, least ``key`` first (their time unless given), each
        of its own structure (stage groups, layers, microbatch size) and idling the same ranks as the chosen
        one: the finalists whose interleaving :mod:`.interleave_choice` tries beside the chosen plan's (one
        idling other ranks would have to be weighed against :data:`IDLE_MARGIN` again). Simulated plans, and
        where ``reach`` is given, plans not simulated whose closed form is within that factor of the chosen
        plan's time and whose simulation is cheap (at most :data:`FINALIST_WORK`): the simulations of
        :meth:`finalists` go to the fastest plain plans, which are not always those interleaving speeds most."""
        chosen = self.chosen
        if chosen is None:
            return []
        seen, kept = {_structure(chosen)}, []
        candidates = [
            p for p in self.pool if p.idle_ranks == chosen.idle_ranks and (
                p.predicted.closed_form_ms is not None
                or (_ms(p) <= _ms(chosen) * reach and simulable(p) and work_of(p) <= FINALIST_WORK)
            )
        ]
        for plan in sorted(candidates, key=key):
            if len(kept) == count:
                break
            if _structure(plan) in seen:
                continue
            seen.add(_structure(plan))
            kept.append(plan)
        return kept

    @property
    def chosen(self) -> Plan | None:
        fastest, every = self.fastest, self.every_gpu
        if fastest is not None and fastest.idle_ranks and every is not None and _ms(fastest) > _ms(every) * (1 - IDLE_MARGIN):
            return every
        return fastest

    def threshold_ms(self, uses_every_gpu: bool) -> float:
        """A candidate whose iteration time cannot go below this cannot change :attr:`chosen`."""
        chosen = self.chosen
        if chosen is None:
            return math.inf
        if uses_every_gpu:
            return _ms(chosen) / (1 - IDLE_MARGIN) if chosen.idle_ranks else _ms(chosen)
        if self.every_gpu is not None:
            return min(_ms(chosen), _ms(self.every_gpu) * (1 - IDLE_MARGIN))
        return _ms(chosen)

    def idle_note(self, gpu_type_of) -> str | None:
        """Why the chosen plan leaves GPUs idle (None when it uses every GPU)."""
        chosen = self.chosen
        if chosen is None or not chosen.idle_ranks:
            return None
        types = ", ".join(sorted({gpu_type_of(r) for r in chosen.idle_ranks}))
        head = f"ranks {list(chosen.idle_ranks)} ({types}) stay idle: they would slow the others down"
        if self.every_gpu is None:
            return f"{head} (no plan using every GPU fits or comes within {IDLE_MARGIN:.0%} of this one)"
        gain = 1 - _ms(chosen) / _ms(self.every_gpu)
        return (
            f"{head}: this plan is {gain:.1%} faster than the fastest using every GPU ({_ms(chosen):.1f} against "
            f"{_ms(self.every_gpu):.1f} ms without interleaving; idle GPUs must win by {IDLE_MARGIN:.0%})"
        )

"""Which plan the search keeps, and how each plan it holds is predicted.

Every plan is first priced in the cost model's closed form (no programs), but the plan returned is predicted
by the event simulation of the engine's own programs (:mod:`..cost.simulate`), and the two disagree (0.55x to
3.9x on the shipped clusters, a slow link between stages most). So the plan held is simulated before it
prunes anything (:meth:`Choice.settle`), and the loop simulates the others whose closed form, times the
lowest ratio of simulation to closed form seen (:meth:`Choice.floor`), could still win. A plan beyond the
search's one budget of work keeps its closed form while the search runs, but the plan returned is played
(:meth:`Choice._answer`); only a plan whose stages gather parameters per microbatch (which the simulation
does not play) is returned in its closed form: :func:`price` is the one pricing of every plan and baseline.

Two margins break near-ties towards the plainer plan, as handicaps on its time (:func:`handicap`): a plan
leaving GPUs idle wastes hardware the user has, and an interleaved plan sends V times the messages.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace

from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.simulate import with_simulated_prediction
from zorse_lightning.schedule.plan import Plan

IDLE_MARGIN = 0.02
"""How much faster (a fraction of the iteration time) a plan leaving GPUs idle must be than the fastest plan
using every GPU to be chosen."""
INTERLEAVE_MARGIN = 0.005
"""How much faster, in the simulation of the engine's programs, an interleaved plan must be than the fastest
plan without interleaving (and a plan with tensor parallelism than the fastest without). The simulation
prices what interleaving adds (V times the messages, the chunk order the engine runs) and the interleaved
plan's memory is priced from its own programs, so the margin only breaks near-ties towards the plainer plan.
At 2 % it kept out a structure the simulation puts 0.9 % ahead (four one-machine groups interleaved x3 on a
cluster of four types, ``tests/planner/test_planner_ranking.py``), which a peer planner finds."""
CLOSED_FORM_SPREAD = 2.0
"""The simulation of a plan never came below ``1 / CLOSED_FORM_SPREAD`` of its closed form (0.55x at its
lowest, over the candidates of every shipped cluster and reference model;
``tests/planner/test_planner_ranking.py`` checks the plans it keeps): the closed form is no bound of the
simulation, so this measured floor stands in for one when the search decides which plans to simulate."""
FLOOR_CEILING = 0.985
"""The highest a kind's floor goes once plans of it were simulated: how far below its closed form a plan not
yet simulated may come. The plays that set the floor are of the plans the closed form ranks first, which are
the likeliest to be priced low there, so they come above their closed form more often than other plans do;
with a ceiling of 1 the floor stayed there, and candidates within 1-2 % of the plan held that play below their
closed form were never played: the peers' structures on a10g_l4_t4 (Llama 3B, 0.985 of its closed form) and
a100x4_v100x4 (GPT 1.3B, 0.995), lab4's Llama tiny x3 at 8 samples per GPU (0.976). It cannot go: it is the
closed form's measured spread below the play. Of the 177 plans twenty reference searches played, 5 came
lower (plain down to 0.963, interleaved to 0.982); at this ceiling the mix32 Llama 7B search plays 15 plans
where it played 12."""
PLAY_OVERHEAD = 2**12
"""What any simulation or recording costs beyond its ``2 V M R`` (building the programs, the events, the
prediction), in the same units: an 8-GPU plan of 384 units took 40-60 ms to simulate here, a 1024-GPU plan of
2^20 units about 8 s (8 us a unit), so a fixed 30 ms or so."""


def work_of(plan: Plan) -> int:
    """What simulating ``plan`` (or recording its programs) costs, in units of about 8 us here: ``2 V M R``
    (its actions times the ranks each step of the play looks at) and the fixed :data:`PLAY_OVERHEAD`."""
    return 2 * plan.interleave * plan.num_microbatches * sum(len(group.ranks) for group in plan.rank_groups) + PLAY_OVERHEAD


def simulated(plan: Plan) -> bool:
    """Whether ``plan``'s prediction is the simulation's."""
    return plan.predicted.closed_form_ms is not None


def simulable(plan: Plan) -> bool:
    """Whether the simulation models ``plan``: it does not play per-microbatch gathers."""
    return not any(s.gather_per_microbatch for s in plan.stages)


def price(ctx: CostContext, plan: Plan) -> Plan:
    """``plan`` predicted as every plan the planner reports is: by the simulation of the engine's programs
    where :func:`simulable`, else by the closed form it carries (``predicted.closed_form_ms`` None)."""
    return with_simulated_prediction(ctx, plan) if simulable(plan) else plan


def margin(idle: bool, interleaved: bool, split: bool = False) -> float:
    """The factor a plan's time is divided by when plans are compared: the margins it must win by (``split``:
    some stage tensor parallel, held to the interleaving margin: both add messages per microbatch that a
    plainer plan does not send)."""
    return (1 - IDLE_MARGIN) ** idle * (1 - INTERLEAVE_MARGIN) ** (interleaved + split)


def handicap(plan: Plan) -> float:
    """:func:`margin` of ``plan``."""
    return margin(bool(plan.idle_ranks), plan.interleave > 1, any(s.tensor_parallel > 1 for s in plan.stages))


def twin_key(plan: Plan) -> tuple:
    """What a plan's simulation depends on but which GPUs and machines its stages hold, and its closed form to
    the last bit (which prices every link it crosses): plans alike in both are taken as one pipeline."""
    stages = tuple(
        (s.gpu_types, tuple(s.machines.index(m) for m in s.machines), s.layers, s.microbatches_per_rank, s.sharding,
         s.shard_fractions, s.recompute, s.offload_activations, s.tensor_parallel)
        for s in plan.stages
    )
    return plan.schedule, plan.interleave, plan.microbatch_size, stages, _ms(plan)


def _ms(plan: Plan) -> float:
    return plan.predicted.iteration_ms


def _rank_ms(plan: Plan) -> float:
    return _ms(plan) / handicap(plan)


@dataclass
class Choice:
    """The search's plans so far, and the one it would return now."""

    ctx: CostContext | None
    """None: plans offered are compared as priced (tests of the margins), never simulated."""
    budget: float = math.inf
    """Work (``2 V M R``) the simulations may still spend: beyond it plans keep their closed form."""
    pool: list[Plan] = field(default_factory=list)
    """Every fitting plan offered, in its latest prediction (closed form, or simulated)."""
    chosen: Plan | None = None
    simulated: int = 0
    """Plans simulated so far, and their work (``2 V M R`` summed)."""
    simulated_work: int = 0
    floors: dict[bool, float] = field(default_factory=dict)
    """For plain plans (False) and interleaved ones (True): the lowest ratio of a plan's simulation to its
    closed form seen so far, at most :data:`FLOOR_CEILING` and never below ``1 / CLOSED_FORM_SPREAD``: how
    far below its closed form a plan of that kind not simulated may yet come (the two kinds part: interleaved
    plans came 2-4 % closer to their closed form than plain ones on the same clusters)."""
    answer_plays: int = 0
    """Plans played to settle the answer (:meth:`_answer`), past the budget where it ran out."""
    simulated_since: dict[int, Plan] = field(default_factory=dict)
    """Every plan offered that has been simulated since, by ``id`` (held, so that no id is reused)."""
    twins: dict[tuple, Plan] = field(default_factory=dict)
    """Each plan simulated, by :func:`twin_key`: a plan of the same key is the same pipeline on GPUs and links
    alike (groups of one type in another order, or on other machines of the same kind), whose simulation it
    takes instead of playing its own (other orders of a plan on a cluster of alike machines gave three of each
    at 512 GPUs, 0.7 s a play). The plan chosen is played itself (:meth:`settle`)."""
    proxies: set[int] = field(default_factory=set)
    """``id`` of each plan of the pool predicted by its twin's simulation."""

    def offer(self, plan: Plan) -> None:
        """Keep ``plan``, a plan that fits."""
        self.pool.append(plan)
        if self.chosen is None or _rank_ms(plan) < _rank_ms(self.chosen):
            self.chosen = plan

    def simulate(self, plan: Plan) -> bool:
        """Simulate ``plan`` of the pool (no longer there: simulated already) where the budget allows, or take its
        twin's simulation (:attr:`twins`); whether it did either."""
        index = self._index(plan)
        if self.ctx is None or index is None or simulated(plan) or not simulable(plan):
            return False
        key = twin_key(plan)
        twin = self.twins.get(key)
        if twin is not None:
            ms, closed_ms = _ms(twin), twin.predicted.closed_form_ms
            self.pool[index] = plan.predicted_at(ms, closed_ms)
            self.proxies.add(id(self.pool[index]))
        elif work_of(plan) > self.budget:
            return False
        else:
            self._play(index, plan)
            self.twins[key] = self.pool[index]
        self.simulated_since[id(plan)] = plan
        self.chosen = min(self.pool, key=_rank_ms)
        return True

    def _index(self, plan: Plan) -> int | None:
        """Where ``plan`` (this very object) lies in the pool; None where it is not there."""
        return next((i for i, kept in enumerate(self.pool) if kept is plan), None)

    def _play(self, index: int, plan: Plan) -> None:
        """Put ``plan`` at ``index`` of the pool as its simulation predicts it (:meth:`_played`)."""
        self.pool[index] = self._played(plan)

    def _played(self, plan: Plan) -> Plan:
        """``plan`` as its simulation predicts it; its ratio to its closed form lowers its kind's floor, its work
        is paid from the budget."""
        played = price(self.ctx, plan)
        kind = plan.interleave > 1
        self.floors[kind] = max(1 / CLOSED_FORM_SPREAD, min(FLOOR_CEILING, self.floors.get(kind, 1.0), _ms(played) / played.predicted.closed_form_ms))
        self.budget -= work_of(plan)
        self.simulated += 1
        self.simulated_work += work_of(plan)
        return played

    def learn(self, plan: Plan) -> None:
        """Play ``plan``, which fits nowhere, only for its kind's floor, where none of its kind was played yet and
        the budget allows: until then the floor is ``1 / CLOSED_FORM_SPREAD``, and where no interleaving fits,
        every one whose closed form came within twice the plan held was fitted, its programs recorded to price
        its memory (a10g_l4_t4 Llama 13B at 8 samples a GPU: 102 fits spent the budget, one plan was played, and
        the plain plan kept was 2.3 % slower than the one played since; 55 fits now)."""
        if self.ctx is not None and (plan.interleave > 1) not in self.floors and simulable(plan) and work_of(plan) <= self.budget:
            with contextlib.suppress(PlanningError):  # no order of its programs: nothing to learn
                self._played(plan)

    def settle(self, final: bool = False) -> None:
        """Simulate the plan held until the one held is simulated (or cannot be): a plan the closed form
        ranks ahead of one simulated is simulated in turn, so pruning is against a simulated time. An
        interleaved plan the budget cannot simulate is dropped: it must win in the simulation. ``final``: the
        plan returned is played itself (:meth:`_answer`)."""
        while self.chosen is not None and not simulated(self.chosen):
            if self.simulate(self.chosen):
                continue
            if self.ctx is None or self.chosen.interleave == 1:
                break
            self.pool.remove(self.chosen)
            self.chosen = min(self.pool, key=_rank_ms, default=None)
        if final and self.ctx is not None:
            self._answer()

    def _answer(self) -> None:
        """Hold the plan to return, played itself whatever the budget: the budget bounds what the search
        explores, not the honesty of its answer. While the plan leading the pool was left in the closed form
        by the budget, or holds its twin's simulation, it is played on its own GPUs and the pool ranked again.
        Closed forms short by 1.4-2.8x (NCCL's 1F1B across a 25 Gb/s link with hundreds of microbatches) had
        the unplayed plan win against honest plays, once against the fastest type alone
        (``bench/random_clusters.py``)."""
        while True:
            self.chosen = min(self.pool, key=_rank_ms, default=None)
            if self.chosen is None or not simulable(self.chosen) or simulated(self.chosen) and id(self.chosen) not in self.proxies:
                return
            index = self._index(self.chosen)
            own = self.chosen
            if id(own) in self.proxies:
                self.proxies.discard(id(own))
                own = own.with_prediction(replace(own.predicted, iteration_ms=own.predicted.closed_form_ms, closed_form_ms=None))
            self._play(index, own)
            self.answer_plays += 1

    def threshold_ms(self, margin: float = 1.0) -> float:
        """A plan that cannot beat this, once divided by its ``margin`` (:func:`handicap`), cannot change
        :attr:`chosen`."""
        return math.inf if self.chosen is None else _rank_ms(self.chosen) * margin

    def past(self, bound_ms: float, margin: float = 1.0) -> bool:
        """Whether no plan of lower bound ``bound_ms`` (and handicap ``margin``) can change the choice,
        against the simulated time of the plan held. That plan is simulated first only where its play could
        decide: no simulation came below its closed form times the lowest :meth:`floor`, so a bound under that
        much of the threshold is not past either way and the plan may wait, unplayed, until the queue reaches
        it (its own :attr:`~.space.Kind.SIMULATED` candidate) or a later plan displaces it. Playing each plan
        held at once played every near-tie in turn: at 32 synthetic GPUs, 26 TP plans 2-4 % apart in the
        closed form, before the interleaved plans the queue held next beat them all (38 plays; now 13)."""
        if bound_ms >= self.threshold_ms(margin) * self.floor():
            self.settle()
        return bound_ms >= self.threshold_ms(margin)

    def best(self, keep) -> Plan | None:
        """The fastest plan of the pool for which ``keep`` holds."""
        return min((p for p in self.pool if keep(p)), key=_ms, default=None)

    def floor(self, interleaved: bool | None = None) -> float:
        """The floor of that kind of plan (:attr:`floors`; None: of either), ``1 / CLOSED_FORM_SPREAD`` until
        one of the kind is simulated. Not the other kind's: with plans played only where that decides
        (:meth:`past`), few are, and an interleaved plan of four16's Llama 7B that plays 2.2 % under its
        closed form stayed unplayed behind the plain plans' floor of 0.99."""
        seen = [f for kind, f in self.floors.items() if interleaved is None or kind == interleaved]
        return min(seen, default=1 / CLOSED_FORM_SPREAD)

    def simulation_bound_ms(self, plan: Plan) -> float:
        """How low the simulation of ``plan`` may come: its closed form times its kind's :meth:`floor`."""
        return math.inf if simulated(plan) or id(plan) in self.simulated_since else _ms(plan) * self.floor(plan.interleave > 1)

    def idle_note(self, gpu_type_of) -> str | None:
        """Why the chosen plan leaves GPUs idle (None when it uses every GPU)."""
        chosen = self.chosen
        if chosen is None or not chosen.idle_ranks:
            return None
        types = ", ".join(sorted({gpu_type_of(r) for r in chosen.idle_ranks}))
        head = f"ranks {list(chosen.idle_ranks)} ({types}) stay idle: they would slow the others down"
        every = self.best(lambda p: not p.idle_ranks)
        if every is None:
            return f"{head} (no plan using every GPU fits or comes within {IDLE_MARGIN:.0%} of this one)"
        gain = 1 - _ms(chosen) / _ms(every)
        return (
            f"{head}: this plan is {gain:.1%} faster than the fastest using every GPU ({_ms(chosen):.1f} against "
            f"{_ms(every):.1f} ms; idle GPUs must win by {IDLE_MARGIN:.0%})"
        )

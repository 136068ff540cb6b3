"""What the search learns of its own candidates on the ranks of a baseline the planner plans (the fastest type
alone): that baseline is a whole search of those ranks, which proposes the same candidates (its layouts, and the
other orders of the plan it holds, which the loop queues for the fastest plan here too:
:meth:`.loop._Loop._ordered_held`), so no plan of it is faster than the least of what the search still expects of
them and has found with them. The loop keys the baseline
by that (:meth:`.loop._Loop._refined`): the fastest type alone, planned by a search of its own, was 9 % of planning
mix32 Llama 7B at global batch 128 (and lost to the plan held), 16 % of a 1024-GPU search."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from operator import attrgetter

from zorse_lightning.planner.search.choice import Choice, simulated
from zorse_lightning.planner.search.space import Candidate
from zorse_lightning.schedule.plan import Plan


class SameRanks:
    """Per planned baseline's ranks, the search's own candidates on exactly those ranks as they are queued, and
    whether each was taken (its plans offered, what it opens queued). The lists hold the candidates, so no ``id``
    of one is reused while the search runs."""

    def __init__(self, candidates: Iterable[Candidate]) -> None:
        self._by_ranks: dict[frozenset, list[Candidate]] = {frozenset(c.layout[0]): [] for c in candidates if c.planned}
        self._taken: dict[int, bool] = {}
        self._sorted = True
        self._simulations, self._fastest = 0, []

    def queued(self, candidate: Candidate) -> None:
        """Note ``candidate``, just queued for the first time."""
        if candidate.layout and self._by_ranks and not candidate.planned:
            mine = self._by_ranks.get(frozenset(r for stage in candidate.layout for r in stage))
            if mine is not None:
                mine.append(candidate)
                self._taken[id(candidate)] = False
                self._sorted = False

    def taken(self, candidate: Candidate) -> None:
        """Note ``candidate`` taken by the loop."""
        if id(candidate) in self._taken:
            self._taken[id(candidate)] = True

    def fastest(self, choice: Choice) -> list[Plan]:
        """Per planned baseline's ranks, the fastest simulated plan of the pool on exactly those ranks; looked for
        again only where a plan was simulated since (the loop asks after every candidate)."""
        if len(choice.simulated_since) != self._simulations:
            self._simulations = len(choice.simulated_since)
            fastest: dict[frozenset, Plan] = {}
            for plan in choice.pool:
                ranks = _ranks(plan)
                if ranks in self._by_ranks and simulated(plan) and (ranks not in fastest or plan.predicted.iteration_ms < fastest[ranks].predicted.iteration_ms):
                    fastest[ranks] = plan
            self._fastest = list(fastest.values())
        return self._fastest

    def least_ms(self, ranks: tuple[int, ...], key: Callable[[Candidate], float], choice: Choice) -> float:
        """The least a plan of the search's own candidates on exactly ``ranks`` may take, as far as the search knows:
        the ``key`` of each not yet taken, and each plan found there (simulated, or its closed form times its kind's
        floor). No key is below its candidate's bound, so the candidates are walked in order of their bounds
        until one is past the least so far (at 1024 synthetic GPUs the baseline was keyed 112 times against 2,074
        candidates: 1.9 s)."""
        mine = frozenset(ranks)
        least = min((p.predicted.iteration_ms * (1.0 if simulated(p) else choice.floor(p.interleave > 1))
                     for p in choice.pool if p.world_size - len(p.idle_ranks) == len(mine) and _ranks(p) == mine), default=math.inf)
        if not self._sorted:
            for candidates in self._by_ranks.values():
                candidates.sort(key=attrgetter("bound_ms"))
            self._sorted = True
        for c in self._by_ranks.get(mine, ()):
            if c.bound_ms >= least:
                break
            if not self._taken[id(c)]:
                least = min(least, key(c))
        return least


def _ranks(plan: Plan) -> frozenset:
    """The ranks ``plan`` uses."""
    return frozenset(r for group in plan.rank_groups for r in group.ranks)

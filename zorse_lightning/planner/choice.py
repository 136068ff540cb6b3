"""Which plan the search keeps: the fastest, except that leaving GPUs idle must win by a margin.

A plan that leaves GPUs idle wastes hardware the user has, and the cost model's
prediction of it is no more exact than of the plan using every GPU (fidelity
benches: within a few per cent), so a tie in the model is no reason to leave GPUs
out: the idle plan is kept only when it is :data:`IDLE_MARGIN` faster than the
fastest plan using every GPU, and its note says by how much.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zorse_lightning.planner.plan import Plan

IDLE_MARGIN = 0.02
"""How much faster (a fraction of the iteration time) a plan leaving GPUs idle must be than the fastest plan
using every GPU to be chosen."""
INTERLEAVE_MARGIN = 0.02
"""How much faster an interleaved plan must be than the same plan without interleaving to be chosen
(:mod:`.interleave_choice`): it sends V times the messages and holds more activations, and its
schedule is the engine's newest, so a tie in the model is no reason to take it."""


def _ms(plan: Plan) -> float:
    return plan.predicted.iteration_ms


@dataclass
class Choice:
    """The search's best plans so far: the fastest overall and the fastest using every GPU."""

    fastest: Plan | None = None
    every_gpu: Plan | None = None

    def offer(self, plan: Plan | None) -> None:
        if plan is None:
            return
        if self.fastest is None or _ms(plan) < _ms(self.fastest):
            self.fastest = plan
        if not plan.idle_ranks and (self.every_gpu is None or _ms(plan) < _ms(self.every_gpu)):
            self.every_gpu = plan

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
            f"{head}: this plan is {gain:.1%} faster than the fastest using every GPU in the closed form the "
            f"search ranks by ({_ms(chosen):.1f} against {_ms(self.every_gpu):.1f} ms without interleaving; idle GPUs "
            f"must win by {IDLE_MARGIN:.0%})"
        )

"""What the search learns of its own candidates on a planned baseline's ranks (planner.search.same_ranks): the least
key of those not yet taken, found without asking the key of every one."""

from __future__ import annotations

import math
import random

from zorse_lightning.planner.search.choice import Choice
from zorse_lightning.planner.search.same_ranks import SameRanks
from zorse_lightning.planner.search.space import Candidate, Kind


def test_the_least_key_of_the_candidates_not_taken_is_found_asking_only_those_bounded_below_it() -> None:
    rng = random.Random(7)
    baseline = Candidate(0.0, Kind.BASELINE, ((0, 1),), baseline=lambda: None, planned=True)
    same_ranks = SameRanks([baseline])
    mine = [Candidate(rng.uniform(100.0, 200.0), Kind.SPLIT, ((0,), (1,)), m) for m in range(1, 61)]
    other_ranks = [Candidate(1.0, Kind.SPLIT, ((0,), (2,)), 1)]  # another set of ranks: never counted
    extra = {id(c): rng.uniform(0.0, 50.0) for c in mine}  # what the search learnt since each was queued
    for candidate in [*mine, *other_ranks]:
        same_ranks.queued(candidate)
    taken = rng.sample(mine, 20)
    for candidate in taken:
        same_ranks.taken(candidate)
    asked: list[Candidate] = []

    def key(candidate: Candidate) -> float:
        asked.append(candidate)
        return candidate.bound_ms + extra[id(candidate)]

    least = same_ranks.least_ms((1, 0), key, Choice(None))
    left = [c for c in mine if all(c is not t for t in taken)]
    assert least == min(c.bound_ms + extra[id(c)] for c in left)
    assert not any(c is t for c in asked for t in taken)
    assert all(c.bound_ms < least for c in asked) and len(asked) < len(left)
    assert same_ranks.least_ms((0, 3), key, Choice(None)) == math.inf

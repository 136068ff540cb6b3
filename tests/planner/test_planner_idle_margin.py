"""Leaving GPUs idle must win by a margin (planner.search.choice), and the plan's note says by how much."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zorse_lightning.planner import PlannerOptions, make_plan
from zorse_lightning.planner.search.choice import IDLE_MARGIN, Choice
from zorse_lightning.schedule.plan import Prediction
from testing.plans import hand_plan


def _priced(plan, ms: float):
    return replace(plan, predicted=Prediction(ms, 1000.0 / ms, (0.0,) * plan.world_size, {}))


EVERY = hand_plan([((0, 1, 2, 3), (1, 1, 1, 1), (0, 4))])
IDLE = hand_plan([((0, 1), (2, 2), (0, 4))], idle_ranks=(2, 3))


def test_an_idle_plan_within_the_margin_loses_to_one_using_every_gpu():
    choice = Choice(ctx=None)  # nothing simulated: settle() is not called
    choice.offer(_priced(EVERY, 100.0))
    choice.offer(_priced(IDLE, 100.0 * (1 - IDLE_MARGIN / 2)))
    assert choice.chosen.idle_ranks == ()
    assert choice.idle_note(lambda rank: "t4") is None
    # an all-GPU candidate matters up to the margin past the idle plan; an idle one must beat the margin
    assert choice.threshold_ms() == pytest.approx(100.0)
    assert choice.threshold_ms(1 - IDLE_MARGIN) == pytest.approx(100.0 * (1 - IDLE_MARGIN))


def test_an_idle_plan_past_the_margin_wins_and_says_by_how_much():
    choice = Choice(ctx=None)  # nothing simulated: settle() is not called
    choice.offer(_priced(IDLE, 90.0))
    choice.offer(_priced(EVERY, 100.0))
    assert choice.chosen.idle_ranks == (2, 3)
    note = choice.idle_note(lambda rank: "t4")
    assert "ranks [2, 3] (t4) stay idle" in note and "10.0% faster" in note and "90.0 against 100.0 ms" in note
    assert choice.threshold_ms() == pytest.approx(90.0 / (1 - IDLE_MARGIN))


def test_the_search_notes_why_gpus_stay_idle():
    from zorse_lightning.cluster.config import load_cluster
    from zorse_lightning.profiling import reference_profile

    inventory = load_cluster("mix32_4types")
    profile = reference_profile("llama_7b", [t.name for t in inventory.gpu_types], 512, "float16")
    plan = make_plan(inventory, profile, 256, PlannerOptions(allow_idle_ranks=True))
    assert plan.idle_ranks
    assert any("stay idle" in n and ("faster than the fastest using every GPU" in n or "no plan using every GPU" in n)
               for n in plan.notes), plan.notes

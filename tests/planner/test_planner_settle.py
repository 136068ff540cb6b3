"""When the choice plays the plan it holds (planner.search.choice.Choice.past): only where the play could decide
whether a bound is past it, and each kind of plan keeps its own floor."""

from __future__ import annotations

from dataclasses import replace

import pytest

from test_planner_fixtures import synthetic_profile

from zorse_lightning.cluster import DEFAULT_CATALOG, ClusterInventory, Machine
from zorse_lightning.planner import CostContext
from zorse_lightning.planner.cost.evaluate import plan_cost, prediction
from zorse_lightning.planner.cost.simulate import simulate
from zorse_lightning.planner.search.choice import CLOSED_FORM_SPREAD, Choice, simulated
from zorse_lightning.schedule.plan import Plan, StagePlan


@pytest.fixture(scope="module")
def ctx() -> CostContext:
    a100 = DEFAULT_CATALOG.get("a100x40")
    inventory = ClusterInventory("two", tuple(Machine(f"m{i}", (a100, a100), intra_bandwidth_gbps=100.0) for i in range(2)),
                                 inter_machine_bandwidth_gbps=10.0)
    return CostContext.build(inventory, synthetic_profile(("a100x40",), num_layers=12, hidden=1024))


def _held(ctx: CostContext) -> Plan:
    """Two machines of two A100s, a stage each, priced in the closed form."""
    stages = tuple(
        StagePlan((2 * m, 2 * m + 1), ("a100x40",) * 2, (f"m{m}",) * 2, layers, (4, 4)) for m, layers in ((0, (0, 6)), (1, (6, 12)))
    )
    plan = Plan("synthetic", "two", 12, 4, 8, 1, "1f1b", stages)
    return replace(plan, predicted=prediction(ctx, plan, plan_cost(ctx, plan)))


def test_the_plan_held_is_played_only_where_its_play_could_decide(ctx):
    plan = _held(ctx)
    closed_ms = plan.predicted.iteration_ms
    played_ms = simulate(ctx, plan).makespan_ms
    choice = Choice(ctx)
    choice.offer(plan)
    choice.floors = {False: 0.9}  # no play came below 0.9 of its closed form
    assert not choice.past(0.89 * closed_ms)  # not past whatever the play says
    assert choice.simulated == 0 and not simulated(choice.chosen)
    bound_ms = 0.95 * closed_ms  # past or not: the play decides
    assert choice.past(bound_ms) == (bound_ms >= played_ms)
    assert choice.simulated == 1 and choice.chosen.predicted.iteration_ms == played_ms


def test_a_kind_of_plan_never_played_has_the_widest_floor():
    choice = Choice(None)
    assert choice.floor(False) == choice.floor(True) == choice.floor() == 1 / CLOSED_FORM_SPREAD
    choice.floors = {False: 0.99}
    assert choice.floor(False) == choice.floor() == 0.99
    assert choice.floor(True) == 1 / CLOSED_FORM_SPREAD  # not the plain plans' floor
    choice.floors[True] = 0.97
    assert choice.floor(True) == choice.floor() == 0.97 and choice.floor(False) == 0.99


def test_the_plan_returned_is_played_whatever_the_budget(ctx):
    plan = _held(ctx)
    choice = Choice(ctx, budget=0)  # no play left for the search
    choice.offer(plan)
    choice.settle()
    assert not simulated(choice.chosen)  # the search prunes against it unplayed
    choice.settle(final=True)
    assert simulated(choice.chosen) and choice.chosen.predicted.iteration_ms == simulate(ctx, plan).makespan_ms
    assert choice.budget < 0


def test_the_answer_is_the_fastest_plan_played_once_every_plan_ahead_of_it_in_the_closed_form_is_played(ctx):
    plan = _held(ctx)
    played_ms = simulate(ctx, plan).makespan_ms

    def closed_at(ms: float) -> Plan:
        return plan.with_prediction(replace(plan.predicted, iteration_ms=ms))

    choice = Choice(ctx, budget=0)
    for ms in (played_ms * 1.1, played_ms / 1.4, played_ms / 1.6):
        choice.offer(closed_at(ms))
    choice.settle(final=True)
    assert choice.answer_plays == 2  # the two ahead of the answer's play; the one behind it stays in its closed form
    assert [simulated(p) for p in choice.pool] == [False, True, True]
    assert simulated(choice.chosen) and choice.chosen.predicted.iteration_ms == played_ms

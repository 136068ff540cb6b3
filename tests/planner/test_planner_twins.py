"""Plans alike but for which GPUs of a kind they hold take one simulation (planner.search.choice.Choice.twins):
the second is predicted by the first's play, and a plan held that way is played itself before it is returned."""

from __future__ import annotations

from dataclasses import replace

import pytest

from test_planner_fixtures import synthetic_profile

from zorse_lightning.cluster import DEFAULT_CATALOG, ClusterInventory, Machine
from zorse_lightning.planner import CostContext
from zorse_lightning.planner.cost.evaluate import plan_cost, prediction
from zorse_lightning.planner.cost.simulate import simulate
from zorse_lightning.planner.search.choice import Choice, simulated
from zorse_lightning.schedule.plan import Plan, StagePlan


def _cluster() -> ClusterInventory:
    """Three alike machines of two A100s each."""
    a100 = DEFAULT_CATALOG.get("a100x40")
    return ClusterInventory("alike", tuple(Machine(f"m{i}", (a100, a100), intra_bandwidth_gbps=100.0) for i in range(3)),
                            inter_machine_bandwidth_gbps=10.0)


def _plan(first: int, second: int, shares=(4, 4)) -> Plan:
    """Machine ``first`` runs layers 0-5, machine ``second`` layers 6-11; the third machine idles."""
    stages = tuple(
        StagePlan((2 * m, 2 * m + 1), ("a100x40",) * 2, (f"m{m}",) * 2, layers, counts)
        for m, layers, counts in ((first, (0, 6), shares), (second, (6, 12), (4, 4)))
    )
    idle = tuple(r for r in range(6) if r not in (2 * first, 2 * first + 1, 2 * second, 2 * second + 1))
    return Plan("synthetic", "alike", 12, 6, 8, 1, "1f1b", stages, idle_ranks=idle)


def _priced(ctx: CostContext, plan: Plan) -> Plan:
    return replace(plan, predicted=prediction(ctx, plan, plan_cost(ctx, plan)))


@pytest.fixture(scope="module")
def ctx() -> CostContext:
    inventory = _cluster()
    return CostContext.build(inventory, synthetic_profile(("a100x40",), num_layers=12, hidden=1024))


def test_a_twin_takes_the_simulation_of_the_plan_it_mirrors(ctx):
    one, other, unlike = _priced(ctx, _plan(0, 1)), _priced(ctx, _plan(2, 0)), _priced(ctx, _plan(0, 1, (5, 3)))
    assert other.predicted.iteration_ms == one.predicted.iteration_ms  # the same pipeline on other machines
    choice = Choice(ctx)
    for plan in (one, other, unlike):
        choice.offer(plan)
    assert choice.simulate(one) and choice.simulated == 1
    assert choice.simulate(other) and choice.simulated == 1  # not played: its twin's play
    assert choice.simulate(unlike) and choice.simulated == 2  # other shares: played
    played = simulate(ctx, one).makespan_ms
    by_twin = next(p for p in choice.pool if p.stages == other.stages)
    assert simulated(by_twin) and by_twin.predicted.iteration_ms == played
    assert by_twin.predicted.memory_gib == other.predicted.memory_gib  # its own, not its twin's
    assert simulate(ctx, other).makespan_ms == pytest.approx(played, rel=1e-12)  # which holds: the same play


def test_a_plan_held_by_its_twins_simulation_is_played_itself_at_the_end(ctx):
    one, other = _priced(ctx, _plan(0, 1)), _priced(ctx, _plan(2, 0))
    choice = Choice(ctx)
    choice.offer(one)
    choice.simulate(one)
    choice.offer(other)
    choice.simulate(other)
    choice.pool.remove(next(p for p in choice.pool if p.stages == one.stages))  # only the twin left
    choice.chosen = choice.pool[0]
    assert id(choice.chosen) in choice.proxies
    choice.settle(final=True)
    assert choice.simulated == 2 and id(choice.chosen) not in choice.proxies
    assert choice.chosen.predicted.iteration_ms == simulate(ctx, other).makespan_ms


def test_the_search_fits_one_of_each_set_of_twins(monkeypatch):
    """Four alike machines: other orders of a plan are twins of it (alike groups on alike links), so the loop
    fits each interleaving once per set of twins (4 fits here, none twice) and returns the plan it returns when
    it fits them all and follows every twin (10 fits: what each twin opens is queued again, so the two explore
    differently, to the same plan)."""
    import zorse_lightning.planner.search.loop as loop
    from zorse_lightning.planner import make_plan
    from zorse_lightning.planner.search.choice import twin_key

    a100 = DEFAULT_CATALOG.get("a100x40")
    inventory = ClusterInventory("alike4", tuple(Machine(f"m{i}", (a100, a100), intra_bandwidth_gbps=100.0) for i in range(4)),
                                 inter_machine_bandwidth_gbps=100.0)
    profile = synthetic_profile(("a100x40",), num_layers=32, hidden=4096)
    fitted: list[tuple] = []
    fit = loop.interleaved_fit
    monkeypatch.setattr(loop, "interleaved_fit", lambda search, draft, *rest: fitted.append(twin_key(draft)) or fit(search, draft, *rest))
    plan = make_plan(inventory, profile, 16)
    once = list(fitted)
    fitted.clear()
    monkeypatch.setattr(loop._Loop, "_twin_seen", lambda self, plan, kind: False)
    every = make_plan(inventory, profile, 16)
    assert once and len(set(once)) == len(once) and len(fitted) > len(once)
    assert plan.interleave > 1 and plan.stages == every.stages and plan.predicted == every.predicted

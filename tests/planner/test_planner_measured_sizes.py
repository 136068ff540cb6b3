"""A measured profile is priced at its measured microbatch sizes only: never on a line through two points."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zorse_lightning.cluster.catalog import DEFAULT_CATALOG
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.cluster.inventory import ClusterInventory, Machine
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner import CostContext, PlannerOptions, make_plan
from zorse_lightning.planner.cost.simulate import simulate
from zorse_lightning.profiling.profile import BlockTimes, ModelProfile, ProfileSource, TimeCurve

from test_planner_fixtures import synthetic_profile


def _measured(profile: ModelProfile, sizes: tuple[int, ...]) -> ModelProfile:
    """Every type's times as measured at ``sizes`` (each a point of its line)."""

    def at(curve: TimeCurve) -> TimeCurve:
        return TimeCurve(curve.slope_ms, curve.intercept_ms, tuple(curve.at(b) for b in sizes), sizes)

    def block(times: BlockTimes) -> BlockTimes:
        return BlockTimes(at(times.forward), at(times.backward))

    devices = {
        name: replace(d, source=ProfileSource.MEASURED, embedding=block(d.embedding), layers=tuple(block(l) for l in d.layers),
                      head=block(d.head))
        for name, d in profile.devices.items()
    }
    return replace(profile, devices=devices)


def test_only_measured_sizes_are_planned_and_a_pinned_unmeasured_one_is_refused():
    inventory = load_cluster("a100x4_v100x4")
    profile = _measured(synthetic_profile(tuple(t.name for t in inventory.gpu_types), num_layers=8, hidden=512), (1, 2, 4))
    assert profile.measured_sizes == (1, 2, 4)
    plan = make_plan(inventory, profile, 64, PlannerOptions(microbatch_sizes=(1, 2, 4, 8, 16), solver_time_limit_s=2))
    assert plan.microbatch_size in (1, 2, 4)
    with pytest.raises(PlanningError, match=r"sizes \[8\] were not measured.*\[1, 2, 4\]"):
        make_plan(inventory, profile, 64, PlannerOptions(microbatch_size=8))


def test_one_rank_without_a_pipeline_takes_the_whole_local_batch_in_one_microbatch_when_it_is_fastest():
    """Per-microbatch costs (an intercept) make one large microbatch the fastest on one GPU: the search
    finds it once that size is measured, with no special case."""
    one = ClusterInventory("one", (Machine("m0", (DEFAULT_CATALOG.get("a100x40"),), intra_bandwidth_gbps=100.0),))
    profile = synthetic_profile(("a100x40",), num_layers=4, hidden=256)
    profile = _measured(profile, (1, 2, 4, 8))
    devices = {
        name: replace(d, layers=tuple(
            BlockTimes(replace(l.forward, measured_ms=tuple(t + 5.0 for t in l.forward.measured_ms)), l.backward)
            for l in d.layers
        ))
        for name, d in profile.devices.items()
    }
    plan = make_plan(one, replace(profile, devices=devices), 8, PlannerOptions(microbatch_sizes=(1, 2, 4, 8)))
    assert plan.microbatch_size == 8 and plan.num_microbatches == 1


def test_a_plan_past_the_budget_of_plays_is_played_all_the_same_and_says_so(monkeypatch):
    from zorse_lightning.planner.search import loop

    monkeypatch.setattr(loop, "WORK_PER_GPU", 0)
    inventory = load_cluster("a100x4_v100x4")
    profile = synthetic_profile(tuple(t.name for t in inventory.gpu_types), num_layers=8, hidden=512)
    options = PlannerOptions(solver_time_limit_s=2)
    plan = make_plan(inventory, profile, 64, options)
    assert plan.predicted.closed_form_ms is not None  # its simulation, not the closed form the search ranked it by
    assert plan.predicted.iteration_ms == simulate(CostContext.build(inventory, profile, options.memory_reserve_gib, options.p2p_rules), plan).makespan_ms
    assert any(n.startswith("predicted by the simulation") and "the budget of plays ran out" in n for n in plan.notes)

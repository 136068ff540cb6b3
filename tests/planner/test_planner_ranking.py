"""The search ranks by what it reports (issue 30): the simulation of the engine's programs where the closed
form disagrees with it, the baselines as candidates priced the same way, and the peers' structures.

The figures and structures here were found with the messages played under gloo's rules, which the planner
used on every cluster until 2026-11-28; on these clusters of GPUs it now plays NCCL's (each rank's batches on
one stream, receives posted ahead of the actions that need them: :mod:`zorse_lightning.planner.cost.stream_play`),
which hides more of a transfer under compute and finds other structures. These tests are of the search, so
they keep the rules their figures were found under (:data:`GLOO`)."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import pytest

from zorse_lightning.capabilities import P2PRules
from zorse_lightning.cluster.catalog import DEFAULT_CATALOG
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.cluster.inventory import ClusterInventory, Machine
from zorse_lightning.planner import CostContext, PlannerOptions, all_baselines, make_plan
from zorse_lightning.planner.search.choice import IDLE_MARGIN, INTERLEAVE_MARGIN, Choice, work_of
from zorse_lightning.planner.search import loop
from zorse_lightning.planner.search.fit import interleaved_best_case_ms, interleaved_draft
from zorse_lightning.planner.search.space import Search
from zorse_lightning.planner.interleaving import degrees
from zorse_lightning.planner.cost.evaluate import plan_cost
from zorse_lightning.planner.cost.simulate import simulate
from zorse_lightning.profiling import reference_profile
from testing.synthetic_cluster import four_machines_four_types

GLOO = PlannerOptions(p2p_rules="gloo")
"""The rules the figures of this file were found under (see the module's docstring)."""
DC2 = "dc2_a100x8_v100x8"
BATCH = 512
FOUR_A100S = ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15))
"""dc2's four machines as stages: the cross-datacenter link between stages 1 and 2."""


@lru_cache(maxsize=None)
def _dc2():
    inventory = load_cluster(DC2)
    profile = reference_profile("llama_3b", [t.name for t in inventory.gpu_types], 512, "float16")
    return inventory, profile, make_plan(inventory, profile, BATCH, GLOO)


def _closed_form_only(plan):
    """``plan`` as the search first holds it: predicted by the closed form, not yet simulated."""
    return replace(plan, predicted=replace(plan.predicted, iteration_ms=plan.predicted.closed_form_ms, closed_form_ms=None))


def test_where_the_closed_form_and_the_simulation_disagree_the_search_follows_the_simulation() -> None:
    inventory, profile, plan = _dc2()
    ctx = CostContext.build(inventory, profile, p2p_rules=P2PRules.GLOO)
    across = make_plan(inventory, profile, BATCH, PlannerOptions(p2p_rules="gloo", stage_layout=FOUR_A100S, microbatch_size=8, max_interleave=1))
    # the closed form misses what the slow link costs the 1F1B pipeline across it: it prefers that plan ...
    assert across.predicted.closed_form_ms < plan.predicted.closed_form_ms
    assert across.predicted.iteration_ms > 1.2 * across.predicted.closed_form_ms
    # ... the simulation does not, and the search returns the plan that is faster in the simulation
    assert plan.predicted.iteration_ms < across.predicted.iteration_ms
    assert plan.predicted.iteration_ms == pytest.approx(simulate(ctx, plan).makespan_ms, rel=1e-12)
    assert any("closed form says" in note for note in plan.notes)
    # the choice itself: offered both in the closed form, it keeps the one the simulation puts first
    choice = Choice(ctx)
    choice.offer(_closed_form_only(across))
    choice.offer(_closed_form_only(replace(plan, notes=())))
    assert choice.chosen.stages == across.stages  # by the closed form
    choice.settle()  # simulates the plan it holds until the one it holds is simulated
    assert choice.chosen.stages == plan.stages and choice.chosen.predicted.closed_form_ms is not None


def test_the_search_simulates_within_its_budgets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning time (issue 30, 512 GPUs): beyond the one budget of work, the plans held keep their closed
    form; the plan returned is played all the same, and its note says so."""
    inventory, profile, plan = _dc2()
    ctx = CostContext.build(inventory, profile, p2p_rules=P2PRules.GLOO)
    across = make_plan(inventory, profile, BATCH, PlannerOptions(p2p_rules="gloo", stage_layout=FOUR_A100S, microbatch_size=8, max_interleave=1))
    plans = [_closed_form_only(across), _closed_form_only(replace(plan, notes=()))]
    # room for one simulation: the closed form's favourite is simulated, the plan it then holds is not
    choice = Choice(ctx, budget=work_of(across))
    for held in plans:
        choice.offer(held)
    choice.settle()
    assert choice.simulated == 1 and choice.simulated_work == work_of(across)
    assert choice.chosen.stages == plan.stages and choice.chosen.predicted.closed_form_ms is None
    # no room at all: the plans leading the closed form are played past the budget until one played leads,
    # the plan found with the budget (the cross-datacenter plans lead the closed form, not their plays)
    monkeypatch.setattr(loop, "WORK_PER_GPU", 0)
    planned = make_plan(inventory, profile, BATCH, GLOO)
    assert planned.stages == plan.stages and planned.predicted.iteration_ms == plan.predicted.iteration_ms
    assert any(note.startswith("predicted by the simulation") and "the budget of plays ran out" in note for note in planned.notes)


def test_a_baseline_that_beat_the_plan_is_now_the_plan_or_beaten() -> None:
    """On dc2 the A100s alone were 2.1x faster than the plan (issue 30): the baseline is a candidate now."""
    inventory, profile, plan = _dc2()
    baselines = all_baselines(inventory, profile, BATCH, GLOO)
    alone = baselines["fastest_type_alone"]
    assert alone is not None
    assert plan.predicted.iteration_ms <= alone.predicted.iteration_ms * (1 + 1e-9)
    for name, baseline in baselines.items():
        if baseline is not None:
            assert plan.predicted.iteration_ms <= baseline.predicted.iteration_ms * (1 + 1e-9), name


def test_the_fastest_type_alone_is_planned_only_where_the_searchs_own_candidates_on_its_ranks_could_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its planner, a whole search of those GPUs, proposes the search's own candidates on those ranks: the baseline
    is keyed after them and by what the search learnt of them. On dc2 (Llama 3B) the A100s alone win, found by the
    search's own candidates (4756.08 ms, as the baseline's planner found them); on mix32 Llama 7B at global batch 128
    they lose to the plan held (2107.25 ms). Neither plans the sub-cluster now (it was 9 % of mix32's planning)."""
    calls = []
    planner = loop._planner
    monkeypatch.setattr(loop, "_planner", lambda *args: lambda cluster: calls.append(cluster) or planner(*args)(cluster))
    _, _, plan = _dc2()
    assert plan.predicted.iteration_ms == pytest.approx(4756.08, abs=0.01) and len(plan.idle_ranks) == 8
    mix32 = load_cluster("mix32_4types")
    mixed = make_plan(mix32, reference_profile("llama_7b", [t.name for t in mix32.gpu_types], 512, "float16"), 128)
    assert mixed.predicted.iteration_ms == pytest.approx(2107.25, abs=0.01)
    assert calls == []


def test_the_search_proposes_on_the_fastest_types_ranks_what_its_own_planner_would() -> None:
    """The fastest type alone is keyed by what the search learnt of its own candidates on its ranks, so there the
    search proposes what that baseline's planner does: its layouts, and the other orders of the fastest plan it
    holds. Six RTX 3090s on two machines beside L4s, T4s and a V100, 1 Gb/s between machines (GPT 1.3B, gloo's
    rules): the 3090s alone win as groups of 2, 2, 1 and 1 GPUs in an order no layout of the search has
    (5077.85 ms). Without the other orders of its fastest plan there, the search kept six one-GPU stages
    (5168.32 ms) and the baseline it prints beat it."""
    catalog = {name: DEFAULT_CATALOG.get(name) for name in ("l4", "rtx3090", "t4", "v100x32")}
    machines = (
        Machine("m0", (catalog["l4"],) * 8, intra_bandwidth_gbps=600.0),
        Machine("m1", (catalog["rtx3090"],) * 2, intra_bandwidth_gbps=600.0),
        Machine("m2", (catalog["t4"],) * 4 + (catalog["rtx3090"],) * 4, intra_bandwidth_gbps=16.0),
        Machine("m3", (catalog["v100x32"],), intra_bandwidth_gbps=16.0),
    )
    inventory = ClusterInventory("six_3090s", machines, inter_machine_bandwidth_gbps=1.0)
    profile = reference_profile("gpt_1.3b", [t.name for t in inventory.gpu_types])
    options = PlannerOptions(p2p_rules=P2PRules.GLOO)
    plan = make_plan(inventory, profile, 76, options)
    alone = all_baselines(inventory, profile, 76, options, ("fastest_type_alone",))["fastest_type_alone"]
    assert plan.predicted.iteration_ms == pytest.approx(alone.predicted.iteration_ms, abs=1e-6)
    assert plan.predicted.iteration_ms == pytest.approx(5077.85, abs=0.01)
    assert [len(s.ranks) for s in plan.stages] == [2, 2, 1, 1]


@pytest.mark.parametrize("name", ["a100x4_v100x4", "a10g_l4_t4", "lab4_l4_a6000_p40", "mix32_4types", DC2])
def test_no_plan_is_slower_than_a_baseline_in_its_own_prediction(name: str) -> None:
    """Both predicted the same way (the simulation where it runs in planning time); a baseline leaving
    GPUs idle must beat a plan using every GPU by the planner's margin."""
    inventory = load_cluster(name)
    profile = reference_profile("llama_7b", [t.name for t in inventory.gpu_types], 512, "float16")
    batch = 4 * inventory.world_size
    plan = make_plan(inventory, profile, batch, GLOO)
    for label, baseline in all_baselines(inventory, profile, batch, GLOO).items():
        if baseline is None:
            continue
        margin = IDLE_MARGIN if baseline.world_size < inventory.world_size and not plan.idle_ranks else 0.0
        assert plan.predicted.iteration_ms * (1 - margin) <= baseline.predicted.iteration_ms * (1 + 1e-9), label


def test_whole_machines_of_one_type_as_stages_sharded_interleaved() -> None:
    """The peers' structure on four machines of four types (Llama 3B): one stage group per machine,
    sharded, interleaved. It gains 0.9 % at microbatch 4 in the simulation, which the 2 % margin asked
    of the closed form as well used to refuse; at microbatch 8, slower plain (more fill and drain), it
    gains 6 % at x2, and the finalists interleaved are now those that could gain most
    (a split is queued by the best its interleavings could do), so the search takes it: within 1 % of the best order of
    the four machines pinned (found by pinning all 24 at microbatches 4 and 8)."""
    inventory = four_machines_four_types()
    profile = reference_profile("llama_3b", [t.name for t in inventory.gpu_types], 512, "float16")
    plan = make_plan(inventory, profile, 32 * inventory.world_size, GLOO)
    groups = plan.rank_groups
    assert len(groups) == 4 and all(len(set(g.machines)) == 1 and len(g.ranks) == 4 for g in groups)
    assert plan.microbatch_size == 8 and plan.interleave == 2
    assert all(s.sharding.value != "none" for s in plan.stages)
    assert any(note.startswith("interleaved x2") for note in plan.notes)
    best_order = tuple(tuple(range(4 * m, 4 * m + 4)) for m in (3, 1, 0, 2))  # A10G, A6000, A100, V100
    pinned = make_plan(inventory, profile, 32 * inventory.world_size, PlannerOptions(p2p_rules="gloo", stage_layout=best_order, microbatch_size=8))
    assert pinned.interleave == 2
    assert plan.predicted.iteration_ms <= pinned.predicted.iteration_ms * 1.01
    plain = make_plan(inventory, profile, 32 * inventory.world_size, PlannerOptions(p2p_rules="gloo", max_interleave=1))
    assert plain.interleave == 1 and plain.predicted.iteration_ms > plan.predicted.iteration_ms
    assert plan.predicted.iteration_ms < plain.predicted.iteration_ms * (1 - INTERLEAVE_MARGIN)


def test_an_interleaving_is_sharded_as_the_search_shards_whatever_its_plain_plan_left_unsharded() -> None:
    """a100x4_v100x4, GPT 2.7B at 8 samples per GPU (NCCL's rules): the plain plan of the V100s then the A100s
    leaves the A100s unsharded (their step ends within the V100s' backward of the last microbatch, 8 layers),
    but interleaved x4 that drain is one chunk's, and the A100s' longer step shows (1303.3 against 1292.3 ms
    played). Its interleavings start from the search's sharding, and the search returns the sharded x4 (1290.9
    ms since the floors' ceiling played one more of its kind; 1292.3 before)."""
    inventory = load_cluster("a100x4_v100x4")
    profile = reference_profile("gpt_2.7b", [t.name for t in inventory.gpu_types], 512, "float16")
    batch = 8 * inventory.world_size
    pins = PlannerOptions(stage_layout=((4, 5, 6, 7), (0, 1, 2, 3)), microbatch_size=2, max_interleave=1)
    plain = make_plan(inventory, profile, batch, pins)
    assert [s.sharding.value for s in plain.stages] == ["optimizer_gradients", "none"]
    search = Search.build(inventory, profile, batch, pins, lambda _: None)
    busy = [stage.busy_ms for stage in plan_cost(search.ctx, plain, memory=False).stages]
    assert {s.sharding.value for s in interleaved_draft(search, plain, 4, busy).stages} == {"optimizer_gradients"}
    plan = make_plan(inventory, profile, batch)
    assert plan.interleave == 4 and {s.sharding.value for s in plan.stages} == {"optimizer_gradients"}
    assert plan.predicted.iteration_ms == pytest.approx(1290.89, abs=0.01)


def test_a_split_only_its_interleavings_could_win_opens_them_unfitted(monkeypatch: pytest.MonkeyPatch) -> None:
    """lab4_l4_a6000_p40, GPT 2.7B at global batch 128 (NCCL's rules): the splits whose plain plan cannot beat
    the plan held are not fitted (32 of the splits taken at most, 30 before the floors' ceiling, where every
    one was: 61), and their interleavings start from their drafts. The plan: x3 over the P40, both L4s and the
    A6000 (widths 1, 2, 1), 18668.1 ms. Recorded in unit steps, such interleavings across groups of different
    widths played 1.15-1.5x their closed form, the search spent its budget playing them and kept one stage of
    every GPU (19023.6 ms); in balanced time this one plays 1.017x its closed form."""
    fitted = []
    split = loop.heuristic_split
    monkeypatch.setattr(loop, "heuristic_split", lambda *args: fitted.append(args) or split(*args))
    inventory = load_cluster("lab4_l4_a6000_p40")
    plan = make_plan(inventory, reference_profile("gpt_2.7b", [t.name for t in inventory.gpu_types], 512, "float16"), 128)
    assert plan.predicted.iteration_ms == pytest.approx(18668.1, abs=0.1) and plan.interleave == 3
    assert [len(group.ranks) for group in plan.rank_groups] == [1, 2, 1]
    assert len(fitted) <= 32


def test_an_interleaving_that_fits_nowhere_still_teaches_its_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """a10g_l4_t4, Llama 13B at 8 samples a GPU: no interleaving fits. Until one is played its kind's floor is
    1 / CLOSED_FORM_SPREAD, so every interleaving within twice the plan held was fitted, its programs recorded
    to price its memory, until the budget was spent: 102 fits, one plan played, the plain plan kept 13703.3 ms.
    The first that fits nowhere is played for its floor alone: 55 fits, and the plain plans are played. (66 fits
    since NCCL's receivers wait for no gradient's notice, and a plain plan of 13638.1 ms: the 13390.8 ms one,
    the same twelve stages in another order, plays 0.96 of a closed form that no longer comes under the floor.)"""
    fits = []
    interleaved = loop.interleaved_fit
    monkeypatch.setattr(loop, "interleaved_fit", lambda *args: fits.append(args) or interleaved(*args))
    inventory = load_cluster("a10g_l4_t4")
    plan = make_plan(inventory, reference_profile("llama_13b", [t.name for t in inventory.gpu_types], 512, "float16"), 8 * inventory.world_size)
    assert plan.interleave == 1 and plan.predicted.iteration_ms == pytest.approx(13638.1, abs=0.1)
    assert len(fits) < 70


def test_a_slow_group_holding_few_layers_gets_a_layer_per_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A split of [13, 8, 4, 1] admits no interleaving as it stands: the group of one layer gets layers
    from the busiest groups (the first, then the second), so every degree up to num_layers // groups is tried."""
    inventory = four_machines_four_types()
    profile = reference_profile("llama_3b", [t.name for t in inventory.gpu_types], 512, "float16")
    layout = tuple(tuple(range(4 * m, 4 * m + 4)) for m in range(4))
    pins = PlannerOptions(p2p_rules="gloo", stage_layout=layout, layer_counts=(13, 8, 4, 1), microbatch_size=4, max_interleave=1)
    plain = make_plan(inventory, profile, 32 * inventory.world_size, pins)
    search = Search.build(inventory, profile, 32 * inventory.world_size, pins, lambda _: None)
    busy = [stage.busy_ms for stage in plan_cost(search.ctx, plain, memory=False).stages]
    thick = interleaved_draft(search, plain, 3, busy)
    assert [sum(thick.stages[s].num_layers for s in thick.stages_of_group(g)) for g in range(4)] == [12, 7, 4, 3]
    assert degrees(plain, 4) == [1, 2, 3, 4]


@pytest.mark.parametrize("rules", ["gloo", "nccl"])
def test_an_interleavings_estimate_never_exceeds_its_draft(rules: str) -> None:
    """The loop keys an interleaving by :func:`interleaved_best_case_ms` before drafting it: no draft's closed
    form is below it, and its pipeline is within 5 % of the estimate. A middle group of one layer gets a layer
    per chunk from the busiest group (its work x2, x3, x4, the busiest's less: the fill and drain alone said
    6341 ms at x2 where the draft is 5769), and every rank waits for its messages of every chunk. (Within 3 %
    while a rank paid one round's waits for chunks heavier elsewhere; it pays half their excess now, which
    depends on the chunks' split: the estimate takes the busiest group's work for it, 4.7 % short at most.)
    Where no layer moves, the tail of the groups' synchronisation and step brings it within 1 % of the draft
    (0.977-0.985 under gloo's rules without it)."""
    inventory = four_machines_four_types()
    profile = reference_profile("llama_3b", [t.name for t in inventory.gpu_types], 512, "float16")
    layout = tuple(tuple(range(4 * m, 4 * m + 4)) for m in range(4))
    batch = 32 * inventory.world_size
    for counts in ((13, 1, 8, 4), (7, 4, 15), (8, 4, 14)):
        stages = layout if len(counts) == 4 else ((*layout[0], *layout[1]), layout[2], layout[3])
        pins = PlannerOptions(p2p_rules=rules, stage_layout=stages, layer_counts=counts, microbatch_size=4, max_interleave=1)
        plain = make_plan(inventory, profile, batch, pins)
        search = Search.build(inventory, profile, batch, pins, lambda _: None)
        base = plan_cost(search.ctx, plain, memory=False)
        for degree in degrees(plain, 4)[1:]:
            estimate = interleaved_best_case_ms(search.ctx, plain, base, degree)
            draft = interleaved_draft(search, plain, degree, [stage.busy_ms for stage in base.stages])
            assert 0.95 * plan_cost(search.ctx, draft, memory=False).pipeline_ms <= estimate <= draft.predicted.iteration_ms
            if min(counts) >= degree:  # no layer moves: the groups' synchronisation and step counted, within 1 %
                assert estimate >= 0.99 * draft.predicted.iteration_ms


def test_llama_7b_on_four_machines_finds_the_peers_order_and_moves_layers_to_fit_interleaved() -> None:
    """The peers' Llama 7B structure on the same cluster: whole machines in the order A6000, A10G, A100, V100
    (most memory per unit of speed first: each group's layers follow its speed), interleaved x2 with
    [8, 4, 14, 6] layers. The even split of that order, [7, 4, 15, 6], does not fit interleaved (the A100s
    hold more activations in flight): a layer moved off them makes it fit, and the search finds it unpinned,
    as fast as the structure pinned."""
    inventory = four_machines_four_types()
    profile = reference_profile("llama_7b", [t.name for t in inventory.gpu_types], 512, "float16")
    plan = make_plan(inventory, profile, 32 * inventory.world_size, GLOO)
    groups = plan.rank_groups
    assert [inventory.gpus[g.ranks[0]].gpu_type.name for g in groups] == ["a6000", "a10g", "a100x40", "v100x16"]
    assert [sum(s.num_layers for s in plan.stages if s.ranks == g.ranks) for g in groups] == [8, 4, 14, 6]
    assert plan.interleave == 2 and plan.microbatch_size == 4
    assert any(note.startswith("interleaved x2") and "(layers [8, 4, 14, 6])" in note for note in plan.notes)
    layout = tuple(g.ranks for g in groups)
    pinned = make_plan(inventory, profile, 32 * inventory.world_size, PlannerOptions(
        p2p_rules="gloo",         stage_layout=layout, layer_counts=(8, 4, 14, 6), microbatch_size=4, max_interleave=2,
    ))
    assert plan.predicted.iteration_ms <= pinned.predicted.iteration_ms * 1.0001
    unmoved = PlannerOptions(p2p_rules="gloo", stage_layout=layout, layer_counts=(7, 4, 15, 6), microbatch_size=4, max_interleave=2)
    assert make_plan(inventory, profile, 32 * inventory.world_size, unmoved).interleave == 1  # pins are kept as given


def test_the_plan_held_is_refined_by_its_layouts_program_past_max_programs() -> None:
    """a100x4_v100x4, Llama 7B at 32 samples per GPU (gloo's rules): the plan held at the stop, one stage per
    machine at microbatch 4, is the heuristic split (11 and 21 layers), and the 8 programs went to layouts of
    lower bound. Its own layout's program runs then, past ``max_programs``: a layer moves to the A100s, as the
    peers' structure pinned gives it (1.1 % faster). With programs off it does not run. (Under NCCL's rules,
    whose receivers wait for no gradient's notice, the heuristic split is 10 and 22 already.)"""
    inventory = load_cluster("a100x4_v100x4")
    profile = reference_profile("llama_7b", [t.name for t in inventory.gpu_types], 512, "float16")
    batch = 32 * inventory.world_size
    plan = make_plan(inventory, profile, batch, PlannerOptions(p2p_rules="gloo"))
    assert plan.solver.status.startswith("optimal; 9 programs solved")
    assert [s.num_layers for s in plan.stages] == [10, 22] and plan.interleave == 1
    layout = tuple(s.ranks for s in plan.stages)
    pinned = make_plan(inventory, profile, batch, PlannerOptions(p2p_rules="gloo", stage_layout=layout, microbatch_size=plan.microbatch_size))
    assert plan.predicted.iteration_ms == pytest.approx(pinned.predicted.iteration_ms, rel=1e-9)
    heuristic = make_plan(inventory, profile, batch, PlannerOptions(p2p_rules="gloo", max_programs=0))
    assert "; 0 programs solved" in heuristic.solver.status
    assert heuristic.predicted.iteration_ms > plan.predicted.iteration_ms * 1.005


def test_a_degree_whose_remedy_costs_its_gain_gives_its_simulation_to_the_next() -> None:
    """a100x4_v100x4, Llama 7B at 8 samples per GPU: the degrees the closed form rates best fit only by
    offloading on the A100s, whose copies cost more than interleaving gains. Estimated again once fitted,
    they are not simulated, and the simulations go to the degrees still promising: a finalist at x3, 3.2 %
    faster (all four simulations went to the offloading degrees before, and the plan stayed plain)."""
    inventory = load_cluster("a100x4_v100x4")
    profile = reference_profile("llama_7b", [t.name for t in inventory.gpu_types], 512, "float16")
    plan = make_plan(inventory, profile, 8 * inventory.world_size, GLOO)
    plain = make_plan(inventory, profile, 8 * inventory.world_size, PlannerOptions(p2p_rules="gloo", max_interleave=1))
    assert plan.interleave > 1
    assert plan.predicted.iteration_ms < plain.predicted.iteration_ms * (1 - INTERLEAVE_MARGIN)
    assert not any(s.offload_activations for s in plan.stages)


def test_every_order_of_the_chosen_groups_is_tried_where_no_rule_gives_the_best() -> None:
    """Llama tiny on four machines of four types: the machines' links are alike, so the order of the four
    groups is set by where the embedding and head land and by the activations in flight. The best order
    of the chosen groups at the chosen microbatch size (A10G, V100, A6000, A100, NCCL's rules) is none of the
    rules of :func:`.grouping.stage_orders`; the search tries all 24 orders and ends within 1 % of the best
    plan of an order found under gloo's rules pinned at microbatches 4 and 8 (V100, A10G, A6000, A100).
    (Under gloo's rules, a plain plan of a rule's order and that order's x3 at 8 are 1.1 % apart, within the
    spread of the closed form and the interleaving margin, and the search may hold either.)"""
    from zorse_lightning.planner.cost.context import CostContext
    from zorse_lightning.planner.search.layouts import stage_orders
    from zorse_lightning.planner.search.heuristic import speed_by_type

    inventory = four_machines_four_types()
    profile = reference_profile("llama_tiny", [t.name for t in inventory.gpu_types], 512, "float16")
    plan = make_plan(inventory, profile, 32 * inventory.world_size)
    layout = tuple(s.ranks for s in plan.stages)
    ctx = CostContext.build(inventory, profile)
    assert layout not in stage_orders(sorted(layout), inventory, ctx.links, speed_by_type(ctx))  # as the search groups them
    best_order = tuple(tuple(range(4 * m, 4 * m + 4)) for m in (2, 3, 1, 0))  # V100, A10G, A6000, A100
    for size in (4, 8):
        pinned = make_plan(inventory, profile, 32 * inventory.world_size, PlannerOptions(stage_layout=best_order, microbatch_size=size))
        assert plan.predicted.iteration_ms <= pinned.predicted.iteration_ms * 1.01


def test_slowest_machines_first_is_an_order_the_search_tries() -> None:
    """Llama 13B on eight machines of four types (32 samples a GPU): one stage per machine, slowest first,
    the A100s last with the head, beats every other rule's order by 4 %: the slow machines hold few layers,
    so they have room for the activations 1F1B's warm-up keeps on the first stages."""
    inventory = load_cluster("mix32_4types")
    profile = reference_profile("llama_13b", [t.name for t in inventory.gpu_types], 512, "float16")
    plan = make_plan(inventory, profile, 32 * inventory.world_size, GLOO)
    types = [s.gpu_types[0] for s in plan.stages]
    assert types == ["t4", "t4", "a10g", "a10g", "v100x16", "v100x16", "a100x40", "a100x40"]
    assert all(len(set(s.machines)) == 1 and len(s.ranks) == 4 for s in plan.stages)

"""The search's heuristic split and lower bound: the balanced layer split against brute
force, the lower bound never above a priced plan (it prunes candidates), and the stage
order that keeps the head off the slowest GPUs."""

from __future__ import annotations

import itertools

import pytest

from zorse_lightning.capabilities import P2PRules, Schedule
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.search.layouts import stage_orders
from zorse_lightning.planner.search.heuristic import balanced_layer_counts, balanced_plan, proportional_plan, speed_by_type
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.planner.cost.comm import transfer_ms
from zorse_lightning.planner.search.problem import WindowCosts, block_extras, receive_wait_ms
from zorse_lightning.planner.search.bound import lower_bound_ms
from zorse_lightning.planner.search.fit import heuristic_split, split_draft
from zorse_lightning.planner.search.space import Search

from test_planner_fixtures import synthetic_profile


def _stage_busy_ms(ctx, windows, layout, m, microbatches, counts) -> float:
    """Busiest stage's compute (layers and the embedding or head) and transfer waits, rank by rank."""
    last = len(layout) - 1
    message_bytes = ctx.profile.layers[0].output_bytes_per_sample * m
    return max(
        n * (windows.time_ms(ctx.inventory.gpus[r].gpu_type.name, m, False)[k - 1]
             + block_extras(ctx, ctx.inventory.gpus[r].gpu_type.name, m, s == 0, s == last)[0]
             + receive_wait_ms(ctx, layout, s, (r,), message_bytes))
        for s, (ranks, stage_microbatches, k) in enumerate(zip(layout, microbatches, counts))
        for r, n in zip(ranks, stage_microbatches)
    )


@pytest.mark.parametrize(
    ("layer_scale", "hidden", "vocab"),
    [
        (None, 2048, 50_000),
        ((1.0, 2.5, 0.5, 1.0, 3.0, 1.0, 0.7, 1.0, 1.2, 0.9), 2048, 50_000),
        (None, 256, 1000),  # small blocks: the transfers waited for move the optimum (compute alone: 3, 5, 2)
    ],
)
def test_balanced_layer_split_is_the_brute_force_optimum(layer_scale, hidden: int, vocab: int) -> None:
    inventory = load_cluster("a10g_l4_t4")
    profile = synthetic_profile(
        tuple(t.name for t in inventory.gpu_types), num_layers=10, hidden=hidden, vocab=vocab, layer_scale=layer_scale
    )
    ctx = CostContext.build(inventory, profile)
    windows = WindowCosts(ctx)
    layout = ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))  # A10G, L4, T4 machines
    microbatches = [[4, 4, 3, 3], [2, 2, 3, 3], [1, 2, 3, 4]]
    counts = balanced_layer_counts(ctx, windows, layout, 2, microbatches, False)
    best = min(
        _stage_busy_ms(ctx, windows, layout, 2, microbatches, split)
        for split in itertools.product(range(1, 9), repeat=3)
        if sum(split) == 10
    )
    assert sum(counts) == 10 and min(counts) >= 1
    assert _stage_busy_ms(ctx, windows, layout, 2, microbatches, counts) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("rules", list(P2PRules))
def test_a_stage_waits_for_an_activation_and_a_gradient_from_before_and_a_gradient_from_after(rules: P2PRules) -> None:
    """The engine's blocking receives: per microbatch a middle stage waits for three transfers under gloo's
    rules (the previous stage's activation behind the gradient it sent there, the next stage's gradient), the
    first for one, the last for two; under NCCL's, whose receives are posted ahead, no gradient goes before an
    activation: two, one and one. What a split balancing compute alone leaves out."""
    inventory = load_cluster("a10g_l4_t4")
    profile = synthetic_profile(tuple(t.name for t in inventory.gpu_types), num_layers=12, hidden=4096)
    ctx = CostContext.build(inventory, profile, p2p_rules=rules)
    layout = ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))  # one machine per stage
    message_bytes = profile.layers[0].output_bytes_per_sample * 4
    one_ms = transfer_ms(message_bytes, *ctx.links.link(0, 4, header=True)[1:])
    waits = [receive_wait_ms(ctx, layout, s, layout[s], message_bytes) for s in range(3)]
    noticed = rules is P2PRules.GLOO
    assert waits == pytest.approx([one_ms, (2 + noticed) * one_ms, (1 + noticed) * one_ms])


def test_balanced_split_moves_layers_off_the_stage_with_the_head() -> None:
    """Same GPUs, same speed: the proportional split is even; the head costs like a layer
    or more, so the balanced split gives the last stage fewer layers."""
    inventory = load_cluster("dc2_a100x8_v100x8")
    profile = synthetic_profile(tuple(t.name for t in inventory.gpu_types), num_layers=12, vocab=100_000)
    ctx = CostContext.build(inventory, profile)
    layout = (tuple(range(4)), tuple(range(4, 8)))  # two stages of four A100s
    even = proportional_plan(ctx, layout, 2, 64)
    balanced = balanced_plan(
        ctx, WindowCosts(ctx), layout, 2, 64, schedule=Schedule.ONE_F_ONE_B, recompute=False, speeds=speed_by_type(ctx)
    )
    assert [s.num_layers for s in even.stages] == [6, 6]
    head_in_layers = block_extras(ctx, "a100x40", 2, False, True)[0] / WindowCosts(ctx).time_ms("a100x40", 2, False)[0]
    assert head_in_layers > 1.5
    assert balanced.stages[1].num_layers < balanced.stages[0].num_layers


@pytest.mark.parametrize("name", ["a100x4_v100x4", "a10g_l4_t4", "lab4_l4_a6000_p40"])
def test_lower_bound_never_exceeds_a_priced_plan(name: str) -> None:
    inventory = load_cluster(name)
    profile = synthetic_profile(tuple(t.name for t in inventory.gpu_types), num_layers=12, hidden=1024)
    search = _search(inventory, profile, 32)
    checked = 0
    for layout in search.layouts:
        for m in (1, 4):
            for priced_plan in heuristic_split(search, layout, m, (), split_draft(search, layout, m)):  # offloading where over memory, where offered
                assert lower_bound_ms(search.ctx, layout, m, 32) <= priced_plan.predicted.iteration_ms * (1 + 1e-12)
                checked += 1
    assert checked > 10


def _search(inventory, profile, global_batch_size: int, **options) -> Search:
    return Search.build(inventory, profile, global_batch_size, PlannerOptions(allow_idle_ranks=True, **options), lambda _: None)


def test_an_order_puts_the_fastest_group_last_where_the_head_is() -> None:
    inventory = load_cluster("mix32_4types")
    ctx = CostContext.build(inventory, synthetic_profile(tuple(t.name for t in inventory.gpu_types)))
    speeds = speed_by_type(ctx)
    groups = [tuple(range(i, i + 8)) for i in range(0, 32, 8)]  # A100, V100, A10G, T4 pairs of machines
    by_speed = sorted(groups, key=lambda g: -speeds[inventory.gpus[g[0]].gpu_type.name])
    assert inventory.gpus[by_speed[0][0]].gpu_type.name == "a100x40"
    orders = stage_orders(groups, inventory, ctx.links, speeds)
    assert tuple(by_speed) in orders
    assert (*by_speed[1:], by_speed[0]) in orders  # the rest fastest first, the A100s last with the head


@pytest.mark.parametrize("m", [1, 4, 8])
def test_lower_bound_never_exceeds_any_layer_split(m: int) -> None:
    """Every split of the layers of every layout, priced in the closed form, with as few microbatches
    as GPUs in a stage or fewer (16 samples): the bound of the fill and drain and of a stage's busiest
    GPU holds for each split, not only for the heuristic's."""
    from zorse_lightning.planner.cost.evaluate import plan_cost
    from zorse_lightning.planner.search.heuristic import _split_plan, microbatch_split
    from zorse_lightning.planner.search.problem import SEARCH_SHARDING

    inventory = load_cluster("a10g_l4_t4")
    profile = synthetic_profile(tuple(t.name for t in inventory.gpu_types), num_layers=8, hidden=1024)
    ctx = CostContext.build(inventory, profile)
    speeds = speed_by_type(ctx)
    checked = 0
    for layout in _search(inventory, profile, 16).layouts:
        if len(layout) > 3:
            continue
        bound = lower_bound_ms(ctx, layout, m, 16)
        microbatches = microbatch_split(ctx, layout, 16 // m, speeds)
        for split in itertools.product(range(1, 9), repeat=len(layout)):
            if sum(split) != 8:
                continue
            plan = _split_plan(ctx, layout, split, microbatches, m, 16, Schedule.ONE_F_ONE_B, SEARCH_SHARDING, False)
            assert bound <= plan_cost(ctx, plan, memory=False).iteration_ms * (1 + 1e-12), (layout, split)
            checked += 1
    assert checked > 50


@pytest.mark.parametrize("name", ["a10g_l4_t4", "mix32_4types"])
def test_lower_bound_never_exceeds_a_random_plan_plain_or_interleaved(name: str) -> None:
    """Random layouts of the search, random layer counts, random microbatch shares and a random
    interleaving degree: the bound the loop queues a candidate by is below the plan's closed form and
    below its simulation (what the search predicts it by)."""
    import random

    from zorse_lightning.planner.cost.evaluate import plan_cost
    from zorse_lightning.planner.cost.simulate import simulate
    from zorse_lightning.planner.interleaving import interleave
    from zorse_lightning.planner.search.heuristic import _split_plan
    from zorse_lightning.planner.search.problem import SEARCH_SHARDING

    inventory = load_cluster(name)
    profile = synthetic_profile(tuple(t.name for t in inventory.gpu_types), num_layers=12, hidden=1024)
    search = _search(inventory, profile, 32)
    rng = random.Random(37)
    layouts = [l for l in search.layouts if 2 <= len(l) <= 6]
    interleaved = 0
    for _ in range(40):
        layout, m, degree = rng.choice(layouts), rng.choice((2, 4, 8)), rng.choice((1, 2, 3))  # few microbatches
        degree = degree if degree * len(layout) <= 12 else 1
        counts = [degree] * len(layout)  # every group a layer per chunk, the rest anywhere
        for _ in range(12 - sum(counts)):
            counts[rng.randrange(len(counts))] += 1
        shares = [[0] * len(ranks) for ranks in layout]
        for stage in shares:
            for _ in range(16 // m):
                stage[rng.randrange(len(stage))] += 1
        plain = _split_plan(search.ctx, layout, counts, shares, m, 16, Schedule.ONE_F_ONE_B, SEARCH_SHARDING, False)
        plan = interleave(plain, degree)
        interleaved += degree > 1
        bound = lower_bound_ms(search.ctx, layout, m, 16, degree)
        assert bound <= plan_cost(search.ctx, plan, memory=False).iteration_ms * (1 + 1e-12), (layout, counts, degree)
        assert bound <= simulate(search.ctx, plan).makespan_ms * (1 + 1e-12), (layout, counts, degree)
    assert interleaved > 10


def test_lower_bound_counts_every_layer_of_one_microbatch() -> None:
    """One microbatch through a pipeline of four stages passes every layer once, back to back: the
    bound is at least the model's layers at the fastest GPU's layer time (a bound that counted one
    layer per stage in the fill let the search price thousands of hopeless deep layouts)."""
    inventory = load_cluster("a10g_l4_t4")
    profile = synthetic_profile(tuple(t.name for t in inventory.gpu_types), num_layers=12, hidden=1024)
    ctx = CostContext.build(inventory, profile)
    layout = ((0,), (4,), (8,), (9,))
    fastest = min(ctx.fastest_layer_ms(t.name, 4) for t in inventory.gpu_types)
    assert lower_bound_ms(ctx, layout, 4, 4) >= 12 * fastest


@pytest.mark.parametrize("m", [1, 4])
def test_the_any_layout_bound_holds_for_every_layout_of_its_ranks_and_the_sub_cluster_plan(m: int) -> None:
    """The bound the search skips planning the fastest type alone by is below every layout's bound on
    those GPUs or fewer, and below the simulated time of the plan made on their sub-cluster."""
    from zorse_lightning.planner.baselines import fastest_type_cluster
    from zorse_lightning.planner.search.bound import any_layout_lower_bound_ms
    from zorse_lightning.planner.search import make_plan

    inventory = load_cluster("a10g_l4_t4")
    profile = synthetic_profile(tuple(t.name for t in inventory.gpu_types), num_layers=8, hidden=1024)
    ctx = CostContext.build(inventory, profile)
    everyone = tuple(range(inventory.world_size))
    checked = 0
    for layout in _search(inventory, profile, 16).layouts:
        used = tuple(sorted(r for stage in layout for r in stage))
        for ranks in {used, everyone}:
            assert any_layout_lower_bound_ms(ctx, ranks, m, 16) <= lower_bound_ms(ctx, layout, m, 16) * (1 + 1e-12)
            checked += 1
    assert checked > 20
    sub, ranks = fastest_type_cluster(ctx)
    alone = make_plan(sub, profile, 16, PlannerOptions(microbatch_sizes=(m,)))
    assert alone.predicted.closed_form_ms is not None  # simulated
    assert any_layout_lower_bound_ms(ctx, ranks, m, 16) <= alone.predicted.iteration_ms


def test_a_stage_unsharded_where_free_is_priced_as_a_fresh_pricing_would() -> None:
    """The search reuses a stage's times when it unshards it (sharding changes only what follows the last
    backward): the plan's prediction equals the prediction of the unsharded plan priced from scratch."""
    from zorse_lightning.capabilities import Sharding
    from zorse_lightning.planner.cost.evaluate import plan_cost, prediction
    from zorse_lightning.planner.search.fit import unsharded_where_free

    inventory = load_cluster("a10g_l4_t4")
    profile = synthetic_profile(tuple(t.name for t in inventory.gpu_types), num_layers=8, hidden=1024)
    search = _search(inventory, profile, 32)
    ctx = search.ctx
    unsharded = 0
    for layout in search.layouts:
        for m in (1, 4):
            plan = balanced_plan(ctx, search.windows, layout, m, 32, schedule=Schedule.ONE_F_ONE_B, recompute=False, speeds=search.speeds)
            found = plan and unsharded_where_free(search, plan)
            if found is None:
                continue
            unsharded += sum(a.sharding is not b.sharding for a, b in zip(found.stages, plan.stages))
            assert found.predicted == prediction(ctx, found, plan_cost(ctx, found))
            assert all(s.sharding in (Sharding.NONE, Sharding.OPTIMIZER_GRADIENTS) for s in found.stages)
    assert unsharded > 5


@pytest.mark.parametrize("name", ["a100x4_v100x4", "mix32_4types"])
def test_lower_bound_never_exceeds_a_random_plan_with_tensor_parallelism(name: str) -> None:
    """Random layouts split over TP groups where their stages admit it (:meth:`Search.split_over`), random
    layer counts and replica shares: the bound a TP candidate is queued by is below the plan's closed form
    and its simulation (a bound that took a TP stage's layers at their one-GPU time would exceed them)."""
    import random
    from dataclasses import replace

    from zorse_lightning.planner.cost.evaluate import plan_cost
    from zorse_lightning.planner.cost.simulate import simulate
    from zorse_lightning.planner.search.heuristic import _split_plan
    from zorse_lightning.planner.search.problem import SEARCH_SHARDING
    from zorse_lightning.profiling.profile import TensorParallelSupport

    inventory = load_cluster(name)
    profile = synthetic_profile(tuple(t.name for t in inventory.gpu_types), num_layers=12, hidden=1024)
    profile = replace(profile, tensor_parallel=TensorParallelSupport((2, 4), "", 2048))
    search = _search(inventory, profile, 32)
    rng = random.Random(38)
    splits = [s for l in search.layouts if len(l) <= 6 for t in (2, 4) for s in [search.split_over(l, t)] if s]
    tight = 0
    for _ in range(30):
        layout, degrees = rng.choice(splits)
        m = rng.choice((2, 4, 8))
        counts = [1] * len(layout)
        for _ in range(12 - len(layout)):
            counts[rng.randrange(len(counts))] += 1
        shares = []
        for ranks, t in zip(layout, degrees):
            replicas = [0] * (len(ranks) // t)
            for _ in range(16 // m):
                replicas[rng.randrange(len(replicas))] += 1
            shares.append([n for n in replicas for _ in range(t)])
        plan = _split_plan(search.ctx, layout, counts, shares, m, 16, Schedule.ONE_F_ONE_B, SEARCH_SHARDING, False, degrees)
        assert [s.tensor_parallel for s in plan.stages] == list(degrees)
        bound = lower_bound_ms(search.ctx, layout, m, 16, 1, degrees)
        plain_bound = lower_bound_ms(search.ctx, layout, m, 16)
        closed = plan_cost(search.ctx, plan, memory=False).iteration_ms
        assert bound <= closed * (1 + 1e-12), (layout, degrees, counts)
        assert bound <= simulate(search.ctx, plan).makespan_ms * (1 + 1e-12), (layout, degrees, counts)
        tight += plain_bound > min(closed, simulate(search.ctx, plan).makespan_ms)  # the bound without TP would not hold
    assert tight > 0


def test_the_tail_bound_holds_at_every_sharding_level_and_bounds_a_wide_stage_tightly() -> None:
    """Random plans of GPT 1.3B on two datacenters (NCCL's collectives, a slow link between them) at every
    sharding level, some interleaved, some gathered per microbatch, some recomputing, some with TP: the bound
    is below each plan's closed form and (where the simulation plays it) its simulation. A layout whose
    stages reduce their gradients over the slow link is bounded by that reduction: the bound of one stage of
    every GPU is within 15 % of its heuristic split's closed form (without :func:`.bound.tail_bound_ms`, a
    twentieth of it)."""
    import random
    from dataclasses import replace

    from zorse_lightning.capabilities import Sharding
    from zorse_lightning.planner.cost.evaluate import plan_cost
    from zorse_lightning.planner.cost.simulate import simulate
    from zorse_lightning.planner.interleaving import interleave
    from zorse_lightning.planner.search.heuristic import _split_plan
    from zorse_lightning.profiling import reference_profile

    inventory = load_cluster("dc2_a100x8_v100x8")
    profile = reference_profile("gpt_1.3b", [t.name for t in inventory.gpu_types], 512, "float16")
    search = _search(inventory, profile, 64)
    layers = profile.num_layers
    rng = random.Random(41)
    splits = [(l, None) for l in search.layouts if len(l) <= 6]
    splits += [s for l in search.layouts if len(l) <= 6 for t in search.tensor_parallel_degrees for s in [search.split_over(l, t)] if s]
    tight = 0
    for _ in range(120):
        layout, degrees = rng.choice(splits)
        m, num_m = rng.choice((1, 2, 4, 8)), rng.choice((2, 4, 8, 16))
        degree = rng.choice((1, 2, 3)) if degrees is None and rng.random() < 0.5 else 1
        degree = degree if len(layout) > 1 and degree * len(layout) <= layers else 1
        counts = [degree] * len(layout)
        for _ in range(layers - sum(counts)):
            counts[rng.randrange(len(counts))] += 1
        shares = []
        for ranks, t in zip(layout, degrees or (1,) * len(layout)):
            replicas = [0] * (len(ranks) // t)
            for _ in range(num_m):
                replicas[rng.randrange(len(replicas))] += 1
            shares.append([n for n in replicas for _ in range(t)])
        level = rng.choice([Sharding.NONE, Sharding.OPTIMIZER] if degrees else list(Sharding))
        plan = _split_plan(search.ctx, layout, counts, shares, m, m * num_m, Schedule.ONE_F_ONE_B, level, rng.random() < 0.2, degrees)
        gathered = len(layout) == 1 and len(layout[0]) > 1 and level is Sharding.FULL and rng.random() < 0.5
        plan = replace(plan, stages=tuple(replace(s, gather_per_microbatch=True) for s in plan.stages)) if gathered else plan
        plan = interleave(plan, degree) if degree > 1 else plan
        bound = lower_bound_ms(search.ctx, layout, m, m * num_m, degree, degrees)
        predicted = [plan_cost(search.ctx, plan, memory=False).iteration_ms] + ([] if gathered else [simulate(search.ctx, plan).makespan_ms])
        assert bound <= min(predicted) * (1 + 1e-12), (layout, degrees, counts, level, degree)
        tight += bound > 0.5 * min(predicted)
    assert tight > 20
    everyone = (tuple(range(inventory.world_size)),)
    draft = split_draft(search, everyone, 4)
    closed = plan_cost(search.ctx, draft).iteration_ms
    assert 0.85 * closed <= lower_bound_ms(search.ctx, everyone, 4, 64) <= closed


def test_the_bound_adds_to_the_pipeline_only_the_first_stages_step() -> None:
    """Llama 7B on four stages of two A100s, few microbatches: the pipeline is its fill and drain, which the bound
    counts to within 0.1 %, and the stage with the most layers steps inside its drain; only the first stage's step
    follows the pipeline. Adding the step of every parameter spread over every GPU instead came 0.08 % over the plan."""
    from zorse_lightning.capabilities import Sharding
    from zorse_lightning.planner.cost.evaluate import plan_cost
    from zorse_lightning.planner.search.heuristic import _split_plan
    from zorse_lightning.profiling import reference_profile

    inventory = load_cluster("dc2_a100x8_v100x8")
    profile = reference_profile("llama_7b", [t.name for t in inventory.gpu_types], 512, "float16")
    ctx = CostContext.build(inventory, profile)
    layout = ((0, 1), (2, 3), (4, 5), (6, 7))
    plan = _split_plan(ctx, layout, [5, 9, 11, 7], [[1, 1]] * 4, 8, 16, Schedule.ONE_F_ONE_B, Sharding.OPTIMIZER_GRADIENTS, False)
    cost = plan_cost(ctx, plan, memory=False)
    assert cost.exposed_tail_ms(0) == cost.tail_ms < cost.stage_update_ms(2)  # the busiest stage's step hides
    assert cost.iteration_ms * 0.99 < lower_bound_ms(ctx, layout, 8, 16) <= cost.iteration_ms

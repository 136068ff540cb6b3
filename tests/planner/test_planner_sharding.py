"""Sharding levels: memory and communication of each, against hand calculations, and the search's
choice among them (``optimizer_gradients`` over ``optimizer``; ``full`` gathered per microbatch
where nothing else fits, in one-stage plans only)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_planner_costs import _ctx
from test_planner_fixtures import synthetic_profile

from zorse_lightning.capabilities import Schedule, Sharding
from zorse_lightning.cluster import DEFAULT_CATALOG, ClusterInventory, Machine
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner import PlannerOptions, make_plan
from zorse_lightning.planner.cost.comm import (
    LinkTable,
    gather_round_ms,
    ring_all_gather_ms,
    ring_all_reduce_ms,
    ring_reduce_scatter_ms,
    stage_sync_ms,
)
from zorse_lightning.planner.cost.compute import lockstep_busy_ms
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.evaluate import gather_round_ms_of, memory_overruns, plan_cost
from zorse_lightning.planner.cost.stage_state import free_memory_shard_fractions, stage_memory
from zorse_lightning.planner.cost.memory import StageParameters, stage_parameter_counts, stage_state_bytes
from zorse_lightning.schedule.plan import Plan, StagePlan
from zorse_lightning.profiling.profile import BlockShape, BlockTimes, DeviceTimes, ModelProfile, ProfileSource, TimeCurve

# float16: weights 2 + gradients 2 + optimizer 12 bytes per parameter
EDGES, LAYERS, LARGEST = 800, 4500, 1500  # layers of 1000, 1500, 1000, 1000 parameters
SMALL = StageParameters(total=EDGES + LAYERS, layers=LAYERS, largest_layer=LARGEST, num_layers=4)


@pytest.mark.parametrize(
    "sharding, held, sharded",
    [
        (Sharding.NONE, 5300 * 16, 0),
        (Sharding.OPTIMIZER, 5300 * 4, 5300 * 12),
        (Sharding.OPTIMIZER_GRADIENTS, 5300 * 4, 5300 * 12),  # full gradients until the step's end
        (Sharding.FULL, 5300 * 4, 5300 * 12),  # gathered once per step: all weights during it
    ],
)
def test_state_bytes_per_level(sharding: Sharding, held: int, sharded: int) -> None:
    assert stage_state_bytes(SMALL, "float16", sharding) == (held, sharded)
    assert stage_state_bytes(5300, "float16", sharding) == (held, sharded)  # a count is enough here


def test_state_bytes_gathered_per_microbatch() -> None:
    # held: embedding and head whole (weights + gradients) and two of the largest blocks
    # sharded: the layers' whole state and the edges' optimizer state
    held, sharded = stage_state_bytes(SMALL, "float16", Sharding.FULL, gather_per_microbatch=True)
    assert held == (EDGES + 2 * LARGEST) * 4
    assert sharded == LAYERS * 16 + EDGES * 12
    one_block = StageParameters(total=1000, layers=1000, largest_layer=1000, num_layers=1)
    assert stage_state_bytes(one_block, "float32", Sharding.FULL, True) == (1000 * 8, 1000 * 16)  # one block, not two
    for wrong in ((SMALL, Sharding.OPTIMIZER_GRADIENTS), (5300, Sharding.FULL)):
        with pytest.raises(PlanningError, match="gathering per microbatch"):
            stage_state_bytes(*wrong[:1], "float16", wrong[1], True)


def _profile_of(layer_params: tuple[int, ...], edge_params: int, tied: bool = False) -> ModelProfile:
    times = BlockTimes(TimeCurve(1.0, 0.0), TimeCurve(2.0, 0.0))
    device = DeviceTimes("a100x40", ProfileSource.MEASURED, times, (times,) * len(layer_params), times)
    layers = tuple(BlockShape(f"layer{i}", p, 1000, 500, 1.0) for i, p in enumerate(layer_params))
    edge = BlockShape("edge", edge_params, 1000, 500, 1.0)
    return ModelProfile("sharded", 8, "float16", edge, layers, edge, {"a100x40": device}, tied_embedding_head=tied)


def test_stage_parameter_counts() -> None:
    profile = _profile_of((1000, 1500, 1000, 1000), 400)
    assert stage_parameter_counts(profile, (0, 4), first=True, last=True) == SMALL
    assert stage_parameter_counts(profile, (1, 3), first=False, last=False) == StageParameters(2500, 2500, 1500, 2)
    tied = _profile_of((1000, 1500, 1000, 1000), 400, tied=True)
    assert stage_parameter_counts(tied, (0, 4), first=True, last=True).edges == 400  # one copy on one stage


def test_sync_per_level() -> None:
    """On NCCL, inside one machine: an all-reduce of the gradients, two all-reduces, or the traffic of a
    reduce-scatter and an all-gather (the integer program prices its tails so too)."""
    a100 = DEFAULT_CATALOG.get("a100x40")
    links = LinkTable(ClusterInventory("gpus", (Machine("m0", (a100,) * 4, 600.0),)))
    g, ranks = 1e9, (0, 1, 2, 3)
    bandwidth, latency = links.ring(ranks)
    at = {s: stage_sync_ms(links, ranks, g, g, s) for s in Sharding}
    assert at[Sharding.NONE] == pytest.approx(ring_all_reduce_ms(g, 4, bandwidth, latency))
    assert at[Sharding.OPTIMIZER] == pytest.approx(2 * at[Sharding.NONE])
    expected = ring_reduce_scatter_ms(g, 4, bandwidth, latency) + ring_all_gather_ms(g, 4, bandwidth, latency)
    assert at[Sharding.OPTIMIZER_GRADIENTS] == pytest.approx(expected) == pytest.approx(at[Sharding.FULL])
    assert at[Sharding.OPTIMIZER_GRADIENTS] < at[Sharding.OPTIMIZER]
    assert stage_sync_ms(links, (0,), g, g, Sharding.OPTIMIZER) == 0.0


def test_gather_round_pays_each_blocks_collectives() -> None:
    ctx = _ctx()
    ranks = (0, 1, 2)  # one machine at 80 Gb/s
    bandwidth, latency = ctx.links.ring(ranks)
    one = gather_round_ms(ctx.links, ranks, 4e6, 4e6, 1)
    assert one == pytest.approx(2 * ring_all_gather_ms(4e6, 3, bandwidth, latency) + ring_reduce_scatter_ms(4e6, 3, bandwidth, latency))
    # four blocks move the same bytes in four times the collectives: 3 kinds x 3 more x (n - 1) latencies
    assert gather_round_ms(ctx.links, ranks, 4e6, 4e6, 4) == pytest.approx(one + 3 * 3 * 2 * latency / 1000)
    assert gather_round_ms(ctx.links, (0,), 4e6, 4e6, 4) == 0.0


def test_lockstep_rounds_wait_for_the_slowest_rank_with_a_microbatch() -> None:
    assert lockstep_busy_ms([1.0, 3.0], [3, 1]) == pytest.approx(3.0 + 1.0 + 1.0)
    assert lockstep_busy_ms([1.0, 3.0], [2, 2]) == pytest.approx(6.0)
    assert lockstep_busy_ms([1.0, 3.0], [4, 0]) == pytest.approx(4.0)


def _one_stage(counts: tuple[int, ...], sharding: Sharding = Sharding.FULL, gather: bool = True, fractions=()) -> Plan:
    """The hand cluster (A100, V100, A100 in one box) as one stage of the 4-layer hand profile."""
    stage = StagePlan((0, 1, 2), ("a100x40", "v100x16", "a100x40"), ("box",) * 3, (0, 4), counts, sharding, fractions,
                      gather_per_microbatch=gather)
    return Plan("hand", "hand", 4, 3, 2 * sum(counts), 2, Schedule.ONE_F_ONE_B, (stage,))


def test_gathered_per_microbatch_adds_one_round_per_microbatch_of_the_busiest_rank() -> None:
    ctx = _ctx()
    for counts in ((2, 1, 1), (3, 1, 0), (1, 1, 2)):
        plan = _one_stage(counts)
        cost = plan_cost(ctx, plan)
        totals = [t.total_ms for t in cost.stages[0].times]
        round_ms = gather_round_ms_of(ctx, plan, 0)
        assert round_ms > 0
        assert cost.stages[0].busy_ms == pytest.approx(lockstep_busy_ms(totals, list(counts)) + max(counts) * round_ms)
        once = plan_cost(ctx, _one_stage(counts, Sharding.OPTIMIZER_GRADIENTS, False))
        assert cost.iteration_ms > once.iteration_ms  # gathering per microbatch only ever costs time
        assert cost.stages[0].sync_ms == 0.0  # the hand profile's embedding and head have no parameters


def test_memory_of_gathered_stage_and_shares_by_free_memory() -> None:
    ctx = _ctx()
    plan = _one_stage((2, 1, 1))
    fractions = free_memory_shard_fractions(ctx, plan, 0)
    # every rank holds two 1e6-parameter blocks (weights + gradients) and the activations of one microbatch
    held = 2 * 1_000_000 * 4
    memory = stage_memory(ctx, plan, 0, fractions)
    for rank, used, fraction in zip((0, 1, 2), memory, fractions):
        assert used.state_bytes == held
        assert used.sharded_bytes == pytest.approx(fraction * 4 * 1_000_000 * 16)
    free = [ctx.capacity_bytes(r) - (m.total_bytes - m.sharded_bytes) for r, m in zip((0, 1, 2), memory)]
    assert fractions == pytest.approx(tuple(f / sum(free) for f in free))
    assert fractions[1] < fractions[0] == pytest.approx(fractions[2])  # the 16 GiB V100 takes less


def _box(count: int, budget_gib: float) -> ClusterInventory:
    a100 = DEFAULT_CATALOG.get("a100x40")
    return ClusterInventory("box", (Machine("box", (a100,) * count, intra_bandwidth_gbps=80.0, memory_budget_gib=(budget_gib,) * count),))


def test_search_gathers_per_microbatch_where_nothing_else_fits() -> None:
    """Eight layers of 1e6 parameters and a tied 4e6-parameter embedding (192 MB of state) on eight
    GPUs of 47 MB: every pipeline holds the embedding whole on an end stage, one stage sharded at a
    lesser level holds every weight; gathered per microbatch each GPU holds about 46 MB."""
    profile = _profile_of((1_000_000,) * 8, 4_000_000, tied=True)
    state = profile.total_parameters * 16
    inventory = _box(8, 47e6 / 2**30)
    assert state > 3 * inventory.gpus[0].memory_gib * 2**30
    options = PlannerOptions(memory_reserve_gib=0.0)
    plan = make_plan(inventory, profile, 16, options)
    (stage,) = plan.stages
    assert stage.sharding is Sharding.FULL and stage.gather_per_microbatch
    assert any("block by block" in note for note in plan.notes)
    ctx = CostContext.build(inventory, profile, 0.0)
    assert not memory_overruns(ctx, plan, plan_cost(ctx, plan))
    at_once = replace(plan, stages=(replace(stage, sharding=Sharding.OPTIMIZER_GRADIENTS, gather_per_microbatch=False),))
    assert memory_overruns(ctx, at_once, plan_cost(ctx, at_once))


def test_search_does_not_gather_per_microbatch_when_something_else_fits() -> None:
    profile = _profile_of((1_000_000,) * 8, 4_000_000, tied=True)
    plan = make_plan(_box(8, 1.0), profile, 16, PlannerOptions(memory_reserve_gib=0.0))
    assert not any(s.gather_per_microbatch for s in plan.stages)


@pytest.mark.parametrize("cluster", ["cpu_sim4_small_memory", "a10g_l4_t4", "mix32_4types"])
def test_pipelines_that_fit_unsharded_do_not_gather_per_microbatch(cluster: str) -> None:
    """Gathering per microbatch is the remedy of last resort for a pipeline (the search proposes it where a
    layout's split fits only with offload, or not at all): where plain splits fit, none is gathered."""
    inventory = load_cluster(cluster)
    types = tuple(t.name for t in inventory.gpu_types)
    # On the emulated cluster, blocks big enough that the engine's time per action does not outweigh a pipeline.
    hidden, seq_len = (64, 32) if inventory.emulated else (2048, 16)
    profile = synthetic_profile(types, num_layers=8, hidden=hidden, seq_len=seq_len, vocab=100)
    plan = make_plan(inventory, profile, 8 * inventory.world_size)
    assert len(plan.stages) > 1  # these pipeline: the point of the check
    assert not any(s.gather_per_microbatch for s in plan.stages)
    assert all(stage.sharding in (Sharding.NONE, Sharding.OPTIMIZER_GRADIENTS) for stage in plan.stages)


def test_infeasible_message_names_the_most_frugal_level() -> None:
    profile = _profile_of((1_000_000,) * 8, 4_000_000, tied=True)
    with pytest.raises(PlanningError, match="full sharding gathered block by block per microbatch"):
        make_plan(_box(8, 30e6 / 2**30), profile, 16, PlannerOptions(memory_reserve_gib=0.0))

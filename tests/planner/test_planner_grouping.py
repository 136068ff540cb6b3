"""Stage layouts: slow links between stages, every GPU once, and scale."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.planner.cost.comm import LINK_EFFICIENCY, LinkTable
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.search.layouts import (
    candidate_layouts,
    fastest_type_subsets,
    partitions,
    split_groups,
    stage_counts_to_try,
    stage_orders,
)
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.cost.compute import per_sample_layer_ms
from zorse_lightning.planner.search.heuristic import speed_by_type
from zorse_lightning.profiling.profile import BlockTimes, DeviceTimes, ProfileSource, TimeCurve

from test_planner_fixtures import big_cluster, profile_for, real_gpu_profile


def _setup(name: str):
    inventory = load_cluster(name)
    ctx = CostContext.build(inventory, profile_for(inventory))
    return inventory, ctx.links, speed_by_type(ctx)


def _machines(inventory, groups) -> list[set[str]]:
    return [{inventory.gpus[r].machine for r in g} for g in groups]


def test_agglomeration_merges_fastest_links_first() -> None:
    inventory, links, speeds = _setup("mix32_4types")
    all_ranks = tuple(range(32))
    by_count = {len(p): p for p in partitions(inventory, links, speeds, [3, 4], all_ranks)}
    # 200 Gb/s (A100s), 100 (V100s, A100-V100), then 50 (A10Gs), then 25 (T4s)
    assert sorted(map(sorted, _machines(inventory, by_count[4]))) == [
        ["a100-0", "a100-1", "v100-0", "v100-1"], ["a10g-0", "a10g-1"], ["t4-0"], ["t4-1"],
    ]
    # then 25 Gb/s links tie (the T4 pair and the defaults): the A10Gs join the V100s of
    # the same fp16 peak before the T4s meet
    assert sorted(map(sorted, _machines(inventory, by_count[3]))) == [
        ["a100-0", "a100-1", "a10g-0", "a10g-1", "v100-0", "v100-1"], ["t4-0"], ["t4-1"],
    ]


def test_two_datacenters_become_two_groups() -> None:
    inventory, links, speeds = _setup("dc2_a100x8_v100x8")
    (two,) = partitions(inventory, links, speeds, [2], tuple(range(16)))
    assert sorted(map(sorted, two)) == [list(range(8)), list(range(8, 16))]


def test_one_machine_splits_by_gpu_type() -> None:
    inventory, links, speeds = _setup("lab4_l4_a6000_p40")
    (three,) = partitions(inventory, links, speeds, [3], tuple(range(4)))
    assert sorted(map(sorted, three)) == [[0, 1], [2], [3]]  # two L4, the A6000, the P40


def test_split_groups_and_stage_counts() -> None:
    assert split_groups([tuple(range(8)), (8, 9, 10)], 4) == [(0, 1), (2, 3), (4, 5), (6, 7), (8,), (9,), (10,)]
    assert stage_counts_to_try(8, 16) == list(range(1, 9))
    assert stage_counts_to_try(128, 64) == [*range(1, 17), 24, 36, 54, 64]


def test_orders_put_the_fastest_links_on_boundaries() -> None:
    inventory, links, speeds = _setup("mix32_4types")
    groups = [tuple(range(28, 32)), tuple(range(0, 4)), tuple(range(4, 8))]  # t4-1, a100-0, a100-1
    orders = stage_orders(groups, inventory, links, speeds)
    # path t4-1 - a100-1 (10 Gb/s) - a100-0 (200) beats t4-1 - a100-0 (25) - a100-1 (200)? its slowest
    # boundary is 10 < 25, so the best path keeps t4-1 next to a100-0
    best = orders[0]
    boundaries = [links.bandwidth_gbps(a[0], b[0]) for a, b in zip(best, best[1:])]
    assert min(boundaries) == 25.0 * LINK_EFFICIENCY
    assert all(sorted(r for s in order for r in s) == sorted(r for g in groups for r in g) for order in orders)


def test_fastest_type_subsets() -> None:
    inventory, _, speeds = _setup("a10g_l4_t4")
    subsets = fastest_type_subsets(inventory, speeds)
    fastest = max(speeds, key=speeds.get)
    assert subsets[0] == tuple(range(12))
    assert {inventory.gpus[r].gpu_type.name for r in subsets[-1]} == {fastest}
    assert [len(s) for s in subsets] == [12, 8, 4]


def test_layouts_of_1024_gpus_use_each_gpu_once() -> None:
    inventory = big_cluster()
    ctx = CostContext.build(inventory, real_gpu_profile(inventory))
    layouts = candidate_layouts(inventory, LinkTable(inventory), speed_by_type(ctx), 16)
    assert 10 < len(layouts) < 400
    for layout in layouts:
        ranks = [r for stage in layout for r in stage]
        assert sorted(ranks) == list(range(1024)) and len(layout) <= 16
    # racks of four machines share 200 Gb/s links: at 32 groups no rack is cut
    for groups in partitions(inventory, LinkTable(inventory), speed_by_type(ctx), [32], tuple(range(1024))):
        assert all(len({int(m[1:]) // 4 for m in machines}) == 1 for machines in _machines(inventory, groups))


def test_speeds_stay_positive_when_a_slope_is_not() -> None:
    # tiny blocks timed faster at 2 samples than at 1: slope -0.1 ms, one sample 0.5 + 1.0 ms
    falling = BlockTimes(TimeCurve(-0.1, 0.6, (0.5, 0.4)), TimeCurve(-0.1, 1.1, (1.0, 0.9)))
    device = DeviceTimes("t4", ProfileSource.MEASURED, falling, (falling,) * 2, falling)
    assert per_sample_layer_ms(device) == pytest.approx(1.5)  # the one-sample time, not the slope
    rising = BlockTimes(TimeCurve(0.2, 0.1), TimeCurve(0.4, 0.1))
    assert per_sample_layer_ms(replace(device, layers=(rising,) * 2)) == pytest.approx(0.6)
    inventory, links, speeds = _setup("mix32_4types")
    with pytest.raises(PlanningError, match="must be positive"):
        partitions(inventory, links, {**speeds, "t4": 0.0}, [3], tuple(range(32)))

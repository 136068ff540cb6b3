"""Cost-model terms against hand calculations."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zorse_lightning.capabilities import P2PRules, Schedule, Sharding
from zorse_lightning.cluster import DEFAULT_CATALOG, ClusterInventory, Machine
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.planner.cost.comm import (
    LINK_EFFICIENCY,
    LinkTable,
    ring_all_reduce_ms,
    ring_reduce_scatter_ms,
    transfer_ms,
)
from zorse_lightning.planner.cost.compute import (
    pipeline_ms,
    receiving_busy_ms,
    round_trip_busy_ms,
    stage_microbatch_times,
)
from zorse_lightning.planner.cost.boundaries import routes
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.evaluate import memory_overruns, plan_cost, prediction
from zorse_lightning.planner.cost.framework_memory import reserve_gib
from zorse_lightning.errors import PlanningError
from zorse_lightning.schedule.plan import Plan, StagePlan
from zorse_lightning.planner.rounding import proportional_counts
from zorse_lightning.profiling.profile import BlockShape, BlockTimes, DeviceTimes, ModelProfile, ProfileSource, TimeCurve
from zorse_lightning.units import BYTES_PER_GIB

FLOOR = 1e-3  # MIN_BLOCK_TIME_MS: a zero curve still costs this much
LAYER_PARAMS = 1_000_000
LAYER_ACT = 1_000_000
LAYER_OUT = 250_000


def _curve(slope: float) -> TimeCurve:
    return TimeCurve(slope, 0.0)


def _device(name: str, forward_slope: float) -> DeviceTimes:
    layer = BlockTimes(_curve(forward_slope), _curve(2 * forward_slope))
    zero = BlockTimes(_curve(0.0), _curve(0.0))
    return DeviceTimes(name, ProfileSource.MEASURED, zero, (layer,) * 4, zero)


def _profile() -> ModelProfile:
    layer = BlockShape("layer", LAYER_PARAMS, LAYER_ACT, LAYER_OUT, 1.0)
    edge = BlockShape("edge", 0, 0, LAYER_OUT, 0.0)
    devices = {"a100x40": _device("a100x40", 1.0), "v100x16": _device("v100x16", 2.0)}
    return ModelProfile("hand", 8, "float16", edge, (layer,) * 4, edge, devices)


def _inventory() -> ClusterInventory:
    a100, v100 = DEFAULT_CATALOG.get("a100x40"), DEFAULT_CATALOG.get("v100x16")
    return ClusterInventory("hand", (Machine("box", (a100, v100, a100), intra_bandwidth_gbps=80.0),))


def _plan(sharding: Sharding = Sharding.NONE, fractions=(), recompute: bool = False) -> Plan:
    """Stage 0: ranks 0 (A100) and 1 (V100) with 3 and 1 microbatches, layers [0, 2);
    stage 1: rank 2 (A100), layers [2, 4); microbatch size 2, global batch 8."""
    first = StagePlan((0, 1), ("a100x40", "v100x16"), ("box", "box"), (0, 2), (3, 1), sharding, fractions, recompute)
    second = StagePlan((2,), ("a100x40",), ("box",), (2, 4), (4,))
    return Plan("hand", "hand", 4, 3, 8, 2, Schedule.ONE_F_ONE_B, (first, second))


def _ctx(rules: P2PRules | None = None) -> CostContext:
    return CostContext.build(_inventory(), _profile(), memory_reserve_gib=0.5, p2p_rules=rules)


def test_transfer_and_ring_collectives() -> None:
    # 8 Gb/s = 1e9 B/s: 1e6 bytes take 1 ms, plus 10 us latency
    assert transfer_ms(1e6, 8.0, 10.0) == pytest.approx(1.01)
    # ring all-reduce over 4 ranks at 80 Gb/s (1e10 B/s): 2 * 3/4 * 1e9 / 1e10 s + 6 x 5 us
    assert ring_all_reduce_ms(1e9, 4, 80.0, 5.0) == pytest.approx(150.03)
    assert ring_reduce_scatter_ms(1e9, 4, 80.0, 5.0) == pytest.approx(75.015)
    assert ring_all_reduce_ms(1e9, 1, 80.0, 5.0) == 0.0


def test_ring_is_limited_by_its_slowest_link() -> None:
    links = LinkTable(load_cluster("mix32_4types"), efficiency=1.0)
    assert links.ring(tuple(range(4))) == (4800.0, 5.0)  # inside a100-0
    assert links.ring(tuple(range(8))) == (200.0, 20.0)  # a100-0 and a100-1 over InfiniBand
    assert links.ring((0, 31))[0] == 25.0  # a100-0 - t4-1: the default between machines
    assert links.ring((0, 4, 31))[0] == 10.0  # a100-1 - t4-1: the old uplink


def test_stage_microbatch_times() -> None:
    device = DeviceTimes(
        "x",
        ProfileSource.MEASURED,
        BlockTimes(TimeCurve(1, 0), TimeCurve(1, 0)),
        (BlockTimes(TimeCurve(2, 1), TimeCurve(4, 2)),) * 3,
        BlockTimes(TimeCurve(0.5, 0.5), TimeCurve(0.5, 0.5)),
    )
    times = stage_microbatch_times(device, (0, 2), 3, first=True, last=False, recompute=False)
    assert (times.forward_ms, times.backward_ms) == pytest.approx((3 + 2 * 7, 3 + 2 * 14))
    recomputed = stage_microbatch_times(device, (0, 2), 3, first=True, last=False, recompute=True)
    assert recomputed.backward_ms == pytest.approx(3 + 2 * 14 + 2 * 7)
    last = stage_microbatch_times(device, (2, 3), 3, first=False, last=True, recompute=False)
    assert (last.forward_ms, last.backward_ms) == pytest.approx((7 + 2, 14 + 2))


def test_pipeline_formula_matches_textbook() -> None:
    # three equal stages of 3 ms per microbatch, 8 microbatches, free links: (M + S - 1) t
    assert pipeline_ms([3, 0, 3, 0, 3], [24, 0, 24, 0, 24]) == pytest.approx((8 + 3 - 1) * 3)
    # one stage: its busy time
    assert pipeline_ms([5], [40]) == pytest.approx(40)


def test_round_trip_limit_of_1f1b() -> None:
    # 8 microbatches of 1 ms, 2 in flight, 3 ms of later stages and transfers: a backward
    # returns every 4 ms, so two microbatches per 4 ms: span 16 ms, of which 3 are latency
    assert round_trip_busy_ms([1.0], [8], [2], 3.0) == pytest.approx(8 * (1 + 3) / 2 - 3)
    # first of four equal stages without transfers: never above its own work
    assert round_trip_busy_ms([1.0], [8], [4], 3.0) <= 8.0
    assert round_trip_busy_ms([1.0, 2.0], [0, 3], [1, 1], 0.0) == pytest.approx(6.0)


def test_receives_between_microbatches_add_to_a_stage() -> None:
    # 8 microbatches of 4 ms, each needing a 1 ms transfer the rank waits for: the first
    # lies in the fill, the other 7 between its microbatches
    assert receiving_busy_ms([4.0], [8], [1.0]) == pytest.approx(8 * 4 + 7 * 1)
    # the slowest rank with work sets it; a rank without microbatches waits for nothing
    assert receiving_busy_ms([4.0, 1.0, 9.0], [2, 6, 0], [3.0, 2.0, 5.0]) == pytest.approx(max(2 * 4 + 3, 6 * 1 + 5 * 2))
    assert receiving_busy_ms([4.0], [8], [0.0]) == pytest.approx(32.0)


def test_routes_pair_contiguous_microbatch_ranges() -> None:
    sender = StagePlan((0, 1), ("t4", "t4"), ("m", "m"), (0, 1), (2, 2))
    receiver = StagePlan((2, 3), ("t4", "t4"), ("m", "m"), (1, 2), (1, 3))
    assert routes(sender, receiver) == [(0, 2, 1), (0, 3, 1), (1, 3, 2)]


@pytest.mark.parametrize("rules", list(P2PRules))
def test_plan_iteration_time_by_hand(rules: P2PRules) -> None:
    ctx = _ctx(rules)
    cost = plan_cost(ctx, _plan())
    layer_a100, layer_v100 = 2 * (1 + 2), 2 * (2 + 4)  # fwd + bwd of one layer at microbatch 2
    edges = 2 * FLOOR  # embedding (stage 0) or head (stage 1), forward and backward
    a100_first, v100_first, a100_last = 2 * layer_a100 + edges, 2 * layer_v100 + edges, 2 * layer_a100 + edges
    assert cost.stages[0].busy_ms == pytest.approx(max(3 * a100_first, v100_first))
    assert cost.stages[0].latency_ms == pytest.approx(v100_first)
    assert cost.stages[1].busy_ms == pytest.approx(4 * a100_last)
    rate = 1e10 * LINK_EFFICIENCY  # 80 Gb/s, priced at the measured goodput fraction
    transfer = 0.005 + 2 * LAYER_OUT / rate * 1e3  # 5 us + 5e5 bytes
    assert cost.boundaries[0].transfer_ms == pytest.approx(transfer)
    assert cost.boundaries[0].busy_ms == pytest.approx(3 * transfer)  # rank 0 -> 2 carries 3 microbatches
    # each rank also waits for its transfers between its microbatches (receiving_busy_ms), the first
    # counted in the fill: rank 0 for 3 gradients, rank 2 for 4 activations, under gloo's rules each
    # behind the gradient it has just sent back (its notice that it is ready crosses the link after
    # it); under NCCL's its receive was posted while it computed, and no notice crosses
    per_activation = 2 * transfer if rules is P2PRules.GLOO else transfer
    busiest_first, busiest_last = 3 * a100_first + 2 * transfer, 4 * a100_last + 3 * per_activation
    pipeline = v100_first + 2 * transfer + a100_last + max(
        busiest_first - v100_first, 3 * transfer - 2 * transfer, busiest_last - a100_last
    )
    assert busiest_last - a100_last > busiest_first - v100_first  # the receiving stage is the bottleneck
    assert cost.pipeline_ms == pytest.approx(pipeline)
    sync = 2 * 1 / 2 * (2 * 2 * LAYER_PARAMS) / rate * 1e3 + 2 * 0.005  # fp16 gradients of 2 layers over 2 ranks
    assert cost.sync_ms == pytest.approx(sync)
    # optimizer steps, estimated: 2 layers of parameters per rank at 28 bytes each over the
    # datasheet bandwidth (A100 1555 GB/s, V100 900 GB/s); stage 0 waits for its V100
    update_v100, update_a100 = 2 * LAYER_PARAMS * 28 / 900e9 * 1e3, 2 * LAYER_PARAMS * 28 / 1555e9 * 1e3
    assert cost.stages[0].update_ms == pytest.approx((update_a100, update_v100))
    assert cost.stages[1].update_ms == pytest.approx((update_a100,))
    assert cost.update_ms == pytest.approx(update_v100)
    iteration = pipeline + max(sync + update_v100, update_a100)
    assert cost.iteration_ms == pytest.approx(iteration)
    predicted = prediction(ctx, _plan(), cost)
    assert predicted.samples_per_s == pytest.approx(8 / iteration * 1000)
    assert predicted.profile_source == {"a100x40": "measured", "v100x16": "measured"}


def test_tied_embedding_gradient_is_synchronised_between_the_ends() -> None:
    head_params = 3_000_000
    profile = replace(_profile(), head=BlockShape("head", head_params, 0, 0, 0.0), tied_embedding_head=True)
    ctx = CostContext.build(_inventory(), profile, memory_reserve_gib=0.5)
    cost = plan_cost(ctx, _plan())
    rate = 1e10 * LINK_EFFICIENCY
    own = 2 * 1 / 2 * (2 * 2 * LAYER_PARAMS) / rate * 1e3 + 2 * 0.005  # stage 0's two ranks, as above
    # ring all-reduce of the fp16 head gradient over the 3 ranks of the first and last stage
    tied = 2 * 2 / 3 * (2 * head_params) / rate * 1e3 + 4 * 0.005
    assert cost.tied_sync_ms == pytest.approx(tied)
    assert cost.stage_sync_ms(0) == pytest.approx(own + tied)
    assert cost.stage_sync_ms(1) == pytest.approx(tied)  # one rank: nothing of its own
    assert cost.sync_ms == pytest.approx(own + tied)
    untied = plan_cost(CostContext.build(_inventory(), replace(profile, tied_embedding_head=False), 0.5), _plan())
    assert untied.sync_ms == pytest.approx(own)
    one_stage = Plan("hand", "hand", 4, 3, 8, 2, Schedule.ONE_F_ONE_B, (
        StagePlan((0, 1, 2), ("a100x40", "v100x16", "a100x40"), ("box",) * 3, (0, 4), (2, 1, 1)),
    ))
    assert plan_cost(ctx, one_stage).tied_sync_ms == 0.0  # the weight lives on one stage: no extra collective


def test_link_efficiency_is_validated() -> None:
    with pytest.raises(PlanningError, match="efficiency"):
        LinkTable(_inventory(), efficiency=1.5)


def test_memory_by_hand() -> None:
    ctx = _ctx()
    reserve = 0.5 * BYTES_PER_GIB
    state = 2 * LAYER_PARAMS * 16  # 16 bytes per parameter in mixed precision
    per_microbatch = 2 * LAYER_ACT * 2  # two layers, two samples
    memory = [m.total_bytes for s in plan_cost(ctx, _plan()).stages for m in s.memory]
    # 1F1B: stage 0 of 2 holds min(n, 2) microbatches, stage 1 min(n, 1)
    assert memory == pytest.approx([state + 2 * per_microbatch + reserve, state + per_microbatch + reserve, state + per_microbatch + reserve])

    sharded = plan_cost(ctx, _plan(Sharding.OPTIMIZER, (0.75, 0.25))).stages[0].memory
    unsharded_state = 2 * LAYER_PARAMS * 4  # fp16 weights and gradients
    optimizer = 2 * LAYER_PARAMS * 12
    assert sharded[0].total_bytes == pytest.approx(unsharded_state + 0.75 * optimizer + 2 * per_microbatch + reserve)
    assert sharded[1].total_bytes == pytest.approx(unsharded_state + 0.25 * optimizer + per_microbatch + reserve)

    recomputed = plan_cost(ctx, _plan(recompute=True)).stages[0].memory
    kept = (LAYER_OUT + LAYER_OUT + LAYER_ACT) * 2  # inputs of both layers + one layer rebuilt, two samples
    assert recomputed[0].activation_bytes == pytest.approx(2 * kept)

    gpipe = replace(_plan(), schedule=Schedule.GPIPE)
    assert plan_cost(ctx, gpipe).stages[0].memory[0].activation_bytes == pytest.approx(3 * per_microbatch)


def test_memory_is_checked_against_each_gpus_own_capacity() -> None:
    profile = _profile()
    big = replace(profile, layers=tuple(replace(l, parameters=600_000_000) for l in profile.layers))
    ctx = CostContext.build(_inventory(), big, memory_reserve_gib=0.5)
    plan = _plan()
    over = memory_overruns(ctx, plan, plan_cost(ctx, plan))
    # two layers of 6e8 parameters at 16 bytes: 17.9 GiB, over the V100's 16 GiB, not the A100s' 40
    state_gib = 2 * 600_000_000 * 16 / BYTES_PER_GIB
    expected_v100 = state_gib + 2 * LAYER_ACT * 2 / BYTES_PER_GIB + 0.5 - 16
    assert [(s, r) for s, r, _ in over] == [(0, 1)]
    assert over[0][2] == pytest.approx(expected_v100)


def test_reserve_scales_on_emulated_clusters() -> None:
    assert reserve_gib(16.0, 16.0, False, None) == 0.5
    assert reserve_gib(0.16, 16.0, True, None) == pytest.approx(0.005)
    assert reserve_gib(0.16, 16.0, True, 0.01) == 0.01


def test_proportional_counts() -> None:
    assert proportional_counts(10, [1, 1, 1]) == [4, 3, 3]
    assert proportional_counts(10, [3, 1]) == [8, 2]
    assert proportional_counts(5, [100, 1, 1], minimum=1) == [3, 1, 1]
    assert sum(proportional_counts(97, [0.3, 1.7, 2.2, 5.0])) == 97


def test_the_engines_time_per_action_is_priced_as_measured_on_every_kind_of_rank() -> None:
    """Each forward and each backward of a stage pays the engine's own time once (so interleaving, with V
    times the actions, pays it V times), as start-up measured it on that GPU type, GPUs included."""
    real = _ctx()
    devices = dict(real.profile.devices)
    devices["a100x40"] = replace(devices["a100x40"], action_overhead_ms=0.7)
    measured = replace(real, profile=replace(real.profile, devices=devices), _microbatch_times={})
    assert real.action_overhead_ms("a100x40") == 0.0 and measured.action_overhead_ms("a100x40") == 0.7
    plain = real.microbatch_times("a100x40", (0, 2), 1, first=False, last=False, recompute=False)
    priced = measured.microbatch_times("a100x40", (0, 2), 1, first=False, last=False, recompute=False)
    assert priced.forward_ms == pytest.approx(plain.forward_ms + 0.7)
    assert priced.backward_ms == pytest.approx(plain.backward_ms + 0.7)



def test_on_an_asynchronous_device_the_engines_host_time_hides_under_the_compute() -> None:
    """On CUDA the host queues kernels ahead: an action takes the longer of its compute and the engine's host
    time, not their sum (summed, the 168M Llama on one H100 was predicted 23 % long)."""
    device = _ctx().profile.times("a100x40")
    compute = stage_microbatch_times(device, (0, 2), 1, first=False, last=False, recompute=False)
    hidden = stage_microbatch_times(device, (0, 2), 1, first=False, last=False, recompute=False, action_ms=1e-6, overlaps=True)
    assert hidden == compute
    slow_host = stage_microbatch_times(device, (0, 2), 1, first=False, last=False, recompute=False, action_ms=1e6, overlaps=True)
    assert (slow_host.forward_ms, slow_host.backward_ms) == (1e6, 1e6)
    summed = stage_microbatch_times(device, (0, 2), 1, first=False, last=False, recompute=False, action_ms=2.0)
    assert summed.forward_ms == pytest.approx(compute.forward_ms + 2.0)

"""The timeline simulation against the cost model and the schedule's rules.

The simulation plays the engine's programs (``schedule/programs.py``; that it follows
them action by action is tested in ``tests/reporting/test_timeline_matches_schedule.py``)
where it used to order each rank's microbatches by a rule of its own (index order,
backward first when ready). No expectation here changed: on single-rank stages and on a
single stage both orders are the same, so the textbook pipeline, the data-parallel
stage and the message's round trip keep their exact closed forms; the GPipe plan of
stages 2 -> 3 now walks microbatches interleaved across the wide stage, in the same
makespan, still every forward before any backward. Only the measured ratios of the
planned plans to the closed form moved (see :func:`test_planned_timelines_follow_the_schedule`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from zorse_lightning.capabilities import P2PRules, Schedule
from zorse_lightning.cluster import DEFAULT_CATALOG, ClusterInventory, Machine
from zorse_lightning.cluster.inventory import Latencies
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.planner import CostContext, EventKind, Plan, StagePlan, PlannerOptions, make_plan, plan_cost, simulate
from zorse_lightning.profiling.profile import BlockShape, BlockTimes, DeviceTimes, ModelProfile, ProfileSource, TimeCurve

from test_planner_fixtures import profile_for


def _profile(output_bytes: int) -> ModelProfile:
    """Six layers of 1 ms forward and 2 ms backward per sample on the A100, twice on the T4."""
    layer = BlockShape("layer", 1000, 1000, output_bytes, 1.0)
    edge = BlockShape("edge", 0, 0, output_bytes, 0.0)

    def device(name: str, slope: float) -> DeviceTimes:
        times = BlockTimes(TimeCurve(slope, 0.0), TimeCurve(2 * slope, 0.0))
        return DeviceTimes(name, ProfileSource.MEASURED, times, (times,) * 6, times)

    devices = {"a100x40": device("a100x40", 1.0), "t4": device("t4", 2.0)}
    # embedding and head as costly as a layer: stages of two blocks each below are equal
    return ModelProfile("sim", 8, "float16", edge, (layer,) * 6, edge, devices)


def _inventory() -> ClusterInventory:
    a100, t4 = DEFAULT_CATALOG.get("a100x40"), DEFAULT_CATALOG.get("t4")
    return ClusterInventory("sim", (Machine("box", (a100, a100, a100, t4, t4), intra_bandwidth_gbps=100.0),))


def _stage(ranks, layers, counts) -> StagePlan:
    types = tuple("a100x40" if r < 3 else "t4" for r in ranks)
    return StagePlan(tuple(ranks), types, ("box",) * len(ranks), layers, tuple(counts))


def _textbook_plan(schedule: Schedule = Schedule.ONE_F_ONE_B) -> Plan:
    """Three A100 stages of equal work: embedding + 1 layer, 2 layers, 1 layer + head."""
    stages = (_stage([0], (0, 1), [8]), _stage([1], (1, 3), [8]), _stage([2], (3, 4), [8]))
    return Plan("sim", "sim", 4, 5, 8, 1, schedule, stages, idle_ranks=(3, 4))


@pytest.mark.parametrize("schedule", [Schedule.ONE_F_ONE_B, Schedule.GPIPE])
def test_textbook_pipeline_without_transfers(schedule: Schedule) -> None:
    profile = replace(_profile(0), layers=_profile(0).layers[:4])
    ctx = CostContext.build(_inventory(), profile)
    plan = replace(_textbook_plan(schedule), num_layers=4)
    timeline = simulate(ctx, plan)
    per_microbatch = 2 * (1 + 2)  # two blocks, forward 1 ms + backward 2 ms each
    assert timeline.makespan_ms == pytest.approx((8 + 3 - 1) * per_microbatch)
    assert timeline.makespan_ms == pytest.approx(plan_cost(ctx, plan).iteration_ms)


def test_a_later_stages_step_overlaps_the_drain_after_its_last_backward() -> None:
    """The textbook pipeline with a head of 2 M parameters stepped at 5 ms per million (the last stage steps
    10 ms, the others next to nothing): the last stage's last backward ends 8 ms before the first stage's
    (the last microbatch's backward of 4 ms on each stage before it), and its step starts there, so the
    iteration is the pipeline plus 2 ms, not plus 10, in the closed form as in the simulation."""
    base = _profile(0)
    devices = {name: replace(d, optimizer_ms_per_million_parameters=5.0) for name, d in base.devices.items()}
    profile = replace(base, layers=base.layers[:4], head=replace(base.head, parameters=2_000_000), devices=devices)
    ctx = CostContext.build(_inventory(), profile)
    plan = replace(_textbook_plan(), num_layers=4)
    cost = plan_cost(ctx, plan)
    assert cost.drain_ms == pytest.approx((0.0, 4.0, 8.0))
    assert cost.stage_tail_ms(2) == pytest.approx(10.0, rel=1e-3) and cost.stage_tail_ms(0) < 0.01
    assert cost.iteration_ms == pytest.approx(cost.pipeline_ms + cost.stage_tail_ms(2) - 8.0)
    assert simulate(ctx, plan).makespan_ms == pytest.approx(cost.iteration_ms)


def test_data_parallel_stage_is_busy_time_plus_all_reduce_plus_optimizer_step() -> None:
    ctx = CostContext.build(_inventory(), _profile(0))
    plan = Plan("sim", "sim", 6, 5, 10, 1, Schedule.ONE_F_ONE_B, (_stage([0, 1, 2, 3, 4], (0, 6), [3, 3, 2, 1, 1]),))
    timeline = simulate(ctx, plan)
    cost = plan_cost(ctx, plan)
    assert cost.sync_ms > 0 and cost.update_ms > 0
    # the busiest A100s' 3 microbatches through 8 blocks (embedding, 6 layers, head) of 3 ms,
    # the all-reduce, then the slowest step (a T4's: the least memory bandwidth)
    assert cost.iteration_ms == pytest.approx(3 * 8 * 3 + cost.sync_ms + cost.update_ms)
    assert timeline.makespan_ms == pytest.approx(cost.iteration_ms)
    allreduces = [e for e in timeline.events if e.kind is EventKind.ALLREDUCE]
    assert len(allreduces) == 5 and len({(e.start_ms, e.end_ms) for e in allreduces}) == 1
    steps = sorted((e for e in timeline.events if e.kind is EventKind.OPTIMIZER), key=lambda e: e.rank)
    assert [e.start_ms for e in steps] == pytest.approx([allreduces[0].end_ms] * 5)
    assert [e.end_ms - e.start_ms for e in steps] == pytest.approx(list(cost.stages[0].update_ms))
    assert max(e.end_ms - e.start_ms for e in steps) == pytest.approx(steps[-1].end_ms - steps[-1].start_ms)  # a T4


def _check_schedule_rules(plan: Plan, timeline) -> None:
    compute = [e for e in timeline.events if e.kind in (EventKind.FORWARD, EventKind.BACKWARD)]
    stage_of = {r: i for i, s in enumerate(plan.stages) for r in s.ranks}
    # every microbatch once forward and once backward on every stage (on each rank of a TP group)
    counts = Counter((stage_of[e.rank], plan.stages[stage_of[e.rank]].tensor_index(e.rank), e.kind, e.microbatch) for e in compute)
    degrees = sum(s.tensor_parallel for s in plan.stages)
    assert len(counts) == 2 * degrees * plan.num_microbatches and set(counts.values()) == {1}
    # a rank computes one thing at a time
    for rank in stage_of:
        mine = sorted((e.start_ms, e.end_ms) for e in compute if e.rank == rank)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(mine, mine[1:]))
    # forward follows the previous stage's forward, backward the next stage's backward
    when = {(stage_of[e.rank], e.kind, e.microbatch): e for e in compute}
    for (s, kind, j), event in when.items():
        if kind is EventKind.FORWARD and s > 0:
            assert event.start_ms >= when[(s - 1, kind, j)].end_ms - 1e-9
        if kind is EventKind.BACKWARD and s < len(plan.stages) - 1:
            assert event.start_ms >= when[(s + 1, kind, j)].end_ms - 1e-9
        if kind is EventKind.BACKWARD:
            assert event.start_ms >= when[(s, EventKind.FORWARD, j)].end_ms - 1e-9


@pytest.mark.parametrize("name", ["a10g_l4_t4", "a100x4_v100x4", "mix32_4types", "cpu_sim4"])
def test_planned_timelines_follow_the_schedule(name: str) -> None:
    inventory = load_cluster(name)
    profile = profile_for(inventory)
    plan = make_plan(inventory, profile, 64, PlannerOptions(max_interleave=1))  # the rules of plain programs
    ctx = CostContext.build(inventory, profile)
    timeline = simulate(ctx, plan)
    _check_schedule_rules(plan, timeline)
    cost = plan_cost(ctx, plan)
    # no schedule beats the busiest stage's work plus its synchronisation
    assert timeline.makespan_ms >= max(s.busy_ms for s in cost.stages) - 1e-9
    assert timeline.predicted_iteration_ms == pytest.approx(cost.iteration_ms)
    if name in ("a10g_l4_t4", "a100x4_v100x4"):
        # where compute outweighs transfers the closed form tracks the schedule closely
        # (measured, engine programs: 1.00 and 1.01. Not mix32_4types, 1.47: its 1F1B
        # programs, recorded in unit steps, run each microbatch's forward and backward back
        # to back on its wide V100 stages, which then wait out every round trip through the
        # last stage; the closed form assumes the warm-up's microbatches stay in flight)
        assert timeline.makespan_ms == pytest.approx(cost.iteration_ms, rel=0.03)


def test_gpipe_runs_every_forward_before_any_backward() -> None:
    ctx = CostContext.build(_inventory(), _profile(4000))
    stages = (_stage([0, 3], (0, 3), [5, 3]), _stage([1, 2, 4], (3, 6), [2, 3, 3]))
    plan = Plan("sim", "sim", 6, 5, 8, 1, Schedule.GPIPE, stages)
    timeline = simulate(ctx, plan)
    _check_schedule_rules(plan, timeline)
    for rank in range(5):
        kinds = [e.kind for e in timeline.of_rank(rank) if e.kind in (EventKind.FORWARD, EventKind.BACKWARD)]
        assert kinds == sorted(kinds, key=lambda k: k is EventKind.BACKWARD)
    sends = [e for e in timeline.events if e.kind is EventKind.SEND]
    assert len(sends) == 2 * 8  # each microbatch's activation forward and its gradient back


def test_a_message_moves_when_its_receiver_is_free() -> None:
    """gloo sends once the blocking receive is posted, and the receiver's notice crosses the link
    behind the gradient it has just sent: the last stage waits for both between its microbatches,
    and the closed form prices that wait (receiving_busy_ms)."""
    profile = replace(_profile(20_000_000), layers=_profile(20_000_000).layers[:3])
    ctx = CostContext.build(_inventory(), profile, p2p_rules=P2PRules.GLOO)
    # stage 0: embedding + layer 0 (6 ms a microbatch); stage 1: layers 1-2 + head (9 ms), the busiest
    plan = Plan("sim", "sim", 3, 5, 8, 1, Schedule.ONE_F_ONE_B, (_stage([0], (0, 1), [8]), _stage([1], (1, 3), [8])),
                idle_ranks=(2, 3, 4))
    cost = plan_cost(ctx, plan)
    transfer = cost.boundaries[0].transfer_ms
    assert transfer == pytest.approx(0.005 + 20e6 / (100e9 / 8 * 0.95) * 1e3)  # 20 MB at 95 % of 100 Gb/s
    timeline = simulate(ctx, plan)
    _check_schedule_rules(plan, timeline)
    # stage 0's forward, the first activation, 8 x 9 ms on stage 1 with 7 x (a gradient back, the
    # next activation) between them, the last gradient, stage 0's backward: 6 + 72 + 16 x
    assert timeline.makespan_ms == pytest.approx(6 + 8 * 9 + 16 * transfer, abs=1e-3)
    assert cost.iteration_ms == pytest.approx(timeline.makespan_ms, abs=1e-3)
    last = [e for e in timeline.of_rank(1) if e.kind in (EventKind.FORWARD, EventKind.BACKWARD)]
    for backward, forward in zip(last[1::2], last[2::2]):
        assert forward.start_ms == pytest.approx(backward.end_ms + 2 * transfer)


MESSAGE_BYTES = 125_000
"""An activation of one sample: 10.5 ms over 100 Mbit/s, 10 us over 100 Gb/s (at 95 %)."""


def _near_and_far(header_us: float = 0.0) -> ClusterInventory:
    """Ranks 0 and 1 on one machine (100 Gb/s between them), rank 2 on another behind 100 Mbit/s."""
    a100 = DEFAULT_CATALOG.get("a100x40")
    machines = (Machine("near", (a100, a100), intra_bandwidth_gbps=100.0), Machine("far", (a100,), intra_bandwidth_gbps=100.0))
    return ClusterInventory("near_far", machines, inter_machine_bandwidth_gbps=0.1,
                            latencies=Latencies(header_intra_machine_us=header_us, header_inter_machine_us=header_us))


def _three_stages() -> Plan:
    """Embedding + layer 0 on rank 0 (2 ms a forward), layer 1 on rank 1 (1 ms), layer 2 + head on rank 2
    (2 ms); two microbatches of one sample, GPipe."""
    stages = tuple(
        StagePlan((r,), ("a100x40",), (machine,), layers, (2,))
        for r, machine, layers in ((0, "near", (0, 1)), (1, "near", (1, 2)), (2, "far", (2, 3)))
    )
    return Plan("sim", "near_far", 3, 3, 2, 1, Schedule.GPIPE, stages)


def test_a_header_is_priced_on_activations_only() -> None:
    """The engine sends its host header before an activation and none before a gradient (it has the shape
    of the activation it belongs to): both the closed form's routes and gloo's play price it so."""
    profile = replace(_profile(MESSAGE_BYTES), layers=_profile(MESSAGE_BYTES).layers[:3])
    ctx = CostContext.build(_near_and_far(header_us=1000.0), profile, p2p_rules=P2PRules.GLOO)
    plan = _three_stages()
    slow_ms = 0.020 + MESSAGE_BYTES / (0.1e9 / 8 * 0.95) * 1e3
    assert plan_cost(ctx, plan).boundaries[1].route_ms == (pytest.approx((slow_ms + 1.0, slow_ms)),)
    crossing = [e for e in simulate(ctx, plan).events if e.kind is EventKind.SEND and e.stage == 1]
    activations = [e.end_ms - e.start_ms for e in crossing if e.rank == 1]
    gradients = [e.end_ms - e.start_ms for e in crossing if e.rank == 2]
    assert activations == pytest.approx([slow_ms + 1.0] * 2) and gradients == pytest.approx([slow_ms] * 2)


def test_under_nccls_rules_a_fast_receive_waits_for_a_slow_send_on_its_stream() -> None:
    """Rank 1 receives its second activation from rank 0 over 100 Gb/s in the batch that sends its first
    to rank 2 over 100 Mbit/s (the schedule's batches: schedule.p2p_batches). Under NCCL's rules the batch
    completes with its slow send, so rank 1's second forward waits for it; under gloo's it waits only for
    its own receive.

    By hand (fast 0.015 ms, slow 10.546 ms): rank 0 forwards microbatch 0 in [0, 2] and 1 in [2, 4];
    gloo: rank 1 forwards 0 from 2 + fast and 1 from 4 + fast. NCCL: rank 1's host posts its first batch
    (receive 0) and waits there for the activation's header, which rank 0 sends when it posts at 2 (the
    header costs nothing here); 0 crosses in [2, 2 + fast], rank 1 forwards it in [2 + fast, 3 + fast] and
    posts its second batch (send 0 to rank 2, receive 1), which waits for rank 0's header of 1 at 4: both
    messages move from 4, and the batch completes at 4 + slow, when rank 1 forwards 1."""
    profile = replace(_profile(MESSAGE_BYTES), layers=_profile(MESSAGE_BYTES).layers[:3])
    plan = _three_stages()
    fast_ms = 0.005 + MESSAGE_BYTES / (100e9 / 8 * 0.95) * 1e3
    slow_ms = 0.020 + MESSAGE_BYTES / (0.1e9 / 8 * 0.95) * 1e3
    starts = {}
    for rules in P2PRules:
        timeline = simulate(CostContext.build(_near_and_far(), profile, p2p_rules=rules), plan)
        _check_schedule_rules(plan, timeline)
        starts[rules] = [e.start_ms for e in timeline.of_rank(1) if e.kind is EventKind.FORWARD]
    assert starts[P2PRules.GLOO] == pytest.approx([2 + fast_ms, 4 + fast_ms])
    assert starts[P2PRules.NCCL] == pytest.approx([2 + fast_ms, 4 + slow_ms])


def test_on_gloos_transport_a_pair_of_ranks_moves_one_message_at_a_time() -> None:
    """Under NCCL's rules 1F1B's steady-state batches send a gradient back to the rank they receive the next
    activation from. NCCL moves the two at once (a connection per direction); gloo, which runs an emulated
    cluster under ZORSE_P2P_RULES=nccl, has one connection per pair of ranks and moves them in turn (both
    ways at once took twice one way's time, :mod:`zorse_lightning.planner.cost.stream_play`)."""
    profile = replace(_profile(20_000_000), layers=_profile(20_000_000).layers[:3])
    plan = Plan("sim", "sim", 3, 5, 8, 1, Schedule.ONE_F_ONE_B, (_stage([0], (0, 1), [8]), _stage([1], (1, 3), [8])),
                idle_ranks=(2, 3, 4))

    def overlaps(inventory: ClusterInventory) -> int:
        timeline = simulate(CostContext.build(inventory, profile, p2p_rules=P2PRules.NCCL), plan)
        _check_schedule_rules(plan, timeline)
        forward = [e for e in timeline.events if e.kind is EventKind.SEND and e.rank == 0]
        back = [e for e in timeline.events if e.kind is EventKind.SEND and e.rank == 1]
        return sum(a.start_ms < b.end_ms - 1e-9 and b.start_ms < a.end_ms - 1e-9 for a in forward for b in back)

    assert overlaps(_inventory()) > 0
    assert overlaps(replace(_inventory(), emulated=True)) == 0


def test_a_tp_group_runs_each_action_at_once_and_its_messages_share_a_link() -> None:
    """Two TP pairs on two machines behind 100 Mbit/s: each rank of stage 0's pair sends its activation to the
    rank of the same index in stage 1's, both over the one link between the machines, one after the other. The
    all-reduces inside a TP block hold a group together, so stage 1's pair starts each forward once the later
    of its two messages is in, under either rules: the closed form's crossing is both messages (the fill pays
    it at every boundary, which a play that let the first rank run ahead paid only once)."""
    from zorse_lightning.profiling.profile import TensorParallelSupport

    a100 = DEFAULT_CATALOG.get("a100x40")
    inventory = ClusterInventory(
        "pairs", (Machine("near", (a100, a100), intra_bandwidth_gbps=100.0), Machine("far", (a100, a100), intra_bandwidth_gbps=100.0)),
        inter_machine_bandwidth_gbps=0.1,
    )
    base = _profile(MESSAGE_BYTES)
    profile = replace(base, layers=base.layers[:2], tensor_parallel=TensorParallelSupport((2,), ""))
    stages = tuple(
        StagePlan(ranks, ("a100x40",) * 2, (machine,) * 2, layers, (2, 2), tensor_parallel=2)
        for ranks, machine, layers in (((0, 1), "near", (0, 1)), ((2, 3), "far", (1, 2)))
    )
    plan = Plan("sim", "pairs", 2, 4, 2, 1, Schedule.GPIPE, stages)
    slow_ms = 0.020 + MESSAGE_BYTES / (0.1e9 / 8 * 0.95) * 1e3
    for rules in P2PRules:
        ctx = CostContext.build(inventory, profile, p2p_rules=rules)
        cost = plan_cost(ctx, plan)
        one_ms = cost.boundaries[0].route_ms[0][1]  # a gradient: no header
        assert one_ms == pytest.approx(slow_ms)
        assert cost.boundaries[0].transfer_ms == pytest.approx(2 * cost.boundaries[0].route_ms[0][0])
        timeline = simulate(ctx, plan)
        _check_schedule_rules(plan, timeline)
        forwards = {r: [e for e in timeline.of_rank(r) if e.kind is EventKind.FORWARD] for r in (2, 3)}
        assert [e.start_ms for e in forwards[2]] == pytest.approx([e.start_ms for e in forwards[3]])
        received = max(e.end_ms for e in timeline.events if e.kind is EventKind.RECV and e.microbatch == 0 and e.rank in (2, 3))
        assert forwards[2][0].start_ms == pytest.approx(received)
        sent = [e for e in timeline.events if e.kind is EventKind.SEND and e.microbatch == 0 and e.rank in (0, 1)]
        assert len(sent) == 2 and max(e.start_ms for e in sent) >= min(e.end_ms for e in sent) - 1e-9  # in turn

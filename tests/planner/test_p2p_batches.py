"""The schedule's point-to-point batches under NCCL's rules, in one process: what the engine posts is what
the play checks, every plan the planner can emit passes, and the order the engine used to post fails."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from test_planner_fixtures import synthetic_profile
from testing.plans import hand_plan, in_backward_collectives, per_message_batches, random_plan

from zorse_lightning.capabilities import P2PRules, Schedule
from zorse_lightning.cluster import DEFAULT_CATALOG, ClusterInventory, Machine
from zorse_lightning.planner import CostContext
from zorse_lightning.planner.cost.simulate import simulate
from zorse_lightning.errors import PlanningError
from zorse_lightning.schedule.p2p_batches import HostCollective, play_rendezvous
from zorse_lightning.schedule.programs import build_schedule


def test_two_stage_1f1b_posts_each_send_beside_the_receive_of_its_step():
    plan = hand_plan([((0,), (2,), (0, 1)), ((1,), (2,), (1, 2))])
    schedule = build_schedule(plan)
    assert [b.describe(0) for b in schedule.batches[0]] == [
        "rank 0 [send activation of microbatch 0 (stages 0-1) to rank 1]",
        "rank 0 [send activation of microbatch 1 (stages 0-1) to rank 1]",
        "rank 0 [receive gradient of microbatch 0 (stages 0-1) from rank 1]",
        "rank 0 [receive gradient of microbatch 1 (stages 0-1) from rank 1]",
    ]
    # rank 1 takes microbatch 1's activation in the step rank 0 sends it, before it sends gradient 0
    assert [b.describe(1) for b in schedule.batches[1]][:3] == [
        "rank 1 [receive activation of microbatch 0 (stages 0-1) from rank 0]",
        "rank 1 [receive activation of microbatch 1 (stages 0-1) from rank 0]",
        "rank 1 [send gradient of microbatch 0 (stages 0-1) to rank 0]",
    ]
    assert [b.before for b in schedule.batches[1]] == [0, 1, 2, 4]


def test_a_wide_stage_fed_by_one_gpu_does_not_hold_back_the_feeder_under_nccl_rules():
    """Two H100s of 4 layers each, then two of 8 layers taking every other microbatch: balanced. Batches
    derived in unit steps put the feeder's next activation beside a gradient the wide stage sends a whole
    (longer) action later, and NCCL's play took 10 % longer than gloo's (128.6 against 117.0 ms); derived in
    the balanced play, no longer than gloo's."""
    h100 = DEFAULT_CATALOG.get("h100-sxm")
    inventory = ClusterInventory("four", (Machine("m0", (h100,) * 4, intra_bandwidth_gbps=600.0),))
    profile = synthetic_profile(("h100-sxm",), num_layers=16, hidden=2048)
    plan = hand_plan([((0,), (32,), (0, 4)), ((1,), (32,), (4, 8)), ((2, 3), (16, 16), (8, 16))], inventory=inventory)
    gloo, nccl = (simulate(CostContext.build(inventory, profile, p2p_rules=rules), plan).makespan_ms for rules in (P2PRules.GLOO, P2PRules.NCCL))
    assert nccl <= gloo


def test_the_old_per_message_order_deadlocks_1f1b_and_not_gpipe():
    """Today's engine order, played under the rendezvous rules: the issue's two-stage hang, named."""
    plan = hand_plan([((0,), (2,), (0, 1)), ((1,), (2,), (1, 2))])
    programs = build_schedule(plan).programs
    with pytest.raises(PlanningError) as raised:
        play_rendezvous(plan, programs, per_message_batches(plan, programs))
    assert "rank 0, after 2 of its 4 actions, waits to send activation of microbatch 1 (stages 0-1) to rank 1" in str(raised.value)
    assert "rank 1, after 2 of its 4 actions, waits to send gradient of microbatch 0 (stages 0-1) to rank 0" in str(raised.value)
    gpipe = hand_plan([((0,), (2,), (0, 1)), ((1,), (2,), (1, 2))], schedule=Schedule.GPIPE)
    programs = build_schedule(gpipe).programs
    play_rendezvous(gpipe, programs, per_message_batches(gpipe, programs))


def test_a_batch_missing_a_receive_is_refused():
    plan = hand_plan([((0,), (2,), (0, 1)), ((1,), (2,), (1, 2))])
    schedule = build_schedule(plan)
    broken = [schedule.batches[0], schedule.batches[1][1:]]
    with pytest.raises(PlanningError, match="rank 1's batches never receive activation of microbatch 0"):
        play_rendezvous(plan, schedule.programs, broken)


def test_no_random_plan_deadlocks_under_nccl_rules_and_the_old_order_does():
    """200 random plans: every schedule (training and forward-only) passes the rendezvous play (build_schedule
    plays it); posting each message alone, as the engine did, hangs a large share of them."""
    rng = random.Random(29)
    old_order_hangs, kinds = 0, set()
    for _ in range(200):
        plan = random_plan(rng)
        kinds.add((plan.schedule, plan.interleave > 1, len(plan.rank_groups) >= 3))
        schedule = build_schedule(plan)
        build_schedule(plan, forward_only=True)
        try:
            play_rendezvous(plan, schedule.programs, per_message_batches(plan, schedule.programs))
        except PlanningError:
            old_order_hangs += 1
    assert {(Schedule.ONE_F_ONE_B, True, True), (Schedule.GPIPE, False, True), (Schedule.ONE_F_ONE_B, False, False)} <= kinds
    assert old_order_hangs >= 40


def test_a_reduction_started_inside_the_last_backward_hangs_a_replicated_stage_and_the_placed_one_does_not():
    """Stages [0, 1] | [2, 3], shares 4+1 and 1+4. A replica of stage 1 that starts its reduction inside its
    last backward holds its host before posting the gradient upstream; its peer waits for an activation the
    upstream rank sends only after that gradient."""
    plan = hand_plan([((0, 1), (4, 1), (0, 2)), ((2, 3), (1, 4), (2, 4))])
    plan = replace(plan, stages=tuple(replace(s, machines=(f"m{i}",) * 2) for i, s in enumerate(plan.stages)))
    schedule = build_schedule(plan)  # plays the placed collectives
    assert [c.what for c in schedule.collectives[2]] == [
        "the gradient reduction of stages [1]", "the step's loss over every rank",
        "the sum of weights shared by groups [0, 1] into rank 2", "the exchange of weights shared by groups [0, 1] between machines",
        "the broadcast of weights shared by groups [0, 1] from rank 2", "the gradient norm over every rank",
    ]
    world = (0, 1, 2, 3)
    assert [c.ranks for c in schedule.collectives[3]] == [(2, 3), world, (2, 3), (2, 3), world]  # rank 3 does not exchange
    assert schedule.collectives[0][3].ranks == (0, 2)  # one representative of each stage does
    placed = schedule.collectives[2][0]
    assert (placed.after_actions, placed.after_batches, placed.at_end) == (2, len(schedule.batches[2]), False)
    with pytest.raises(PlanningError) as raised:
        play_rendezvous(plan, schedule.programs, schedule.batches, in_backward_collectives(plan, schedule.programs, schedule.batches))
    message = str(raised.value)
    assert "rank 2, after 2 of its 2 actions, waits in stage 1's gradient reduction over ranks [2, 3] for rank(s) [3]" in message
    assert "and waits to send gradient of microbatch 0 (stages 0-1) to rank 0" in message
    assert "rank 0, after 6 of its 8 actions, waits to receive gradient of microbatch 0 (stages 0-1) from rank 2" in message


def test_collectives_issued_in_another_order_on_two_ranks_hang():
    """NCCL wants one order of calls on communicators used together; the play holds every call until all
    members made it, so crossed orders are found."""
    a = HostCollective((0, 1), "a", at_end=True)
    b = HostCollective((0, 1, 2), "b", at_end=True)
    two = hand_plan([((0, 1), (1, 1), (0, 2))], idle_ranks=(2,))
    schedule = build_schedule(two)
    with pytest.raises(PlanningError, match=r"rank 0, after 2 of its 2 actions, waits in a over ranks \[0, 1\] for rank\(s\) \[1\]"):
        play_rendezvous(two, schedule.programs, schedule.batches, [(a, b), (b, a), (b,)])
    play_rendezvous(two, schedule.programs, schedule.batches, [(a, b), (a, b), (b,)])


def test_no_random_plan_with_replicated_stages_hangs_with_its_collectives_and_the_in_backward_order_does():
    """At least 200 random pipelines with data parallelism inside a stage (uneven shares, ranks without
    microbatches, idle ranks, interleaving): the schedule's reductions and end-of-step collectives, each played
    as blocking its host until every member calls it, never hang; starting each stage's reduction inside its
    last backward, as the engine did, hangs many."""
    rng = random.Random(36)
    played = old_hangs = 0
    kinds = set()
    while played < 220:
        plan = random_plan(rng)
        if len(plan.stages) == 1 or all(len(group.ranks) == 1 for group in plan.rank_groups):
            continue
        played += 1
        kinds.add((plan.schedule, plan.interleave > 1, bool(plan.idle_ranks), any(0 in s.microbatches_per_rank for s in plan.stages)))
        schedule = build_schedule(plan)  # raises where the placed collectives would hang
        build_schedule(plan, forward_only=True)
        try:
            play_rendezvous(plan, schedule.programs, schedule.batches, in_backward_collectives(plan, schedule.programs, schedule.batches))
        except PlanningError:
            old_hangs += 1
    assert {(Schedule.ONE_F_ONE_B, True, True, True), (Schedule.GPIPE, False, False, False), (Schedule.ONE_F_ONE_B, False, True, True)} <= kinds
    assert old_hangs >= 40

"""Programs recorded once per plan shape: plans of the same stage widths and shares on other ranks (the same
groups in another order, or other GPUs) take the recording rank for rank, and their batches are their own."""

from __future__ import annotations

import random
from dataclasses import replace

from testing.plans import random_plan
from testing.synthetic_cluster import synthetic_cluster
from zorse_lightning.planner import CostContext
from zorse_lightning.capabilities import Schedule
from zorse_lightning.planner.cost.recorded_programs import action_orders, programs_recorded, schedule_batches, schedule_programs
from zorse_lightning.profiling import reference_profile
from zorse_lightning.schedule.p2p_batches import rank_batches
from zorse_lightning.schedule.plan import Plan, StagePlan
from zorse_lightning.schedule.programs import played_programs


def _on_other_ranks(plan: Plan, rng: random.Random) -> Plan:
    """``plan`` with its ranks renumbered at random: the same shape on other ranks."""
    new = rng.sample(range(plan.world_size), plan.world_size)
    stages = tuple(replace(s, ranks=tuple(new[r] for r in s.ranks)) for s in plan.stages)
    return replace(plan, stages=stages, idle_ranks=tuple(sorted(new[r] for r in plan.idle_ranks)))


def test_a_plan_of_a_recorded_shape_gets_the_programs_and_batches_recorded_for_it_alone() -> None:
    """120 random plans (widths 1-4, uneven shares, idle ranks, GPipe and 1F1B, interleaved up to 4), each
    recorded first, then the same shape on renumbered ranks: no second recording, and its programs and
    batches are those recording it alone gives."""
    rng = random.Random(41)
    inventory = synthetic_cluster(16, 8)
    ctx = CostContext.build(inventory, reference_profile("llama_tiny", [t.name for t in inventory.gpu_types]))
    relabelled = 0
    for _ in range(120):
        plan = random_plan(rng)
        moved = _on_other_ranks(plan, rng)
        schedule_programs(ctx, plan)
        recordings = len(ctx._programs)
        assert programs_recorded(ctx, moved)
        alone = played_programs(moved)
        assert schedule_programs(ctx, moved) == alone[0]
        assert schedule_batches(ctx, moved) == rank_batches(moved, alone[0])
        assert len(ctx._programs) == recordings
        relabelled += moved.stages != plan.stages
    assert relabelled > 100


def test_plans_of_lanes_read_their_programs_from_the_lane_template() -> None:
    """60 random plans of lanes (1-4 groups as many replicas wide, 1-3 of them, on shuffled ranks, some two-GPU
    TP groups, every replica as many microbatches, GPipe and 1F1B, interleaved up to 4): each rank's actions from
    the one-GPU template are its own programs' stages and kinds in order, and pricing them records nothing;
    without TP, the programs and batches moved from the template's are those recording the plan gives."""
    rng = random.Random(7)
    inventory = synthetic_cluster(16, 8)
    ctx = CostContext.build(inventory, reference_profile("llama_tiny", [t.name for t in inventory.gpu_types]))
    moved = 0
    for _ in range(60):
        degree, width, count = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 12)
        groups = rng.randint(1 if degree == 1 else 2, 4)
        tp = [rng.choice([1, 1, 2]) for _ in range(groups)]
        firsts = [sum(width * t for t in tp[:g]) for g in range(groups)]
        world = firsts[-1] + width * tp[-1]
        shuffled = rng.sample(range(world), world)
        stages = tuple(
            StagePlan(ranks=tuple(shuffled[firsts[g] : firsts[g] + width * tp[g]]), gpu_types=("cpu",) * (width * tp[g]),
                      machines=("localhost",) * (width * tp[g]), layers=(k, k + 1), microbatches_per_rank=(count,) * (width * tp[g]),
                      tensor_parallel=tp[g])
            for k, g in enumerate(list(range(groups)) * degree)
        )
        plan = Plan("test", "test", groups * degree, world, width * count, 1, rng.choice([Schedule.ONE_F_ONE_B, Schedule.GPIPE]),
                    stages, interleave=degree)
        assert programs_recorded(ctx, plan)
        orders = action_orders(ctx, plan)
        assert not ctx._programs
        programs = played_programs(plan)[0]
        assert [[(a.stage, a.kind) for a in row] for row in orders] == [[(a.stage, a.kind) for a in row] for row in programs]
        if set(tp) == {1}:
            assert schedule_programs(ctx, plan) == programs and schedule_batches(ctx, plan) == rank_batches(plan, programs)
            assert not ctx._programs
            moved += 1
    assert moved > 20

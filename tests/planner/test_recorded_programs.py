"""Programs recorded once per plan shape: plans of the same stage widths and shares on other ranks (the same
groups in another order, or other GPUs) take the recording rank for rank, and their batches are their own."""

from __future__ import annotations

import random
from dataclasses import replace

from testing.plans import random_plan
from testing.synthetic_cluster import synthetic_cluster
from zorse_lightning.planner import CostContext
from zorse_lightning.planner.cost.recorded_programs import programs_recorded, schedule_batches, schedule_programs
from zorse_lightning.profiling import reference_profile
from zorse_lightning.schedule.p2p_batches import rank_batches
from zorse_lightning.schedule.plan import Plan
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

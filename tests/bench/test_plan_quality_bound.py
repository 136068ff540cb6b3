"""bench/plan_quality's bound with the optimizer step (issue 37 item 6): above the compute bound by at least
the step's share, and below the plan the search finds, over every GPU and over the GPUs the plan uses."""

from __future__ import annotations

from bench.plan_quality import compute_bound_ms, microbatch_sizes_of
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.planner import PlannerOptions, make_plan
from zorse_lightning.planner.cost.update import optimizer_step_ms
from zorse_lightning.profiling import reference_profile


def test_the_step_bound_lies_between_the_compute_bound_and_the_plan():
    inventory = load_cluster("a100x4_v100x4")
    profile = reference_profile("llama_7b", [t.name for t in inventory.gpu_types], 512, "float16")
    batch = 8 * inventory.world_size
    sizes = microbatch_sizes_of(batch, inventory.world_size, PlannerOptions())
    plan = make_plan(inventory, profile, batch)
    compute = compute_bound_ms(inventory, profile, batch, sizes)
    step = compute_bound_ms(inventory, profile, batch, sizes, with_step=True)
    # the whole model's step spread over every GPU at its own rate, with no compute: a bound of its own
    rate = sum(1.0 / optimizer_step_ms(profile.times(g.gpu_type.name), g.gpu_type, 1.0) for g in inventory.gpus)
    spread_ms = profile.total_parameters / rate
    assert max(compute, spread_ms) < step <= plan.predicted.iteration_ms
    used = compute_bound_ms(inventory, profile, batch, sizes, plan.idle_ranks, with_step=True)
    assert step <= used <= plan.predicted.iteration_ms

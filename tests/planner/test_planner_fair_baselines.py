"""Fair baselines (issue 17, part 3): data parallel accumulates before it is called "does not fit",
and bench/plan_quality's compute-only bound is below every plan, negative intercepts included."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.plan_quality import compute_bound_ms, layer_sample_ms, microbatch_sizes_of
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.planner import PlannerOptions, all_baselines, make_plan
from zorse_lightning.planner.search import ProgramLog
from zorse_lightning.profiling import reference_profile
from zorse_lightning.profiling.profile import BlockTimes, TimeCurve

from test_planner_fixtures import real_gpu_profile, synthetic_profile

GPUS = 8


def data_parallel_equal(inventory, profile, batch, options=PlannerOptions()):
    """The data-parallel baseline alone, predicted as the planner prints it."""
    return all_baselines(inventory, profile, batch, options, names=("data_parallel_equal",))["data_parallel_equal"]


def _cluster_and_profile():
    inventory = load_cluster("a100x4_v100x4")
    return inventory, real_gpu_profile(inventory)


def test_data_parallel_accumulates_when_one_microbatch_per_gpu_does_not_fit() -> None:
    inventory, profile = _cluster_and_profile()
    batch = 32 * GPUS
    alone = data_parallel_equal(inventory, profile, batch, PlannerOptions(microbatch_sizes=(32,)))
    assert alone is None  # 32 samples in one microbatch overflow the V100s
    ddp = data_parallel_equal(inventory, profile, batch)
    assert ddp is not None and len(ddp.stages) == 1 and ddp.idle_ranks == ()
    stage = ddp.stages[0]
    count = 32 // ddp.microbatch_size
    assert count > 1 and stage.microbatches_per_rank == (count,) * GPUS
    assert not stage.recompute and stage.sharding.value == "none"
    assert f"accumulating {count} microbatches of {ddp.microbatch_size}" in ddp.notes[0]
    for m in (1, 2, 4, 8, 16):  # the fastest of the sizes that fit
        other = data_parallel_equal(inventory, profile, batch, PlannerOptions(microbatch_sizes=(m,)))
        assert other is None or other.predicted.iteration_ms >= ddp.predicted.iteration_ms


def test_data_parallel_is_one_microbatch_where_that_fits_and_fastest() -> None:
    inventory, profile = _cluster_and_profile()
    ddp = data_parallel_equal(inventory, profile, 4 * GPUS)
    assert ddp.microbatch_size == 4 and ddp.stages[0].microbatches_per_rank == (1,) * GPUS
    assert "one microbatch" in ddp.notes[0]


def test_data_parallel_does_not_fit_only_when_no_microbatch_size_fits() -> None:
    inventory = load_cluster("a100x4_v100x4")
    profile = synthetic_profile(tuple(t.name for t in inventory.gpu_types), num_layers=48)  # state alone overflows
    assert data_parallel_equal(inventory, profile, 8 * GPUS) is None
    for m in (1, 2, 4, 8):
        assert data_parallel_equal(inventory, profile, 8 * GPUS, PlannerOptions(microbatch_sizes=(m,))) is None


def _negative_intercepts(profile, fraction: float):
    """Every layer's line through ``-fraction x slope`` at zero samples (as some reference profiles)."""
    def curve(c: TimeCurve) -> TimeCurve:
        return TimeCurve(c.slope_ms, -fraction * c.slope_ms)

    devices = {
        t: replace(d, layers=tuple(BlockTimes(curve(b.forward), curve(b.backward)) for b in d.layers))
        for t, d in profile.devices.items()
    }
    return replace(profile, devices=devices)


def test_bound_is_below_every_plan_with_negative_intercepts() -> None:
    inventory, profile = _cluster_and_profile()
    profile = _negative_intercepts(profile, 0.9)
    batch = 8 * GPUS
    options = PlannerOptions()
    sizes = microbatch_sizes_of(batch, GPUS, options)
    bound = compute_bound_ms(inventory, profile, batch, sizes)
    plans = [make_plan(inventory, profile, batch, options), *all_baselines(inventory, profile, batch, options).values()]
    plans += [data_parallel_equal(inventory, profile, batch, PlannerOptions(microbatch_sizes=(m,))) for m in sizes]
    times = [p.predicted.iteration_ms for p in plans if p is not None]
    assert len(times) >= 5
    assert all(bound <= t for t in times)
    slopes_bound = batch / sum(
        1 / sum(b.forward.slope_ms + b.backward.slope_ms for b in profile.times(g.gpu_type.name).layers) for g in inventory.gpus
    )
    assert min(times) < slopes_bound  # the bound by slopes was not one: the plan beats it


def test_bound_of_unlike_layers_is_the_assignment_program() -> None:
    """Layers of different times take the linear program: at most spreading the whole model by speed
    (it may give each type the layers it is relatively fastest on: here the fixed intercepts make the
    ratio between types differ a little from layer to layer), and below every plan."""
    inventory = load_cluster("a100x4_v100x4")
    types = tuple(t.name for t in inventory.gpu_types)
    profile = synthetic_profile(types, num_layers=6, layer_scale=(1.0, 2.0, 1.0, 3.0, 1.0, 0.5))
    sizes = [1, 2, 4, 8]
    per_model = {
        t: sum(min((b.forward.at(m) + b.backward.at(m)) / m for m in sizes) for b in profile.times(t).layers) for t in types
    }
    spread = 64 / sum(1 / per_model[g.gpu_type.name] for g in inventory.gpus)
    bound = compute_bound_ms(inventory, profile, 64, sizes)
    assert 0.98 * spread <= bound <= spread * (1 + 1e-9)
    plan = make_plan(inventory, profile, 64, PlannerOptions(microbatch_sizes=tuple(sizes)))
    assert bound <= plan.predicted.iteration_ms


@pytest.mark.parametrize("cluster, model", [("lab4_l4_a6000_p40", None), ("a100x4_v100x4", "llama_13b")])
def test_program_log_records_each_program_against_its_start(cluster: str, model: str | None) -> None:
    """The loop solves a program only for a layout whose bound is below the plan it holds (here, on three
    machines of three types, several). A layout whose split fits only recomputing solves two (Llama 13B on
    the A100s and V100s: none fits without), and the plan's count is of programs solved."""
    inventory = load_cluster(cluster)
    profile = real_gpu_profile(inventory) if model is None else reference_profile(model, [t.name for t in inventory.gpu_types], 512, "float16")
    log = ProgramLog()
    plan = make_plan(inventory, profile, 64 * inventory.world_size, PlannerOptions(), log)
    assert log.runs and all(r.warm_started == (r.start_ms is not None) for r in log.runs)
    assert all(r.solves == (1 + r.recompute if r.plan_ms is not None else 2) for r in log.runs)
    assert f"{sum(r.solves for r in log.runs)} programs solved" in plan.solver.status
    assert model is None or any(r.solves == 2 for r in log.runs)
    for run in log.runs:
        if run.gain is not None:
            assert run.gain == pytest.approx((run.start_ms - run.plan_ms) / run.start_ms)


def test_the_bound_over_the_gpus_a_plan_uses_leaves_its_idle_ones_out() -> None:
    """bench/plan_quality's second figure: the compute bound over the GPUs a plan uses. Leaving the four
    V100s of a100x4_v100x4 out gives the bound of the four A100s alone: the whole batch over their rate."""
    inventory = load_cluster("a100x4_v100x4")
    profile = reference_profile("llama_7b", [t.name for t in inventory.gpu_types], 512, "float16")
    sizes = microbatch_sizes_of(64, inventory.world_size, PlannerOptions())
    every = compute_bound_ms(inventory, profile, 64, sizes)
    v100s = tuple(r for r, g in enumerate(inventory.gpus) if g.gpu_type.name != "a100x40")
    a100s_alone = compute_bound_ms(inventory, profile, 64, sizes, idle=v100s)
    assert compute_bound_ms(inventory, profile, 64, sizes, idle=()) == every
    per_sample_ms = sum(layer_sample_ms(l, sizes) for l in profile.times("a100x40").layers)
    assert a100s_alone == pytest.approx(64 * per_sample_ms / 4, rel=1e-12)
    assert a100s_alone > every

"""The optimizer step term of the cost model against hand calculations."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_planner_costs import LAYER_PARAMS, _device, _inventory, _plan, _profile

from zorse_lightning.capabilities import Sharding
from zorse_lightning.cluster import DEFAULT_CATALOG
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner import PlannerOptions, make_plan
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.evaluate import plan_cost
from zorse_lightning.planner.cost.update import update_lower_bound_ms
from zorse_lightning.planner.cost.update import (
    ADAM_STEP_BYTES_PER_PARAMETER,
    optimizer_step_ms,
    parameters_updated,
)
from zorse_lightning.profiling.profile import ModelProfile

A100, V100 = DEFAULT_CATALOG.get("a100x40"), DEFAULT_CATALOG.get("v100x16")


def _measured(rates: dict[str, float]) -> ModelProfile:
    """The hand profile of test_planner_costs with measured optimizer rates (ms per million parameters)."""
    profile = _profile()
    devices = {name: replace(d, optimizer_ms_per_million_parameters=rates[name]) for name, d in profile.devices.items()}
    return replace(profile, devices=devices)


def test_measured_rate_is_preferred_over_the_bandwidth_estimate() -> None:
    measured = replace(_device("a100x40", 1.0), optimizer_ms_per_million_parameters=6.0)
    assert optimizer_step_ms(measured, A100, 3_300_000) == pytest.approx(6.0 * 3.3)
    assert optimizer_step_ms(measured, V100, 3_300_000) == pytest.approx(6.0 * 3.3)  # the device's own rate
    free = replace(measured, optimizer_ms_per_million_parameters=0.0)
    assert optimizer_step_ms(free, A100, 3_300_000) == 0.0


def test_estimate_is_bytes_over_memory_bandwidth() -> None:
    assert ADAM_STEP_BYTES_PER_PARAMETER == 28  # 4 + 2 + 8 read, 4 + 8 + 2 written (fp32: 16 + 12)
    estimated = _device("a100x40", 1.0)
    # 1e9 parameters x 28 bytes at 1555 GB/s (12440 Gb/s)
    assert optimizer_step_ms(estimated, A100, 1e9) == pytest.approx(28e9 / 1555e9 * 1e3)
    assert optimizer_step_ms(estimated, V100, 1e9) == pytest.approx(28e9 / 900e9 * 1e3)


def test_a_rank_steps_its_shard_or_everything() -> None:
    assert parameters_updated(1000, Sharding.NONE, (0.75, 0.25)) == (1000.0, 1000.0)
    assert parameters_updated(1000, Sharding.OPTIMIZER, (0.75, 0.25)) == pytest.approx((750.0, 250.0))


def test_rate_is_validated() -> None:
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(PlanningError, match="optimizer_ms_per_million_parameters"):
            replace(_device("a100x40", 1.0), optimizer_ms_per_million_parameters=bad)


def test_iteration_adds_each_stages_sync_and_slowest_update() -> None:
    """Stage 0: A100 + V100 on 2 layers (2e6 parameters); stage 1: one A100 on 2 layers."""
    ctx = CostContext.build(_inventory(), _measured({"a100x40": 2.0, "v100x16": 5.0}), memory_reserve_gib=0.5)
    unsharded = plan_cost(ctx, _plan())
    stage_params = 2 * LAYER_PARAMS / 1e6  # millions
    assert unsharded.stages[0].update_ms == pytest.approx((2.0 * stage_params, 5.0 * stage_params))  # 4, 10 ms
    assert unsharded.stages[1].update_ms == pytest.approx((2.0 * stage_params,))
    sync = unsharded.sync_ms
    assert unsharded.stage_tail_ms(0) == pytest.approx(sync + 10.0)
    assert unsharded.iteration_ms == pytest.approx(unsharded.pipeline_ms + sync + 10.0)

    # sharded 3:1, the V100 steps a quarter: 0.75 x 4 = 3 ms, 0.25 x 10 = 2.5 ms
    sharded = plan_cost(ctx, _plan(Sharding.OPTIMIZER, (0.75, 0.25)))
    assert sharded.stages[0].update_ms == pytest.approx((3.0, 2.5))
    # the same all-reduce, then one of the fp16 weights (each owner's shard, zeros elsewhere)
    assert sharded.sync_ms == pytest.approx(2 * sync)
    gather = sync
    assert sharded.pipeline_ms == pytest.approx(unsharded.pipeline_ms)
    assert sync + gather + 3.0 < 4.0  # now stage 1's step is the longest tail
    assert sharded.update_ms == pytest.approx(4.0)
    # it starts at stage 1's last backward, before stage 0's by the last microbatch's backward on stage 0
    slowest_backward = max(t.backward_ms for t in sharded.stages[0].times)
    assert sharded.drain_ms == pytest.approx((0.0, slowest_backward + sharded.boundaries[0].transfer_ms))
    exposed = max(sync + gather + 3.0, 4.0 - sharded.drain_ms[1])
    assert sharded.iteration_ms == pytest.approx(sharded.pipeline_ms + exposed)


def test_search_keeps_sharding_where_it_shortens_the_step() -> None:
    options = PlannerOptions(allow_pipeline=False, stage_layout=[[0, 1, 2]])
    costly = make_plan(_inventory(), _measured({"a100x40": 2.0, "v100x16": 5.0}), 8, options)
    assert costly.stages[0].sharding is Sharding.OPTIMIZER_GRADIENTS  # everything fits unsharded, but steps 3x longer
    free = make_plan(_inventory(), _measured({"a100x40": 0.0, "v100x16": 0.0}), 8, options)
    assert free.stages[0].sharding is Sharding.NONE  # no faster sharded: prefer fewer collectives
    assert costly.predicted.iteration_ms > free.predicted.iteration_ms


def test_update_bound_spreads_every_parameter_over_every_gpu_by_speed() -> None:
    ctx = CostContext.build(_inventory(), _measured({"a100x40": 2.0, "v100x16": 5.0}), memory_reserve_gib=0.5)
    # 4e6 parameters; the GPUs step 1/2, 1/5 and 1/2 million parameters per ms
    assert update_lower_bound_ms(ctx, [0, 1, 2]) == pytest.approx(4.0 / (0.5 + 0.2 + 0.5))
    for sharding, fractions in ((Sharding.NONE, ()), (Sharding.OPTIMIZER, (0.75, 0.25)), (Sharding.OPTIMIZER, (0.3, 0.7))):
        assert update_lower_bound_ms(ctx, [0, 1, 2]) <= plan_cost(ctx, _plan(sharding, fractions)).update_ms
    free = CostContext.build(_inventory(), _measured({"a100x40": 0.0, "v100x16": 5.0}), memory_reserve_gib=0.5)
    assert update_lower_bound_ms(free, [0, 1, 2]) == 0.0

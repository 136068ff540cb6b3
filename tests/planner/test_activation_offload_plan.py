"""Activation offload as a plan choice: in the plan, its JSON and its checks."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from rich.console import Console

from zorse_lightning.cluster.catalog import DEFAULT_CATALOG
from zorse_lightning.cluster.inventory import ClusterInventory, Machine
from zorse_lightning.errors import InventoryError, PlanningError
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.evaluate import PlanCost, memory_overruns, plan_cost, prediction
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.schedule.plan import Plan
from zorse_lightning.planner.plan_check import check_predicted_memory
from zorse_lightning.planner.search import make_plan
from zorse_lightning.reporting.plan_table import plan_table
from zorse_lightning.profiling.profile import BlockShape, BlockTimes, DeviceTimes, ModelProfile, ProfileSource, TimeCurve
from testing.plans import hand_plan


def _two_stages(**kwargs) -> Plan:
    return hand_plan([((0,), (4,), (0, 2)), ((1,), (4,), (2, 4))], **kwargs)


def test_offload_survives_json_and_old_plans_read_as_keeping_activations():
    plan = _two_stages(offload_stages=(1,))
    again = Plan.from_json(plan.to_json())
    assert again == plan and [s.activations_label for s in again.stages] == ["keep", "offload"]
    old = json.loads(_two_stages(recompute=True).to_json())
    for stage in old["stages"]:
        del stage["offload_activations"]  # a plan written before offload existed
    assert [s.activations_label for s in Plan.from_dict(old).stages] == ["recompute", "recompute"]


# -- priced, not assumed free ------------------------------------------------------------------


def _ctx(host_link_gbps: float = 256.0, host_memory_gib: float | None = None) -> CostContext:
    """Two A100-like GPUs on one machine, 4 layers of 1 MB activations a sample and 1 ms forward a sample."""
    a100 = replace(DEFAULT_CATALOG.get("a100x40"), host_link_gbps=host_link_gbps)
    layer = BlockShape("layer", 1_000_000, 1_000_000, 250_000, 1.0)
    edge = BlockShape("edge", 0, 0, 250_000, 0.0)
    timed = BlockTimes(TimeCurve(1.0, 0.0), TimeCurve(2.0, 0.0))
    zero = BlockTimes(TimeCurve(0.0, 0.0), TimeCurve(0.0, 0.0))
    profile = ModelProfile(
        "hand", 8, "float16", edge, (layer,) * 4, edge, {"a100x40": DeviceTimes("a100x40", ProfileSource.MEASURED, zero, (timed,) * 4, zero)}
    )
    machine = Machine("box", (a100, a100), intra_bandwidth_gbps=80.0, host_memory_gib=host_memory_gib)
    return CostContext.build(ClusterInventory("hand", (machine,)), profile, memory_reserve_gib=0.5)


def _priced(ctx: CostContext, offload: tuple[int, ...]) -> tuple[Plan, PlanCost]:
    plan = hand_plan([((0,), (8,), (0, 2)), ((1,), (8,), (2, 4))], microbatch_size=4, inventory=ctx.inventory, offload_stages=offload)
    return plan, plan_cost(ctx, plan)


def test_offload_moves_the_in_flight_activations_to_host_memory():
    ctx = _ctx()
    _, kept = _priced(ctx, ())
    plan, offloaded = _priced(ctx, (0,))
    before, after = kept.stages[0].memory[0], offloaded.stages[0].memory[0]
    # Stage 0 holds 2 microbatches in flight (1F1B, one later stage) of 2 layers x 4 samples x 1 MB:
    # all on the host now; the device keeps the stage output of each and two blocks of the running one.
    assert after.host_bytes == 2 * 2 * 4 * 1_000_000 and before.host_bytes == 0
    assert after.activation_bytes == 2 * 4 * 250_000 + 2 * 4 * 1_000_000 < before.activation_bytes
    assert offloaded.stages[1].memory == kept.stages[1].memory
    assert prediction(ctx, plan, offloaded).host_memory_gib[0] == pytest.approx(16e6 / 2**30, abs=1e-4)


def test_offload_with_recompute_moves_only_the_block_inputs_and_pays_both():
    ctx = _ctx()
    recomputed = hand_plan([((0,), (8,), (0, 2)), ((1,), (8,), (2, 4))], microbatch_size=4, inventory=ctx.inventory, recompute=True)
    both = hand_plan(
        [((0,), (8,), (0, 2)), ((1,), (8,), (2, 4))], microbatch_size=4, inventory=ctx.inventory, recompute=True, offload_stages=(0,)
    )
    kept, offloaded = plan_cost(ctx, recomputed), plan_cost(ctx, both)
    # Two microbatches in flight of two layer inputs (the embedding's and layer 0's outputs) x 4 samples x 0.25 MB.
    assert offloaded.stages[0].memory[0].host_bytes == 2 * 2 * 4 * 250_000
    # On the device: each in-flight microbatch's stage output, the layer recomputed and two inputs brought back.
    assert offloaded.stages[0].memory[0].activation_bytes == 2 * 4 * 250_000 + 4 * 1_000_000 + 2 * 4 * 250_000
    assert offloaded.stages[0].memory[0].activation_bytes < kept.stages[0].memory[0].activation_bytes
    assert offloaded.stages[0].times == kept.stages[0].times  # 2 MB at 32 GB/s hides under the compute
    assert ctx.offload_copy_ms("a100x40", (0, 2), 4, recompute=True) == pytest.approx(2e6 / 32e9 * 1000)
    assert offloaded.stages[1] == kept.stages[1]


def test_copies_cost_only_what_they_last_beyond_the_compute_they_hide_under():
    # 2 layers x 4 samples x 1 MB = 8 MB each way; forward 8 ms, backward 16 ms.
    _, hidden = _priced(_ctx(host_link_gbps=256.0), (0,))  # 32 GB/s: 0.25 ms
    _, kept = _priced(_ctx(host_link_gbps=256.0), ())
    assert hidden.stages[0].times == kept.stages[0].times
    _, slow = _priced(_ctx(host_link_gbps=4.0), (0,))  # 0.5 GB/s: 16 ms each way
    assert (slow.stages[0].times[0].forward_ms, slow.stages[0].times[0].backward_ms) == pytest.approx((16.0, 16.0), abs=0.01)
    assert slow.iteration_ms > kept.iteration_ms


def test_a_plan_pinning_over_half_the_host_memory_does_not_fit_and_a_pinned_one_is_refused():
    ctx = _ctx(host_memory_gib=0.02)  # may pin 10 MB; offload pins 16 MB on rank 0
    plan, cost = _priced(ctx, (0,))
    assert [(stage, rank) for stage, rank, _ in memory_overruns(ctx, plan, cost)] == [(0, 0)]
    roomy = _ctx(host_memory_gib=1.0)
    assert not memory_overruns(roomy, *_priced(roomy, (0,)))
    pinned = replace(plan, predicted=prediction(ctx, plan, cost))
    with pytest.raises(PlanningError, match="would pin 0.01 GiB of host memory on machine 'box'.*half its host_memory_gib"):
        check_predicted_memory(pinned, ctx.inventory)


def test_host_link_and_host_memory_are_checked_with_the_fix():
    with pytest.raises(InventoryError, match="host_link_gbps=0 must be positive"):
        replace(DEFAULT_CATALOG.get("t4"), host_link_gbps=0)
    with pytest.raises(InventoryError, match="host_memory_gib .* must be a positive number"):
        Machine("box", (DEFAULT_CATALOG.get("t4"),), intra_bandwidth_gbps=1.0, host_memory_gib=-1)
    assert DEFAULT_CATALOG.get("h100-sxm").host_link_gbps == 4 * DEFAULT_CATALOG.get("v100x16").host_link_gbps
    assert Machine("box", (DEFAULT_CATALOG.get("t4"),) * 2, intra_bandwidth_gbps=1.0).pinnable_host_gib == 32.0


def test_the_plan_table_says_which_stages_offload_and_what_they_pin():
    ctx = _ctx()
    plan, _ = _priced(ctx, (0,))
    console = Console(width=200, record=True)
    console.print(plan_table(plan, ctx))
    rows = [line for line in console.export_text().splitlines() if line.startswith("│")]
    assert "+offload" in rows[0] and "+0.0149 host" in rows[0]
    assert "offload" not in rows[1] and "host" not in rows[1]


# -- chosen by the search ------------------------------------------------------------------------


def _small_beside_big(host_link_gbps: float) -> tuple[ClusterInventory, ModelProfile]:
    """A GPU of 24 MiB (rank 0, first stage: two microbatches in flight) beside a roomy one of the same
    speed, 8 layers of 1 MB activations a sample: the first stage's 4 layers at microbatch 4 keep 32 MB
    in flight, 10 MB with offload (its outputs and two blocks of the running microbatch)."""
    a100 = replace(DEFAULT_CATALOG.get("a100x40"), host_link_gbps=host_link_gbps)
    small = replace(a100, name="small", memory_gib=24 / 1024)
    layer = BlockShape("layer", 1000, 1_000_000, 250_000, 1.0)
    edge = BlockShape("edge", 0, 0, 250_000, 0.0)
    timed = BlockTimes(TimeCurve(1.0, 0.0), TimeCurve(2.0, 0.0))
    zero = BlockTimes(TimeCurve(0.0, 0.0), TimeCurve(0.0, 0.0))
    devices = {t: DeviceTimes(t, ProfileSource.MEASURED, zero, (timed,) * 8, zero) for t in ("small", "a100x40")}
    profile = ModelProfile("hand", 8, "float16", edge, (layer,) * 8, edge, devices)
    machine = Machine("box", (small, a100), intra_bandwidth_gbps=80.0, host_memory_gib=1.0)
    return ClusterInventory("small_beside_big", (machine,)), profile


_PINS = PlannerOptions(stage_layout=((0,), (1,)), microbatch_size=4, memory_reserve_gib=0.0, max_interleave=1)


def test_the_search_offloads_the_stage_that_holds_its_in_flight_activations_only_so():
    inventory, profile = _small_beside_big(host_link_gbps=256.0)  # 32 GB/s: the copies hide under compute
    plan = make_plan(inventory, profile, 32, _PINS)
    assert [s.activations_label for s in plan.stages] == ["offload", "keep"]
    assert plan.stages[0].layers == (0, 4)  # balanced: neither layers moved off the small GPU nor recomputed
    ctx = CostContext.build(inventory, profile, memory_reserve_gib=0.0)
    kept = replace(plan, stages=(replace(plan.stages[0], offload_activations=False), plan.stages[1]))
    assert memory_overruns(ctx, kept, plan_cost(ctx, kept))  # it does not fit without offload
    console = Console(width=200, record=True)
    console.print(plan_table(plan, ctx))
    rows = [line for line in console.export_text().splitlines() if line.startswith("│")]
    assert "+offload" in rows[0] and "host" in rows[0] and "offload" not in rows[1]


def test_the_search_does_not_offload_where_the_copies_cost_more_than_recomputing():
    inventory, profile = _small_beside_big(host_link_gbps=0.5)  # 62.5 MB/s: 256 ms a microbatch each way
    plan = make_plan(inventory, profile, 32, _PINS)
    assert not any(s.offload_activations for s in plan.stages)


def test_allow_offload_false_keeps_the_search_from_offloading():
    inventory, profile = _small_beside_big(host_link_gbps=256.0)
    plan = make_plan(inventory, profile, 32, replace(_PINS, allow_offload=False))
    assert not any(s.offload_activations for s in plan.stages)
    assert plan.stages[0].recompute or plan.stages[0].layers != (0, 4)  # fitted some other way

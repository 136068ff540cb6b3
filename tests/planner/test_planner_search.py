"""The search on every shipped cluster: plan invariants, baselines, pins, infeasible cases."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest

from zorse_lightning.capabilities import SUPPORTED_SCHEDULES, SUPPORTED_SHARDING, Schedule, Sharding
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner import CostContext, Plan, PlannerOptions, all_baselines, make_plan, plan_cost
from zorse_lightning.planner.cost.evaluate import memory_overruns
from zorse_lightning.planner.cost.simulate import simulate

from test_planner_fixtures import big_cluster, profile_for, synthetic_profile

SIZED_FOR_ONE_MODEL = {"cpu_sim4_small_memory", "cpu_sim4_30mb"}
"""Budgets of 2 and 30 MB, sized for the GPTs of test_bigger_than_any_gpu and recipe gpt_bigger_than_any_gpu:
the profiles here fit none."""
CLUSTERS = sorted(
    p.stem for p in (Path(__file__).parents[2] / "zorse_lightning" / "conf" / "cluster").glob("*.yaml")
    if p.stem not in SIZED_FOR_ONE_MODEL
)
GLOBAL_BATCH = 64


@lru_cache(maxsize=None)
def _planned(name: str, allow_idle_ranks: bool = False):
    inventory = load_cluster(name)
    profile = profile_for(inventory)
    return inventory, profile, make_plan(inventory, profile, GLOBAL_BATCH, PlannerOptions(allow_idle_ranks=allow_idle_ranks))


def test_every_shipped_cluster_is_covered() -> None:
    assert {"cpu_sim2", "cpu_sim4", "mix32_4types", "dc2_a100x8_v100x8"} <= set(CLUSTERS)


@pytest.mark.parametrize("allow_idle_ranks", [False, True])
@pytest.mark.parametrize("name", CLUSTERS)
def test_plan_invariants(name: str, allow_idle_ranks: bool) -> None:
    inventory, profile, plan = _planned(name, allow_idle_ranks)
    if not allow_idle_ranks:
        assert plan.idle_ranks == ()  # off: every rank works
    assert plan.world_size == inventory.world_size
    used = sorted([r for s in plan.rank_groups for r in s.ranks] + list(plan.idle_ranks))
    assert used == list(range(inventory.world_size))
    assert plan.stages[0].layers[0] == 0 and plan.stages[-1].layers[1] == profile.num_layers
    for before, after in zip(plan.stages, plan.stages[1:]):
        assert before.layers[1] == after.layers[0]
    for stage in plan.stages:
        assert stage.num_microbatches * plan.microbatch_size == GLOBAL_BATCH
        assert stage.sharding in SUPPORTED_SHARDING
        assert stage.gpu_types == tuple(inventory.gpus[r].gpu_type.name for r in stage.ranks)
        assert stage.machines == tuple(inventory.gpus[r].machine for r in stage.ranks)
        if stage.sharding is not Sharding.NONE:
            assert sum(stage.shard_fractions) == pytest.approx(1.0)
    assert plan.schedule in SUPPORTED_SCHEDULES
    # the prediction is the simulation of the engine's programs (what runs), and every GPU fits its own memory
    ctx = CostContext.build(inventory, profile)
    cost = plan_cost(ctx, plan)
    simulated_ms = simulate(ctx, plan).makespan_ms
    assert plan.predicted.iteration_ms == pytest.approx(simulated_ms, rel=1e-12)
    assert plan.predicted.samples_per_s == pytest.approx(GLOBAL_BATCH / simulated_ms * 1000)
    assert not memory_overruns(ctx, plan, cost)
    for rank, gpu in enumerate(inventory.gpus):
        assert plan.predicted.memory_gib[rank] <= gpu.memory_gib
        assert (plan.predicted.memory_gib[rank] == 0) == (rank in plan.idle_ranks)
    assert set(plan.predicted.profile_source) == {t for s in plan.stages for t in s.gpu_types}
    assert plan.planner_seconds > 0
    assert plan.solver.name in ("pulp-cbc", "heuristic")


@pytest.mark.parametrize("name", CLUSTERS)
def test_plan_is_never_worse_than_a_baseline(name: str) -> None:
    # the defaults, idle ranks allowed: "the fastest type alone" idles the rest, so the plan may too
    inventory, profile, plan = _planned(name, allow_idle_ranks=PlannerOptions().allow_idle_ranks)
    baselines = all_baselines(inventory, profile, GLOBAL_BATCH)
    assert set(baselines) == {"data_parallel_equal", "fastest_type_alone", "proportional_heuristic", "cephalo"}
    for label, baseline in baselines.items():
        if baseline is not None:
            # in the prediction the planner reports and ranks by (the simulation of what runs)
            assert plan.predicted.iteration_ms <= baseline.predicted.iteration_ms * (1 + 1e-9), label
    # with every rank in use, the plan still beats every baseline that uses every rank
    every_rank = _planned(name)[2]
    for label in ("data_parallel_equal", "proportional_heuristic", "cephalo"):
        if baselines[label] is not None:
            assert every_rank.predicted.iteration_ms <= baselines[label].predicted.iteration_ms * (1 + 1e-9), label


def test_baselines_are_what_they_say() -> None:
    inventory = load_cluster("a100x4_v100x4")
    profile = profile_for(inventory)
    baselines = all_baselines(inventory, profile, GLOBAL_BATCH)
    ddp = baselines["data_parallel_equal"]
    assert len(ddp.stages) == 1 and ddp.stages[0].microbatches_per_rank == (1,) * 8 and ddp.microbatch_size == 8
    fastest = baselines["fastest_type_alone"]
    assert fastest.world_size == 4 and {t for s in fastest.stages for t in s.gpu_types} == {"a100x40"}
    proportional = baselines["proportional_heuristic"]
    assert [s.machines[0] for s in proportional.stages] == ["a100-node", "v100-node"]
    assert proportional.stages[0].num_layers > proportional.stages[1].num_layers  # A100s are faster
    cephalo = baselines["cephalo"]
    assert len(cephalo.stages) == 1
    counts = cephalo.stages[0].microbatches_per_rank
    assert min(counts[:4]) > max(counts[4:])  # batches by speed


def test_plan_uses_pipeline_and_uneven_microbatches_on_mixed_cluster() -> None:
    _, _, plan = _planned("a10g_l4_t4")
    assert len(plan.stages) > 1
    assert len({s.gpu_types[0] for s in plan.stages}) > 1


def test_slow_link_falls_between_stages() -> None:
    inventory, _, plan = _planned("dc2_a100x8_v100x8")
    for stage in plan.stages:
        assert len({inventory.machine_of(r).datacenter for r in stage.ranks}) == 1


def test_json_round_trip_of_a_planned_plan(tmp_path: Path) -> None:
    inventory = load_cluster("mix32_4types")
    # gloo's play of the messages leaves the T4s behind slow links idle (NCCL's, the cluster's own, hides
    # more of their transfers under compute and uses them)
    plan = make_plan(inventory, profile_for(inventory), GLOBAL_BATCH, PlannerOptions(allow_idle_ranks=True, p2p_rules="gloo"))
    assert plan.idle_ranks
    assert Plan.from_json(plan.to_json()) == plan
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan


def test_pins_are_respected() -> None:
    inventory = load_cluster("a100x4_v100x4")
    profile = profile_for(inventory)
    options = PlannerOptions(
        stage_layout=[[4, 5, 6, 7], [0, 1, 2, 3]], layer_counts=[8, 16], microbatch_size=2, schedule="gpipe"
    )
    plan = make_plan(inventory, profile, GLOBAL_BATCH, options)
    groups = [g.ranks for g in plan.rank_groups]
    assert groups == [(4, 5, 6, 7), (0, 1, 2, 3)]
    assert [sum(s.num_layers for s in plan.stages if s.ranks == g) for g in groups] == [8, 16]
    assert plan.microbatch_size == 2 and plan.schedule is Schedule.GPIPE
    plain = make_plan(inventory, profile, GLOBAL_BATCH, replace(options, max_interleave=1))
    assert [s.layers for s in plain.stages] == [(0, 8), (8, 24)]


def test_data_parallel_only_says_why() -> None:
    inventory = load_cluster("a100x4_v100x4")
    options = PlannerOptions(allow_pipeline=False, no_pipeline_reason="encoder-decoder: values cross any cut")
    plan = make_plan(inventory, profile_for(inventory), GLOBAL_BATCH, options)
    assert len(plan.stages) == 1
    assert any("encoder-decoder" in note for note in plan.notes)


def test_uneven_layers_get_a_valid_plan() -> None:
    inventory = load_cluster("a10g_l4_t4")
    scales = tuple(1.0 + 0.1 * (i % 5) for i in range(24))
    profile = synthetic_profile(tuple(t.name for t in inventory.gpu_types), layer_scale=scales)
    plan = make_plan(inventory, profile, GLOBAL_BATCH)
    ctx = CostContext.build(inventory, profile)
    assert not memory_overruns(ctx, plan, plan_cost(ctx, plan))


def test_model_too_big_names_gpu_shortfall_and_remedies() -> None:
    inventory = load_cluster("a10g_l4_t4")
    huge = synthetic_profile(tuple(t.name for t in inventory.gpu_types), num_layers=48, hidden=8192)
    with pytest.raises(PlanningError) as caught:
        make_plan(inventory, huge, GLOBAL_BATCH)
    message = str(caught.value)
    for expected in ("GPU rank", "on machine", "short by", "GiB", "more GPUs", "smaller microbatch size", "sharding"):
        assert expected in message
    assert "recomputation on" in message


def test_infeasible_with_pins_mentions_the_pins() -> None:
    inventory = load_cluster("cpu_sim2")
    profile = profile_for(inventory)
    with pytest.raises(PlanningError, match="pins"):
        make_plan(inventory, profile, 4096, PlannerOptions(microbatch_size=4096, schedule="gpipe"))


def test_infeasible_names_offload_only_where_it_is_off_and_activations_overflow() -> None:
    """Offload keeps activations in host memory: the error suggests allowing it where it was turned off and
    the training state alone fits, never where the state alone is over (offload could not help)."""
    inventory = load_cluster("cpu_sim2")
    pins = {"microbatch_size": 4096, "schedule": "gpipe"}
    messages = []
    for options in (PlannerOptions(**pins), PlannerOptions(**pins, allow_offload=False)):
        with pytest.raises(PlanningError) as caught:
            make_plan(inventory, profile_for(inventory), 4096, options)
        messages.append(str(caught.value))
    assert "allow_offload" not in messages[0] and "allow_offload=False rules out" in messages[1]
    big = load_cluster("a10g_l4_t4")
    huge = synthetic_profile(tuple(t.name for t in big.gpu_types), num_layers=48, hidden=8192)
    with pytest.raises(PlanningError) as caught:
        make_plan(big, huge, GLOBAL_BATCH, PlannerOptions(allow_offload=False))
    assert "allow_offload" not in str(caught.value)


@pytest.mark.parametrize(
    "options, match",
    [
        (PlannerOptions(microbatch_size=3), "divides global_batch_size"),
        (PlannerOptions(stage_layout=[[0, 1]]), "exactly once"),
        (PlannerOptions(layer_counts=[4, 3]), "sum to 7"),
    ],
)
def test_bad_requests_are_refused_with_the_fix(options: PlannerOptions, match: str) -> None:
    inventory = load_cluster("cpu_sim4")
    with pytest.raises(PlanningError, match=match):
        make_plan(inventory, profile_for(inventory), GLOBAL_BATCH, options)


def test_profile_missing_a_gpu_type_is_refused() -> None:
    inventory = load_cluster("cpu_sim4")
    profile = synthetic_profile(("a100x40",), num_layers=8, hidden=256, seq_len=128, vocab=1000)
    with pytest.raises(PlanningError, match="no times for GPU type"):
        make_plan(inventory, profile, GLOBAL_BATCH)


def test_options_are_validated() -> None:
    with pytest.raises(PlanningError, match="solver_time_limit_s"):
        PlannerOptions(solver_time_limit_s=0)
    with pytest.raises(PlanningError, match="schedule"):
        PlannerOptions(schedule="interleaved")


def test_a_1024_gpu_cluster_plans() -> None:
    inventory = big_cluster()
    assert inventory.world_size == 1024 and len(inventory.gpu_types) == 4
    profile = synthetic_profile(tuple(t.name for t in inventory.gpu_types), num_layers=32, hidden=4096)
    plan = make_plan(inventory, profile, 2048)
    ctx = CostContext.build(inventory, profile)
    cost = plan_cost(ctx, plan)
    assert plan.predicted.iteration_ms == pytest.approx(simulate(ctx, plan).makespan_ms)
    assert plan.predicted.closed_form_ms == pytest.approx(cost.iteration_ms)
    assert not memory_overruns(ctx, plan, cost)
    assert sum(len(g.ranks) for g in plan.rank_groups) + len(plan.idle_ranks) == 1024


def test_sharding_when_state_does_not_fit_unsharded_with_shares_by_free_memory() -> None:
    inventory = load_cluster("a10g_l4_t4")
    profile = profile_for(inventory)  # 1.4e9 parameters x 16 bytes: 21 GiB, more than any GPU here
    options = PlannerOptions(allow_pipeline=False, stage_layout=[list(range(12))])  # all of them, one stage
    plan = make_plan(inventory, profile, GLOBAL_BATCH, options)
    (stage,) = plan.stages
    assert stage.sharding is Sharding.OPTIMIZER_GRADIENTS  # as much memory as optimizer, half its traffic
    ctx = CostContext.build(inventory, profile)
    memory = plan_cost(ctx, plan).stages[0].memory
    # shares in proportion to free memory: every GPU fills the same fraction of what it had free
    fill = [m.sharded_bytes / (ctx.capacity_bytes(r) - (m.total_bytes - m.sharded_bytes)) for r, m in zip(stage.ranks, memory)]
    assert max(fill) == pytest.approx(min(fill))
    assert len(set(stage.shard_fractions)) > 1


def test_data_parallel_shards_optimizer_and_gradients_where_optimizer_alone_cost_more_than_none() -> None:
    """``optimizer`` adds an all-reduce of the updated weights, which on 8 fast GPUs costs more than
    its shorter step saves; ``optimizer_gradients`` moves only what an unsharded all-reduce moves
    (reduce-scatter + all-gather) and steps as little, so the search keeps it."""
    inventory = load_cluster("a100x4_v100x4")
    profile = synthetic_profile(tuple(t.name for t in inventory.gpu_types), num_layers=8, hidden=512, vocab=8000)
    options = PlannerOptions(allow_pipeline=False, allow_idle_ranks=False)
    plan = make_plan(inventory, profile, GLOBAL_BATCH, options)
    (stage,) = plan.stages
    assert stage.sharding is Sharding.OPTIMIZER_GRADIENTS
    ctx = CostContext.build(inventory, profile)
    level = {s: plan_cost(ctx, replace(plan, stages=(replace(stage, sharding=s),))) for s in Sharding if s is not Sharding.FULL}
    unsharded = level[Sharding.NONE]
    assert level[Sharding.OPTIMIZER].stages[0].sync_ms == pytest.approx(2 * unsharded.stages[0].sync_ms)  # the exchange
    assert level[Sharding.OPTIMIZER_GRADIENTS].stages[0].sync_ms == pytest.approx(unsharded.stages[0].sync_ms)
    assert unsharded.iteration_ms < level[Sharding.OPTIMIZER].iteration_ms
    assert level[Sharding.OPTIMIZER_GRADIENTS].iteration_ms < unsharded.iteration_ms

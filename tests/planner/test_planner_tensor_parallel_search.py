"""Tensor parallelism as a dimension of the search's one loop: TP candidates are queued beside the others,
bounded, split, fitted and simulated like them, and chosen only where they win."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
from test_planner_fixtures import synthetic_profile

from zorse_lightning.capabilities import TENSOR_PARALLEL_SHARDING
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.planner import PlannerOptions, make_plan
from zorse_lightning.planner.plan_check import check_plan
from zorse_lightning.profiling import reference_profile
from zorse_lightning.profiling.profile import TensorParallelSupport
from zorse_lightning.schedule.plan import Plan


def _reference(model: str, inventory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return reference_profile(model, [t.name for t in inventory.gpu_types], 512, "float16")


def test_the_search_splits_a_13b_model_over_tp_groups_inside_each_machine() -> None:
    """Llama 13B on four A100s and four V100s (32 samples a GPU): every stage a TP group inside its machine (four
    stages of TP pairs, 17262.8 ms; two of TP 4 send four copies of each activation over the one link between
    the machines) beats every plan without TP the search finds (two stages of four GPUs gathered per
    microbatch, 18082.6 ms), and the plan is one the engine runs: each TP group on one machine and of one type,
    sharded at a level TP runs, no offload; the note says what TP gained."""
    inventory = load_cluster("a100x4_v100x4")
    profile = _reference("llama_13b", inventory)
    plan = make_plan(inventory, profile, 256)
    without = make_plan(inventory, profile, 256, PlannerOptions(max_tp=1))
    assert all(s.tensor_parallel > 1 for s in plan.stages)
    assert all(s.tensor_parallel == 1 for s in without.stages)
    assert plan.predicted.iteration_ms < without.predicted.iteration_ms * 0.97
    check_plan(plan, inventory)
    for stage in plan.stages:
        assert stage.sharding in TENSOR_PARALLEL_SHARDING and not stage.offload_activations
        assert all(len({stage.machines[stage.ranks.index(r)] for r in group}) == 1 for group in stage.replicas)
    split = ", ".join(f"stage {i} x{s.tensor_parallel}" for i, s in enumerate(plan.stages))
    assert any(n.startswith(f"tensor parallel ({split})") for n in plan.notes)
    assert Plan.from_json(plan.to_json()) == plan


def test_no_stage_is_split_where_the_model_admits_no_degree_and_the_note_says_why() -> None:
    """The same case with a profile whose blocks admit no TP degree (a fused projection, say): the plan of
    ``max_tp=1``, and the note gives the profile's reason."""
    inventory = load_cluster("a100x4_v100x4")
    profile = replace(_reference("llama_13b", inventory), tensor_parallel=TensorParallelSupport((), "a fused qkv projection"))
    plan = make_plan(inventory, profile, 256)
    assert all(s.tensor_parallel == 1 for s in plan.stages)
    assert "no tensor parallelism: a fused qkv projection" in plan.notes


@pytest.mark.parametrize("cluster", ["cpu_sim4", "a10g_l4_t4"])
def test_tp_is_not_chosen_where_it_does_not_win(cluster: str) -> None:
    """A small model whose blocks admit TP 2 and 4: the all-reduces of a split block cost more than the
    split saves, so the search keeps its plan without TP (the same plan as with ``max_tp=1``)."""
    inventory = load_cluster(cluster)
    profile = synthetic_profile(tuple(t.name for t in inventory.gpu_types), num_layers=8, hidden=256, vocab=1000)
    profile = replace(profile, tensor_parallel=TensorParallelSupport((2, 4), "", 512))
    plan = make_plan(inventory, profile, 8 * inventory.world_size)
    without = make_plan(inventory, profile, 8 * inventory.world_size, PlannerOptions(max_tp=1))
    assert all(s.tensor_parallel == 1 for s in plan.stages)
    assert plan.stages == without.stages
    assert any(n.startswith("not tensor parallel (each must beat ") for n in plan.notes)
    assert not any("tensor parallel" in n for n in without.notes)


def test_a_tp_plan_is_interleaved_where_that_wins_too() -> None:
    """Llama 7B on one machine of eight A100s at 2 samples a GPU (``bench/plan_scaling.py``'s smallest case):
    fill and drain dominate, the loop interleaves a TP plan as it does any other (TP pairs, three chunks each:
    1053.9 ms against 1282.9 ms without TP), and the engine's programs exist for it."""
    from testing.synthetic_cluster import synthetic_cluster
    from zorse_lightning.engine.tensor_parallel import check_stage
    from zorse_lightning.schedule.programs import build_schedule

    inventory = synthetic_cluster(8)
    profile = _reference("llama_7b", inventory)
    plan = make_plan(inventory, profile, 16)
    without = make_plan(inventory, profile, 16, PlannerOptions(max_tp=1))
    assert plan.interleave > 1 and {s.tensor_parallel for s in plan.stages} == {2}
    assert plan.predicted.iteration_ms < 0.9 * without.predicted.iteration_ms
    check_plan(plan, inventory)
    for index in range(len(plan.stages)):
        check_stage(plan, index)
    assert build_schedule(plan) is not None

"""Memory that counts what runs: autocast's weight copies per microbatch, the optimizer's own state and
step temporaries, edge activations, and weights held in the dtype that trains."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zorse_lightning.capabilities import Sharding
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.cost.framework_memory import NcclBuffers, nccl_communicators
from zorse_lightning.planner.cost.memory import (
    RankMemory,
    activation_bytes_per_microbatch,
    optimizer_step_bytes,
    profile_state_bytes,
    stage_state_bytes,
    transient_bytes,
)
from zorse_lightning.profiling.profile import BlockShape, ModelProfile, OptimizerProfile


def _profile(**changes) -> ModelProfile:
    layer = BlockShape("layer", 1000, 100, 10, 0.0, activation_bytes_per_microbatch=2000)
    profile = ModelProfile(
        "m", 8, "bfloat16", BlockShape("embedding", 500, 7, 10, 0.0, 30), (layer, layer),
        BlockShape("head", 500, 50, 0, 0.0, 40), {},
    )
    return replace(profile, **changes)


def test_a_microbatch_keeps_its_fixed_bytes_once_whatever_its_size():
    profile = _profile()
    one = activation_bytes_per_microbatch(profile, (0, 2), 1, first=True, last=True, recompute=False)
    four = activation_bytes_per_microbatch(profile, (0, 2), 4, first=True, last=True, recompute=False)
    per_sample, fixed = 7 + 50 + 2 * 100, 30 + 40 + 2 * 2000
    assert (one, four) == (per_sample + fixed, 4 * per_sample + fixed)


def test_weights_under_autocast_are_priced_in_float32_with_the_users_optimizer_state():
    autocast = _profile(weight_dtype="float32", optimizer=OptimizerProfile("torch.optim.sgd.SGD", 0.0, 0.0))
    per = profile_state_bytes(autocast)
    assert (per.weights, per.gradients, per.optimizer) == (4, 4, 0)  # SGD without momentum keeps nothing
    adamw = profile_state_bytes(replace(autocast, optimizer=OptimizerProfile("torch.optim.adamw.AdamW", 8.0, 4.0)))
    assert (adamw.weights, adamw.gradients, adamw.optimizer) == (4, 4, 8)
    assert stage_state_bytes(1000, adamw, Sharding.NONE) == (16000.0, 0.0)
    unknown = profile_state_bytes(_profile())  # a reference profile: ZeRO's mixed-precision accounting
    assert (unknown.weights, unknown.optimizer) == (2, 12)


def test_the_optimizer_steps_temporaries_meet_the_activations_at_the_peak_not_beside_them():
    profile = _profile(optimizer=OptimizerProfile("torch.optim.adamw.AdamW", 8.0, 4.0))
    assert optimizer_step_bytes(profile, 1000) == 4000.0
    small_activations = RankMemory(100.0, 0.0, 1000.0, 10.0, step_bytes=4000.0)
    large_activations = RankMemory(100.0, 0.0, 9000.0, 10.0, step_bytes=4000.0)
    assert small_activations.total_bytes == pytest.approx(4110.0)
    assert large_activations.total_bytes == pytest.approx(9110.0)


def test_what_a_running_microbatch_holds_counts_once_on_the_stages_with_the_edges():
    profile = _profile(head=BlockShape("head", 500, 50, 0, 0.0, 40, transient_bytes_per_sample=1000,
                                       transient_bytes_per_microbatch=10))
    assert transient_bytes(profile, 4, first=False, last=True) == 4010.0
    assert transient_bytes(profile, 4, first=True, last=False) == 0.0


MIB = 1024 * 1024


def test_nccls_buffers_per_communicator_follow_its_settings():
    """NCCL_BUFFSIZE toward each ring neighbour on each channel: 4 MiB x 2 channels x 2 unset."""
    assert NcclBuffers.from_environment({}).communicator_bytes == 16 * MIB
    bigger = NcclBuffers.from_environment({"NCCL_BUFFSIZE": str(8 * MIB), "NCCL_MIN_NCHANNELS": "4"})
    assert (bigger.buffer_bytes, bigger.channels, bigger.communicator_bytes) == (8 * MIB, 4, 64 * MIB)
    assert NcclBuffers.from_environment({"NCCL_MAX_NCHANNELS": "1"}).communicator_bytes == 8 * MIB
    with pytest.raises(PlanningError, match=r"NCCL_BUFFSIZE='4M' is not a positive whole number.*unset it"):
        NcclBuffers.from_environment({"NCCL_BUFFSIZE": "4M"})


@pytest.mark.parametrize("widths, group, pipelined, expected", [
    ((4, 4), 0, True, 4),  # default, its stage, first and last (tied), pipeline
    ((2, 2, 2), 0, True, 5),  # and every group: the first and last ranks' four or five
    ((2, 2, 2), 1, True, 4),  # a middle stage: default, its stage, every group, pipeline
    ((1, 2, 1), 0, True, 4),  # a stage of one rank has no stage communicator
    ((8,), 0, False, 2),  # data parallel: default and its stage
    ((2, 1), None, True, 2),  # an idle rank: default and pipeline
    ((1,), 0, False, 0),  # one rank: no communicator at all
])
def test_a_rank_has_the_communicators_the_engine_makes_for_it(widths, group, pipelined, expected):
    """Those of engine.groups.build_groups with two ranks or more (made at setup by engine.communicators)."""
    assert nccl_communicators(widths, group, pipelined) == expected


@pytest.mark.parametrize("widths, group, pipelined, expected", [
    ((4, 4), 0, True, 5),  # default, its TP index's 2 replicas, first and last per index, pipeline, its TP group
    ((2, 2), 0, True, 4),  # one replica: no data-parallel group
    ((4,), 0, False, 3),  # default, data parallel per index, TP
])
def test_tensor_parallelism_adds_its_group_and_narrows_the_data_parallel_one(widths, group, pipelined, expected):
    assert nccl_communicators(widths, group, pipelined, tensor_parallel=2) == expected


def test_a_real_gpus_rank_holds_its_communicators_memory_beside_the_reserve(monkeypatch):
    """Two stages of four GPUs: each rank's peak holds 4 communicators' buffers, 4 x 16 MiB, on top of the
    0.5 GiB reserve, or 4 times what its type measured at setup; none on an emulated cluster (gloo) or where the
    user gave the whole reserve."""
    from test_planner_fixtures import synthetic_profile

    from testing.plans import hand_plan
    from zorse_lightning.cluster.config import load_cluster
    from zorse_lightning.cluster.detection import DeviceReport, with_measured_nccl
    from zorse_lightning.planner.cost.context import CostContext
    from zorse_lightning.planner.cost.stage_state import stage_memory

    for name in ("NCCL_BUFFSIZE", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"):
        monkeypatch.delenv(name, raising=False)
    inventory = load_cluster("a100x4_v100x4")
    profile = synthetic_profile(("a100x40", "v100x32"), num_layers=4, hidden=256, seq_len=64, vocab=1000)
    plan = hand_plan([((0, 1, 2, 3), (1, 1, 1, 1), (0, 2)), ((4, 5, 6, 7), (1, 1, 1, 1), (2, 4))], inventory=inventory)
    for index in (0, 1):
        for used in stage_memory(CostContext.build(inventory, profile), plan, index, (0.25,) * 4):
            assert (used.nccl_bytes, used.reserve_bytes) == (4 * 16 * MIB, 0.5 * 1024**3)
        pinned = stage_memory(CostContext.build(inventory, profile, memory_reserve_gib=0.75), plan, index, (0.25,) * 4)
        assert {(m.nccl_bytes, m.reserve_bytes) for m in pinned} == {(0.0, 0.75 * 1024**3)}
    a100 = DeviceReport("NVIDIA A100-SXM4-40GB", 40 * 1024**3, None, 558 * MIB)  # what NCCL took at setup
    measured = with_measured_nccl(inventory, [a100] * 4 + [None] * 4)
    for index, communicator in ((0, 558 * MIB), (1, 16 * MIB)):  # the V100s measured nothing: priced
        used = stage_memory(CostContext.build(measured, profile), plan, index, (0.25,) * 4)
        assert {m.nccl_bytes for m in used} == {4 * communicator}
    emulated = load_cluster("cpu_sim4")
    one_stage = hand_plan([((0, 1, 2, 3), (1, 1, 1, 1), (0, 4))], inventory=emulated)
    profile = synthetic_profile(("a100x40", "v100x16", "t4"), num_layers=4, hidden=256, seq_len=64, vocab=1000)
    assert {m.nccl_bytes for m in stage_memory(CostContext.build(emulated, profile), one_stage, 0, (0.25,) * 4)} == {0.0}

"""Memory that counts what runs: autocast's weight copies per microbatch, the optimizer's own state and
step temporaries, edge activations, and weights held in the dtype that trains."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zorse_lightning.capabilities import Sharding
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

"""The plan-driven sampler, log capture merging and registration (one process)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from testing.plans import hand_plan
from torch.utils.data import DataLoader, TensorDataset

import zorse_lightning  # noqa: F401  (registers the strategies)
from zorse_lightning.strategy.log_capture import LogCapture, LoggedValue
from zorse_lightning.strategy.run_state import ResumeState
from zorse_lightning.strategy.sampler import PlanBatchSampler, SamplerState, plan_dataloader
from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

PLAN = hand_plan([((0,), (4,), (0, 1)), ((1, 2, 3), (2, 1, 1), (1, 2))], microbatch_size=2)


def _batches(rank: int, shuffle: bool, epoch: int = 0, size: int = 20) -> list[list[int]]:
    sampler = PlanBatchSampler(size, PLAN, rank, shuffle=shuffle, seed=7)
    sampler.restore(SamplerState(epoch, 0, 7, shuffle))
    return list(sampler)


def test_each_rank_loads_its_microbatches_of_each_global_batch():
    # Global batch 8 = 4 microbatches of 2; 20 samples give 2 full global batches (the rest is dropped).
    assert _batches(0, shuffle=False) == [list(range(0, 8)), list(range(8, 16))]
    assert _batches(1, shuffle=False) == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert _batches(2, shuffle=False) == [[4, 5], [12, 13]]
    assert _batches(3, shuffle=False) == [[6, 7], [14, 15]]


def test_shuffling_is_seeded_per_epoch_and_the_wide_stage_covers_the_global_batch():
    first = _batches(0, shuffle=True)
    assert first == _batches(0, shuffle=True) and first != _batches(0, shuffle=True, epoch=1)
    wide_stage = [sum((_batches(r, shuffle=True)[g] for r in (1, 2, 3)), []) for g in range(2)]
    assert wide_stage == first
    assert sorted(first[0] + first[1]) != list(range(16))  # a permutation of all 20 samples, not the first 16


def test_resumed_sampler_skips_the_global_samples_already_seen():
    sampler = PlanBatchSampler(20, PLAN, 2, shuffle=True, seed=7)
    full = list(sampler)
    sampler.restore(sampler.state(batches_done=1, epoch_batches=2))
    assert list(sampler) == full[1:] and len(sampler) == 2  # len: the epoch's batches, as Lightning counts


def test_the_position_after_an_epochs_last_batch_is_the_next_epochs_start():
    sampler = PlanBatchSampler(20, PLAN, 2, shuffle=True, seed=7)
    sampler.restore(SamplerState(3, 0, 7, True))
    assert sampler.state(batches_done=1, epoch_batches=2) == SamplerState(3, 8, 7, True)
    assert sampler.state(batches_done=2, epoch_batches=2) == SamplerState(4, 0, 7, True)
    assert sampler.state(batches_done=1, epoch_batches=1) == SamplerState(4, 0, 7, True)  # limit_train_batches=1


def test_an_epochs_end_recorded_as_its_last_position_resumes_at_the_next_epoch():
    """What checkpoints taken at an epoch's end recorded before the position moved on to the next epoch."""
    sampler = PlanBatchSampler(20, PLAN, 2, shuffle=True, seed=7)
    sampler.restore(SamplerState(0, 16, 7, True))
    assert list(sampler) == _batches(2, shuffle=True, epoch=1)


def test_a_training_loader_takes_the_position_and_each_step_moves_it():
    resume = ResumeState(position=SamplerState(1, 8, 7, True))
    sampler = PlanBatchSampler(20, PLAN, 2, shuffle=True, seed=7)
    resume.train_loader(sampler)
    assert list(sampler) == _batches(2, shuffle=True, epoch=1)[1:]
    resume.step_done(batches_done=2, epoch_batches=2)
    assert resume.sampler_state() == SamplerState(2, 0, 7, True)
    assert list(sampler) == _batches(2, shuffle=True, epoch=2) != _batches(2, shuffle=True, epoch=1)  # a new order
    reloaded = PlanBatchSampler(20, PLAN, 2, shuffle=True, seed=7)  # reload_dataloaders_every_n_epochs
    resume.train_loader(reloaded)
    assert list(reloaded) == _batches(2, shuffle=True, epoch=2)


def test_a_position_past_the_end_of_its_epoch_is_refused_not_trained_as_an_empty_epoch():
    sampler = PlanBatchSampler(20, PLAN, 2, shuffle=True, seed=7)
    sampler.restore(SamplerState(0, 24, 7, True))  # 24 > 16: the checkpoint was of a larger dataset
    with pytest.raises(ValueError, match=r"epoch 0 resumes at global sample 24, but it has 2 full global batches of 8 "
                                         r"\(16 samples\): this rank would train nothing.*resume with the dataset"):
        list(sampler)


def test_a_training_set_smaller_than_one_global_batch_is_refused():
    resume = ResumeState()
    with pytest.raises(ValueError, match=r"has 5 samples, fewer than one global batch of 8.*at least 8 samples"):
        resume.train_loader(PlanBatchSampler(5, PLAN, 0, shuffle=False))


def test_plan_dataloader_keeps_the_users_dataset_and_collate():
    dataset = TensorDataset(torch.arange(20).float())
    loader = plan_dataloader(DataLoader(dataset, batch_size=5, shuffle=True), PLAN, 2, seed=7)
    batches = [b[0].tolist() for b in loader]
    assert batches == [[float(i) for i in idx] for idx in _batches(2, shuffle=True)]


def test_logged_values_are_weighted_by_samples_and_merged():
    capture = LogCapture(samples_per_call=2)
    capture.log("loss", torch.tensor(1.0), prog_bar=True)
    capture.log("loss", torch.tensor(3.0), prog_bar=True)
    capture.log("count", 1, reduce_fx="sum")
    other = LoggedValue(total=5.0 * 2, samples=2)
    capture.records["loss"].merge(other)
    assert capture.records["loss"].value == (1 + 3 + 5) / 3
    assert capture.records["count"].value == 1
    assert capture.records["loss"].kwargs == {"prog_bar": True}


def test_registered_names():
    assert type(StrategyRegistry.get("zorse")) is ZorseStrategy
    assert StrategyRegistry["zorse_gpipe"]["init_params"] == {"schedule": "gpipe"}

"""Resuming at an epoch boundary, shuffled epochs and the epoch options, against an uninterrupted zorse run and
against single-process training.

An epoch is 3 global batches of 16 (53 samples: the last 5 are dropped), every training loader shuffles.
Four processes (as torchrun starts them) run these Trainers in turn, re-creating the process group when the
number of ranks changes (plans: ``testing.gpt_reference.elastic_plans``):

A. 4 ranks, 2 epochs without stopping; ``ModelCheckpoint(every_n_epochs=1)`` and
   ``ModelCheckpoint(every_n_train_steps=2)`` (step 2: mid-epoch 0).
B. 4 ranks, 1 epoch, ``trainer.save_checkpoint`` after ``fit``; C. 4 ranks resume it to 2 epochs.
D. 4 ranks resume from A's end-of-epoch-0 checkpoint; E. from A's step-2 one (the resume crosses an epoch end).
F. 3 ranks resume from B's checkpoint (4 to 3 ranks at the epoch boundary).
G. 2 ranks train 1 epoch and save; H. 4 ranks resume it (2 to 4 ranks at the epoch boundary).
L. 4 ranks, ``limit_train_batches=2`` and ``max_steps=3``: one step into epoch 1.
M. 4 ranks, a fit stopped by ``max_steps=2`` and saved; N resumes it to step 6 (Lightning counts M's epoch as
   finished, and the rest of it as a new one: the data must not follow that count).
V. 4 ranks, 2 epochs, validation after every second batch (mid-epoch) checkpointed; W resumes from the first.
S. 4 ranks on 10 samples, fewer than one global batch: refused (Lightning would log that it had no batches).

Single-process training on epoch 0's order then epoch 1's (each as ``DistributedSampler.set_epoch`` gives)
must equal A and L; each resumed run must equal its uninterrupted run: float32 parameters within 1e-6 on the
same plan, 1e-4 on another (sums in another order) or against one process (Adam moves a weight by about its
learning rate whatever the size of its gradient, so rounding in tiny gradients shows: 5e-5 after 6 steps), the
losses on the way within 1e-5 (the wrong batches of the code before this test were off by 7e-4 to 6e-2).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from testing.gpt_reference import GLOBAL_BATCH, Recorder, elastic_plans, gpt, reference_training, tokens
from testing.launch import free_ports, join_world, spawn_ranks
from zorse_lightning.apps.export_app import export_state_dict
from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

pytestmark = pytest.mark.multiprocess

EPOCH_BATCHES = 3
SAMPLES = GLOBAL_BATCH * EPOCH_BATCHES + 5
EPOCHS = 2
EVERY = 2
SAME_PLAN, OTHER_SUMS, LOSSES = 1e-6, 1e-4, 1e-5
"""Tolerances (see above): parameters on the same plan, on another plan or one process; losses."""


def _fit(name: str, world: int, tmp: Path, *, ckpt_path: Path | None = None, epochs: int = EPOCHS,
         callbacks: tuple[pl.Callback, ...] = (), validate: bool = False, samples: int = SAMPLES,
         **trainer_args) -> dict:
    """One Trainer; the checkpoint it ends with is ``<name>.ckpt``."""
    inventory, plan = elastic_plans()[world]
    recorder = Recorder("train_loss")
    trainer = pl.Trainer(
        strategy=ZorseStrategy(cluster=inventory, plan=plan, emulate=False), accelerator="cpu", devices=world,
        max_epochs=epochs, logger=False, enable_checkpointing=bool(callbacks), enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp, callbacks=[recorder, *callbacks],
        val_check_interval=EVERY if validate else None, limit_val_batches=1.0 if validate else 0, **trainer_args,
    )
    loader = DataLoader(tokens(samples), batch_size=GLOBAL_BATCH // world, shuffle=True)
    val = DataLoader(tokens(GLOBAL_BATCH * 2), batch_size=GLOBAL_BATCH // world) if validate else None
    trainer.fit(gpt(), train_dataloaders=loader, val_dataloaders=val, ckpt_path=ckpt_path)
    trainer.save_checkpoint(tmp / f"{name}.ckpt")
    return {"losses": recorder.values, "step": trainer.global_step, "epoch": trainer.current_epoch}


def _saving(tmp: Path, folder: str, **when) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=tmp / folder, filename="{step}", save_top_k=-1, **when)


def _worker(rank: int, tmp: Path, ports: list[int]) -> dict:
    join_world(4, ports[0])  # ports distinct from each other (spawn_ranks' own might equal one of them)
    result = {"A": _fit("A", 4, tmp, callbacks=(_saving(tmp, "epochs", every_n_epochs=1),
                                                 _saving(tmp, "steps", every_n_train_steps=EVERY)))}
    result["B"] = _fit("B", 4, tmp, epochs=1)
    result["C"] = _fit("C", 4, tmp, ckpt_path=tmp / "B.ckpt")
    result["D"] = _fit("D", 4, tmp, ckpt_path=tmp / "epochs" / f"step={EPOCH_BATCHES}.ckpt")
    result["E"] = _fit("E", 4, tmp, ckpt_path=tmp / "steps" / f"step={EVERY}.ckpt")
    result["L"] = _fit("L", 4, tmp, limit_train_batches=2, max_steps=3)
    result["M"] = _fit("M", 4, tmp, max_steps=EVERY)
    result["N"] = _fit("N", 4, tmp, ckpt_path=tmp / "M.ckpt", epochs=-1, max_steps=EPOCH_BATCHES * EPOCHS)
    result["V"] = _fit("V", 4, tmp, callbacks=(_saving(tmp, "validated"),), validate=True)
    result["W"] = _fit("W", 4, tmp, ckpt_path=tmp / "validated" / f"step={EVERY}.ckpt", validate=True)
    try:
        _fit("S", 4, tmp, samples=10)
    except ValueError as error:
        result["S"] = str(error)
    if rank < 3:
        join_world(3, ports[1])
        result["F"] = _fit("F", 3, tmp, ckpt_path=tmp / "B.ckpt")
    if rank < 2:
        join_world(2, ports[2])
        result["G"] = _fit("G", 2, tmp, epochs=1)
    join_world(4, ports[3])
    result["H"] = _fit("H", 4, tmp, ckpt_path=tmp / "G.ckpt")
    return result


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("epochs")
    return out, spawn_ranks(_worker, 4, out, free_ports(4))


def _epoch_order(epoch: int) -> list[int]:
    """What DDP's sampler gives one rank of one for this epoch, shuffling with seed 0 (ZorseStrategy's default)."""
    sampler = DistributedSampler(tokens(SAMPLES), num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def _single_process(batches_per_epoch: list[int]) -> tuple[dict, list[float]]:
    """One process trains on the first ``batches_per_epoch[e]`` global batches of each epoch's order."""
    order = [i for e, n in enumerate(batches_per_epoch) for i in _epoch_order(e)[: n * GLOBAL_BATCH]]
    inputs, targets = tokens(SAMPLES)[order]
    return reference_training(gpt(), TensorDataset(inputs, targets), None, steps=sum(batches_per_epoch))


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


def _loss_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_uninterrupted_epochs_shuffle_anew_as_single_process_training_does(results):
    out, ranks = results
    expected, losses = _single_process([EPOCH_BATCHES] * EPOCHS)
    assert _epoch_order(0) != _epoch_order(1)
    assert _max_diff(export_state_dict(out / "A.ckpt"), expected) < OTHER_SUMS
    for result in ranks:
        assert result["A"]["step"] == EPOCH_BATCHES * EPOCHS and result["A"]["epoch"] == EPOCHS
        assert _loss_diff(result["A"]["losses"], losses) < LOSSES


def test_limit_train_batches_and_max_steps_across_an_epoch_end(results):
    out, ranks = results
    expected, losses = _single_process([2, 1])
    assert _max_diff(export_state_dict(out / "L.ckpt"), expected) < OTHER_SUMS
    for result in ranks:
        assert result["L"]["step"] == 3 and _loss_diff(result["L"]["losses"], losses) < LOSSES


@pytest.mark.parametrize("run, resumed_from, tolerance", [
    ("C", "trainer.save_checkpoint after a 1-epoch fit", SAME_PLAN),
    ("D", "ModelCheckpoint(every_n_epochs=1)", SAME_PLAN),
    ("E", "ModelCheckpoint(every_n_train_steps=2), mid-epoch", SAME_PLAN),
    ("N", "trainer.save_checkpoint after a fit stopped by max_steps mid-epoch", SAME_PLAN),
    ("F", "an epoch-end checkpoint of 4 ranks, on 3", OTHER_SUMS),
    ("H", "an epoch-end checkpoint of 2 ranks, on 4", OTHER_SUMS),
])
def test_resume_continues_as_the_uninterrupted_run(results, run, resumed_from, tolerance):
    out, ranks = results
    uninterrupted = export_state_dict(out / "A.ckpt")
    assert _max_diff(uninterrupted, export_state_dict(out / f"{run}.ckpt")) < tolerance, resumed_from
    assert _max_diff(uninterrupted, gpt().state_dict()) > 1e-3  # it trained
    done = EVERY if run in ("E", "N") else EPOCH_BATCHES
    for result in ranks:
        if run in result:
            assert result[run]["step"] == EPOCH_BATCHES * EPOCHS, resumed_from
            assert _loss_diff(result[run]["losses"], result["A"]["losses"][done:]) < LOSSES, resumed_from
    if run == "H":  # the 2-rank epoch that H resumed from trained on the same samples as A's first epoch
        assert _loss_diff(ranks[0]["G"]["losses"], ranks[0]["A"]["losses"][:EPOCH_BATCHES]) < LOSSES


def test_resume_after_a_mid_epoch_validation_continues_the_training_data(results):
    out, ranks = results
    assert sorted(p.name for p in (out / "validated").iterdir()) == ["step=2.ckpt", "step=5.ckpt"]
    assert _max_diff(export_state_dict(out / "V.ckpt"), export_state_dict(out / "W.ckpt")) < SAME_PLAN
    for result in ranks:
        assert result["W"]["step"] == EPOCH_BATCHES * EPOCHS
        assert _loss_diff(result["W"]["losses"], result["V"]["losses"][EVERY:]) < SAME_PLAN


def test_a_training_set_smaller_than_one_global_batch_is_an_error_on_every_rank(results):
    _, ranks = results
    for result in ranks:
        assert "has 10 samples, fewer than one global batch of 16" in result.get("S", ""), result.get("S")

"""Checkpoints through Lightning: mid-epoch resume, resume on another cluster, export, a corrupt checkpoint.

Four processes (as torchrun starts them) run five phases, re-creating the
process group when the number of ranks changes:

A. 4 ranks (all state sharded in one stage, optimizer state and gradients in the other), 4 steps without stopping; ``ModelCheckpoint`` saves
   every 2 steps (mid-epoch: an epoch has 6).
B. 4 ranks resume from A's step-2 checkpoint (a truncated copy of it is refused first).
C. 3 ranks resume from A's step-2 checkpoint, planning at start (no plan given) with a DataLoader batch
   of 16 // 3 = 5: the plan keeps the checkpoint's global batch of 16, not 5 x 3.
D. 2 ranks (one stage gathering block by block) train 2 steps and save; E. 4 ranks resume from it.

Every run ends at step 4 with the same global batch (16) and data order, so
each must equal A: float32 parameters within 1e-6 on the same plan, within
1e-5 on another (sums in another order), the same losses on the way.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from testing.gpt_reference import GLOBAL_BATCH, Recorder, elastic_plans, gpt, tokens
from torch.utils.data import DataLoader

from zorse_lightning.engine.checkpoint.files import CheckpointError, shard_name
from zorse_lightning.apps.export_app import export_state_dict
from zorse_lightning.module.materialize import holds_values
from zorse_lightning.strategy.zorse_strategy import ZorseStrategy
from testing.launch import free_ports, join_world, spawn_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 4
EVERY = 2
EPOCH_BATCHES = 6


def _fit(world: int, tmp: Path, steps: int, ckpt_path: Path | None = None, save_every: Path | None = None,
         plan_at_start: bool = False):
    inventory, plan = elastic_plans()[world]
    plan = None if plan_at_start else plan
    recorder = Recorder("train_loss")
    callbacks = [recorder]
    if save_every is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_every, filename="{step}", every_n_train_steps=EVERY, save_top_k=-1))
    trainer = pl.Trainer(
        strategy=ZorseStrategy(cluster=inventory, plan=plan, emulate=False), accelerator="cpu", devices=world,
        max_steps=steps, logger=False, enable_checkpointing=save_every is not None, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp, callbacks=callbacks,
    )
    model = gpt()
    loader = DataLoader(tokens(GLOBAL_BATCH * EPOCH_BATCHES), batch_size=GLOBAL_BATCH // world, shuffle=True)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    return trainer, model, recorder.values


def _finish(name: str, trainer: pl.Trainer, model: pl.LightningModule, losses: list[float], tmp: Path) -> dict:
    trainer.save_checkpoint(tmp / f"{name}.ckpt")
    held = {n: p.detach().clone() for n, p in model.named_parameters() if holds_values(p)}
    exported = export_state_dict(tmp / f"{name}.ckpt", gpt())
    return {
        "losses": losses,
        "step": trainer.global_step,
        "global_batch_size": trainer.strategy.plan.global_batch_size,
        # a rank the plan leaves idle holds nothing (C plans at start: on a loaded machine it may leave one out)
        "held_vs_export": max(((held[n] - exported[n]).abs().max().item() for n in held), default=0.0),
        "held": len(held),
    }


def _worker(rank: int, tmp: Path, ports: list[int]) -> dict:
    result = {}
    join_world(4, ports[0])  # ports distinct from each other (spawn_ranks' own might equal one of them)
    result["A"] = _finish("A", *_fit(4, tmp, STEPS, save_every=tmp / "every"), tmp)
    step2 = tmp / "every" / "step=2.ckpt"
    broken = tmp / "broken.ckpt"
    if rank == 0:
        shutil.copytree(step2, broken)
        shard = broken / shard_name(2)
        shard.write_bytes(shard.read_bytes()[:-100])
    dist.barrier()
    try:
        _fit(4, tmp, STEPS, ckpt_path=broken)
    except CheckpointError as error:
        result["broken"] = str(error)
    result["B"] = _finish("B", *_fit(4, tmp, STEPS, ckpt_path=step2), tmp)
    if rank < 3:
        join_world(3, ports[1])
        result["C"] = _finish("C", *_fit(3, tmp, STEPS, ckpt_path=step2, plan_at_start=True), tmp)
    if rank < 2:
        join_world(2, ports[2])
        trainer, _, result["D_losses"] = _fit(2, tmp, EVERY)
        trainer.save_checkpoint(tmp / "D.ckpt")
    join_world(4, ports[3])
    result["E"] = _finish("E", *_fit(4, tmp, STEPS, ckpt_path=tmp / "D.ckpt"), tmp)
    return result


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("resume")
    return out, spawn_ranks(_worker, 4, out, free_ports(4))


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_mid_epoch_resume_from_model_checkpoint_equals_the_uninterrupted_run(results):
    out, ranks = results
    assert sorted(p.name for p in (out / "every").iterdir()) == ["step=2.ckpt", "step=4.ckpt"]
    uninterrupted, resumed = export_state_dict(out / "A.ckpt"), export_state_dict(out / "B.ckpt")
    assert _max_diff(uninterrupted, resumed) < 1e-6
    assert _max_diff(uninterrupted, export_state_dict(out / "every" / "step=4.ckpt")) == 0.0
    assert _max_diff(uninterrupted, gpt().state_dict()) > 1e-3  # it trained
    for result in ranks:
        assert result["B"]["step"] == STEPS and len(result["B"]["losses"]) == STEPS - EVERY
        assert max(abs(a - b) for a, b in zip(result["B"]["losses"], result["A"]["losses"][EVERY:])) < 1e-6


def test_truncated_checkpoint_is_refused_on_every_rank(results):
    _, ranks = results
    for result in ranks:
        assert f"{shard_name(2)} has" in result["broken"] and "truncated" in result["broken"]
        assert "resume from an earlier one" in result["broken"]


@pytest.mark.parametrize("run, worlds", [("C", "4 to 3 ranks"), ("E", "2 to 4 ranks")])
def test_resume_on_another_cluster_continues_the_same_trajectory(results, run, worlds):
    out, ranks = results
    assert _max_diff(export_state_dict(out / "A.ckpt"), export_state_dict(out / f"{run}.ckpt")) < 1e-5, worlds
    for result in ranks:
        if run in result:
            assert result[run]["step"] == STEPS and result[run]["global_batch_size"] == GLOBAL_BATCH
            assert max(abs(a - b) for a, b in zip(result[run]["losses"], result["A"]["losses"][EVERY:])) < 1e-5
    assert max(abs(a - b) for a, b in zip(ranks[0]["D_losses"], ranks[0]["A"]["losses"][:EVERY])) < 1e-5


def test_export_is_the_whole_model_loadable_without_zorse(results):
    out, ranks = results
    exported = export_state_dict(out / "A.ckpt")
    assert exported["head.weight"].data_ptr() == exported["tok_emb.weight"].data_ptr()  # tied: one tensor
    plain = gpt()
    plain.load_state_dict(exported)  # strict: every key of the user's module, nothing else
    assert plain.head.weight is plain.tok_emb.weight
    for result in ranks:  # what each rank held at the end is what the export gathered
        for run in ("A", "B", "C", "E"):
            if run in result:
                assert result[run]["held_vs_export"] == 0.0, (run, result[run])
    for run in ("A", "B", "C", "E"):  # and some rank held something
        assert max(result[run]["held"] for result in ranks if run in result) > 0, run

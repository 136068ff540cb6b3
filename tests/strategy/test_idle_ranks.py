"""Plans that leave a rank idle, trained through Lightning, against single-process training.

Four processes on cpu_sim4 (as torchrun starts them), started once. Rank 0 is
idle: in no stage, it holds no weights and loads no sample, yet runs every step
of its Lightning loop, since it joins what every rank does over the whole world
(the loss, the log replay, the global-norm clipping, checkpoint agreement, the
emulation's cost agreement, evaluation). Stage 0 is rank 1 alone, stage 1 ranks
2 and 3 with their optimizer state sharded, so the stage groups and the tied
embedding's group (stages 0 and 1) all leave rank 0 out. An idle rank 0 also
takes global rank zero's paths (the checkpoint's common file, ModelCheckpoint).

A. 4 steps in float32 with clipping, ``ModelCheckpoint`` every 2 steps: parameters against the
   reference, the logged losses on every rank, the idle rank's module on the meta device and
   its batches without samples.
B. Resume from A's step-2 checkpoint, emulation on: ends where A ends.
C. ``validate`` and ``predict`` with A's trainer: the reference's loss and predictions.
D. The planner's most common idle plan: one data-parallel stage of the fast GPUs (ranks 0 and 1),
   the two others idle.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from zorse_lightning.capabilities import Sharding
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.engine.checkpoint.files import MANIFEST, shard_name
from zorse_lightning.apps.export_app import export_state_dict
from zorse_lightning.strategy.zorse_strategy import ZorseStrategy
from testing.gpt_reference import CLIP, GLOBAL_BATCH, Recorder, gpt, reference_training, tokens
from testing.launch import spawn_ranks
from testing.plans import hand_plan

pytestmark = pytest.mark.multiprocess

WORLD = 4
IDLE = 0
STEPS = 4
EVERY = 2
EVAL_BATCHES = 2
MICROBATCH = 2


def _plan(pipelined: bool = True):
    inventory = load_cluster("cpu_sim4")
    if not pipelined:
        return inventory, hand_plan([((0, 1), (6, 2), (0, 4))], microbatch_size=MICROBATCH, inventory=inventory,
                                    idle_ranks=(2, 3))
    plan = hand_plan(
        [((1,), (8,), (0, 2)), ((2, 3), (5, 3), (2, 4))], microbatch_size=MICROBATCH, sharding=Sharding.OPTIMIZER,
        shard_fractions={1: (0.6, 0.4)}, inventory=inventory, idle_ranks=(IDLE,),
    )
    return inventory, plan


class BatchKinds(pl.Callback):
    """The type of each training batch this rank's loop ran."""

    def __init__(self) -> None:
        self.kinds: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.kinds.append(type(batch).__name__)


def _loader(batches: int) -> DataLoader:
    return DataLoader(tokens(GLOBAL_BATCH * batches), batch_size=GLOBAL_BATCH // WORLD, shuffle=False)


def _trainer(tmp: Path, emulate: bool, callbacks: list[pl.Callback], pipelined: bool = True,
             steps: int = STEPS) -> pl.Trainer:
    inventory, plan = _plan(pipelined)
    return pl.Trainer(
        strategy=ZorseStrategy(cluster=inventory, plan=plan, emulate=emulate), accelerator="cpu", devices=WORLD,
        max_steps=steps, gradient_clip_val=CLIP, logger=False, enable_checkpointing=True, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp, callbacks=callbacks,
    )


def _fit(tmp: Path, name: str, emulate: bool, ckpt_path: Path | None = None):
    recorder, kinds = Recorder("train_loss"), BatchKinds()
    every = ModelCheckpoint(dirpath=tmp / name, filename="{step}", every_n_train_steps=EVERY, save_top_k=-1)
    trainer, model = _trainer(tmp, emulate, [recorder, kinds, every]), gpt()
    trainer.fit(model, train_dataloaders=_loader(STEPS), ckpt_path=ckpt_path)
    trainer.save_checkpoint(tmp / f"{name}.ckpt")
    return trainer, model, recorder.values, kinds.kinds


def _data_parallel(tmp: Path) -> dict:
    recorder, steps = Recorder("train_loss"), EVERY
    trainer, model = _trainer(tmp / "D", False, [recorder], pipelined=False, steps=steps), gpt()
    trainer.fit(model, train_dataloaders=_loader(steps))
    expected, expected_losses = reference_training(gpt(), tokens(GLOBAL_BATCH * steps), CLIP, steps=steps)
    held = {n: p.detach() for n, p in model.named_parameters() if not p.is_meta}
    return {
        "step": trainer.global_step,
        "held": len(held),
        "loss_diff": max(abs(a - b) for a, b in zip(recorder.values, expected_losses)),
        "param_diff": max(((p - expected[n]).abs().max().item() for n, p in held.items()), default=0.0),
    }


def _evaluate(rank: int, trainer: pl.Trainer, model: pl.LightningModule, reference: pl.LightningModule) -> dict:
    validated = trainer.validate(model, dataloaders=_loader(EVAL_BATCHES), verbose=False)
    predicted = trainer.predict(model, dataloaders=_loader(EVAL_BATCHES))
    dataset = tokens(GLOBAL_BATCH * EVAL_BATCHES)
    batches = [dataset[b * GLOBAL_BATCH : (b + 1) * GLOBAL_BATCH] for b in range(EVAL_BATCHES)]
    with torch.no_grad():
        expected_loss = sum(reference._loss(batch).item() for batch in batches) / EVAL_BATCHES
        expected_predictions = [reference(batch[0]).argmax(dim=-1) for batch in batches]
    plan = trainer.strategy.plan
    result = {"val_loss_diff": abs(validated[0]["val_loss"] - expected_loss), "predicted": [p is not None for p in predicted]}
    if rank in plan.stages[-1].ranks:
        share = plan.stages[-1].microbatch_ranges()[rank]
        rows = slice(share.start * MICROBATCH, share.stop * MICROBATCH)
        result["predictions_equal"] = all(torch.equal(p, e[rows]) for p, e in zip(predicted, expected_predictions))
    return result


def _worker(rank: int, tmp: Path) -> dict:
    trainer, model, losses, kinds = _fit(tmp, "A", emulate=False)
    reference = gpt()
    expected, expected_losses = reference_training(reference, tokens(GLOBAL_BATCH * STEPS), CLIP, steps=STEPS)
    held = {n: p.detach() for n, p in model.named_parameters() if not p.is_meta}
    result = {
        "A": {
            "step": trainer.global_step,
            "loss_diff": max(abs(a - b) for a, b in zip(losses, expected_losses)),
            "losses": losses,
            "held": len(held),
            "param_diff": max(((p - expected[n]).abs().max().item() for n, p in held.items()), default=0.0),
            "all_meta": all(t.is_meta for t in [*model.parameters(), *model.buffers()]),
            "batch_kinds": sorted(set(kinds)),
        },
        "C": _evaluate(rank, trainer, model, reference),
    }
    trainer, _, losses, _ = _fit(tmp, "B", emulate=True, ckpt_path=tmp / "A" / f"step={EVERY}.ckpt")
    result["B"] = {"step": trainer.global_step, "losses": losses}
    result["D"] = _data_parallel(tmp)
    return result


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("idle")
    return out, spawn_ranks(_worker, WORLD, out)


def test_training_with_an_idle_rank_equals_single_process(results):
    _, ranks = results
    for rank, result in enumerate(ranks):
        trained = result["A"]
        assert trained["step"] == STEPS, (rank, trained)  # the idle rank ran every step, and no more
        assert len(trained["losses"]) == STEPS and trained["loss_diff"] < 1e-5, (rank, trained)
        assert trained["param_diff"] < 1e-5, (rank, trained)
        assert trained["all_meta"] == (rank == IDLE), (rank, trained)
        assert (trained["held"] == 0) == (rank == IDLE), (rank, trained)
        assert trained["batch_kinds"] == (["NoSamples"] if rank == IDLE else ["list"]), (rank, trained)


def test_checkpoint_with_an_idle_rank_is_complete_and_exports(results):
    out, _ = results
    manifest = json.loads((out / "A.ckpt" / MANIFEST).read_text())
    assert sorted(manifest["contents"]) == [shard_name(r) for r in range(WORLD)]
    assert manifest["contents"][shard_name(IDLE)]["state_dict"] == []  # the idle rank holds nothing to write
    reference = gpt()
    expected, _ = reference_training(reference, tokens(GLOBAL_BATCH * STEPS), CLIP, steps=STEPS)
    exported = export_state_dict(out / "A.ckpt", gpt())
    assert max((exported[n] - p).abs().max().item() for n, p in expected.items()) < 1e-5
    plain = gpt()
    plain.load_state_dict(exported)  # strict: the whole model
    assert plain.head.weight is plain.tok_emb.weight


def test_resume_with_an_idle_rank_continues_exactly(results):
    out, ranks = results
    uninterrupted, resumed = export_state_dict(out / "A.ckpt"), export_state_dict(out / "B.ckpt")
    assert max((uninterrupted[k] - resumed[k]).abs().max().item() for k in uninterrupted) < 1e-6
    for rank, result in enumerate(ranks):
        assert result["B"]["step"] == STEPS, (rank, result["B"])
        assert len(result["B"]["losses"]) == STEPS - EVERY
        assert max(abs(a - b) for a, b in zip(result["B"]["losses"], result["A"]["losses"][EVERY:])) < 1e-6


def test_validate_and_predict_with_an_idle_rank(results):
    _, ranks = results
    for rank, result in enumerate(ranks):
        evaluated = result["C"]
        assert evaluated["val_loss_diff"] < 1e-5, (rank, evaluated)
        assert evaluated["predicted"] == [rank in (2, 3)] * EVAL_BATCHES, (rank, evaluated)
    assert ranks[2]["C"]["predictions_equal"] and ranks[3]["C"]["predictions_equal"]


def test_data_parallel_stage_with_two_idle_ranks(results):
    _, ranks = results
    for rank, result in enumerate(ranks):
        trained = result["D"]
        assert trained["step"] == EVERY and trained["loss_diff"] < 1e-5, (rank, trained)
        assert trained["param_diff"] < 1e-5, (rank, trained)
        assert (trained["held"] == 0) == (rank in (2, 3)), (rank, trained)

"""``validate``, ``test``, ``predict`` and resuming from a checkpoint, on a 2-stage pipelined plan.

Two processes (cpu_sim2, emulation off: numerics only), started once. Values
are compared with the single-process reference; a run resumed from
``trainer.save_checkpoint`` after N steps is compared with an uninterrupted
run of 2N steps (same plan, shuffled data: the sampler's position is restored;
Lightning's sanity-check validation runs before each fit's first step).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from testing.plans import hand_plan
from testing.gpt_reference import GLOBAL_BATCH, gpt, tokens
from torch.utils.data import DataLoader

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.strategy.zorse_strategy import ZorseStrategy
from zorse_lightning.module.materialize import holds_values
from testing.launch import spawn_ranks

pytestmark = pytest.mark.multiprocess

WORLD = 2
PER_RANK_BATCH = GLOBAL_BATCH // WORLD
EVAL_BATCHES = 2
RESUME_STEPS = 2
"""N: saved after N steps, compared after 2N."""


def _plan():
    inventory = load_cluster("cpu_sim2")
    return hand_plan([((0,), (8,), (0, 2)), ((1,), (8,), (2, 4))], microbatch_size=2, inventory=inventory)


def _trainer(tmp: Path, max_steps: int = -1, sanity_steps: int = 0) -> pl.Trainer:
    return pl.Trainer(
        strategy=ZorseStrategy(cluster="cpu_sim2", plan=_plan(), emulate=False), accelerator="cpu", devices=WORLD,
        max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=sanity_steps, default_root_dir=tmp,
    )


def _loader(batches: int, shuffle: bool = False) -> DataLoader:
    return DataLoader(tokens(GLOBAL_BATCH * batches), batch_size=PER_RANK_BATCH, shuffle=shuffle)


def _evaluation_case(tmp: Path) -> dict:
    model, reference = gpt(), gpt()
    trainer = _trainer(tmp)  # one Trainer: its strategy cuts the module once, for all three
    validated = trainer.validate(model, dataloaders=_loader(EVAL_BATCHES), verbose=False)
    tested = trainer.test(model, dataloaders=_loader(EVAL_BATCHES), verbose=False)
    predicted = trainer.predict(model, dataloaders=_loader(EVAL_BATCHES))
    dataset = tokens(GLOBAL_BATCH * EVAL_BATCHES)
    batches = [dataset[b * GLOBAL_BATCH : (b + 1) * GLOBAL_BATCH] for b in range(EVAL_BATCHES)]
    with torch.no_grad():
        losses = [reference._loss(batch).item() for batch in batches]
        predictions = [reference(batch[0]).argmax(dim=-1) for batch in batches]
    expected_loss = sum(losses) / len(losses)
    result = {
        "val_diff": abs(validated[0]["val_loss"] - expected_loss),
        "test_diff": abs(tested[0]["test_loss"] - expected_loss),
        "predicted_batches": len(predicted),
    }
    if all(p is not None for p in predicted):
        result["predictions_equal"] = all(torch.equal(p, e) for p, e in zip(predicted, predictions))
    return result


def _fit(model: pl.LightningModule, tmp: Path, steps: int, ckpt_path: Path | None = None) -> pl.Trainer:
    """With a validation loader and Lightning's sanity check, so the engine is cut by a validation
    before the first training step (which must still restrict optimizers and restore their state)."""
    trainer = _trainer(tmp, max_steps=steps, sanity_steps=1)
    trainer.fit(model, train_dataloaders=_loader(2 * RESUME_STEPS, shuffle=True), val_dataloaders=_loader(1),
                ckpt_path=ckpt_path)
    return trainer


def _resume_case(tmp: Path) -> dict:
    checkpoint = tmp / "resume.ckpt"
    first = _fit(gpt(), tmp, RESUME_STEPS)
    first.save_checkpoint(checkpoint)
    stepped = {id(p) for group in first.optimizers[0].param_groups for p in group["params"]}
    local = {id(p) for p in first.strategy.engine.local_parameters()}
    resumed = gpt()
    resumed_trainer = _fit(resumed, tmp, 2 * RESUME_STEPS, ckpt_path=checkpoint)
    uninterrupted = gpt()
    _fit(uninterrupted, tmp, 2 * RESUME_STEPS)
    held = {n: p for n, p in resumed.named_parameters() if holds_values(p)}
    expected = dict(uninterrupted.named_parameters())
    return {
        "param_diff": max((held[n] - expected[n]).abs().max().item() for n in held),
        "held": len(held),
        "global_step": resumed_trainer.global_step,
        "moved": max((held[n] - p).abs().max().item() for n, p in gpt().named_parameters() if n in held),
        "optimizer_steps_only_this_stage": bool(local) and stepped == local,
    }


def _worker(rank: int, tmp: Path) -> dict:
    return {"evaluation": _evaluation_case(tmp), "resume": _resume_case(tmp)}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("evaluation")
    return spawn_ranks(_worker, WORLD, out)


def test_validate_and_test_losses_match_single_process(results):
    for rank, result in enumerate(results):
        assert result["evaluation"]["val_diff"] < 1e-5, (rank, result)
        assert result["evaluation"]["test_diff"] < 1e-5, (rank, result)


def test_predictions_come_from_the_last_stage_and_match_single_process(results):
    first, last = (r["evaluation"] for r in results)
    assert first["predicted_batches"] == last["predicted_batches"] == EVAL_BATCHES
    assert last["predictions_equal"] is True  # the last stage holds every microbatch's prediction


def test_resume_on_the_same_cluster_continues_exactly(results):
    for rank, result in enumerate(results):
        resume = result["resume"]
        assert resume["global_step"] == 2 * RESUME_STEPS
        assert resume["held"] > 0 and resume["moved"] > 1e-4  # it trained, on this rank's stage
        assert resume["param_diff"] < 1e-6, (rank, resume)
        assert resume["optimizer_steps_only_this_stage"], "the sanity check's validation skipped the training set-up"

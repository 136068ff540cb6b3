"""A hand-written plan with tensor parallelism runs as written through ``Trainer(strategy=ZorseStrategy(plan=...))``,
and its checkpoints hold whole tensors: TP -> no TP -> TP equals the uninterrupted run.

Four processes (as torchrun starts them) on one machine of four equal emulated GPUs train the project's GPT with
AdamW and clipping:

A. TP 2 x data parallel 2 (replicas with 5 and 3 of 8 microbatches), 2 steps, saved;
B. resumed from A on a two-stage pipeline without TP, to step 4, saved;
C. resumed from B on A's plan, to step 6, emulated (T4 deadlines and memory budgets: the meter counts the
   ranks' slices), splitting the MLPs alone by a TP plan given to the strategy (``tp_plan=``).

Each is compared with single-process training on the same global batches (16 samples a step).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.tensor import DTensor, Shard
from torch.utils.data import DataLoader

from testing.gpt_reference import CLIP, GLOBAL_BATCH, PER_RANK_BATCH, Recorder, gpt, reference_training, tokens
from testing.launch import spawn_ranks
from testing.plans import hand_plan
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.engine.checkpoint.files import shard_name
from zorse_lightning.schedule.plan import Plan, StagePlan
from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

pytestmark = pytest.mark.multiprocess

WORLD = 4
CLUSTER = {
    "name": "cpu_t4x4", "emulated": True,
    "machines": [{"name": "localhost", "intra_bandwidth_gbps": 10, "gpus": [{"type": "t4", "count": 4, "memory_gib": 0.16}]}],
}


MLP_ONLY = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
"""A TP plan given to the strategy: only the MLPs split (the GPT's own splits attention too)."""


def _tensor_parallel_plan() -> Plan:
    stage = StagePlan(
        ranks=(0, 1, 2, 3), gpu_types=("t4",) * 4, machines=("localhost",) * 4, layers=(0, 4),
        microbatches_per_rank=(5, 5, 3, 3), tensor_parallel=2,
    )
    return Plan("GPT", "cpu_t4x4", 4, WORLD, GLOBAL_BATCH, 2, "1f1b", (stage,))


def _pipeline_plan(inventory) -> Plan:
    return hand_plan([((0, 1), (4, 4), (0, 2)), ((2, 3), (3, 5), (2, 4))], microbatch_size=2, inventory=inventory)


def _fit(plan: Plan, steps: int, tmp: Path, ckpt_path: Path | None = None, emulate: bool = False, tp_plan=None):
    inventory = load_cluster(CLUSTER)
    recorder = Recorder("train_loss")
    trainer = pl.Trainer(
        strategy=ZorseStrategy(cluster=inventory, plan=plan, emulate=emulate, tp_plan=tp_plan), accelerator="cpu", devices=WORLD,
        max_steps=steps, gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp, callbacks=[recorder],
    )
    model = gpt()
    loader = DataLoader(tokens(GLOBAL_BATCH * 6), batch_size=PER_RANK_BATCH, shuffle=False)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    return trainer, model, recorder.values


def _diff(model, expected: dict) -> float:
    """The largest difference of this rank's values (its slice of a split weight) from the reference's."""
    worst = 0.0
    for name, param in model.named_parameters():
        theirs = expected[name]
        if isinstance(param, DTensor):
            for placement in param.placements:
                if isinstance(placement, Shard):
                    theirs = theirs.chunk(param.device_mesh.size(), dim=placement.dim)[param.device_mesh.get_local_rank()]
            mine = param.to_local()
        else:
            mine = param
        if mine.numel() and not mine.is_meta:
            worst = max(worst, (mine.detach() - theirs).abs().max().item())
    return worst


def _worker(rank: int, tmp: Path) -> dict:
    inventory = load_cluster(CLUSTER)
    expected, losses = reference_training(gpt(), tokens(GLOBAL_BATCH * 6), CLIP, steps=6)
    result = {}
    for name, plan, steps, resume in (
        ("A", _tensor_parallel_plan(), 2, None),
        ("B", _pipeline_plan(inventory), 4, "A"),
        ("C", _tensor_parallel_plan(), 6, "B"),
    ):
        resumed = tmp / f"{resume}.ckpt" if resume else None
        trainer, model, values = _fit(plan, steps, tmp, resumed, emulate=name == "C", tp_plan=MLP_ONLY if name == "C" else None)
        trainer.save_checkpoint(tmp / f"{name}.ckpt")
        reference, _ = reference_training(gpt(), tokens(GLOBAL_BATCH * 6), CLIP, steps=steps)
        result[name] = {
            "param_diff": _diff(model, reference),
            "loss_diff": max(abs(a - b) for a, b in zip(values, losses[steps - len(values) : steps])),
            "split": sorted({n.split(".", 2)[2].rsplit(".", 1)[0] for n, p in model.named_parameters() if isinstance(p, DTensor)}),
            "tensor_parallel": trainer.strategy.plan.stages[0].tensor_parallel,
        }
    if rank == 0:
        saved = torch.load(tmp / "A.ckpt" / shard_name(0), weights_only=True, map_location="cpu")
        result["saved_plain"] = all(type(v) is torch.Tensor for v in saved["state_dict"].values())
        result["saved_shapes"] = {n: list(v.shape) for n, v in saved["state_dict"].items() if "blocks.0.attn" in n}
    del expected
    return result


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_worker, WORLD, tmp_path_factory.mktemp("tensor_parallel_strategy"))


def test_tensor_parallel_then_pipeline_then_tensor_parallel_equal_one_process(results):
    for rank, result in enumerate(results):
        for name, degree in (("A", 2), ("B", 1), ("C", 2)):
            run = result[name]
            assert run["tensor_parallel"] == degree, (rank, name, run)
            assert run["split"] == {"A": ["attn.k", "attn.proj", "attn.q", "attn.v", "mlp.0", "mlp.2"], "B": [], "C": ["mlp.0", "mlp.2"]}[name], (rank, name, run)
            assert run["param_diff"] < 1e-5, (rank, name, run)
            assert run["loss_diff"] < 1e-5, (rank, name, run)


def test_checkpoint_files_hold_plain_tensors(results):
    """Whole tensors, written once (TP index 0's rank 0 here), readable with ``weights_only``."""
    assert results[0]["saved_plain"]
    assert results[0]["saved_shapes"]["blocks.0.attn.q.weight"] == [32, 32]
    assert results[0]["saved_shapes"]["blocks.0.attn.proj.weight"] == [32, 32]

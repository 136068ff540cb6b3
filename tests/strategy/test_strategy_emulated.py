"""The strategy with emulation on (cpu_sim2: an A100 and a V100 on two CPU ranks), end to end.

Start-up profiling through each rank's emulation, planning, and training:
emulation changes time, never numerics, so parameters and losses equal those of
single-process training on the same global batches. A hand-made pipelined plan
also runs emulated, so the stage boundaries (the received activation, the
stage's output) are emulated and stay exact too. Two processes, started once.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from testing.plans import hand_plan
from testing.gpt_reference import GLOBAL_BATCH, STEPS, VOCAB, Recorder, compare, reference_training
from torch.utils.data import DataLoader, TensorDataset

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.strategy.zorse_strategy import ZorseStrategy
from zorse_lightning.models.gpt import GPT
from zorse_lightning.planner.options import PlannerOptions
from testing.launch import spawn_ranks

pytestmark = pytest.mark.multiprocess

WORLD = 2
PER_RANK_BATCH = GLOBAL_BATCH // WORLD
MICROBATCHES = 8
"""Of the hand-made pipelined plan (microbatch size 2)."""
SEQ = 32


class _SgdGpt(GPT):
    """The GPT with SGD: AdamW would turn float32 rounding noise in gradients that are zero in exact
    arithmetic (attention's key bias) into updates of up to its learning rate (measured: parameters
    2.5e-4 apart after 3 steps at this width, with losses 2e-7 apart)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def gpt() -> GPT:
    """Blocks of about a millisecond per sample: emulated deadlines stay well above the hooks' overhead,
    so the start-up profile (and the plan made from it) reflects the emulated speeds."""
    torch.manual_seed(0)
    return _SgdGpt(vocab_size=VOCAB, seq_len=SEQ, width=128, layers=4, heads=4)


def tokens(count: int) -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (count, SEQ + 1), generator=torch.Generator().manual_seed(2))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _fit(model: pl.LightningModule, strategy: ZorseStrategy, tmp: Path, validate: bool) -> Recorder:
    """With ``validate``, Lightning's sanity check runs a validation loader of another batch size first,
    in inference mode: the plan must still come from the training loader, with backward timed."""
    recorder = Recorder("train_loss")
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[recorder], default_root_dir=tmp, num_sanity_val_steps=1 if validate else 0,
        limit_val_batches=1, val_check_interval=STEPS,
    )
    val = DataLoader(tokens(GLOBAL_BATCH), batch_size=PER_RANK_BATCH // 2) if validate else None
    trainer.fit(
        model, train_dataloaders=DataLoader(tokens(GLOBAL_BATCH * STEPS), batch_size=PER_RANK_BATCH),
        val_dataloaders=val,
    )
    return recorder


def _case(strategy: ZorseStrategy, tmp: Path, validate: bool = False) -> dict:
    model = gpt()
    recorder = _fit(model, strategy, tmp, validate)
    expected, losses = reference_training(gpt(), tokens(GLOBAL_BATCH * STEPS), None)
    emulator = strategy.emulation.emulator
    return {
        "param_diff": compare(model, expected),
        "loss_diff": max(abs(a - b) for a, b in zip(recorder.values, losses)),
        "stages": [
            {"ranks": list(s.ranks), "layers": list(s.layers), "microbatches": list(s.microbatches_per_rank)}
            for s in strategy.plan.stages
        ],
        "notes": list(strategy.plan.notes),
        "gpu_type": emulator.spec.gpu_type,
        "slowdown": emulator.spec.slowdown,
        "calls": emulator.calls,
        "overruns": emulator.overruns,
        "global_batch": strategy.plan.global_batch_size,
        "profiled_backward_ms": None if strategy.startup is None or strategy.startup.profile is None else min(
            layer.backward.at(1) for times in strategy.startup.profile.devices.values() for layer in times.layers
        ),
    }


def _worker(rank: int, tmp: Path) -> dict:
    inventory = load_cluster("cpu_sim2")
    planned = ZorseStrategy(cluster=inventory, emulate=True, planner_options=PlannerOptions(solver_time_limit_s=5))
    pipelined_plan = hand_plan([((0,), (MICROBATCHES,), (0, 3)), ((1,), (MICROBATCHES,), (3, 4))], 2, inventory=inventory)
    pipelined = ZorseStrategy(cluster=inventory, plan=pipelined_plan, emulate=True, emulation_slowdown=4.0)
    interleaved_plan = hand_plan(
        [((r,), (MICROBATCHES,), (layer, layer + 1)) for layer, r in enumerate((0, 1, 0, 1))], 2, inventory=inventory,
        interleave=2,
    )
    interleaved = ZorseStrategy(cluster=inventory, plan=interleaved_plan, emulate=True, emulation_slowdown=4.0)
    return {
        "planned": _case(planned, tmp, validate=True),
        "pipelined": _case(pipelined, tmp),
        "interleaved": _case(interleaved, tmp),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("emulated")
    return spawn_ranks(_worker, WORLD, out)


def _work(stages: list[dict], rank: int) -> int:
    """Layer-microbatches a rank runs per step: what the planner balances against its speed (0: idle)."""
    stage = next((s for s in stages if rank in s["ranks"]), None)
    if stage is None:
        return 0
    return (stage["layers"][1] - stage["layers"][0]) * stage["microbatches"][stage["ranks"].index(rank)]


def test_planned_on_emulated_ranks_gives_the_faster_rank_more_and_matches_single_process(results):
    for rank, result in enumerate(results):
        planned = result["planned"]
        assert planned["param_diff"] < 1e-5, (rank, planned)
        assert planned["loss_diff"] < 1e-5, (rank, planned)
        stages = planned["stages"]
        assert planned["calls"] > 0 or _work(stages, rank) == 0  # emulated while it trained (unless left idle)
        assert "precision 32-true: the Trainer's precision" in planned["notes"]  # Lightning's default, kept
        assert planned["global_batch"] == GLOBAL_BATCH  # the training loader's, not the validation one's
    # Profiled with gradients on, though the sanity check's validation came first (in inference mode):
    # a block's backward costs about twice its forward, never nothing.
    assert results[0]["planned"]["profiled_backward_ms"] > 0.5
    # cpu_sim2: A100 (312 TFLOPS) at slowdown 3, V100 (125) at 3 x 312 / 125.
    assert [r["planned"]["gpu_type"] for r in results] == ["a100x40", "v100x16"]
    assert [r["planned"]["slowdown"] for r in results] == pytest.approx([3.0, 3.0 * 312 / 125])
    stages = results[0]["planned"]["stages"]
    assert all(r["planned"]["stages"] == stages for r in results)  # one plan, broadcast
    if len(stages) == 1 and len(stages[0]["ranks"]) == 2:
        a100, v100 = stages[0]["microbatches"]
        assert a100 > v100, stages
    assert _work(stages, 0) > _work(stages, 1), stages


def test_emulated_pipeline_stage_boundaries_are_exact_and_fully_emulated(results):
    for rank, result in enumerate(results):
        pipelined = result["pipelined"]
        assert pipelined["param_diff"] < 1e-5, (rank, pipelined)
        assert pipelined["loss_diff"] < 1e-5, (rank, pipelined)
    # Every forward and every backward of every emulated module of the stage, for every microbatch:
    # stage 0 runs blocks 0-2 and both embeddings, stage 1 block 3, the final norm and the head. The
    # stage's last block (which ends the stage) and the receiving block's backward count too.
    per_microbatch = [2 * (3 + 2), 2 * (1 + 2)]
    assert [r["pipelined"]["calls"] for r in results] == [STEPS * MICROBATCHES * n for n in per_microbatch]
    assert [r["pipelined"]["slowdown"] for r in results] == pytest.approx([4.0, 4.0 * 312 / 125])  # as asked


def test_emulated_interleaved_chunks_are_exact_and_emulated_once(results):
    """Rank 0 holds blocks 0 and 2, rank 1 blocks 1 and 3. Each chunk's ends are emulated as a stage's are;
    in a rank's second chunk its first chunk's block (which passes its input on) and rank 0's embeddings
    (stand-in zeros) are not slowed."""
    for rank, result in enumerate(results):
        interleaved = result["interleaved"]
        assert interleaved["param_diff"] < 1e-5, (rank, interleaved)
        assert interleaved["loss_diff"] < 1e-5, (rank, interleaved)
    per_microbatch = [2 * (1 + 2) + 2 * 1, 2 * 1 + 2 * (1 + 2)]  # rank 0: block 0, embeddings, block 2
    assert [r["interleaved"]["calls"] for r in results] == [STEPS * MICROBATCHES * n for n in per_microbatch]

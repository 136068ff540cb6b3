"""A model bigger than any one GPU: built on the meta device, each rank materializes only its stage.

``cpu_sim4_small_memory``: four emulated GPUs of 2 MB or less, and a GPT whose
AdamW training state is over three times the largest. Every rank's memory meter
counts from setup (start-up profiling included, with only one real block), so
the peaks asserted here cover the whole run. Parameters must equal single-process
training of the same initial values (the meta-built module materialized whole,
by the same per-module initialisation); the ways a user builds such a model
(``init_module(empty_init=True)``, ``configure_model`` with pretrained weights,
resuming a checkpoint) are one run each, in one set of four processes.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import save_file
from testing.gpt_reference import STEPS, compare, reference_training
from testing.launch import spawn_ranks
from torch.utils.data import DataLoader, TensorDataset

from zorse_lightning import PlannerOptions, ZorseStrategy, load_cluster
from zorse_lightning.engine.sharding import true_numel
from zorse_lightning.models.gpt import GPT
from zorse_lightning.module.materialize import holds_values, materialize

pytestmark = pytest.mark.multiprocess

WORLD = 4
CLUSTER = "cpu_sim4_small_memory"
VOCAB, SEQ = 64, 8
SHAPE = dict(vocab_size=VOCAB, seq_len=SEQ, width=64, layers=8, heads=2)
PER_RANK_BATCH = 4
ONE_STAGE_CLUSTER = load_cluster({
    "name": "cpu_sim4_3mb", "emulated": True,
    "machines": [{"name": "localhost", "intra_bandwidth_gbps": 10, "gpus": [
        {"type": "a100x40", "count": 1, "memory_gib": 0.0028},
        {"type": "v100x16", "count": 1, "memory_gib": 0.0026},
        {"type": "t4", "count": 2, "memory_gib": 0.0026},
    ]}],
})
"""Budgets where the four GPUs fit the model as one stage with all state sharded and each block gathered per
microbatch (the GPT's AdamW state is 2.2x the largest), and nothing less sharded would."""
PEAK_OVER_PREDICTED = 1.15
"""A rank's measured peak may exceed the plan's predicted memory by this factor at most (what the cost model
leaves out: transient buffers; measured 0.92 to 0.94 when written)."""


def tokens(count: int) -> TensorDataset:
    data = torch.randint(0, VOCAB, (count, SEQ + 1), generator=torch.Generator().manual_seed(2))
    return TensorDataset(data[:, :-1], data[:, 1:])


def meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(**SHAPE)


class Configured(pl.LightningModule):
    """A user's module that builds its network in ``configure_model`` (Lightning's hook for big models)."""

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            self.net = GPT(**SHAPE)

    def training_step(self, batch, batch_idx):
        return self.net._loss(batch)

    def configure_optimizers(self):
        return self.net.configure_optimizers()


def _trainer(strategy: ZorseStrategy, steps: int, tmp: Path) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=tmp,
    )


def _loader() -> DataLoader:
    return DataLoader(tokens(PER_RANK_BATCH * WORLD * STEPS), batch_size=PER_RANK_BATCH)


def _report(strategy: ZorseStrategy, model: pl.LightningModule, expected: dict, rank: int) -> dict:
    emulator = strategy.emulation.emulator
    predicted = strategy.plan.predicted
    return {
        "param_diff": compare(model, expected),
        "stages": [list(s.ranks) for s in strategy.plan.stages],
        "peak_bytes": emulator.peak_memory_bytes,
        "budget_bytes": emulator.spec.memory_budget_bytes,
        "sharding": [s.sharding_label for s in strategy.plan.stages],
        "predicted_bytes": None if predicted is None else predicted.memory_gib[rank] * 2**30,
        "held_parameters": sum(p.numel() for p in model.parameters() if holds_values(p)),
        "all_parameters": sum(true_numel(p) for p in model.parameters()),
    }


def _worker(rank: int, tmp: Path) -> dict:
    reference = meta_gpt()
    materialize(reference, "cpu", seed=0)
    initial = {n: t.clone() for n, t in reference.state_dict().items()}
    expected, _ = reference_training(reference, tokens(PER_RANK_BATCH * WORLD * STEPS), None)
    results = {}

    strategy = ZorseStrategy(cluster=CLUSTER)
    trainer = _trainer(strategy, STEPS, tmp)
    with trainer.init_module(empty_init=True):
        model = GPT(**SHAPE)
    trainer.fit(model, _loader())
    results["init_module"] = _report(strategy, model, expected, rank)

    if rank == 0:
        save_file({f"{n}": t for n, t in initial.items() if n != "head.weight"}, tmp / "pretrained.safetensors")
    torch.distributed.barrier()
    strategy = ZorseStrategy(cluster=CLUSTER, weights=tmp / "pretrained.safetensors")
    module = Configured()
    trainer = _trainer(strategy, STEPS, tmp)
    trainer.fit(module, _loader())
    results["configure_model_pretrained"] = _report(strategy, module, {f"net.{n}": t for n, t in expected.items()}, rank)

    strategy = ZorseStrategy(cluster=CLUSTER)
    trainer = _trainer(strategy, STEPS - 1, tmp)
    with trainer.init_module(empty_init=True):
        model = GPT(**SHAPE)
    trainer.fit(model, _loader())
    trainer.save_checkpoint(tmp / "two_steps.ckpt")
    strategy = ZorseStrategy(cluster=CLUSTER)
    trainer = _trainer(strategy, STEPS, tmp)
    with trainer.init_module(empty_init=True):
        model = GPT(**SHAPE)
    trainer.fit(model, _loader(), ckpt_path=tmp / "two_steps.ckpt")
    results["resumed"] = _report(strategy, model, expected, rank)

    strategy = ZorseStrategy(cluster=ONE_STAGE_CLUSTER, planner_options=PlannerOptions(stage_layout=((0, 1, 2, 3),)))
    trainer = _trainer(strategy, STEPS, tmp)
    with trainer.init_module(empty_init=True):
        model = GPT(**SHAPE)
    trainer.fit(model, _loader())
    results["one_stage"] = _report(strategy, model, expected, rank)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_worker, WORLD, tmp_path_factory.mktemp("big_model"))


def test_training_state_is_over_three_times_the_largest_gpu():
    model = meta_gpt()
    adamw_state_bytes = sum(p.numel() for p in model.parameters()) * (4 + 4 + 8)  # weights, gradients, 2 moments
    largest_budget = max(gpu.memory_gib for gpu in load_cluster(CLUSTER).gpus) * 2**30
    assert adamw_state_bytes >= 3 * largest_budget, (adamw_state_bytes, largest_budget)


@pytest.mark.parametrize("case", ["init_module", "configure_model_pretrained", "resumed", "one_stage"])
def test_each_rank_builds_only_its_stage_and_trains_as_one_process(results, case):
    for rank, result in enumerate(results):
        got = result[case]
        assert got["param_diff"] < 1e-5, (rank, case, got)
        if case == "one_stage":  # all four GPUs in one stage: only all state sharded, gathered per block, fits
            assert got["sharding"] == ["full/microbatch"], got
        else:
            assert len(got["stages"]) > 1, got  # no GPU holds the model: without sharding it all, pipeline it
        assert got["held_parameters"] < got["all_parameters"] / 2, got  # a stage, never the model
        assert got["peak_bytes"] <= got["budget_bytes"], (rank, case, got)
        assert got["peak_bytes"] <= got["predicted_bytes"] * PEAK_OVER_PREDICTED, (rank, case, got)

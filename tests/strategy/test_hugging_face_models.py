"""Hugging Face decoder models trained unchanged: GPT-2, Llama, Mistral, Qwen2 and Bloom from small configs.

The module is what a user writes: a LightningModule around ``AutoModelForCausalLM``
whose step returns ``self.model(input_ids=x, labels=x).loss``. Each model on
``cpu_sim4`` (four emulated GPU types) is (a) planned at start, (b) run on a
pinned 2-stage pipeline, at microbatches of two samples and of one (emulated
calibration then resizes each call: the received activation and the side inputs
must be resized alike), (c) run on an asymmetric pipeline (stage 0 one A100,
stage 1 a V100 and two T4s sharding all training state unevenly, gathered once per
step), (d) stopped after two steps and resumed from the checkpoint, (e) run as
one stage of four ranks with uneven microbatches and shards, each layer gathered
for each microbatch, and (f) run interleaved (the A100 holds layers 0 and 2, the
other three layers 1 and 3, sharding gradients and optimizer state), from the start
and resumed onto that plan from (d)'s checkpoint. Every run must end at the parameters of single-process training from
the same initial weights on the global batch (4 ranks x a loader batch of 4 = 16,
as with DDP). Llama, Mistral and Qwen2 pass rotary embeddings and masks to every
layer as keyword arguments, made once before the layers: they must be real on
every stage. Bloom's layers return a tuple (the activation, then attention weights), which the
blocks passing their input on before a stage must return alike, and its ALiBi bias folds the
batch and the heads into dim 0. A Llama saved with ``save_pretrained`` is also read per stage into a module built
on the meta device. One set of four processes runs every case.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from testing.launch import spawn_ranks
from testing.plans import hand_plan
from torch.utils.data import DataLoader, TensorDataset

from zorse_lightning import ZorseStrategy, load_cluster
from zorse_lightning.capabilities import Sharding
from zorse_lightning.module.materialize import holds_values

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.multiprocess

WORLD = 4
STEPS = 3
PER_RANK_BATCH = 4
GLOBAL_BATCH = PER_RANK_BATCH * WORLD
VOCAB, SEQ = 64, 8
ARCHITECTURES = ("gpt2", "llama", "mistral", "qwen2", "bloom")


def config(arch: str):
    if arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=2, n_positions=SEQ,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
    if arch == "bloom":  # layers return (hidden, attention weights); ALiBi's bias folds batch and heads in dim 0
        return transformers.BloomConfig(
            vocab_size=VOCAB, hidden_size=32, n_layer=4, n_head=2, hidden_dropout=0.0, attention_dropout=0.0,
        )
    kinds = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}
    return getattr(transformers, kinds[arch])(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ,
    )


class CausalLm(pl.LightningModule):
    """A user's module around a Hugging Face model (nothing zorse-specific)."""

    def __init__(self, arch: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.AutoModelForCausalLM.from_config(config(arch))

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def tokens() -> TensorDataset:
    return TensorDataset(torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(2)))


def reference(arch: str) -> dict[str, torch.Tensor]:
    """Single-process training on global batches of 16, in the order the strategy's loader gives them."""
    module = CausalLm(arch)
    optimizer = module.configure_optimizers()
    data = tokens().tensors[0]
    for step in range(STEPS):
        module.training_step((data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH],), step).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in module.named_parameters()}


def _fit(arch: str, strategy: ZorseStrategy, steps: int, tmp: Path, ckpt_path: Path | None = None) -> CausalLm:
    module = CausalLm(arch)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=tmp,
    )
    trainer.fit(module, DataLoader(tokens(), batch_size=PER_RANK_BATCH), ckpt_path=ckpt_path)
    if ckpt_path is None and steps < STEPS:
        trainer.save_checkpoint(tmp / f"{arch}.ckpt")
    return module


def _difference(module: CausalLm, expected: dict[str, torch.Tensor]) -> float:
    """The largest difference of a weight this rank holds (0 on a rank the plan leaves idle: the planner may,
    now that the fastest type alone is one of its candidates)."""
    held = {n: p for n, p in module.named_parameters() if holds_values(p)}
    return max(((held[n].detach() - expected[n]).abs().max().item() for n in held), default=0.0)


def _worker(rank: int, tmp: Path) -> dict:
    sim4 = load_cluster("cpu_sim4")
    pinned = hand_plan([((0, 1), (4, 4), (0, 2)), ((2, 3), (4, 4), (2, 4))], 2, inventory=sim4)
    one_sample = hand_plan([((0, 1), (8, 8), (0, 2)), ((2, 3), (8, 8), (2, 4))], 1, inventory=sim4)
    asymmetric = hand_plan([((0,), (8,), (0, 2)), ((1, 2, 3), (4, 2, 2), (2, 4))], 2, inventory=sim4,
                           sharding=Sharding.FULL, shard_fractions={1: (0.5, 0.2, 0.3)})
    gathered = hand_plan([((0, 1, 2, 3), (3, 1, 2, 2), (0, 4))], 2, inventory=sim4, sharding=Sharding.FULL,
                         shard_fractions={0: (0.4, 0.1, 0.3, 0.2)}, gather_per_microbatch=True)
    groups = [((0,), (8,)), ((1, 2, 3), (4, 2, 2))]
    interleaved = hand_plan([(*groups[i % 2], (i, i + 1)) for i in range(4)], 2, inventory=sim4, interleave=2,
                            sharding=Sharding.OPTIMIZER_GRADIENTS, shard_fractions={1: (0.5, 0.2, 0.3)})
    results = {}
    for arch in ARCHITECTURES:
        expected = reference(arch)
        planned = ZorseStrategy(cluster=sim4)
        results[arch] = {
            "planned": _difference(_fit(arch, planned, STEPS, tmp), expected),
            "planned_stages": len(planned.plan.stages),
            "planned_idle": rank in planned.plan.idle_ranks,
            "pinned": _difference(_fit(arch, ZorseStrategy(cluster=sim4, plan=pinned), STEPS, tmp), expected),
            "microbatch_of_one": _difference(_fit(arch, ZorseStrategy(cluster=sim4, plan=one_sample), STEPS, tmp), expected),
            "asymmetric": _difference(_fit(arch, ZorseStrategy(cluster=sim4, plan=asymmetric), STEPS, tmp), expected),
            "gathered": _difference(_fit(arch, ZorseStrategy(cluster=sim4, plan=gathered), STEPS, tmp), expected),
            "interleaved": _difference(_fit(arch, ZorseStrategy(cluster=sim4, plan=interleaved), STEPS, tmp), expected),
        }
        _fit(arch, ZorseStrategy(cluster=sim4, plan=asymmetric), STEPS - 1, tmp)
        resumed = _fit(arch, ZorseStrategy(cluster=sim4, plan=asymmetric), STEPS, tmp, ckpt_path=tmp / f"{arch}.ckpt")
        results[arch]["resumed"] = _difference(resumed, expected)
        onto_interleaved = _fit(arch, ZorseStrategy(cluster=sim4, plan=interleaved), STEPS, tmp, ckpt_path=tmp / f"{arch}.ckpt")
        results[arch]["resumed_interleaved"] = _difference(onto_interleaved, expected)
    results["llama"]["pretrained_per_stage"] = _pretrained_per_stage(rank, sim4, asymmetric, tmp)
    offload_every_rank = hand_plan([((0, 1), (4, 4), (0, 2)), ((2, 3), (4, 4), (2, 4))], 2, inventory=sim4, offload_stages=(0, 1))
    offload_one_rank = hand_plan([((0,), (8,), (0, 2)), ((1, 2, 3), (4, 2, 2), (2, 4))], 2, inventory=sim4, offload_stages=(0,))
    offload_with_recompute = hand_plan([((0, 1), (4, 4), (0, 2)), ((2, 3), (4, 4), (2, 4))], 2, inventory=sim4,
                                       recompute=True, offload_stages=(1,))
    for case, plan in (("offload_every_rank", offload_every_rank), ("offload_one_rank", offload_one_rank),
                       ("offload_with_recompute", offload_with_recompute)):
        strategy = ZorseStrategy(cluster=sim4, plan=plan)
        results["llama"][case] = _difference(_fit("llama", strategy, STEPS, tmp), reference("llama"))
        results["llama"][f"{case}_bytes"] = strategy.engine.offload.offloaded_bytes if strategy.engine.offload else 0
    return results


def _pretrained_per_stage(rank: int, sim4, plan, tmp: Path) -> float:
    """Weights saved by ``save_pretrained``, read per stage into a module built on the meta device."""
    saved = tmp / "llama_pretrained"
    if rank == 0:
        CausalLm("llama").model.save_pretrained(saved)
    torch.distributed.barrier()
    strategy = ZorseStrategy(cluster=sim4, plan=plan, weights=saved)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    with trainer.init_module(empty_init=True):
        module = CausalLm("llama")
    trainer.fit(module, DataLoader(tokens(), batch_size=PER_RANK_BATCH))
    return _difference(module, reference("llama"))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_worker, WORLD, tmp_path_factory.mktemp("hugging_face"))


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("case", ["planned", "pinned", "microbatch_of_one", "asymmetric", "resumed", "gathered", "interleaved", "resumed_interleaved"])
def test_trains_as_one_process_does(results, arch, case):
    for rank, result in enumerate(results):
        assert result[arch][case] < 1e-5, (rank, arch, case, result[arch])
    assert not all(result[arch]["planned_idle"] for result in results)  # some rank compared what it trained


@pytest.mark.parametrize("case", ["offload_every_rank", "offload_one_rank", "offload_with_recompute"])
def test_llama_trains_as_one_process_does_with_its_activations_offloaded(results, case):
    """Activation offload on both stages of a 2-stage pipeline, on the one rank of a stage, and with
    recomputation on the second stage (only its blocks' inputs go): what the offloading ranks' blocks
    keep goes through host memory and back, exactly."""
    for rank, result in enumerate(results):
        assert result["llama"][case] < 1e-5, (rank, case, result["llama"])
    offloading = {"offload_every_rank": (0, 1, 2, 3), "offload_one_rank": (0,), "offload_with_recompute": (2, 3)}[case]
    assert [rank for rank, r in enumerate(results) if r["llama"][f"{case}_bytes"] > 0] == list(offloading)


def test_pretrained_weights_on_disk_are_read_per_stage_into_a_meta_built_model(results):
    for rank, result in enumerate(results):
        assert result["llama"]["pretrained_per_stage"] < 1e-5, (rank, result["llama"])

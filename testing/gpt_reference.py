"""The project's GPT trained by a Trainer over ranks and by a single process, for tests to compare.

Shared by the strategy, engine and fault tests (a test module does not import
another: each folder of tests/ is its own import root).
"""

from __future__ import annotations

from dataclasses import replace

import lightning.pytorch as pl
import torch
from torch.utils.data import TensorDataset

from testing.plans import hand_plan
from zorse_lightning.capabilities import Sharding
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.models.gpt import GPT
from zorse_lightning.schedule.plan import Plan
from zorse_lightning.module.materialize import holds_values

CPU_SIM3 = {
    "name": "cpu_sim3", "emulated": True,
    "machines": [{"name": "localhost", "intra_bandwidth_gbps": 10, "gpus": [
        {"type": "a100x40", "count": 1, "memory_gib": 0.4},
        {"type": "v100x16", "count": 1, "memory_gib": 0.16},
        {"type": "t4", "count": 1, "memory_gib": 0.16},
    ]}],
}
"""Three emulated GPU types on one machine: the fault and resume tests' cluster."""


def elastic_plans() -> dict[int, tuple[ClusterInventory, Plan]]:
    """The resume tests' cluster and plan by number of ranks, for :func:`gpt` with a global batch of 16 in
    microbatches of 2, each with other sharding: 4 ranks (cpu_sim4: all state sharded once per step in the
    first stage, optimizer state and gradients in the second, uneven), 3 (``CPU_SIM3``, unsharded), 2
    (cpu_sim2: one stage, all state sharded and gathered block by block per microbatch, uneven)."""
    sim4, sim3, sim2 = load_cluster("cpu_sim4"), load_cluster(CPU_SIM3), load_cluster("cpu_sim2")
    four = hand_plan([((0, 1), (4, 4), (0, 2)), ((2, 3), (5, 3), (2, 4))], microbatch_size=2,
                     sharding=Sharding.FULL, shard_fractions={0: (0.7, 0.3), 1: (0.4, 0.6)}, inventory=sim4)
    four = replace(four, stages=(four.stages[0], replace(four.stages[1], sharding=Sharding.OPTIMIZER_GRADIENTS)))
    return {
        4: (sim4, four),
        3: (sim3, hand_plan([((0,), (8,), (0, 2)), ((1, 2), (4, 4), (2, 4))], microbatch_size=2, inventory=sim3)),
        2: (sim2, hand_plan([((0, 1), (5, 3), (0, 4))], microbatch_size=2, sharding=Sharding.FULL,
                            shard_fractions={0: (0.3, 0.7)}, gather_per_microbatch=True, inventory=sim2)),
    }


WORLD = 4
STEPS = 3
PER_RANK_BATCH = 4
GLOBAL_BATCH = PER_RANK_BATCH * WORLD
SEQ, VOCAB = 8, 40
CLIP = 0.5


class Recorder(pl.Callback):
    """Logged values after each step, as rank 0's loggers and progress bar see them."""

    def __init__(self, name: str) -> None:
        self.name, self.values = name, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(trainer.callback_metrics[self.name]))


def tokens(count: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (count, SEQ + 1), generator=generator)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, seq_len=SEQ, width=32, layers=4, heads=2, learning_rate=3e-3)


def reference_training(
    model: pl.LightningModule, dataset: TensorDataset, clip: float | None, steps: int = STEPS
) -> tuple[dict, list[float]]:
    optimizer = model.configure_optimizers()
    losses = []
    for step in range(steps):
        inputs, targets = (t.contiguous() for t in dataset[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH])
        loss = model.training_step.__func__(Unlogged(model), (inputs, targets), step)
        loss.backward()
        losses.append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}, losses


class Unlogged:
    """The module seen by its own training_step outside a Trainer: ``self.log`` does nothing."""

    def __init__(self, module: pl.LightningModule) -> None:
        self._module = module

    def __getattr__(self, name: str):
        return (lambda *a, **k: None) if name == "log" else getattr(self._module, name)

    def __call__(self, *args, **kwargs):
        return self._module(*args, **kwargs)


def compare(model, expected: dict) -> float:
    """The largest difference of a parameter the rank holds from ``expected``'s; 0 where it holds none (a rank
    the plan leaves idle: the planner may, where the other GPUs alone are faster by its margin)."""
    held = {n: p for n, p in model.named_parameters() if holds_values(p)}
    return max(((held[n].detach() - expected[n]).abs().max().item() for n in held), default=0.0)

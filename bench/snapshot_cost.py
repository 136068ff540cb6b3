"""What survivor snapshots cost a step: off, at the interval chosen from their cost, and every step.

    .venv/bin/python -m bench.snapshot_cost              # about 2 minutes

Two CPU ranks (gloo, one thread each), nothing emulated (a host clock cannot
hide under an emulated deadline), one data-parallel stage of the project's GPT;
``ZorseStrategy`` trains it three ways, in turn, ``--repeats`` times:
``RecoveryPolicy(enabled=False)``, the default (interval chosen from the
measured cost, at most 3 % of step time) and ``snapshot_every_steps=1``. On CPU
ranks the held state lives on the host, so a snapshot is Lightning's checkpoint
without tensors and the tensors' version counters (on a GPU: a copy on a side
stream into pinned buffers, see ``strategy/host_copies.py``).

The last line is one JSON object: each way's median step (ms), the overhead of
the chosen interval and of every step against off, the chosen interval and the
measured cost of one snapshot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset

from testing.launch import free_port, torchrun_variables
from testing.plans import hand_plan
from testing.timing import StepTimer
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.models.gpt import GPT
from zorse_lightning.engine.checkpoint.survivors import RecoveryPolicy
from zorse_lightning.strategy.snapshots import SurvivorSnapshots
from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

WORLD_SIZE = 2
CLUSTER = {
    "name": "cpu_two",
    "description": "two CPU ranks as they are, nothing emulated",
    "emulated": False,
    "machines": [{"name": "localhost", "intra_bandwidth_gbps": 10, "gpus": [{"type": "a100x40", "count": WORLD_SIZE}]}],
}
POLICIES = {
    "off": RecoveryPolicy(enabled=False),
    "chosen": RecoveryPolicy(),
    "every_step": RecoveryPolicy(snapshot_every_steps=1),
}


@dataclass(frozen=True)
class BenchConfig:
    per_rank_batch: int = 4
    warmup: int = 8
    """Steps before timing: the chosen interval is decided within them."""
    steps: int = 24
    repeats: int = 2
    width: int = 256
    layers: int = 4
    seq_len: int = 64
    vocab: int = 256


def _fit(policy: RecoveryPolicy, plan, config: BenchConfig, root: str) -> dict:
    timer = StepTimer()
    strategy = ZorseStrategy(cluster=CLUSTER, plan=plan, emulate=False, recovery=policy)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD_SIZE, max_steps=config.warmup + config.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[timer], default_root_dir=root,
    )
    torch.manual_seed(0)
    model = GPT(vocab_size=config.vocab, seq_len=config.seq_len, width=config.width, layers=config.layers, heads=4)
    count = config.per_rank_batch * WORLD_SIZE * (config.warmup + config.steps)
    tokens = torch.randint(0, config.vocab, (count, config.seq_len + 1), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=config.per_rank_batch)
    trainer.fit(model, train_dataloaders=loader)
    snapshots = next((c for c in trainer.callbacks if isinstance(c, SurvivorSnapshots)), None)
    return {
        "median_step_ms": statistics.median(timer.step_times_s(config.warmup)) * 1000.0,
        "interval": snapshots.interval if snapshots else None,
        "cost_ms": snapshots.cost_ms if snapshots else None,
    }


def _worker(rank: int, port: int, config: BenchConfig, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(torchrun_variables(rank, WORLD_SIZE, port))
    plan = hand_plan([((0, 1), (1, 1), (0, config.layers))], microbatch_size=config.per_rank_batch,
                     inventory=load_cluster(CLUSTER))
    runs: dict[str, list[dict]] = {name: [] for name in POLICIES}
    for _ in range(config.repeats):
        for name, policy in POLICIES.items():
            runs[name].append(_fit(policy, plan, config, out_dir))
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(runs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in asdict(BenchConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    config = BenchConfig(**vars(parser.parse_args(argv)))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(free_port(), config, out_dir), nprocs=WORLD_SIZE, join=True)
        runs = json.loads(Path(out_dir, "result.json").read_text())
    step_ms = {name: statistics.median(r["median_step_ms"] for r in rs) for name, rs in runs.items()}
    chosen = runs["chosen"]
    result = {
        "median_step_ms": {name: round(ms, 2) for name, ms in step_ms.items()},
        "chosen_overhead": round(step_ms["chosen"] / step_ms["off"] - 1, 4),
        "every_step_overhead": round(step_ms["every_step"] / step_ms["off"] - 1, 4),
        "chosen_interval": [r["interval"] for r in chosen],
        "snapshot_cost_ms": [round(r["cost_ms"], 2) if r["cost_ms"] is not None else None for r in chosen],
    }
    print(f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

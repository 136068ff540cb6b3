"""Engine overhead: a pure data-parallel zorse plan against ``Trainer(strategy="ddp")`` on 2 equal ranks.

    .venv/bin/python bench/overhead.py                  # about 2 minutes

Two CPU processes (gloo, one thread each) emulate two A100s; both strategies
run on the same emulation (ZorseStrategy's own for zorse, the
:class:`EmulateCluster` callback for DDP), so their compute is the same and
what differs is the engine: the plan-driven sampler, the microbatch loop, log
capture and replay, gradient synchronisation after the backward (DDP overlaps
its bucketed all-reduce with the backward), the optimizer step.

The zorse plan is the planner's, made at start-up from its profile, with
pipelining off and the microbatch pinned to DDP's per-rank batch
(``PlannerOptions(allow_pipeline=False, microbatch_size=...)``): one
microbatch per rank per step, exactly DDP's work, so that the ratio measures
overhead and not a choice of microbatch size. The two Trainers alternate
``--repeats`` times in one process group (the machine is shared, its speed
drifts); throughput is the global batch over the median of all timed step
times of a strategy. The last line printed is one JSON object: ``{"ratio",
"zorse_samples_per_s", "ddp_samples_per_s", ...}``; the goal is ratio >= 0.95.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
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

from zorse_lightning.glue.emulation_callback import EmulateCluster
from zorse_lightning.glue.strategy import ZorseStrategy
from zorse_lightning.models.gpt import GPT
from zorse_lightning.planner.search import PlannerOptions
from zorse_lightning.testing.timing import StepTimer

WORLD_SIZE = 2
CLUSTER = {
    "name": "overhead_2x_a100",
    "description": "2 CPU ranks emulating 2x A100-40GB",
    "emulated": True,
    "machines": [{"name": "localhost", "intra_bandwidth_gbps": 10, "gpus": [{"type": "a100x40", "count": WORLD_SIZE}]}],
}


@dataclass(frozen=True)
class BenchConfig:
    per_rank_batch: int = 4
    warmup: int = 2
    steps: int = 8
    """Timed steps per run, after warm-up."""
    repeats: int = 2
    """Runs of each strategy, alternating."""
    width: int = 256
    layers: int = 4
    seq_len: int = 64
    vocab: int = 256


def _fit(strategy, callbacks: list, config: BenchConfig, root: str) -> StepTimer:
    timer = StepTimer()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD_SIZE, max_steps=config.warmup + config.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[timer, *callbacks], default_root_dir=root,
    )
    torch.manual_seed(0)
    model = GPT(vocab_size=config.vocab, seq_len=config.seq_len, width=config.width, layers=config.layers, heads=4)
    count = config.per_rank_batch * WORLD_SIZE * (config.warmup + config.steps)
    tokens = torch.randint(0, config.vocab, (count, config.seq_len + 1), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=config.per_rank_batch, shuffle=True)
    trainer.fit(model, train_dataloaders=loader)
    return timer


def _worker(rank: int, port: int, config: BenchConfig, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        TORCHELASTIC_RUN_ID="bench", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
        LOCAL_WORLD_SIZE=str(WORLD_SIZE), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    options = PlannerOptions(allow_pipeline=False, microbatch_size=config.per_rank_batch,
                             no_pipeline_reason="bench/overhead.py compares data parallel engines")
    steps: dict[str, list[float]] = {"zorse": [], "ddp": []}
    plan = None
    for _ in range(config.repeats):
        zorse = ZorseStrategy(cluster=CLUSTER, planner_options=options)
        steps["zorse"] += _fit(zorse, [], config, out_dir).step_times_s(config.warmup)
        plan = zorse.plan
        steps["ddp"] += _fit("ddp", [EmulateCluster(CLUSTER)], config, out_dir).step_times_s(config.warmup)
    if rank == 0:
        stage = plan.stages[0]
        result = {
            "step_s": steps,
            "plan": {"microbatch_size": plan.microbatch_size, "microbatches": list(stage.microbatches_per_rank),
                     "sharding": stage.sharding.value, "stages": len(plan.stages)},
        }
        Path(out_dir, "result.json").write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = BenchConfig()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    config = BenchConfig(**vars(parser.parse_args(argv)))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(_free_port(), config, out_dir), nprocs=WORLD_SIZE, join=True)
        runs = json.loads(Path(out_dir, "result.json").read_text())
    global_batch = config.per_rank_batch * WORLD_SIZE
    rates = {name: global_batch / statistics.median(times) for name, times in runs["step_s"].items()}
    result = {
        "ratio": round(rates["zorse"] / rates["ddp"], 4),
        "zorse_samples_per_s": round(rates["zorse"], 3),
        "ddp_samples_per_s": round(rates["ddp"], 3),
        "zorse_step_ms": [round(t * 1000.0, 1) for t in runs["step_s"]["zorse"]],
        "ddp_step_ms": [round(t * 1000.0, 1) for t in runs["step_s"]["ddp"]],
        "plan": runs["plan"],
    }
    print(f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

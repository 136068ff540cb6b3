"""Engine overhead: a pure data-parallel zorse plan against ``Trainer(strategy="ddp")`` on 2 equal ranks.

    .venv/bin/python -m bench.overhead                  # about 2 minutes

Two CPU processes (gloo, one thread each) emulate two A100s; both strategies
run on the same emulation (ZorseStrategy's own for zorse, the
:class:`EmulateCluster` callback for DDP), so their compute is the same and
what differs is the engine: the plan-driven sampler, the microbatch loop, log
capture and replay, gradient synchronisation (both overlap a bucketed
all-reduce with the last backward), the optimizer step.

The zorse plan is one stage of both ranks, one microbatch of DDP's per-rank
batch each, training state unsharded: exactly DDP's work, so that the ratio
measures the engine and not a choice of the planner (which may shard the
optimizer state, trading an all-reduce of the updated weights for a shorter step).

Each run calibrates its emulated compute anew at its first step, on cores
other work shares: runs differ in absolute speed by whatever contention that
calibration met (measured here: one DDP run at 850 ms a step, the next at
480 ms, the same work). So ``ratio`` compares each strategy's emulated compute
per step (the synthetic GPU time, max over ranks) over its median step time,
averaged over ``--repeats`` alternating runs: the throughput ratio at equal
compute cost. ``raw_ratio`` is the plain ratio of samples per second (median
of all timed steps), which carries that calibration noise. The last line
printed is one JSON object: ``{"ratio",
"zorse_samples_per_s", "ddp_samples_per_s", ...}``; the goal is ratio >= 0.95.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.emulation.emulator import ComputeEmulator
from zorse_lightning.emulation.callback import EmulateCluster
from zorse_lightning.strategy.zorse_strategy import ZorseStrategy
from zorse_lightning.models.gpt import GPT
from testing.launch import free_port
from testing.plans import hand_plan
from testing.timing import StepTimer

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


def _fit(strategy, emulator: Callable[[], ComputeEmulator], callbacks: list, config: BenchConfig, root: str) -> dict:
    """One Trainer run: its timed step times, and its emulated compute per timed step (max over ranks)."""
    probes = {config.warmup - 1, config.warmup + config.steps - 1}
    timer = StepTimer(lambda step: emulator().emulated_compute_s if step in probes else None)
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
    before, after = [p for p in timer.probes if p is not None]
    compute_s = [0.0] * WORLD_SIZE
    dist.all_gather_object(compute_s, (after - before) / config.steps)
    return {"step_s": timer.step_times_s(config.warmup), "compute_s_per_step": max(compute_s)}


def _worker(rank: int, port: int, config: BenchConfig, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        TORCHELASTIC_RUN_ID="bench", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
        LOCAL_WORLD_SIZE=str(WORLD_SIZE), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    plan = hand_plan([((0, 1), (1, 1), (0, config.layers))], microbatch_size=config.per_rank_batch,
                     inventory=load_cluster(CLUSTER))
    runs: dict[str, list[dict]] = {"zorse": [], "ddp": []}
    for _ in range(config.repeats):
        zorse = ZorseStrategy(cluster=CLUSTER, plan=plan)
        runs["zorse"].append(_fit(zorse, lambda: zorse.emulation.emulator, [], config, out_dir))
        emulate = EmulateCluster(CLUSTER)
        runs["ddp"].append(_fit("ddp", lambda: emulate.emulator, [emulate], config, out_dir))
    if rank == 0:
        stage = plan.stages[0]
        result = {
            "runs": runs,
            "plan": {"microbatch_size": plan.microbatch_size, "microbatches": list(stage.microbatches_per_rank),
                     "sharding": stage.sharding.value, "stages": len(plan.stages)},
        }
        Path(out_dir, "result.json").write_text(json.dumps(result))


def _efficiency(runs: list[dict]) -> float:
    """Emulated compute / step time, averaged over runs: throughput at a common compute cost."""
    return statistics.mean(run["compute_s_per_step"] / statistics.median(run["step_s"]) for run in runs)



def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = BenchConfig()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    config = BenchConfig(**vars(parser.parse_args(argv)))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(free_port(), config, out_dir), nprocs=WORLD_SIZE, join=True)
        runs = json.loads(Path(out_dir, "result.json").read_text())
    global_batch = config.per_rank_batch * WORLD_SIZE
    rates = {
        name: global_batch / statistics.median(t for run in r for t in run["step_s"]) for name, r in runs["runs"].items()
    }
    efficiency = {name: _efficiency(r) for name, r in runs["runs"].items()}
    result = {
        "ratio": round(efficiency["zorse"] / efficiency["ddp"], 4),
        "zorse_samples_per_s": round(rates["zorse"], 3),
        "ddp_samples_per_s": round(rates["ddp"], 3),
        "raw_ratio": round(rates["zorse"] / rates["ddp"], 4),
        "zorse_compute_over_step": round(efficiency["zorse"], 4),
        "ddp_compute_over_step": round(efficiency["ddp"], 4),
        "runs": {
            name: [{"median_step_ms": round(statistics.median(run["step_s"]) * 1000.0, 1),
                    "compute_ms_per_step": round(run["compute_s_per_step"] * 1000.0, 1)} for run in r]
            for name, r in runs["runs"].items()
        },
        "plan": runs["plan"],
    }
    print(f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

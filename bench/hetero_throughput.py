"""Throughput on emulated mixed-GPU clusters: the zorse plan against DDP and the ideal.

    .venv/bin/python -m bench.hetero_throughput          # cpu_sim2, cpu_sim2_1to5, cpu_sim4: about 6 minutes
    .venv/bin/python -m bench.hetero_throughput --clusters cpu_sim4 path/to/mix.yaml

For each cluster, in one set of processes (one per rank, gloo, one thread each):

- zorse: ``Trainer(strategy=ZorseStrategy(cluster=...))`` with emulation on; the
  strategy calibrates the emulated CPU costs once at start-up (ranks one at a
  time, fixed calibration size, minimum over ranks), profiles the blocks
  through each GPU type's emulation on those costs (it is not told the speeds)
  and the planner chooses the plan; the run's emulation uses the same costs;
- ddp: ``Trainer(strategy="ddp")`` with equal per-rank batches on the same
  emulated ranks (the :class:`EmulateCluster` callback), loaded with the zorse
  run's calibrated costs, so both strategies run on the same emulated speeds;
- ideal: the sum over ranks of what each rank trains per second *alone*
  (``solo_samples_per_s`` per GPU type): one process trains the whole model at
  that type's emulated speed on the run's calibrated costs, a DDP rank's batch a
  step, with its loss and optimizer step, measured in this parent process;
- emulated bound (``emulated_bound_samples_per_s``): the same sum computed from
  the emulated compute alone. Each rank's emulated compute over the timed steps,
  divided by its slowdown, summed over ranks, is the whole model's calibrated
  cost ``C`` per sample; a rank alone would train ``1 / (slowdown x C)`` samples
  a second if the loss, the optimizer step and the framework cost nothing
  (:meth:`StepClock.ideal_samples_per_s`). No run can reach it; it shows what
  the measured ideal leaves out.

Throughput is the global batch over the median step time after ``--warmup``
steps. The model is a GPT whose blocks take milliseconds per sample, so the
emulation's per-call overhead (tens of microseconds) stays small beside the
deadlines. The last line printed is one JSON object: ``{"clusters": [{"cluster",
"zorse_samples_per_s", "ddp_samples_per_s", "ideal_samples_per_s", ...}]}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.emulation.emulator import ComputeEmulator, named_emulated_modules
from zorse_lightning.emulation.spec import DEFAULT_FASTEST_SLOWDOWN, emulation_spec_for_rank
from zorse_lightning.emulation.timing import CallCost
from zorse_lightning.emulation.callback import EmulateCluster
from zorse_lightning.strategy.zorse_strategy import ZorseStrategy
from zorse_lightning.models.gpt import GPT
from zorse_lightning.planner.options import PlannerOptions
from testing.launch import spawn_ranks

UNLIMITED_BYTES = 1 << 50

CLUSTERS = ("cpu_sim2", "cpu_sim2_1to5", "cpu_sim4")
"""2 ranks at 1 : 2.5 and 1 : 4.8, 4 ranks at 1 : 2.5 : 4.8 : 4.8."""


@dataclass(frozen=True)
class BenchConfig:
    per_rank_batch: int = 8
    """DDP's batch per rank; the zorse global batch is this x the number of ranks, as with DDP."""
    warmup: int = 3
    steps: int = 10
    """Timed steps after warm-up (the median is kept)."""
    solo_steps: int = 3
    """Timed steps of each type alone (after one warm-up step)."""
    width: int = 256
    layers: int = 4
    seq_len: int = 128
    """Wide and long enough that a block takes milliseconds per sample."""
    vocab: int = 256
    solver_time_limit_s: float = 5.0

    def model(self) -> GPT:
        torch.manual_seed(0)
        return GPT(vocab_size=self.vocab, seq_len=self.seq_len, width=self.width, layers=self.layers, heads=4)

    def dataset(self, world_size: int) -> TensorDataset:
        count = self.per_rank_batch * world_size * (self.warmup + self.steps)
        tokens = torch.randint(0, self.vocab, (count, self.seq_len + 1), generator=torch.Generator().manual_seed(0))
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class StepClock(pl.Callback):
    """Wall time between the ends of consecutive training steps, and this rank's emulated compute."""

    def __init__(self, emulator: Callable[[pl.Trainer], ComputeEmulator]) -> None:
        self.emulator = emulator
        self.ends: list[float] = []
        self.emulated_s: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append(time.perf_counter())
        self.emulated_s.append(self.emulator(trainer).emulated_compute_s)

    def median_step_s(self, warmup: int) -> float:
        intervals = [b - a for a, b in zip(self.ends, self.ends[1:])]
        return statistics.median(intervals[max(warmup - 1, 0):])

    def ideal_samples_per_s(self, trainer: pl.Trainer, cluster: str, warmup: int, samples_per_step: int) -> float:
        """The ideal on this run's own calibrated costs (collective).

        Each rank's emulated compute over the timed steps, divided by its
        slowdown, is the CPU cost of the part of the model it ran; summed over
        ranks it is the whole model's cost ``C`` per sample times the samples
        trained. A rank alone trains ``1 / (slowdown x C)`` samples per second.
        """
        inventory = load_cluster(cluster)
        slowdown = emulation_spec_for_rank(inventory, trainer.global_rank).slowdown
        mine = (self.emulated_s[-1] - self.emulated_s[warmup - 1]) / slowdown
        total = float(trainer.strategy.reduce(torch.tensor(mine, dtype=torch.float64), reduce_op="sum"))
        cost_s_per_sample = total / (samples_per_step * (len(self.emulated_s) - warmup))
        return sum(1.0 / (emulation_spec_for_rank(inventory, r).slowdown * cost_s_per_sample)
                   for r in range(inventory.world_size))


def _trainer(strategy, world_size: int, config: BenchConfig, callbacks: list, root: str) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world_size, max_steps=config.warmup + config.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=root,
    )


def _per_rank(strategy, emulator: ComputeEmulator) -> dict[str, list[float]]:
    """Overruns (compute that passed its deadline: the rank ran slower than emulated) on every rank."""
    counts = strategy.all_gather(torch.tensor(float(emulator.overruns))).reshape(-1).tolist()
    seconds = strategy.all_gather(torch.tensor(emulator.overrun_s)).reshape(-1).tolist()
    return {"count": counts, "total_s": [round(s, 3) for s in seconds]}


def _costs_json(costs: dict[str, CallCost]) -> dict[str, list[float]]:
    return {key: [c.forward_s_per_sample, c.backward_s_per_sample] for key, c in costs.items()}


def _costs_from_json(raw: dict[str, list[float]]) -> dict[str, CallCost]:
    return {key: CallCost(*pair) for key, pair in raw.items()}


def run_zorse(cluster: str, world_size: int, config: BenchConfig, root: str) -> dict:
    """One zorse fit (collective): throughput, ideal, plan, its prediction and the calibrated costs."""
    clock = StepClock(lambda trainer: trainer.strategy.emulation.emulator)
    strategy = ZorseStrategy(cluster=cluster, planner_options=PlannerOptions(solver_time_limit_s=config.solver_time_limit_s))
    trainer = _trainer(strategy, world_size, config, [clock], root)
    loader = DataLoader(config.dataset(world_size), batch_size=config.per_rank_batch, shuffle=True)
    trainer.fit(config.model(), train_dataloaders=loader)
    plan = strategy.plan
    emulator = strategy.emulation.emulator
    overruns = _per_rank(strategy, emulator)
    return {
        "samples_per_s": plan.global_batch_size / clock.median_step_s(config.warmup),
        "measured_ms": clock.median_step_s(config.warmup) * 1000.0,
        "ideal_samples_per_s": clock.ideal_samples_per_s(trainer, cluster, config.warmup, plan.global_batch_size),
        "plan": {
            "microbatch_size": plan.microbatch_size,
            "stages": [
                {"ranks": list(s.ranks), "layers": list(s.layers), "microbatches": list(s.microbatches_per_rank)}
                for s in plan.stages
            ],
            "predicted_iteration_ms": plan.predicted.iteration_ms if plan.predicted else None,
        },
        "overruns_per_rank": overruns,
        "costs": _costs_json(emulator.calibrated_costs),
    }


class _SharedCosts(pl.Callback):
    """Gives DDP's emulation the zorse run's calibrated costs, keyed by module name (after EmulateCluster.setup)."""

    def __init__(self, emulate: EmulateCluster, costs: dict[str, CallCost]) -> None:
        self.emulate, self.costs = emulate, costs

    def setup(self, trainer, pl_module, stage) -> None:
        named = named_emulated_modules(pl_module)
        self.emulate.emulator.instrument([m for _, m in named], names=[n for n, _ in named])
        self.emulate.emulator.load_costs(self.costs)


def _run_ddp(cluster: str, world_size: int, config: BenchConfig, root: str, costs: dict[str, CallCost]) -> dict:
    emulate = EmulateCluster(cluster)
    clock = StepClock(lambda trainer: emulate.emulator)
    trainer = _trainer("ddp", world_size, config, [emulate, _SharedCosts(emulate, costs), clock], root)
    loader = DataLoader(config.dataset(world_size), batch_size=config.per_rank_batch, shuffle=True)
    trainer.fit(config.model(), train_dataloaders=loader)
    overruns = _per_rank(trainer.strategy, emulate.emulator)
    return {
        "samples_per_s": config.per_rank_batch * world_size / clock.median_step_s(config.warmup),
        "ideal_samples_per_s": clock.ideal_samples_per_s(trainer, cluster, config.warmup, config.per_rank_batch * world_size),
        "overruns_per_rank": overruns,
    }


def _worker(rank: int, out_dir: Path, cluster: str, world_size: int, config: BenchConfig, ddp: bool) -> dict:
    result = {"zorse": run_zorse(cluster, world_size, config, str(out_dir))}
    if ddp:
        result["ddp"] = _run_ddp(cluster, world_size, config, str(out_dir), _costs_from_json(result["zorse"]["costs"]))
    return result


def run_cluster(cluster: str, config: BenchConfig, ddp: bool = True) -> dict:
    """Spawn one process per rank of ``cluster``; rank 0's results of the zorse (and DDP) fits."""
    world_size = load_cluster(cluster).world_size
    with tempfile.TemporaryDirectory() as out_dir:
        return spawn_ranks(_worker, world_size, out_dir, cluster, world_size, config, ddp)[0]


def solo_samples_per_s(
    cluster: str, config: BenchConfig, costs: dict[str, CallCost], fastest_slowdown: float = DEFAULT_FASTEST_SLOWDOWN
) -> dict[str, float]:
    """Per GPU type: samples/s of one process training the whole model alone at that type's speed, memory
    unlimited (``config``: anything with ``model()``, ``dataset(n)``, ``per_rank_batch``, ``solo_steps``);
    ``fastest_slowdown``: the run's emulation's.

    On the run's calibrated ``costs`` (keyed by module name), so the types' rates
    differ by their slowdowns alone and match the speeds the run emulated.
    """
    inventory = load_cluster(cluster)
    model = config.model()
    first_of_type: dict[str, int] = {}
    for rank, gpu in enumerate(inventory.gpus):
        first_of_type.setdefault(gpu.gpu_type.name, rank)
    emulator = ComputeEmulator(emulation_spec_for_rank(inventory, 0, fastest_slowdown), costs=costs)
    emulator.batch_samples = config.per_rank_batch
    named = named_emulated_modules(model)
    emulator.instrument([m for _, m in named], names=[n for n, _ in named])
    optimizer = model.configure_optimizers()
    inputs, targets = config.dataset(1)[: config.per_rank_batch]
    rates = {}
    for name, rank in first_of_type.items():
        # The ideal is each type's rate with memory unlimited: the whole model on one GPU of the type.
        emulator.spec = replace(
            emulation_spec_for_rank(inventory, rank, fastest_slowdown), memory_budget_bytes=UNLIMITED_BYTES
        )
        step_s = []
        for _ in range(1 + config.solo_steps):
            start = time.perf_counter()
            model._loss((inputs, targets)).backward()
            optimizer.step()
            optimizer.zero_grad()
            step_s.append(time.perf_counter() - start)
        rates[name] = config.per_rank_batch / statistics.median(step_s[1:])
    emulator.remove()
    return rates



def bench_cluster(cluster: str, config: BenchConfig) -> dict:
    inventory = load_cluster(cluster)
    torch.set_num_threads(1)
    runs = run_cluster(cluster, config)
    solo = solo_samples_per_s(cluster, config, _costs_from_json(runs["zorse"]["costs"]))
    zorse, ddp = runs["zorse"]["samples_per_s"], runs["ddp"]["samples_per_s"]
    ideal = sum(solo[g.gpu_type.name] for g in inventory.gpus)
    bound = runs["zorse"]["ideal_samples_per_s"]
    return {
        "cluster": inventory.name,
        "zorse_samples_per_s": round(zorse, 3),
        "ddp_samples_per_s": round(ddp, 3),
        "ideal_samples_per_s": round(ideal, 3),
        "zorse_over_ideal": round(zorse / ideal, 4),
        "ddp_over_ideal": round(ddp / ideal, 4),
        "zorse_over_ddp": round(zorse / ddp, 4),
        "emulated_bound_samples_per_s": round(bound, 3),
        "zorse_over_emulated_bound": round(zorse / bound, 4),
        "ddp_emulated_bound_samples_per_s": round(runs["ddp"]["ideal_samples_per_s"], 3),
        "solo_samples_per_s": {name: round(rate, 3) for name, rate in solo.items()},
        "plan": runs["zorse"]["plan"],
        "measured_ms": round(runs["zorse"]["measured_ms"], 1),
        "overruns": {"zorse": runs["zorse"]["overruns_per_rank"], "ddp": runs["ddp"]["overruns_per_rank"]},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clusters", nargs="+", default=list(CLUSTERS), help="cluster conf names or YAML paths")
    defaults = BenchConfig()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    clusters = args.pop("clusters")
    config = BenchConfig(**args)
    results = []
    for cluster in clusters:
        started = time.perf_counter()
        results.append(bench_cluster(cluster, config))
        print(f"{cluster}: {time.perf_counter() - started:.0f} s, {results[-1]}", file=sys.stderr)
    print(json.dumps({"clusters": results}))


if __name__ == "__main__":
    main()

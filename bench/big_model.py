"""A model bigger than any one GPU: throughput against the ideal, memory against the budget, prediction against measure.

    .venv/bin/python -m bench.big_model                      # two clusters, about 4 minutes
    .venv/bin/python -m bench.big_model --types a100x40 v100x16 t4 t4

Each cluster is four emulated GPUs whose budgets are made from the model: the
largest holds a third (``--state-over-largest``) of the model's AdamW training
state, the others ``--others-fraction`` of that, so no GPU holds the model and
every plan pipelines it. The model is built on the meta device
(``Trainer.init_module(empty_init=True)``), so each rank only ever materializes
its stage, and its memory meter counts from setup.

- zorse: ``Trainer(strategy=ZorseStrategy(cluster=...))``, planned at start;
  samples/s from the median step after ``--warmup``;
- ideal: the sum over ranks of each type's whole-model solo rate with memory
  unlimited, on the run's calibrated costs (``bench.hetero_throughput``'s
  ``solo_samples_per_s``);
- memory: each rank's peak (the emulation's meter: parameters, gradients,
  optimizer state and saved activations, from setup on) against its budget;
- prediction: the plan's iteration time against the measured median step.

The last line printed is one JSON object: ``{"clusters": [{"cluster",
"zorse_samples_per_s", "ideal_samples_per_s", "peak_gib_per_rank",
"budget_gib_per_rank", "error_pct", ...}]}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from bench.hetero_throughput import (
    BenchConfig,
    StepClock,
    _costs_from_json,
    _costs_json,
    _per_rank,
    _trainer,
    solo_samples_per_s,
)
from testing.launch import spawn_ranks
from zorse_lightning import PlannerOptions, ZorseStrategy
from zorse_lightning.units import bytes_to_gib

TYPES = {
    "near_speeds": ("a6000", "a10g", "v100x16", "l4"),
    "mixed_speeds": ("a100x40", "v100x16", "t4", "t4"),
}
"""Default clusters: four types within 1.3x of each other's speed, and cpu_sim4's types (1 : 2.5 : 4.8 : 4.8)."""


@dataclass(frozen=True)
class BigModelConfig(BenchConfig):
    state_over_largest: float = 3.0
    """The model's AdamW training state over the largest GPU's budget."""
    others_fraction: float = 0.9
    """The other GPUs' budgets as a fraction of the largest's."""
    steps: int = 8
    layers: int = 16
    """With a third of the state per GPU at most, 8 layers left every GPU exactly 2 (no room to balance
    speeds: near_speeds 0.676 of the ideal); 16 let the planner give faster GPUs more (0.797)."""
    seq_len: int = 32
    """Short: a stage's activations must fit beside its share of the weights."""
    emulation_slowdown: float = 8.0
    """The fastest type's slowdown (the run's and the ideal's): four ranks on two cores must stay within
    their emulated deadlines (at 3, about half the calls of a width-512 model overran: the CPU, not the
    emulated GPUs, set the pace)."""
    one_stage: int = 0
    """1: pin one stage of every GPU (the planner then must shard all state), to compare with its choice."""

    def state_bytes(self) -> int:
        with torch.device("meta"):
            model = self.model()
        return sum(p.numel() for p in model.parameters()) * (4 + 4 + 8)  # weights, gradients, two moments

    def inventory(self, name: str, types: tuple[str, ...]) -> dict:
        largest = bytes_to_gib(self.state_bytes() / self.state_over_largest)
        budgets = [largest] + [largest * self.others_fraction] * (len(types) - 1)
        return {
            "name": name, "emulated": True,
            "description": f"{len(types)} emulated GPUs; the model's training state is {self.state_over_largest:g}x "
                           f"the largest budget",
            "machines": [{"name": "localhost", "intra_bandwidth_gbps": 10, "gpus": [
                {"type": t, "count": 1, "memory_gib": round(b, 6)} for t, b in zip(types, budgets)
            ]}],
        }


def stage_json(stage) -> dict:
    """One stage of a plan as the benches print it."""
    return {"ranks": list(stage.ranks), "layers": list(stage.layers), "microbatches": list(stage.microbatches_per_rank),
            "sharding": stage.sharding_label, "recompute": stage.recompute, "offload": stage.offload_activations}


def measured_fit(out_dir: Path, cluster: dict, config: BigModelConfig, options: PlannerOptions) -> dict:
    """One planned fit of the bench's model on ``cluster``'s emulated ranks (collective; every rank gets the
    same result): the median step, the plan's prediction, each rank's peak memory against its budget."""
    clock = StepClock(lambda trainer: trainer.strategy.emulation.emulator)
    world_size = sum(g.get("count", 1) for m in cluster["machines"] for g in m["gpus"])
    strategy = ZorseStrategy(cluster=cluster, planner_options=options, emulation_slowdown=config.emulation_slowdown)
    trainer = _trainer(strategy, world_size, config, [clock], str(out_dir))
    with trainer.init_module(empty_init=True):
        model = config.model()
    loader = DataLoader(config.dataset(world_size), batch_size=config.per_rank_batch, shuffle=True)
    trainer.fit(model, train_dataloaders=loader)
    plan, emulator = strategy.plan, strategy.emulation.emulator
    per_rank = lambda value: strategy.all_gather(torch.tensor(float(value))).reshape(-1).tolist()
    peaks, budgets = per_rank(emulator.peak_memory_bytes), per_rank(emulator.spec.memory_budget_bytes)
    offloaded = per_rank(strategy.engine.offload.offloaded_bytes if strategy.engine.offload is not None else 0)
    return {
        "samples_per_s": plan.global_batch_size / clock.median_step_s(config.warmup),
        "measured_ms": clock.median_step_s(config.warmup) * 1000.0,
        "predicted_ms": plan.predicted.iteration_ms,
        "predicted_gib_per_rank": list(plan.predicted.memory_gib),
        "predicted_host_gib_per_rank": list(plan.predicted.host_memory_gib),
        "peak_bytes": peaks,
        "budget_bytes": budgets,
        "offloaded_bytes": offloaded,
        "copy_bound_s": per_rank(emulator.copy_bound_s),
        "stages": [stage_json(s) for s in plan.stages],
        "idle_ranks": list(plan.idle_ranks),
        "interleave": plan.interleave,
        "microbatch_size": plan.microbatch_size,
        "overruns_per_rank": _per_rank(strategy, emulator),
        "costs": _costs_json(emulator.calibrated_costs),
    }


def _worker(rank: int, out_dir: Path, cluster: dict, config: BigModelConfig) -> dict:
    layout = (tuple(range(len(cluster["machines"][0]["gpus"]))),) if config.one_stage else None
    options = PlannerOptions(solver_time_limit_s=config.solver_time_limit_s, stage_layout=layout)
    return measured_fit(out_dir, cluster, config, options)


def bench_cluster(name: str, types: tuple[str, ...], config: BigModelConfig) -> dict:
    torch.set_num_threads(1)
    cluster = config.inventory(name, types)
    with tempfile.TemporaryDirectory() as out_dir:
        run = spawn_ranks(_worker, len(types), out_dir, cluster, config)[0]
    solo = solo_samples_per_s(cluster, config, _costs_from_json(run["costs"]), config.emulation_slowdown)
    ideal = sum(solo[t] for t in types)
    return {
        "cluster": name,
        "types": list(types),
        "zorse_samples_per_s": round(run["samples_per_s"], 3),
        "ideal_samples_per_s": round(ideal, 3),
        "zorse_over_ideal": round(run["samples_per_s"] / ideal, 4),
        "peak_gib_per_rank": [round(bytes_to_gib(b), 5) for b in run["peak_bytes"]],
        "budget_gib_per_rank": [round(bytes_to_gib(b), 5) for b in run["budget_bytes"]],
        "predicted_gib_per_rank": [round(g, 5) for g in run["predicted_gib_per_rank"]],
        "error_pct": round(100.0 * (run["predicted_ms"] - run["measured_ms"]) / run["measured_ms"], 2),
        "predicted_ms": round(run["predicted_ms"], 1),
        "measured_ms": round(run["measured_ms"], 1),
        "state_over_largest_budget": config.state_over_largest,
        "solo_samples_per_s": {t: round(r, 3) for t, r in solo.items()},
        "stages": run["stages"],
        "microbatch_size": run["microbatch_size"],
        "overruns": run["overruns_per_rank"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=None, help="one cluster of these GPU types (catalog names)")
    defaults = BigModelConfig()
    for field_name, value in asdict(defaults).items():
        parser.add_argument(f"--{field_name.replace('_', '-')}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    types = args.pop("types")
    clusters = {"custom": tuple(types)} if types else TYPES
    config = BigModelConfig(**args)
    results = []
    for name, cluster_types in clusters.items():
        started = time.perf_counter()
        results.append(bench_cluster(name, cluster_types, config))
        print(f"{name}: {time.perf_counter() - started:.0f} s, {results[-1]}", file=sys.stderr)
    print(json.dumps({"clusters": results}))


if __name__ == "__main__":
    main()

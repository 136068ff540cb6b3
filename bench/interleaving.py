"""Interleaved pipeline against the same pipeline without interleaving: measured and predicted.

    .venv/bin/python -m bench.interleaving                   # about 1 minute
    .venv/bin/python -m bench.interleaving --types a100x40 v100x16 t4 t4 --per-rank-batch 4

One emulated cluster of ``bench.big_model`` (four GPUs, the model's training state
``--state-over-largest`` times the largest budget, built on the meta device), so
every plan pipelines the model; few microbatches per step make fill and drain weigh.
In one set of processes:

- interleaved: ``ZorseStrategy(cluster=...)`` planned at start, the planner free to
  interleave (it reports the degree it chose, 1 if none);
- plain: the same groups of ranks, layers per group, microbatch size and schedule
  pinned (``PlannerOptions``), interleaving off (``max_interleave=1``): the plan the
  interleaved one was dealt from.

Each: samples/s from the median step after ``--warmup``, the plan's predicted
iteration time against the measured one (``error_pct``). The last line printed is
one JSON object: ``{"interleaved": {...}, "plain": {...}, "measured_speedup",
"clock_ratio", "measured_speedup_same_clock", "predicted_speedup", "predicted_speedup_same_clock",
"same_plan_otherwise"}``.

Each fit calibrates its emulated GPUs on the CPU at its own start, and this
shared CPU's speed drifts by 15 % within a minute: the two fits then emulate
GPUs of different speeds. ``clock_ratio`` is the interleaved fit's calibrated
compute over the plain fit's (:func:`clock_ratio`), and
``measured_speedup_same_clock`` the measured speedup with the plain fit's
compute on the interleaved fit's clock (communication is not rescaled: it is
real, not emulated). That is the figure to judge interleaving by;
``predicted_speedup`` compares the two fits' predictions, each on its own clock,
``predicted_speedup_same_clock`` both on the interleaved fit's.
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

from bench.big_model import TYPES, BigModelConfig
from bench.hetero_throughput import StepClock, _costs_json, _per_rank, _trainer
from testing.launch import spawn_ranks
from zorse_lightning import PlannerOptions, ZorseStrategy


@dataclass(frozen=True)
class InterleavingConfig(BigModelConfig):
    per_rank_batch: int = 2
    """Eight sequences a step on four GPUs: few microbatches, so the bubble is a large share."""
    steps: int = 10
    width: int = 512
    """Blocks of tens of milliseconds: per-action costs of the engine (a chunk's call of the step, its
    messages) stay small beside them, as on GPUs with real models."""
    layers: int = 8
    """Two layers a GPU: chunks of one layer at x2 (``big_model``'s 16 made this bench a run of 16 one-layer
    chunks the day its default changed)."""


def _fit(cluster: dict, config: InterleavingConfig, options: PlannerOptions, root: str) -> dict:
    clock = StepClock(lambda trainer: trainer.strategy.emulation.emulator)
    world_size = len(cluster["machines"][0]["gpus"])
    strategy = ZorseStrategy(cluster=cluster, planner_options=options, emulation_slowdown=config.emulation_slowdown)
    trainer = _trainer(strategy, world_size, config, [clock], root)
    with trainer.init_module(empty_init=True):
        model = config.model()
    trainer.fit(model, train_dataloaders=DataLoader(config.dataset(world_size), batch_size=config.per_rank_batch))
    plan = strategy.plan
    measured_ms = clock.median_step_s(config.warmup) * 1000.0
    return {
        "interleave": plan.interleave,
        "groups": [list(s.ranks) for s in plan.rank_groups],
        "layers_per_group": [sum(plan.stages[s].num_layers for s in plan.stages_of_group(g)) for g in range(plan.num_groups)],
        "stages": [list(s.layers) for s in plan.stages],
        "microbatch_size": plan.microbatch_size,
        "microbatches": [list(s.microbatches_per_rank) for s in plan.rank_groups],
        "sharding": [s.sharding_label for s in plan.rank_groups],
        "recompute": [s.recompute for s in plan.rank_groups],
        "schedule": plan.schedule.value,
        "samples_per_s": round(plan.global_batch_size / measured_ms * 1000.0, 3),
        "measured_ms": round(measured_ms, 1),
        "predicted_ms": round(plan.predicted.iteration_ms, 1),
        "error_pct": round(100.0 * (plan.predicted.iteration_ms - measured_ms) / measured_ms, 2),
        "notes": list(plan.notes),
        "overruns_per_rank": _per_rank(strategy, strategy.emulation.emulator),
        "costs": _costs_json(strategy.emulation.emulator.calibrated_costs),
    }


def _worker(rank: int, out_dir: Path, cluster: dict, config: InterleavingConfig) -> dict:
    free = PlannerOptions(solver_time_limit_s=config.solver_time_limit_s)
    interleaved = _fit(cluster, config, free, str(out_dir))
    pinned = PlannerOptions(
        solver_time_limit_s=config.solver_time_limit_s,
        stage_layout=tuple(tuple(g) for g in interleaved["groups"]),
        layer_counts=tuple(interleaved["layers_per_group"]),
        microbatch_size=interleaved["microbatch_size"],
        schedule=interleaved["schedule"],
        max_interleave=1,
    )
    plain = _fit(cluster, config, pinned, str(out_dir))
    return {"interleaved": interleaved, "plain": plain}


def clock_ratio(first: dict[str, list[float]], second: dict[str, list[float]]) -> float:
    """How much longer the first fit's emulated compute is than the second's: each fit calibrates the CPU's
    cost of every module at its start, and every emulated time is that cost times the type's slowdown, so a
    CPU running 15 % slower during one calibration makes every GPU of that fit 15 % slower. The sum of the
    modules' forward and backward costs per sample that both fits calibrated, first over second."""
    common = sorted(first.keys() & second.keys())
    if not common:
        raise ValueError("the two fits calibrated no module in common: their clocks cannot be compared")
    return sum(sum(first[k]) for k in common) / sum(sum(second[k]) for k in common)


def bench(types: tuple[str, ...], config: InterleavingConfig) -> dict:
    torch.set_num_threads(1)
    cluster = config.inventory("interleaving", types)
    with tempfile.TemporaryDirectory() as out_dir:
        run = spawn_ranks(_worker, len(types), out_dir, cluster, config)[0]
    interleaved, plain = run["interleaved"], run["plain"]
    alike = ("groups", "layers_per_group", "microbatch_size", "microbatches", "sharding", "recompute", "schedule")
    clock = clock_ratio(interleaved.pop("costs"), plain.pop("costs"))
    return {
        "types": list(types),
        "interleaved": interleaved,
        "plain": plain,
        "measured_speedup": round(interleaved["samples_per_s"] / plain["samples_per_s"], 4),
        "clock_ratio": round(clock, 4),
        "measured_speedup_same_clock": round(interleaved["samples_per_s"] / plain["samples_per_s"] * clock, 4),
        "predicted_speedup": round(plain["predicted_ms"] / interleaved["predicted_ms"], 4),
        "predicted_speedup_same_clock": round(plain["predicted_ms"] * clock / interleaved["predicted_ms"], 4),
        "same_plan_otherwise": {key: interleaved[key] == plain[key] for key in alike},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=list(TYPES["near_speeds"]), help="GPU types (catalog names)")
    defaults = InterleavingConfig()
    for field_name, value in asdict(defaults).items():
        parser.add_argument(f"--{field_name.replace('_', '-')}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    types = tuple(args.pop("types"))
    started = time.perf_counter()
    result = bench(types, InterleavingConfig(**args))
    print(f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

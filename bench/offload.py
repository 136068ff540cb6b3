"""Activation offload on a cluster whose smallest GPU cannot hold the activations in flight (issue 31).

    .venv/bin/python -m bench.offload                  # about 1 minute here

Two emulated GPUs of the same speed (an A10G and a V100-16GB, 125 TFLOPS each)
whose budgets are made from the model as in ``bench/big_model.py``: the larger
holds the GPT's whole AdamW training state with room to spare
(``--state-over-largest`` below 1), the smaller ``--others-fraction`` of that,
about two thirds of the state: its share of the weights fits, the activations of
the microbatches it would keep in flight do not. The GPT's sequence is long
beside its width (128 and 128: a block keeps about 1 MiB a sample for its
backward, attention's scores among it, against 3 MiB of training state); it is
built on the meta device.

In one set of processes, two planned fits, each with its own start-up (profile,
plan) on the same emulated ranks, the second on the CPU costs the first
calibrated (start-up calibrates anew at each fit, and on this shared machine two
calibrations a minute apart differed by a third: both plans then sped up or
slowed down together with their predictions, and their ratio went from 1.07 to
1.48; on one set of costs both are profiled, planned and run on the same
emulated speeds):

- offload: ``PlannerOptions(allow_offload=True)``, the planner's choice;
- without: ``PlannerOptions(allow_offload=False)``, the best plan the planner
  finds without offload (smaller microbatches, recomputation, fewer layers on
  the small GPU, more sharding or fewer GPUs, whichever it prices fastest).

For each: samples/s from the median step after ``--warmup``, the plan's
predicted step against the measured one, each rank's peak (the emulation's
meter: what the device holds; offloaded activations live in host memory) against
its budget, the bytes each rank offloaded and the time its copies added beyond
compute at the type's host link (``copy_bound_s``: 0 where they hid). The
emulated ranks charge recomputation's rerun forward and offload's copies as the
cost model prices them, so neither remedy is free here.

A table, then as the last line one JSON object: ``{"cluster", "offload_samples_per_s",
"best_without_offload_samples_per_s", "offload_over_without", "predicted_error_pct",
"peaks_within_budget", "offload_chosen", "offload_plan", "without_offload_plan",
"offload_peak_gib_per_rank", "budget_gib_per_rank", ..., "plans": {"offload": {...}, "without_offload": {...}}}``;
``predicted_error_pct`` = 100 x (predicted - measured) / measured for the offload plan.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.big_model import BigModelConfig, measured_fit
from testing.launch import spawn_ranks
from zorse_lightning import PlannerOptions
from zorse_lightning.startup import plan_at_start
from zorse_lightning.units import bytes_to_gib

TYPES = ("a10g", "v100x16")
"""Equal speeds, so that the layers are best split evenly; the V100 is the small one."""


@dataclass(frozen=True)
class OffloadConfig(BigModelConfig):
    state_over_largest: float = 0.82
    """The model's AdamW training state over the larger GPU's budget: below 1, the A10G holds it all."""
    others_fraction: float = 0.53
    """The V100's budget over the A10G's: about 0.65 of the training state."""
    layers: int = 8
    width: int = 128
    seq_len: int = 128
    """Long beside the width: attention's saved tensors make activations the memory that binds."""
    vocab: int = 256
    per_rank_batch: int = 8
    warmup: int = 2
    steps: int = 8
    emulation_slowdown: float = 6.0
    """Two ranks keep a third of the two cores busy at 6 (``cpu_cores_demanded``), leaving room for the
    machine's other users; the calls stay within their deadlines."""


@contextmanager
def _calibrated_once() -> Iterator[None]:
    """Start-up's calibration (collective) runs at the first fit only; later fits get its costs back."""
    original = plan_at_start.calibrate_in_turn
    kept: list[dict] = []

    def once(*args: Any, **kwargs: Any) -> dict:
        if not kept:
            kept.append(original(*args, **kwargs))
        return dict(kept[0])

    plan_at_start.calibrate_in_turn = once
    try:
        yield
    finally:
        plan_at_start.calibrate_in_turn = original


def _worker(rank: int, out_dir: Path, cluster: dict, config: OffloadConfig) -> dict:
    runs = {}
    with _calibrated_once():
        for name, allow in (("offload", True), ("without_offload", False)):
            options = PlannerOptions(solver_time_limit_s=config.solver_time_limit_s, allow_offload=allow)
            runs[name] = measured_fit(out_dir, cluster, config, options)
    return runs


def describe(run: dict, types: tuple[str, ...]) -> str:
    """A plan in one line: microbatch size, then each stage's GPUs, layers (first-last), microbatches per GPU
    and memory remedies, stages in pipeline order."""
    parts = []
    for stage in run["stages"]:
        remedies = [stage["sharding"]] if stage["sharding"] != "none" else []
        remedies += ["recompute"] * stage["recompute"] + ["offload"] * stage["offload"]
        gpus = "+".join(types[r] for r in stage["ranks"])
        parts.append(f"{gpus} layers {stage['layers'][0]}-{stage['layers'][1] - 1} "
                     f"x{'/'.join(map(str, stage['microbatches']))}" + (f" ({', '.join(remedies)})" if remedies else ""))
    idle = f"; idle: {'+'.join(types[r] for r in run['idle_ranks'])}" if run["idle_ranks"] else ""
    interleave = f"; interleaved x{run['interleave']}" if run["interleave"] > 1 else ""
    return f"microbatch {run['microbatch_size']}: " + " -> ".join(parts) + idle + interleave


def summary(run: dict, types: tuple[str, ...]) -> dict:
    gib = lambda values: [round(bytes_to_gib(b), 5) for b in values]
    return {
        "plan": describe(run, types),
        "samples_per_s": round(run["samples_per_s"], 3),
        "measured_ms": round(run["measured_ms"], 1),
        "predicted_ms": round(run["predicted_ms"], 1),
        "error_pct": round(100.0 * (run["predicted_ms"] - run["measured_ms"]) / run["measured_ms"], 2),
        "peak_gib_per_rank": gib(run["peak_bytes"]),
        "predicted_gib_per_rank": [round(g, 5) for g in run["predicted_gib_per_rank"]],
        "budget_gib_per_rank": gib(run["budget_bytes"]),
        "peaks_within_budget": all(p <= b for p, b in zip(run["peak_bytes"], run["budget_bytes"])),
        "predicted_host_gib_per_rank": [round(g, 5) for g in run["predicted_host_gib_per_rank"]],
        "offloaded_mib_per_step_per_rank": [
            round(b / 2**20 / (run["timed_steps"]), 2) for b in run["offloaded_bytes"]
        ],
        "copy_bound_s_per_rank": [round(s, 4) for s in run["copy_bound_s"]],
        "stages": run["stages"],
        "microbatch_size": run["microbatch_size"],
        "overruns": run["overruns_per_rank"],
    }


def _table(cluster: str, plans: dict[str, dict]) -> str:
    head = "| plan | samples/s | measured ms | predicted ms | error | peak / budget GiB per rank |"
    rows = [f"{cluster}", head, "|---|---|---|---|---|---|"]
    for name, p in plans.items():
        peaks = ", ".join(f"{a:.4f}/{b:.4f}" for a, b in zip(p["peak_gib_per_rank"], p["budget_gib_per_rank"]))
        rows.append(f"| {name}: {p['plan']} | {p['samples_per_s']:.2f} | {p['measured_ms']:.0f} | "
                    f"{p['predicted_ms']:.0f} | {p['error_pct']:+.1f} % | {peaks} |")
    return "\n".join(rows)


def bench(config: OffloadConfig, types: tuple[str, ...] = TYPES, name: str = "offload_small_v100") -> dict:
    torch.set_num_threads(1)
    cluster = config.inventory(name, types)
    with tempfile.TemporaryDirectory() as out_dir:
        runs = spawn_ranks(_worker, len(types), out_dir, cluster, config)[0]
    for run in runs.values():
        run["timed_steps"] = config.warmup + config.steps  # offloaded bytes count from the first step
    plans = {key: summary(run, types) for key, run in runs.items()}
    offload, without = plans["offload"], plans["without_offload"]
    print(_table(name, plans), file=sys.stderr)
    return {
        "cluster": name,
        "types": list(types),
        "offload_samples_per_s": offload["samples_per_s"],
        "best_without_offload_samples_per_s": without["samples_per_s"],
        "offload_over_without": round(offload["samples_per_s"] / without["samples_per_s"], 4),
        "predicted_error_pct": offload["error_pct"],
        "without_offload_predicted_error_pct": without["error_pct"],
        "peaks_within_budget": offload["peaks_within_budget"],
        "offload_chosen": any(s["offload"] for s in offload["stages"]),
        "offload_plan": offload["plan"],
        "without_offload_plan": without["plan"],
        "offload_peak_gib_per_rank": offload["peak_gib_per_rank"],
        "without_offload_peak_gib_per_rank": without["peak_gib_per_rank"],
        "budget_gib_per_rank": offload["budget_gib_per_rank"],
        "state_over_largest_budget": config.state_over_largest,
        "plans": plans,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=list(TYPES), help="GPU types (catalog names), the smallest last")
    defaults = OffloadConfig()
    for field_name, value in asdict(defaults).items():
        if field_name == "one_stage":  # big_model's pinned layout: here the planner chooses both plans
            continue
        parser.add_argument(f"--{field_name.replace('_', '-')}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    types = tuple(args.pop("types"))
    started = time.perf_counter()
    result = bench(OffloadConfig(**args), types)
    print(f"offload: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

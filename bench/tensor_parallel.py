"""Tensor parallelism inside machines against the best plan without it: measured and predicted (issue 38, item 6).

    .venv/bin/python -m bench.tensor_parallel                 # about 4 minutes here
    .venv/bin/python -m bench.tensor_parallel --width 768 --emulation-slowdown 24

The case TP is for: two machines of four equal GPUs (A100-40GB, emulated on this
CPU, one rank each) and a model whose AdamW training state is about eight times
what one GPU may hold (each GPU's budget is ``--budget-over-share`` times an
eighth of the state). Without TP the planner can only pipeline it one layer a
GPU, eight stages deep, paying a fill and drain of seven stages at each step's
few microbatches; with TP a stage's blocks split over the GPUs of a machine, so
two stages of four (or four of two) hold it, each GPU an eighth of the state as
before, and the pipeline is a quarter (a half) as deep. The planner chooses
between them (``make_plan`` at start-up, from the profile start-up measures,
whose TP degrees come from the GPT's ``tp_plan``:
:mod:`zorse_lightning.startup.tensor_parallel_support`).

What TP pays here is not NVLink's: a TP group all-reduces a layer's activation
four times a microbatch over gloo on this shared CPU, where a 32 KiB all-reduce
among four ranks took 5-9 ms (load 5, 2026-11-28) and start-up measures a small
message at 0.3-8 ms, which the planner prices each all-reduce's phases at. So a
layer's emulated compute is made long beside them (width 512 at slowdown 64: about
440 ms a microbatch; at slowdown 24, 165 ms, the planner kept the eight-stage
pipeline). An emulated split block is charged its whole-block cost
over ``t`` times the type's TP efficiency and its all-reduces run inside that
window (:mod:`zorse_lightning.emulation.emulator`), so where they fit in it the run
does not pay them while the cost model adds them, as on GPUs: the TP plan tends to
run faster than predicted.

In one set of eight processes (gloo, one thread each), two fits, each planned at
start (``ZorseStrategy(cluster=..., planner_options=...)``; the model built on
the meta device, so a rank only materializes its stage):

- with TP: the planner's default options (``max_tp`` 8: up to the four GPUs of a
  machine);
- without: ``PlannerOptions(max_tp=1)``, the best plan the planner finds without TP.

Each: samples/s from the median step after ``--warmup``, the plan's predicted
iteration time against the measured one (``error_pct``), the stages with their TP
degrees. As in :mod:`bench.interleaving`, each fit calibrates its emulated GPUs on
the CPU at its own start and this shared CPU's speed drifts, so ``clock_ratio``
(the TP fit's calibrated compute over the other's) gives the speedup on one clock
(``measured_speedup_same_clock``). Until the planner's search offers TP, both fits
plan alike: ``tp_degrees`` all 1 and a speedup near 1.

Printed: one line per fit (measured and predicted samples/s), then as the last
line one JSON object: ``{"cluster", "tp_samples_per_s", "best_without_tp_samples_per_s",
"predicted_error_pct", "tp_degrees", "admitted_tp_degrees", "measured_speedup", "measured_speedup_same_clock",
"predicted_speedup", "clock_ratio", "with_tp": {...}, "without_tp": {...}, ...}``
(``predicted_error_pct``: the TP fit's, (predicted - measured) / measured; ``tp_degrees``: each stage's of the TP
fit's plan; ``admitted_tp_degrees``: those its profile offered the planner).
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

from bench.hetero_throughput import BenchConfig, StepClock, _costs_json, _per_rank, _trainer
from bench.interleaving import clock_ratio
from testing.launch import spawn_ranks
from zorse_lightning import PlannerOptions, ZorseStrategy
from zorse_lightning.units import bytes_to_gib

STATE_BYTES_PER_PARAMETER = 4 + 4 + 8
"""float32 weights, gradients and AdamW's two moments: what the budgets are made from."""


@dataclass(frozen=True)
class TensorParallelConfig(BenchConfig):
    gpu_type: str = "a100x40"
    """Every GPU's type (catalog name): a TP group is GPUs of one type on one machine."""
    machines: int = 2
    gpus_per_machine: int = 4
    budget_over_share: float = 1.5
    """Each GPU's budget over an even share of the training state (the state over the GPUs): one share and room
    for one layer's activations in flight, so a plan without TP needs every GPU in its own stage."""
    per_rank_batch: int = 1
    """Eight sequences a step on eight GPUs: eight microbatches of one (start-up measures sizes up to a rank's
    batch, so no larger), and an eight-stage pipeline's fill and drain (seven of fifteen slots) is what TP's
    shallower pipeline saves. At two a rank the planner took sixteen microbatches of one, whose fill and drain
    (seven of 23) leave TP at most 1.2x."""
    width: int = 512
    """Wide enough that a layer's compute outweighs the four all-reduces of its activation a TP group makes per
    microbatch (gloo on this loaded CPU: a few milliseconds each, however small)."""
    layers: int = 8
    """One layer a GPU in the eight-stage pipeline (no plan without TP can interleave it), four a stage of TP 4."""
    seq_len: int = 32
    heads: int = 4
    """A degree must divide them: 4 admits TP 2 and 4 (the GPT's ``tp_plan`` splits q, k, v, the MLP)."""
    warmup: int = 2
    steps: int = 5
    """Steps of 5-10 s each: the two fits and their start-ups take about four minutes."""
    emulation_slowdown: float = 64.0
    """Eight ranks on two shared cores: every rank's real compute must stay inside its emulated deadline (at 8,
    big_model's for four ranks, the CPU rather than the emulated GPUs would set the pace), and a layer's emulated
    compute must outweigh the TP all-reduces' latency (see above)."""
    intra_bandwidth_gbps: float = 10.0
    """Inside a machine, as the emulated cluster runs it: gloo over loopback (cpu_sim4's figure); the TP groups'
    all-reduces cross it."""
    inter_bandwidth_gbps: float = 10.0
    """Between machines: loopback too (both machines are this one)."""

    def model(self):
        from zorse_lightning.models.gpt import GPT

        torch.manual_seed(0)
        return GPT(vocab_size=self.vocab, seq_len=self.seq_len, width=self.width, layers=self.layers, heads=self.heads)

    @property
    def world_size(self) -> int:
        return self.machines * self.gpus_per_machine

    def state_bytes(self) -> int:
        with torch.device("meta"):
            model = self.model()
        return sum(p.numel() for p in model.parameters()) * STATE_BYTES_PER_PARAMETER

    def budget_gib(self) -> float:
        return bytes_to_gib(self.state_bytes() / self.world_size * self.budget_over_share)

    def cluster(self) -> dict:
        name = f"{self.gpu_type}_{self.machines}x{self.gpus_per_machine}"
        return {
            "name": name, "emulated": True, "inter_machine_bandwidth_gbps": self.inter_bandwidth_gbps,
            "description": f"{self.machines} machines of {self.gpus_per_machine} emulated {self.gpu_type}; each GPU "
                           f"holds {self.budget_over_share:g}x an even share of the model's training state",
            "machines": [
                {"name": f"m{i}", "intra_bandwidth_gbps": self.intra_bandwidth_gbps, "gpus": [
                    {"type": self.gpu_type, "count": self.gpus_per_machine, "memory_gib": round(self.budget_gib(), 6)},
                ]}
                for i in range(self.machines)
            ],
        }


def _fit(cluster: dict, config: TensorParallelConfig, options: PlannerOptions, root: str) -> dict:
    """One fit planned at start with ``options`` (collective: every rank gets the same result)."""
    clock = StepClock(lambda trainer: trainer.strategy.emulation.emulator)
    strategy = ZorseStrategy(cluster=cluster, planner_options=options, emulation_slowdown=config.emulation_slowdown)
    trainer = _trainer(strategy, config.world_size, config, [clock], root)
    with trainer.init_module(empty_init=True):
        model = config.model()
    trainer.fit(model, train_dataloaders=DataLoader(config.dataset(config.world_size), batch_size=config.per_rank_batch))
    plan, emulator = strategy.plan, strategy.emulation.emulator
    measured_ms = clock.median_step_s(config.warmup) * 1000.0
    peaks = strategy.all_gather(torch.tensor(float(emulator.peak_memory_bytes))).reshape(-1).tolist()
    # rank 0 keeps the profile start-up planned from (the degrees the GPT's tp_plan admits on this cluster)
    profile = strategy.startup.profile if strategy.startup is not None else None
    return {
        "admitted_tp_degrees": list(profile.tensor_parallel.degrees) if profile is not None else None,
        "stages": [
            {"ranks": list(s.ranks), "layers": list(s.layers), "tensor_parallel": s.tensor_parallel,
             "microbatches": list(s.microbatches_per_rank), "sharding": s.sharding_label, "recompute": s.recompute}
            for s in plan.stages
        ],
        "tp_degrees": [s.tensor_parallel for s in plan.stages],
        "interleave": plan.interleave,
        "microbatch_size": plan.microbatch_size,
        "schedule": plan.schedule.value,
        "samples_per_s": round(plan.global_batch_size / measured_ms * 1000.0, 3),
        "predicted_samples_per_s": round(plan.global_batch_size / plan.predicted.iteration_ms * 1000.0, 3),
        "measured_ms": round(measured_ms, 1),
        "predicted_ms": round(plan.predicted.iteration_ms, 1),
        "error_pct": round(100.0 * (plan.predicted.iteration_ms - measured_ms) / measured_ms, 2),
        "peak_gib_per_rank": [round(bytes_to_gib(b), 5) for b in peaks],
        "predicted_gib_per_rank": [round(g, 5) for g in plan.predicted.memory_gib],
        "notes": list(plan.notes),
        "overruns_per_rank": _per_rank(strategy, emulator),
        "costs": _costs_json(emulator.calibrated_costs),
    }


def _worker(rank: int, out_dir: Path, cluster: dict, config: TensorParallelConfig) -> dict:
    with_tp = _fit(cluster, config, PlannerOptions(solver_time_limit_s=config.solver_time_limit_s), str(out_dir))
    without = PlannerOptions(solver_time_limit_s=config.solver_time_limit_s, max_tp=1)
    return {"with_tp": with_tp, "without_tp": _fit(cluster, config, without, str(out_dir))}


def bench(config: TensorParallelConfig) -> dict:
    torch.set_num_threads(1)
    cluster = config.cluster()
    with tempfile.TemporaryDirectory() as out_dir:
        run = spawn_ranks(_worker, config.world_size, out_dir, cluster, config)[0]
    with_tp, without = run["with_tp"], run["without_tp"]
    clock = clock_ratio(with_tp.pop("costs"), without.pop("costs"))
    speedup = with_tp["samples_per_s"] / without["samples_per_s"]
    return {
        "cluster": cluster["name"],
        "tp_samples_per_s": with_tp["samples_per_s"],
        "best_without_tp_samples_per_s": without["samples_per_s"],
        "predicted_error_pct": with_tp["error_pct"],
        "tp_degrees": with_tp["tp_degrees"],
        "admitted_tp_degrees": with_tp["admitted_tp_degrees"],
        "measured_speedup": round(speedup, 4),
        "measured_speedup_same_clock": round(speedup * clock, 4),
        "predicted_speedup": round(without["predicted_ms"] / with_tp["predicted_ms"], 4),
        "clock_ratio": round(clock, 4),
        "state_gib": round(bytes_to_gib(config.state_bytes()), 5),
        "budget_gib": round(config.budget_gib(), 5),
        "config": asdict(config),
        "with_tp": with_tp,
        "without_tp": without,
    }


def _line(name: str, fit: dict) -> str:
    stages = " | ".join(
        f"ranks {s['ranks'][0]}-{s['ranks'][-1]} layers {s['layers'][0]}-{s['layers'][1]}"
        + (f" TP {s['tensor_parallel']}" if s["tensor_parallel"] > 1 else "")
        for s in fit["stages"]
    )
    interleaved = f", interleaved x{fit['interleave']}" if fit["interleave"] > 1 else ""
    return (
        f"{name}: measured {fit['samples_per_s']:.2f} samples/s ({fit['measured_ms']:.1f} ms), predicted "
        f"{fit['predicted_samples_per_s']:.2f} ({fit['predicted_ms']:.1f} ms, {fit['error_pct']:+.1f} %); microbatch "
        f"{fit['microbatch_size']}{interleaved}; {stages}; TP degrees the profile admits: {fit['admitted_tp_degrees']}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = TensorParallelConfig()
    for field_name, value in asdict(defaults).items():
        parser.add_argument(f"--{field_name.replace('_', '-')}", type=type(value), default=value)
    started = time.perf_counter()
    result = bench(TensorParallelConfig(**vars(parser.parse_args(argv))))
    print(f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(_line("with TP", result["with_tp"]))
    print(_line("without TP (max_tp=1)", result["without_tp"]))
    print(
        f"speedup measured {result['measured_speedup']:.3f}x ({result['measured_speedup_same_clock']:.3f}x on one "
        f"clock, clock ratio {result['clock_ratio']:.3f}), predicted {result['predicted_speedup']:.3f}x"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Cost-model fidelity: the planner's predicted iteration time against the measured one.

    .venv/bin/python -m bench.fidelity                  # as root (the slow-link case); about 8 minutes

For every plan of ``bench/hetero_throughput.py`` (clusters ``cpu_sim2``,
``cpu_sim2_1to5``, ``cpu_sim4``): the zorse strategy runs as there, and here
only the zorse run is timed, ``--steps`` steps after ``--warmup`` (median).
In each of these the planner is *not told* the emulated speeds: it learns them
from its start-up profile, which times the blocks through each rank's
emulation (costs calibrated once, shared with the run). The prediction also
prices what the emulation does not make up: the schedule's fill, drain and
waits, transfers between stages, gradient synchronisation.

Where communication matters: the ``two_machines_100mbit`` case of
``bench/slow_link.py`` (two network namespaces of two ranks each, joined by a
link shaped to 100 Mbit/s with ``tc ... tbf``), both the planner's plan and the
planner's best data-parallel plan, whose gradient all-reduce crosses the slow
link. Needs root; without it the case is reported as skipped.

Where the profile does not come from the run (``--honest``, on by default): in
every case above the start-up profile times the blocks through the same
emulation that then runs them, so compute is predicted by construction. Here
(``cpu_sim2``, one set of processes) the planner profiles a GPT of width
``--profile-width`` (256) at start-up, a second start-up profiles the model
that trains (width ``--run-width``, 512: four times a layer's FLOPs), and the
plan for that model is made from the narrow model's profile scaled by the cost
model's own formulas (:class:`zorse_lightning.profiling.estimate.TransformerShape`:
block times by forward FLOPs, sizes by parameters and activations). The run
trains that plan; its emulation charges the wide model's CPU costs, calibrated
at its start, so what the scaling gets wrong about this CPU is a prediction
error. The entry also gives the same plan priced on the wide model's own
profile (``predicted_on_run_profile_ms``), which separates the scaling's error
from the rest of the model's; ``predicted_parts`` (pipeline, sync, update) of
both prices, ``layer_forward_ms`` (a layer's forward at the plan's microbatch
size, scaled and measured at the run width), ``rank0_emulated_compute_ms_per_step``
(what the run's emulation charged rank 0: compare with the pipeline) and
``emulation_overrun_s_per_rank`` (over the whole run) say where a miss comes from.

Measured times are not adjusted: a miss is a cost-model error to fix there.
The last line printed is one JSON object: ``{"plans": [{"cluster",
"predicted_ms", "measured_ms", "error_pct", ...}]}``, ``error_pct`` = 100 x
(predicted - measured) / measured; the goal is within 15%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench import hetero_throughput, slow_link
from testing.launch import spawn_ranks
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.models.gpt import GPT
from zorse_lightning.profiling.estimate import TransformerShape
from zorse_lightning.profiling.profile import BlockShape, ModelProfile


def _entry(cluster: str, kind: str, predicted_ms: float, measured_ms: float, **extra) -> dict:
    return {
        "cluster": cluster,
        "kind": kind,
        "predicted_ms": round(predicted_ms, 1),
        "measured_ms": round(measured_ms, 1),
        "error_pct": round(100.0 * (predicted_ms - measured_ms) / measured_ms, 1),
        **extra,
    }


def emulated_plans(clusters: list[str], config: hetero_throughput.BenchConfig) -> list[dict]:
    out = []
    for cluster in clusters:
        zorse = hetero_throughput.run_cluster(cluster, config, ddp=False)["zorse"]
        plan = zorse["plan"]
        out.append(_entry(cluster, "speeds learned from start-up profiling", plan["predicted_iteration_ms"],
                          zorse["measured_ms"], plan=plan))
        print(f"{cluster}: {out[-1]}", file=sys.stderr)
    return out


def slow_link_plans(cases: list[str], config: slow_link.BenchConfig) -> list[dict]:
    out = []
    for name in cases:
        result = slow_link.bench_case(slow_link.CASES[name], config)
        for which, kind in (("plan", "planner's plan over a slow link"), ("dp", "data parallel across a slow link")):
            run = result[which]
            out.append(_entry(f"{name}/{which}", kind, run["predicted_ms"], run["measured_ms"],
                              link_mbit=result["link_mbit"], layout=run["layout"],
                              predicted_sync_ms=run["predicted_sync_ms"]))
            print(f"{name}: {out[-1]}", file=sys.stderr)
    return out


HONEST_CLUSTER = "cpu_sim2"


@dataclass(frozen=True)
class HonestConfig:
    """The width-scaled case: the model of ``hetero_throughput`` at two widths."""

    profile_width: int = 256
    run_width: int = 512
    bench: hetero_throughput.BenchConfig = hetero_throughput.BenchConfig()

    def model(self, width: int) -> GPT:
        return replace(self.bench, width=width).model()


def _shape(config: HonestConfig, width: int) -> TransformerShape:
    """The cost model's view of the bench's GPT at ``width`` (learned positions, head tied to the embedding)."""
    b = config.bench
    return TransformerShape(width, b.layers, b.seq_len, b.vocab, learned_positions=b.seq_len, tied_embedding_head=True)


def width_scaled_profile(profile: ModelProfile, config: HonestConfig) -> ModelProfile:
    """``profile`` (measured at ``profile_width``) carried to ``run_width`` by the cost model's formulas.

    Each block's times scale by its forward FLOPs (:class:`TransformerShape`),
    its parameters, saved activations and output bytes by the formulas' ratios;
    the optimizer's rate per parameter is kept.
    """
    narrow = _shape(config, config.profile_width).block_shapes(profile.dtype)
    wide = _shape(config, config.run_width).block_shapes(profile.dtype)

    def ratio(n: BlockShape, w: BlockShape, name: str) -> float:
        return getattr(w, name) / getattr(n, name) if getattr(n, name) else 1.0

    def sizes(measured: BlockShape, n: BlockShape, w: BlockShape) -> BlockShape:
        fields = ("parameters", "activation_bytes_per_sample", "output_bytes_per_sample")
        scaled = {name: round(getattr(measured, name) * ratio(n, w, name)) for name in fields}
        flops = measured.forward_flops_per_sample * ratio(n, w, "forward_flops_per_sample")
        return replace(measured, forward_flops_per_sample=flops, **scaled)

    (n_emb, n_layers, n_head), (w_emb, w_layers, w_head) = narrow, wide
    devices = {
        name: replace(
            times,
            embedding=times.embedding.scaled(ratio(n_emb, w_emb, "forward_flops_per_sample")),
            layers=tuple(t.scaled(ratio(n, w, "forward_flops_per_sample")) for t, n, w in zip(times.layers, n_layers, w_layers)),
            head=times.head.scaled(ratio(n_head, w_head, "forward_flops_per_sample")),
        )
        for name, times in profile.devices.items()
    }
    return replace(
        profile,
        model=f"{profile.model} scaled to width {config.run_width}",
        embedding=sizes(profile.embedding, n_emb, w_emb),
        layers=tuple(sizes(m, n, w) for m, n, w in zip(profile.layers, n_layers, w_layers)),
        head=sizes(profile.head, n_head, w_head),
        devices=devices,
    )


def _honest_worker(rank: int, out_dir: Path, config: HonestConfig) -> dict:
    """Start-up on the narrow model, start-up on the wide one, then the wide one trained on the plan made
    from the narrow profile, scaled (collective; rank 0's result)."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from zorse_lightning.planner.cost.context import CostContext
    from zorse_lightning.planner.cost.evaluate import plan_cost
    from zorse_lightning.planner.options import PlannerOptions
    from zorse_lightning.planner.search import make_plan
    from zorse_lightning.startup.profiled_sizes import within_profiled_sizes
    from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

    bench = config.bench
    world_size = load_cluster(HONEST_CLUSTER).world_size
    options = PlannerOptions(solver_time_limit_s=bench.solver_time_limit_s)
    loader = DataLoader(bench.dataset(world_size), batch_size=bench.per_rank_batch, shuffle=True)

    def start_up(width: int) -> ZorseStrategy:
        """One step, for start-up's profile of the model at ``width`` and the plan made from it."""
        strategy = ZorseStrategy(cluster=HONEST_CLUSTER, planner_options=options)
        one_step = replace(bench, warmup=1, steps=0)
        hetero_throughput._trainer(strategy, world_size, one_step, [], str(out_dir)).fit(
            config.model(width), train_dataloaders=loader)
        return strategy

    narrow, wide = start_up(config.profile_width), start_up(config.run_width)
    box: list = [None]
    if rank == 0:
        scaled = width_scaled_profile(narrow.startup.profile, config)
        box[0] = make_plan(narrow.startup.inventory, scaled, world_size * bench.per_rank_batch,
                           within_profiled_sizes(options)[0])
    dist.broadcast_object_list(box, src=0)
    plan = box[0]
    clock = hetero_throughput.StepClock(lambda trainer: trainer.strategy.emulation.emulator)
    run = ZorseStrategy(cluster=HONEST_CLUSTER, plan=plan)
    hetero_throughput._trainer(run, world_size, bench, [clock], str(out_dir)).fit(
        config.model(config.run_width), train_dataloaders=loader)
    overruns = hetero_throughput._per_rank(run, run.emulation.emulator)
    if rank != 0:
        return {}
    scaled_cost = plan_cost(CostContext.build(narrow.startup.inventory, scaled), plan)
    on_run_profile = plan_cost(CostContext.build(wide.startup.inventory, wide.startup.profile), plan)
    timed_steps = len(clock.emulated_s) - bench.warmup

    def parts(cost) -> dict[str, float]:
        return {"pipeline_ms": round(cost.pipeline_ms, 1), "sync_ms": round(cost.sync_ms, 1), "update_ms": round(cost.update_ms, 1)}

    def layer_forward_ms(profile: ModelProfile) -> dict[str, float]:
        return {t: round(d.layers[0].forward.at(plan.microbatch_size), 2) for t, d in profile.devices.items()}

    return {
        "predicted_ms": plan.predicted.iteration_ms,
        "measured_ms": clock.median_step_s(bench.warmup) * 1000.0,
        "predicted_on_run_profile_ms": round(on_run_profile.iteration_ms, 1),
        "predicted_parts": {"scaled": parts(scaled_cost), "on_run_profile": parts(on_run_profile)},
        "rank0_emulated_compute_ms_per_step": round(
            (clock.emulated_s[-1] - clock.emulated_s[bench.warmup - 1]) * 1000.0 / timed_steps, 1),
        "emulation_overrun_s_per_rank": overruns["total_s"],
        "layer_forward_ms": {"scaled": layer_forward_ms(scaled), "measured_at_run_width": layer_forward_ms(wide.startup.profile)},
        "plan": {"microbatch_size": plan.microbatch_size,
                 "stages": [{"ranks": list(s.ranks), "layers": list(s.layers), "microbatches": list(s.microbatches_per_rank)}
                            for s in plan.stages]},
        "run_width_plan_predicted_ms": round(wide.plan.predicted.iteration_ms, 1),
    }


def honest_plans(config: HonestConfig) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        result = spawn_ranks(_honest_worker, load_cluster(HONEST_CLUSTER).world_size, out_dir, config)[0]
    kind = f"profiled at width {config.profile_width}, run at width {config.run_width} (the cost model's scaling)"
    entry = _entry(f"{HONEST_CLUSTER}/width{config.profile_width}->{config.run_width}", kind,
                   result.pop("predicted_ms"), result.pop("measured_ms"), **result)
    print(f"honest: {entry}", file=sys.stderr)
    return [entry]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clusters", nargs="*", default=list(hetero_throughput.CLUSTERS))
    parser.add_argument("--link-cases", nargs="*", default=["two_machines_100mbit"], choices=list(slow_link.CASES))
    parser.add_argument("--honest", action=argparse.BooleanOptionalAction, default=True,
                        help="the case whose profile is taken on another model width than the run's")
    parser.add_argument("--profile-width", type=int, default=HonestConfig.profile_width)
    parser.add_argument("--run-width", type=int, default=HonestConfig.run_width)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps after warm-up (the median is kept)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    bench = replace(hetero_throughput.BenchConfig(), warmup=args.warmup, steps=args.steps)
    plans = emulated_plans(args.clusters, bench)
    if args.honest:
        plans += honest_plans(HonestConfig(args.profile_width, args.run_width, bench))
    if args.link_cases and os.geteuid() != 0:
        print("slow-link cases skipped: network namespaces need root", file=sys.stderr)
    elif args.link_cases:
        plans += slow_link_plans(args.link_cases, replace(slow_link.BenchConfig(), warmup=args.warmup, steps=args.steps))
    print(f"fidelity: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(json.dumps({"plans": plans}))


if __name__ == "__main__":
    main()

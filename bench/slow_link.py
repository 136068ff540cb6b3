"""A slow link between machines: the planner's plan against data parallel across the link.

    .venv/bin/python -m bench.slow_link                 # as root (network namespaces); about 5 minutes
    .venv/bin/python -m bench.slow_link --collectives   # bare gloo collectives across the link; 1-2 minutes

Each case is two "machines" (network namespaces, :mod:`testing.netns`)
of two emulated CPU ranks each, joined by a link shaped with ``tc ... tbf``:

- ``two_machines_100mbit``: two alike machines (an A100 and a V100 each), 100 Mbit/s;
- ``two_datacenters_25mbit``: two A100s in one datacenter, two V100s in the
  other, 25 Mbit/s between them (no added delay: this kernel has no ``netem``).

torchrun starts the ranks inside the namespaces, master on machine 0's address;
the inventory the strategy gets describes the same links. Two Trainers run in
one process group:

- plan: ``ZorseStrategy(cluster=...)``, which profiles the blocks at start-up
  (each type through its emulation) and runs the planner's choice;
- dp: ``ZorseStrategy(cluster=..., plan=dp)``, the planner's best *data
  parallel* plan over every rank (``PlannerOptions(allow_pipeline=False,
  allow_idle_ranks=False)``, same start-up profile, microbatch sizes within the
  profiled ones as the strategy's own), so its synchronisation crosses the link: every rank holds the whole model, microbatches split by speed, the
  gradients synchronised over the slow link. This is ZorseStrategy's data
  parallelism, not ``strategy="ddp"`` (which would also need equal batches on
  unequal ranks); ``bench/overhead.py`` compares the two engines.

The model (a GPT of 12.9 MB of float32 parameters, sequences of 32 tokens, 16
samples a step) has gradients about 25 times larger than the activations that
cross a stage boundary per step (0.5 MB each way), so where the gradient sync
crosses the link matters. Throughput is the global batch over rank 0's median
step time after ``--warmup`` steps; ``predicted_error_pct`` compares each plan's
predicted iteration time with that median. ``link_bytes_per_step`` is what
machine 0 sent over the link per timed step (its shaper's counter),
``emulated_compute_ms_per_rank`` each rank's emulated compute per timed step
(the synthetic GPU time: what is left of a step is communication and waiting),
``emulation_overrun_ms_per_rank`` by how much real CPU compute passed the
emulation's deadlines per timed step (contention for the CPU: the emulated GPU
ran slower than its type, which no prediction follows), and
``predicted_pipeline_ms`` / ``predicted_sync_ms`` / ``predicted_update_ms`` the
cost model's parts of the prediction, with ``predicted_stages`` (each rank's
forward and backward of one microbatch, each stage's compute per iteration) and
``predicted_boundary_transfer_ms`` (one activation across each boundary). The start-up profile and the run use the same emulated
costs (calibrated once at start-up, ranks one at a time), so the run's
emulated compute is the prediction's compute; what is left of a miss is the
model of communication and schedule. The last
line printed is one JSON object: ``{"cases": [{"case", "link_mbit",
"plan_samples_per_s", "dp_samples_per_s", "predicted_error_pct", ...}]}``.

``--collectives`` times, instead of training, the collectives the engine's
synchronisation is made of, bare, among the case's ranks (gloo, one process
per rank, ``--collective-bytes`` each): an all-reduce, a reduce into each rank
and a broadcast from each rank, the median of ``--collective-repeats`` between
barriers, against the cost model's price of the same collective on the same
inventory (:class:`zorse_lightning.planner.cost.comm.LinkTable`), with the bytes each
machine sent over its link. This is the measurement that found what the model
missed across a slow link (``bench/README.md``). Last line: ``{"collectives":
[{"case", "collective", "rank", "num_bytes", "measured_ms", "predicted_ms",
"error_pct", "link_bytes_sent_per_machine"}]}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from testing.netns import NetnsCluster, NetnsMachine, NetnsNetwork
from zorse_lightning.units import gbps_to_mbps, mbps_to_gbps

CASES = {
    "two_machines_100mbit": NetnsCluster("two_machines_100mbit", (
        NetnsMachine("box0", ("a100x40", "v100x16"), link_gbps=mbps_to_gbps(100)),
        NetnsMachine("box1", ("a100x40", "v100x16"), link_gbps=mbps_to_gbps(100)),
    )),
    "two_datacenters_25mbit": NetnsCluster("two_datacenters_25mbit", (
        NetnsMachine("a100-box", ("a100x40", "a100x40"), link_gbps=mbps_to_gbps(25), datacenter="east"),
        NetnsMachine("v100-box", ("v100x16", "v100x16"), link_gbps=mbps_to_gbps(25), datacenter="west"),
    )),
}


@dataclass(frozen=True)
class BenchConfig:
    global_batch: int = 16
    warmup: int = 2
    steps: int = 5
    """Timed steps after warm-up (the median is kept)."""
    width: int = 256
    layers: int = 4
    seq_len: int = 32
    vocab: int = 256
    solver_time_limit_s: float = 2.0
    collective_bytes: int = 4 * 1024 * 1024
    """``--collectives``: bytes of each collective (the engine's gradient bucket)."""
    collective_repeats: int = 3
    """``--collectives``: timed repeats of each collective after one untimed (the median is kept)."""
    emulation_slowdown: float = 5.0
    """The fastest emulated type's slowdown (ZorseStrategy's ``emulation_slowdown``). Above the default 3:
    here four ranks compute at once on two cores, and at 3 the emulated A100s overran their deadlines by up
    to 130 ms a step (``emulation_overrun_ms_per_rank``), so the run no longer emulated what was profiled;
    at 5 overruns stay near 10 ms. Prediction and run use the same slowdown."""


def _worker(cluster_file: str, config: BenchConfig, out_dir: str) -> None:
    """One rank (started by torchrun inside a namespace): both Trainers, results from rank 0."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from zorse_lightning.cluster.config import load_cluster
    from zorse_lightning.strategy.environment import HeterogeneousEnvironment
    from zorse_lightning.startup.profiled_sizes import within_profiled_sizes
    from zorse_lightning.strategy.zorse_strategy import ZorseStrategy
    from zorse_lightning.models.gpt import GPT
    from zorse_lightning.planner.cost.context import CostContext
    from zorse_lightning.planner.cost.evaluate import plan_cost
    from zorse_lightning.planner.options import PlannerOptions
    from zorse_lightning.planner.search import make_plan
    from testing.launch import leave_world
    from testing.netns import uplink_sent_bytes
    from testing.timing import StepTimer

    torch.set_num_threads(1)
    mapping = json.loads(Path(cluster_file).read_text())
    inventory = load_cluster(mapping)
    environment = HeterogeneousEnvironment()
    count = config.global_batch * (config.warmup + config.steps)
    tokens = torch.randint(0, config.vocab, (count, config.seq_len + 1), generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    probe_steps = {config.warmup - 1, config.warmup + config.steps - 1}

    def fit(strategy: ZorseStrategy) -> dict:
        """Rank 0's median step, machine 0's bytes sent and every rank's emulated compute per timed step."""
        def probe(step: int) -> tuple[int, float, float] | None:
            emulator = strategy.emulation.emulator
            return (uplink_sent_bytes(), emulator.emulated_compute_s, emulator.overrun_s) if step in probe_steps else None

        timer = StepTimer(probe)
        trainer = pl.Trainer(
            strategy=strategy, accelerator="cpu", devices=environment.local_world_size(),
            num_nodes=len(inventory.machines), max_steps=config.warmup + config.steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, callbacks=[timer],
        )
        torch.manual_seed(0)
        model = GPT(vocab_size=config.vocab, seq_len=config.seq_len, width=config.width, layers=config.layers, heads=4)
        loader = DataLoader(dataset, batch_size=config.global_batch // inventory.world_size, shuffle=True)
        trainer.fit(model, train_dataloaders=loader)
        (sent_0, compute_0, overrun_0), (sent_1, compute_1, overrun_1) = [p for p in timer.probes if p is not None]
        per_rank = [(0.0, 0.0)] * inventory.world_size
        dist.all_gather_object(per_rank, (round((compute_1 - compute_0) * 1000.0 / config.steps, 1),
                                          round((overrun_1 - overrun_0) * 1000.0 / config.steps, 1)))
        return {
            "measured_ms": timer.median_step_s(config.warmup) * 1000.0,
            "link_bytes_per_step": round((sent_1 - sent_0) / config.steps),
            "emulated_compute_ms_per_rank": [compute for compute, _ in per_rank],
            "emulation_overrun_ms_per_rank": [overrun for _, overrun in per_rank],
        }

    options = PlannerOptions(solver_time_limit_s=config.solver_time_limit_s)
    planned = ZorseStrategy(cluster=mapping, planner_options=options, emulation_slowdown=config.emulation_slowdown)
    measured = {"plan": fit(planned)}
    dp = None
    if environment.global_rank() == 0:
        dp_options, _ = within_profiled_sizes(PlannerOptions(
            solver_time_limit_s=config.solver_time_limit_s, allow_pipeline=False, allow_idle_ranks=False,
            no_pipeline_reason="the data-parallel baseline of bench/slow_link.py",
        ))
        dp = make_plan(planned.startup.inventory, planned.startup.profile, config.global_batch, dp_options)
    box = [dp]
    dist.broadcast_object_list(box, src=0)
    dp = box[0]
    measured["dp"] = fit(ZorseStrategy(cluster=mapping, plan=dp, emulation_slowdown=config.emulation_slowdown))
    if environment.global_rank() == 0:
        context = CostContext.build(planned.startup.inventory, planned.startup.profile)
        result = {}
        for name, plan in (("plan", planned.plan), ("dp", dp)):
            cost = plan_cost(context, plan)
            result[name] = {
                **measured[name],
                "predicted_ms": plan.predicted.iteration_ms,
                "predicted_pipeline_ms": cost.pipeline_ms,
                "predicted_sync_ms": cost.sync_ms,
                "predicted_update_ms": cost.update_ms,
                "predicted_stages": [
                    {"forward_ms": [round(t.forward_ms, 2) for t in s.times],
                     "backward_ms": [round(t.backward_ms, 2) for t in s.times], "busy_ms": round(s.busy_ms, 1)}
                    for s in cost.stages
                ],
                "predicted_boundary_transfer_ms": [round(b.transfer_ms, 2) for b in cost.boundaries],
                "samples_per_s": plan.global_batch_size / measured[name]["measured_ms"] * 1000.0,
                "microbatch_size": plan.microbatch_size,
                "layout": [
                    {"ranks": list(s.ranks), "layers": list(s.layers), "microbatches": list(s.microbatches_per_rank),
                     "sharding": s.sharding.value}
                    for s in plan.stages
                ],
            }
        Path(out_dir, "result.json").write_text(json.dumps(result))
    leave_world()


def _collectives_worker(cluster_file: str, config: BenchConfig, out_dir: str) -> None:
    """One rank: bare collectives among all ranks, timed between barriers; rank 0 writes the results."""
    import statistics

    import torch
    import torch.distributed as dist

    from testing.launch import leave_world
    from testing.netns import uplink_sent_bytes
    from zorse_lightning.cluster.config import load_cluster
    from zorse_lightning.planner.cost.comm import LinkTable

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    inventory = load_cluster(json.loads(Path(cluster_file).read_text()))
    links, ranks = LinkTable(inventory), tuple(range(world))
    first_of_machine = [inventory.ranks_by_machine[m][0] for m in inventory.ranks_by_machine]
    buffer = torch.ones(config.collective_bytes // 4)

    def one_hot(root: int) -> tuple[float, ...]:
        """The whole message owned by ``root``: the model's price of one reduce into it or broadcast from it."""
        return tuple(1.0 if r == root else 0.0 for r in ranks)

    cases = [("all_reduce", None, lambda: dist.all_reduce(buffer), links.all_reduce_ms(ranks, buffer.nbytes))]
    cases += [("reduce", root, lambda root=root: dist.reduce(buffer, dst=root),
               links.to_owners_ms(ranks, buffer.nbytes, one_hot(root))) for root in ranks]
    cases += [("broadcast", root, lambda root=root: dist.broadcast(buffer, src=root),
               links.from_owners_ms(ranks, buffer.nbytes, one_hot(root))) for root in ranks]
    results = []
    for name, root, collective, predicted_ms in cases:
        times_ms, sent = [], []
        for repeat in range(config.collective_repeats + 1):
            dist.barrier()
            sent_before, started = uplink_sent_bytes(), time.perf_counter()
            collective()
            dist.barrier()
            if repeat > 0:
                times_ms.append((time.perf_counter() - started) * 1000.0)
                sent.append(uplink_sent_bytes() - sent_before)
        per_rank = [0] * world
        dist.all_gather_object(per_rank, round(statistics.median(sent)))
        measured_ms = statistics.median(times_ms)
        results.append({
            "collective": name, "rank": root, "num_bytes": buffer.nbytes, "measured_ms": round(measured_ms, 1),
            "predicted_ms": round(predicted_ms, 1), "error_pct": round(100.0 * (predicted_ms - measured_ms) / measured_ms, 1),
            "link_bytes_sent_per_machine": [per_rank[r] for r in first_of_machine],
        })
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(results))
    leave_world()


def bench_collectives(cluster: NetnsCluster, config: BenchConfig) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir, NetnsNetwork(cluster) as net:
        cluster_file = Path(out_dir, "cluster.json")
        cluster_file.write_text(json.dumps(cluster.inventory_mapping()))
        config_args = [f"--{k.replace('_', '-')}={v}" for k, v in asdict(config).items()]
        net.torchrun(["-m", "bench.slow_link", "--collectives", "--worker", str(cluster_file), out_dir, *config_args],
                     log_dir=Path(out_dir), timeout_s=400)
        results = json.loads(Path(out_dir, "result.json").read_text())
    link_mbit = gbps_to_mbps(min(m.link_gbps for m in cluster.machines))
    return [{"case": cluster.name, "link_mbit": link_mbit, **r} for r in results]


def _error_pct(run: dict) -> float:
    return round(100.0 * (run["predicted_ms"] - run["measured_ms"]) / run["measured_ms"], 1)


def bench_case(cluster: NetnsCluster, config: BenchConfig) -> dict:
    with tempfile.TemporaryDirectory() as out_dir, NetnsNetwork(cluster) as net:
        cluster_file = Path(out_dir, "cluster.json")
        cluster_file.write_text(json.dumps(cluster.inventory_mapping()))
        config_args = [f"--{k.replace('_', '-')}={v}" for k, v in asdict(config).items()]
        net.torchrun(["-m", "bench.slow_link", "--worker", str(cluster_file), out_dir, *config_args], log_dir=Path(out_dir),
                     env={"PYTHONFAULTHANDLER": "1"}, timeout_s=400)
        runs = json.loads(Path(out_dir, "result.json").read_text())
    plan, dp = runs["plan"], runs["dp"]
    slowest_gbps = min(m.link_gbps for m in cluster.machines)
    return {
        "case": cluster.name,
        "link_mbit": gbps_to_mbps(slowest_gbps),
        "plan_samples_per_s": round(plan["samples_per_s"], 3),
        "dp_samples_per_s": round(dp["samples_per_s"], 3),
        "plan_over_dp": round(plan["samples_per_s"] / dp["samples_per_s"], 3),
        "predicted_error_pct": _error_pct(plan),
        "dp_predicted_error_pct": _error_pct(dp),
        "plan": {k: round(v, 1) if isinstance(v, float) else v for k, v in plan.items()},
        "dp": {k: round(v, 1) if isinstance(v, float) else v for k, v in dp.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--collectives", action="store_true", help="time bare collectives across the link instead")
    parser.add_argument("--worker", nargs=2, metavar=("CLUSTER_JSON", "OUT_DIR"), help=argparse.SUPPRESS)
    defaults = BenchConfig()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    cases, worker, collectives = args.pop("cases"), args.pop("worker"), args.pop("collectives")
    config = BenchConfig(**args)
    if worker is not None:
        (_collectives_worker if collectives else _worker)(worker[0], config, worker[1])
        return
    if collectives:
        rows = []
        for name in cases:
            rows += bench_collectives(CASES[name], config)
            for row in rows[-(1 + 2 * CASES[name].world_size):]:
                print(row, file=sys.stderr)
        print(json.dumps({"collectives": rows}))
        return
    results = []
    for name in cases:
        started = time.perf_counter()
        results.append(bench_case(CASES[name], config))
        print(f"{name}: {time.perf_counter() - started:.0f} s, {results[-1]}", file=sys.stderr)
    print(json.dumps({"cases": results}))


if __name__ == "__main__":
    main()

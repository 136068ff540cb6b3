"""Does the search miss a structure a peer planner would pick? The structures peers build, pinned and
priced in our own model, against the plan the search makes.

    .venv/bin/python -m bench.peer_structures                                   # about 15 minutes
    .venv/bin/python -m bench.peer_structures --clusters four16 --models llama_3b llama_7b

Peer planners (Zorse's among them) make one pipeline group of each whole machine, or of each GPU type,
and choose the groups' order, the microbatch size and the interleaving degree. For each cluster and
model (global batch 32 samples per GPU, sequence length 512, float16) the bench pins each such
grouping in every order (up to four groups; beyond, fastest first, fastest last and slowest first) at
microbatch sizes 1, 2, 4 and 8, lets the planner fill in the rest (layer split, shares, sharding,
activations, interleaving up to 4), and keeps the fastest that fits. Clusters: the shipped ones named
by ``--clusters`` and ``four16`` (:func:`testing.synthetic_cluster.four_machines_four_types`, the shape
of the peers' plans in issue 30). Goal (issue 30): no pinned structure faster than the plan by more
than 1 %. The last line printed is one JSON object: ``{"cases": [...], "worst_ratio", "over_1pct"}``,
each case ``{"cluster", "model", "plan_ms", "pinned_ms", "pinned", "ratio"}`` (ratio: plan / best
pinned; None where no pinned structure fits).
"""

from __future__ import annotations

import argparse
import itertools
import json
import warnings

from rich.console import Console
from rich.progress import Progress

from testing.synthetic_cluster import four_machines_four_types
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner import CostContext, PlannerOptions, make_plan
from zorse_lightning.planner.search.heuristic import speed_by_type
from zorse_lightning.profiling import MixedProfileSourcesWarning, reference_profile

CLUSTERS = ("four16", "a100x4_v100x4", "a10g_l4_t4", "lab4_l4_a6000_p40", "dc2_a100x8_v100x8", "mix32_4types")
MODELS = ("llama_tiny", "llama_3b", "llama_7b", "llama_13b", "gpt_1.3b", "gpt_2.7b", "gpt_6.7b")
SAMPLES_PER_GPU = 32
MICROBATCH_SIZES = (1, 2, 4, 8)
ALL_ORDERS_UP_TO = 4


def _cluster(name: str) -> ClusterInventory:
    return four_machines_four_types() if name == "four16" else load_cluster(name)


def _groupings(inventory: ClusterInventory) -> dict[str, list[tuple[int, ...]]]:
    by_machine: dict[str, list[int]] = {}
    by_type: dict[str, list[int]] = {}
    for rank, gpu in enumerate(inventory.gpus):
        by_machine.setdefault(gpu.machine, []).append(rank)
        by_type.setdefault(gpu.gpu_type.name, []).append(rank)
    return {"machines": [tuple(r) for r in by_machine.values()], "types": [tuple(r) for r in by_type.values()]}


def _orders(groups: list[tuple[int, ...]], speed: dict[int, float]) -> list[tuple[tuple[int, ...], ...]]:
    if len(groups) <= ALL_ORDERS_UP_TO:
        return list(itertools.permutations(groups))
    fastest_first = sorted(groups, key=lambda g: -speed[g[0]])
    return [tuple(fastest_first), tuple(fastest_first[1:] + fastest_first[:1]), tuple(reversed(fastest_first))]


def run_case(cluster: str, model: str) -> dict:
    inventory = _cluster(cluster)
    profile = reference_profile(model, [t.name for t in inventory.gpu_types], 512, "float16")
    batch = SAMPLES_PER_GPU * inventory.world_size
    try:
        plan_ms = make_plan(inventory, profile, batch).predicted.iteration_ms
    except PlanningError:
        plan_ms = None
    by_type = speed_by_type(CostContext.build(inventory, profile))
    speed = {rank: by_type[gpu.gpu_type.name] for rank, gpu in enumerate(inventory.gpus)}
    best = None
    for grouping, groups in _groupings(inventory).items():
        for order in _orders(groups, speed):
            for m in (m for m in MICROBATCH_SIZES if batch % m == 0):
                try:
                    pinned = make_plan(inventory, profile, batch, PlannerOptions(stage_layout=order, microbatch_size=m))
                except PlanningError:
                    continue
                if best is None or pinned.predicted.iteration_ms < best["pinned_ms"]:
                    best = {
                        "pinned_ms": pinned.predicted.iteration_ms,
                        "pinned": f"{grouping}: {' > '.join(inventory.gpus[g[0]].gpu_type.name for g in order)}, "
                                  f"microbatch {m}, x{pinned.interleave}",
                    }
    ratio = plan_ms / best["pinned_ms"] if best and plan_ms else None
    return {"cluster": cluster, "model": model, "plan_ms": plan_ms, **(best or {"pinned_ms": None, "pinned": None}), "ratio": ratio}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clusters", nargs="+", default=list(CLUSTERS))
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", MixedProfileSourcesWarning)  # expected: the reference data has holes
    console, cases = Console(), []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("pinning", total=len(args.clusters) * len(args.models))
        for cluster in args.clusters:
            for model in args.models:
                progress.update(task, description=f"{cluster} / {model}")
                case = run_case(cluster, model)
                cases.append(case)
                ratio = "-" if case["ratio"] is None else f"{case['ratio']:.4f}"
                console.print(f"{cluster}/{model}: plan {case['plan_ms'] and round(case['plan_ms'], 1)} ms, best pinned "
                              f"{case['pinned_ms'] and round(case['pinned_ms'], 1)} ms ({case['pinned']}), plan / pinned {ratio}")
                progress.advance(task)
    ratios = [c["ratio"] for c in cases if c["ratio"] is not None]
    result = {"cases": cases, "worst_ratio": max(ratios, default=None), "over_1pct": sum(r > 1.01 for r in ratios)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

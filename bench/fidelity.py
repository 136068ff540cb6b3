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
import time
from dataclasses import replace

from bench import hetero_throughput, slow_link


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clusters", nargs="+", default=list(hetero_throughput.CLUSTERS))
    parser.add_argument("--link-cases", nargs="*", default=["two_machines_100mbit"], choices=list(slow_link.CASES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps after warm-up (the median is kept)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    plans = emulated_plans(args.clusters, replace(hetero_throughput.BenchConfig(), warmup=args.warmup, steps=args.steps))
    if args.link_cases and os.geteuid() != 0:
        print("slow-link cases skipped: network namespaces need root", file=sys.stderr)
    elif args.link_cases:
        plans += slow_link_plans(args.link_cases, replace(slow_link.BenchConfig(), warmup=args.warmup, steps=args.steps))
    print(f"fidelity: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(json.dumps({"plans": plans}))


if __name__ == "__main__":
    main()

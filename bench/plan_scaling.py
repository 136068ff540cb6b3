"""How long does planning take as the cluster grows? ``plan.planner_seconds`` at 8 to 1024 GPUs.

    .venv/bin/python -m bench.plan_scaling
    .venv/bin/python -m bench.plan_scaling --gpus 8 32 --model llama_7b

Clusters: :func:`testing.synthetic_cluster.synthetic_cluster`, machines of 8 GPUs of
four types (A100-40GB, V100-16GB, A10G, T4) on links of three speeds (inside a
machine, inside a rack of four machines, between racks). Model: a reference model
(default ``llama_7b``, 32 layers: enough for deep pipelines, too big for plain data
parallel on the 16 GiB GPUs) at sequence length 512, float16; global batch
:data:`SAMPLES_PER_GPU` samples per GPU. Planner options are the defaults
(solver time limit 1 s per program, at most 8 programs, interleaving up to degree 4 where
the engine runs it; ``--interleaving`` / ``--no-interleaving`` overrides that for the run).

The time is the planner's own (search and solve; profile and inventory building
excluded), as ``python -m zorse_lightning.plan`` records it in plan.json, and the CPU
time spent planning, the integer programs' solver processes included (``cpu s``: about
the wall time on a quiet machine; the 2-core machines are shared). The last line printed is one JSON object:
``{"gpus": [...], "seconds": [...], "cpu_seconds": [...]}``. Goals (issue 3): at most
2 s at 32 GPUs and 60 s at 1024 GPUs, on a 2-core machine. The solver column says how
many of the plans the search priced were simulated (:mod:`zorse_lightning.planner.search.choice`).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

from rich.console import Console
from rich.table import Table

from testing.synthetic_cluster import synthetic_cluster
from zorse_lightning.planner import PlannerOptions, make_plan
from zorse_lightning.profiling import MixedProfileSourcesWarning, reference_profile

SIZES = (8, 32, 128, 512, 1024)
SAMPLES_PER_GPU = 2
"""Small enough that even the 8-GPU cluster needs accumulation only modestly; 2048 samples at 1024 GPUs."""
GOALS_S = {32: 2.0, 1024: 60.0}


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the solver runs in a process of its own)."""
    used = os.times()
    return used.user + used.system + used.children_user + used.children_system


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", nargs="+", type=int, default=list(SIZES))
    parser.add_argument("--model", default="llama_7b")
    parser.add_argument(
        "--interleaving", action=argparse.BooleanOptionalAction, default=True,
        help="let the planner interleave its plans where the engine runs them (--no-interleaving: max_interleave=1)",
    )
    args = parser.parse_args(argv)
    options = PlannerOptions() if args.interleaving else PlannerOptions(max_interleave=1)
    warnings.simplefilter("ignore", MixedProfileSourcesWarning)  # expected: the data has holes
    console = Console(width=None if Console().is_terminal else 140)
    table = Table(title=f"planning time, {args.model}, {SAMPLES_PER_GPU} samples per GPU")
    for column in ("GPUs", "machines", "global batch", "stages", "interleave", "microbatch", "predicted ms", "solver", "planner s", "cpu s", "goal s"):
        table.add_column(column, justify="left" if column == "solver" else "right")
    seconds, cpu_seconds = [], []
    for num_gpus in args.gpus:
        inventory = synthetic_cluster(num_gpus)
        profile = reference_profile(args.model, [t.name for t in inventory.gpu_types])
        batch = SAMPLES_PER_GPU * num_gpus
        with console.status(f"planning {num_gpus} GPUs"):
            cpu_started = _cpu_seconds()
            plan = make_plan(inventory, profile, batch, options)
            cpu_seconds.append(_cpu_seconds() - cpu_started)
        seconds.append(plan.planner_seconds)
        table.add_row(
            str(num_gpus),
            str(len(inventory.machines)),
            str(batch),
            str(plan.num_groups),
            str(plan.interleave),
            str(plan.microbatch_size),
            f"{plan.predicted.iteration_ms:,.1f}",
            plan.solver.status,
            f"{plan.planner_seconds:.2f}",
            f"{cpu_seconds[-1]:.2f}",
            str(GOALS_S.get(num_gpus, "")),
        )
    console.print(table)
    result = {"gpus": list(args.gpus), "seconds": seconds, "cpu_seconds": cpu_seconds}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

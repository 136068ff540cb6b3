"""How good are the planner's plans? Every shipped cluster x every reference model, in the
planner's own cost model, against each baseline and against a compute-only bound.

    .venv/bin/python -m bench.plan_quality                         # engine's defaults (idle ranks allowed)
    .venv/bin/python -m bench.plan_quality --no-allow-idle-ranks   # every GPU must work

Cases: each cluster in ``zorse_lightning/conf/cluster/*.yaml`` x each model of
:data:`MODELS` at sequence length 512, float16, global batch 32 samples per GPU
(``--samples-per-gpu``), so the batch grows with the cluster as data-parallel
users scale it: 256 to 1024 sequences of 512 tokens on 8 to 32 GPUs, 0.13 to
0.5 M tokens, below the 0.5 to 1 M tokens models of these sizes are trained
with (GPT-3's 1.3B to 6.7B: 1 to 2 M). Fewer samples per GPU make pipeline fill
and drain and per-microbatch intercepts, which the bound leaves out, weigh more:
at 8 samples per GPU the median ratio to the bound is about 1.6. A case where
neither the planner nor any baseline fits in memory (the reference models on the
emulated ``cpu_sim`` clusters, whose budgets are a few hundred MiB) is listed as
skipped, not counted.

The compute-only bound is ``global batch / sum over GPUs of 1 / (sum over layers of
forward + backward slope per sample on that GPU)``: every GPU busy all the time on
layers only, no intercepts, embedding, head, pipeline fill, communication or memory
limit. No plan can beat it in this cost model; the ratio plan / bound says how much
of the cluster's compute a plan leaves unused.

The last line printed is one JSON object: ``{"cases", "worse_than_a_baseline",
"missing_plans", "median_ratio_to_bound", "median_stages_per_plan",
"median_idle_gpus_per_plan", "per_case": [...], "allow_idle_ranks", "skipped"}``
(each case also gives its plan's stages, idle GPUs and sharding per stage: how the
plan is shaped, beside how fast it is). Goals (issue 3): 0, 0 and at most 1.5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from zorse_lightning.capabilities import SUPPORTS_IDLE_RANKS
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner import PlannerOptions, all_baselines, make_plan
from zorse_lightning.profiling import (
    MixedProfileSourcesWarning,
    ModelProfile,
    reference_profile,
)

CLUSTER_DIR = Path(__file__).resolve().parents[1] / "zorse_lightning" / "conf" / "cluster"
MODELS = ("llama_tiny", "llama_3b", "llama_7b", "llama_13b", "llama_33b", "gpt_1.3b", "gpt_2.7b", "gpt_6.7b")
SEQ_LEN = 512
DTYPE = "float16"
SAMPLES_PER_GPU = 32
SLACK = 1e-9
"""Relative tolerance when comparing a plan with a baseline (equal plans price equal)."""


@dataclass(frozen=True)
class Case:
    cluster: str
    model: str
    global_batch_size: int
    plan_ms: float | None
    baselines_ms: dict[str, float | None]
    bound_ms: float
    stages: int | None = None
    """Pipeline stages of the plan (None: no plan)."""
    idle_gpus: int | None = None
    """GPUs the plan leaves idle (None: no plan)."""
    sharding: str = ""
    """Each stage's sharding level (``full/microbatch``: gathered block by block per microbatch)."""

    @property
    def ratio_to_bound(self) -> float | None:
        return None if self.plan_ms is None else self.plan_ms / self.bound_ms

    @property
    def best_baseline_ms(self) -> float | None:
        return min((ms for ms in self.baselines_ms.values() if ms is not None), default=None)

    @property
    def worse_than_a_baseline(self) -> bool:
        best = self.best_baseline_ms
        return self.plan_ms is not None and best is not None and self.plan_ms > best * (1 + SLACK)

    @property
    def missing_plan(self) -> bool:
        return self.plan_ms is None and self.best_baseline_ms is not None

    @property
    def fits_somewhere(self) -> bool:
        return self.plan_ms is not None or self.best_baseline_ms is not None

    def as_json(self) -> dict:
        return {
            "cluster": self.cluster,
            "model": self.model,
            "global_batch_size": self.global_batch_size,
            "plan_ms": self.plan_ms,
            "baselines": self.baselines_ms,
            "bound_ms": self.bound_ms,
            "ratio_to_bound": self.ratio_to_bound,
            "stages": self.stages,
            "idle_gpus": self.idle_gpus,
            "sharding": self.sharding,
        }


def compute_bound_ms(inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int) -> float:
    """Iteration time if every GPU computed layers only, at its per-sample slope (see module docstring)."""
    per_sample_ms = {
        t.name: sum(l.forward.slope_ms + l.backward.slope_ms for l in profile.times(t.name).layers)
        for t in inventory.gpu_types
    }
    samples_per_ms = sum(1.0 / per_sample_ms[g.gpu_type.name] for g in inventory.gpus)
    return global_batch_size / samples_per_ms


def run_case(cluster: str, model: str, options: PlannerOptions, samples_per_gpu: int = SAMPLES_PER_GPU) -> Case:
    inventory = load_cluster(cluster)
    profile = reference_profile(model, [t.name for t in inventory.gpu_types], SEQ_LEN, DTYPE)
    batch = samples_per_gpu * inventory.world_size
    try:
        plan = make_plan(inventory, profile, batch, options)
    except PlanningError:
        plan = None
    baselines = {
        name: found and found.predicted.iteration_ms for name, found in all_baselines(inventory, profile, batch, options).items()
    }
    shape = {} if plan is None else {
        "stages": len(plan.stages),
        "idle_gpus": len(plan.idle_ranks),
        "sharding": ",".join(s.sharding_label for s in plan.stages),
    }
    return Case(
        cluster, model, batch, plan and plan.predicted.iteration_ms, baselines, compute_bound_ms(inventory, profile, batch), **shape
    )


def _ms(value: float | None) -> str:
    return "no fit" if value is None else f"{value:,.1f}"


def case_table(cases: list[Case], title: str) -> Table:
    baseline_names = list(cases[0].baselines_ms) if cases else []
    table = Table(title=title)
    columns = ("cluster", "model", "batch", "plan ms", *(f"{n} ms" for n in baseline_names), "bound ms", "plan/bound", "stages", "idle", "sharding")
    for column in columns:
        table.add_column(column, justify="left" if column in ("cluster", "model") else "right")
    for case in cases:
        mark = " [red](worse)[/red]" if case.worse_than_a_baseline else " [red](missing)[/red]" if case.missing_plan else ""
        ratio = case.ratio_to_bound
        table.add_row(
            case.cluster,
            case.model,
            str(case.global_batch_size),
            _ms(case.plan_ms) + mark,
            *(_ms(case.baselines_ms[n]) for n in baseline_names),
            _ms(case.bound_ms),
            "-" if ratio is None else f"{ratio:.2f}",
            "-" if case.stages is None else str(case.stages),
            "-" if case.idle_gpus is None else str(case.idle_gpus),
            case.sharding or "-",
        )
    return table


def summary(cases: list[Case], skipped: list[Case], allow_idle_ranks: bool) -> dict:
    ratios = [c.ratio_to_bound for c in cases if c.ratio_to_bound is not None]
    planned = [c for c in cases if c.stages is not None]
    return {
        "cases": len(cases),
        "worse_than_a_baseline": sum(c.worse_than_a_baseline for c in cases),
        "missing_plans": sum(c.missing_plan for c in cases),
        "median_ratio_to_bound": statistics.median(ratios) if ratios else None,
        "median_stages_per_plan": statistics.median(c.stages for c in planned) if planned else None,
        "median_idle_gpus_per_plan": statistics.median(c.idle_gpus for c in planned) if planned else None,
        "per_case": [c.as_json() for c in cases],
        "allow_idle_ranks": allow_idle_ranks,
        "skipped": [f"{c.cluster}/{c.model}" for c in skipped],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--allow-idle-ranks", action=argparse.BooleanOptionalAction, default=SUPPORTS_IDLE_RANKS,
        help="let plans leave the slowest GPU types idle (default: what the engine runs)",
    )
    parser.add_argument("--clusters", nargs="+", default=sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml")))
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--samples-per-gpu", type=int, default=SAMPLES_PER_GPU, help="global batch = this x GPUs")
    args = parser.parse_args(argv)
    options = PlannerOptions(allow_idle_ranks=args.allow_idle_ranks)
    console = Console(width=None if Console().is_terminal else 180)
    warnings.simplefilter("ignore", MixedProfileSourcesWarning)  # expected: the data has holes (issue 3, section 1)
    cases: list[Case] = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("planning", total=len(args.clusters) * len(args.models))
        for cluster in args.clusters:
            for model in args.models:
                progress.update(task, description=f"{cluster} / {model}")
                cases.append(run_case(cluster, model, options, args.samples_per_gpu))
                progress.advance(task)
    fitting = [c for c in cases if c.fits_somewhere]
    skipped = [c for c in cases if not c.fits_somewhere]
    console.print(case_table(fitting, f"plan quality (allow_idle_ranks={args.allow_idle_ranks}); ms per iteration"))
    result = summary(fitting, skipped, args.allow_idle_ranks)
    console.print(
        f"{result['cases']} cases ({len(skipped)} skipped: nothing fits); worse than a baseline: "
        f"{result['worse_than_a_baseline']}; missing plans: {result['missing_plans']}; "
        f"median plan / bound: {result['median_ratio_to_bound']:.3f}; median stages per plan: "
        f"{result['median_stages_per_plan']}; median idle GPUs per plan: {result['median_idle_gpus_per_plan']}"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

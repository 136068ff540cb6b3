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
at 8 samples per GPU the median ratio to the bound is about 1.57 (1.46 at 32). A case where
neither the planner nor any baseline fits in memory (the reference models on the
emulated ``cpu_sim`` clusters, whose budgets are a few hundred MiB) is listed as
skipped, not counted.

The compute-only bound is ``global batch / sum over GPUs of 1 / (sum over layers of
the layer's least forward + backward time per sample on that GPU)``, least over the
microbatch sizes a plan of the case may use (:func:`microbatch_sizes_of`), each priced
as the cost model prices it (measured points, else the line, floored at
``MIN_BLOCK_TIME_MS``): every GPU busy all the time on layers only, no embedding,
head, pipeline fill, communication or memory limit. Per-sample slopes are not a
bound: some reference profiles have negative intercepts (a line below its slope per
sample), and measured points lie below the line. Where a GPU type's layers differ, a
linear program assigns layer-samples to types instead (see :func:`compute_bound_ms`).
No plan can beat it in this cost model; the ratio plan / bound says how much of the
cluster's compute a plan leaves unused.

The integer programs: :func:`make_plan` records each program it solves
(:class:`~zorse_lightning.planner.search.ProgramLog`), with the heuristic split it
started from, both priced; ``ilp`` sums them up (see :func:`ilp_summary`).

The last line printed is one JSON object: ``{"cases", "worse_than_a_baseline",
"missing_plans", "median_ratio_to_bound", "median_ratio_to_used_bound", "median_stages_per_plan",
"median_idle_gpus_per_plan", "interleaved_plans", "ilp", "per_case": [...], "allow_idle_ranks",
"skipped"}`` (each case also gives its plan's ``simulated_ms`` (the prediction, the simulation of the
engine's programs; None where the closed form predicts it) and ``closed_form_ms`` (the closed form the
search screens candidates with), and its plan's stages, idle GPUs, sharding per stage and
interleaving degree with the planner's note on it: how the plan is shaped, beside how
fast it is, and its own ``ilp``; ``interleaved_plans``: plans per degree, 1 plain).
``--no-interleaving`` plans with ``max_interleave=1`` (never interleaved); by default
the planner interleaves where the engine runs it (``capabilities.SUPPORTS_INTERLEAVING``). Goals (issue 3): 0, 0
and at most 1.5. Tensor parallelism: ``--max-tp`` (1: none; each case gives its stages' degrees,
``tensor_parallel``), and ``--compare-tp`` plans each case with TP again at ``max_tp=1``: each case's
``tp_gain_pct``, and ``tensor_parallel_plans`` and ``median_tp_gain_pct_7b_13b`` (Llama 7B and 13B, GPT 6.7B)
in the summary (issue 38).
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from zorse_lightning.capabilities import SUPPORTS_IDLE_RANKS
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner import PlannerOptions, all_baselines, make_plan
from zorse_lightning.planner.search.choice import IDLE_MARGIN
from zorse_lightning.planner.cost.update import optimizer_step_ms
from zorse_lightning.planner.search import ProgramLog, ProgramRun
from zorse_lightning.planner.search.fit import EVEN_SPLIT
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
    used_bound_ms: float | None = None
    """The same bound over the GPUs the plan uses (its idle ones left out; None: no plan)."""
    step_bound_ms: float | None = None
    """A bound that also counts the optimizer step (:func:`compute_bound_ms` with ``with_step``)."""
    step_used_bound_ms: float | None = None
    """That bound over the GPUs the plan uses (None: no plan)."""
    stages: int | None = None
    """Pipeline stages of the plan (None: no plan)."""
    idle_gpus: int | None = None
    """GPUs the plan leaves idle (None: no plan)."""
    sharding: str = ""
    """Each stage's sharding level (``full/microbatch``: gathered block by block per microbatch)."""
    activations: str = ""
    """What each stage does with its activations (``keep``, ``recompute``, ``offload``)."""
    programs: tuple[ProgramRun, ...] = ()
    """The search's integer programs, each against its heuristic start."""
    idle_baselines: tuple[str, ...] = ()
    """Baselines whose plan leaves GPUs idle."""
    from_program: bool = False
    """The plan is an integer program's solution (not a heuristic split or an even split)."""
    interleave: int | None = None
    """The plan's chunks per group of ranks (None: no plan)."""
    interleave_note: str = ""
    """The planner's note on interleaving (the degree and gain, or why not)."""
    closed_form_ms: float | None = None
    """The plan in the cost model's closed form, which the search screens candidates with."""
    simulated_ms: float | None = None
    """The plan in the simulation of the engine's programs (None: predicted by the closed form, see its note)."""
    tensor_parallel: str = ""
    """Each stage's TP degree (1: its blocks not split)."""
    without_tp_ms: float | None = None
    """The plan of the same search with ``max_tp=1`` (``--compare-tp``; planned again only where the plan has
    TP, else the plan's own time); None: not compared, or nothing fits without TP."""

    @property
    def tp_gain_pct(self) -> float | None:
        """How much faster the plan is than the best plan without TP, in percent."""
        if self.plan_ms is None or self.without_tp_ms is None:
            return None
        return (self.without_tp_ms / self.plan_ms - 1) * 100

    @property
    def ratio_to_bound(self) -> float | None:
        return None if self.plan_ms is None else self.plan_ms / self.bound_ms

    @property
    def ratio_to_used_bound(self) -> float | None:
        """Plan against the bound over the GPUs it uses: how much of their compute it leaves unused. Not a
        ratio to a bound on every plan: the GPUs it idles could in principle help (the planner idles them
        only where every plan it found using them is slower by :data:`IDLE_MARGIN`)."""
        return None if self.plan_ms is None or self.used_bound_ms is None else self.plan_ms / self.used_bound_ms

    @property
    def ratio_to_step_bound(self) -> float | None:
        return None if self.plan_ms is None or self.step_bound_ms is None else self.plan_ms / self.step_bound_ms

    @property
    def ratio_to_step_used_bound(self) -> float | None:
        return None if self.plan_ms is None or self.step_used_bound_ms is None else self.plan_ms / self.step_used_bound_ms

    @property
    def best_baseline_ms(self) -> float | None:
        return min((ms for ms in self.baselines_ms.values() if ms is not None), default=None)

    @property
    def worse_than_a_baseline(self) -> bool:
        """Slower than a baseline; a baseline that leaves GPUs idle must be faster by the planner's margin
        (:data:`~zorse_lightning.planner.search.choice.IDLE_MARGIN`) than a plan using every GPU."""
        if self.plan_ms is None:
            return False
        for name, ms in self.baselines_ms.items():
            margin = IDLE_MARGIN if name in self.idle_baselines and not self.idle_gpus else 0.0
            if ms is not None and self.plan_ms * (1 - margin) > ms * (1 + SLACK):
                return True
        return False

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
            "used_bound_ms": self.used_bound_ms,
            "ratio_to_used_bound": self.ratio_to_used_bound,
            "step_bound_ms": self.step_bound_ms,
            "ratio_to_step_bound": self.ratio_to_step_bound,
            "step_used_bound_ms": self.step_used_bound_ms,
            "ratio_to_step_used_bound": self.ratio_to_step_used_bound,
            "stages": self.stages,
            "idle_gpus": self.idle_gpus,
            "sharding": self.sharding,
            "activations": self.activations,
            "interleave": self.interleave,
            "interleave_note": self.interleave_note,
            "closed_form_ms": self.closed_form_ms,
            "simulated_ms": self.simulated_ms,
            "tensor_parallel": self.tensor_parallel,
            "without_tp_ms": self.without_tp_ms,
            "tp_gain_pct": self.tp_gain_pct,
            "ilp": ilp_summary(list(self.programs)) | {"plan_from_program": self.from_program},
        }


def microbatch_sizes_of(global_batch_size: int, world_size: int, options: PlannerOptions) -> list[int]:
    """The microbatch sizes any plan of a case may use: the planner's and the baselines' sizes
    that divide the global batch, and the per-GPU batch (``data_parallel_equal``'s one microbatch)."""
    sizes = {m for m in options.microbatch_sizes if global_batch_size % m == 0}
    if global_batch_size % world_size == 0:
        sizes.add(global_batch_size // world_size)
    return sorted(sizes)


def layer_sample_ms(curve_pair, sizes: list[int]) -> float:
    """A block's least forward + backward time per sample over ``sizes``, each size priced as the cost
    model prices it (:meth:`TimeCurve.at`: measured points where present, else the line, floored at
    ``MIN_BLOCK_TIME_MS``): a line with a negative intercept is below its slope per sample."""
    return min((curve_pair.forward.at(m) + curve_pair.backward.at(m)) / m for m in sizes)


def compute_bound_ms(
    inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, sizes: list[int], idle: tuple[int, ...] = (),
    with_step: bool = False,
) -> float:
    """Iteration time if every GPU computed layers only, each layer at its least time per sample
    over the microbatch sizes ``sizes`` (see :func:`layer_sample_ms`), no GPU ever waiting.

    A lower bound in the cost model: a GPU's busy time is at least the sum over the microbatches
    it runs, through the layers it holds, of each layer's time at the plan's size (recomputation,
    embedding, head, fill and drain, transfers and the optimizer step only add), which is at least
    samples x that layer's least time per sample. When every layer of a GPU type costs the same
    (every reference profile), spreading the ``batch x layers`` layer-samples over the GPUs by speed
    gives ``batch / sum over GPUs of 1 / (sum over layers of its time per sample)``. When layers differ,
    a type may be relatively faster on some layers, so the bound is the linear program that assigns
    layer-samples to GPU types freely (:func:`_assignment_bound_ms`). ``idle``: ranks left out (the same
    bound over the GPUs a plan uses: no global bound, see :attr:`Case.ratio_to_used_bound`).

    ``with_step``: the optimizer step counted too. Every parameter of the model is stepped at least once,
    by a GPU that spends :func:`optimizer_step_ms` on it (its bytes at the GPU's memory bandwidth, or the
    rate it measured) besides its compute of the iteration, so the program also splits the model's
    parameters over the GPU types freely, each type's layer work and step work within ``count x T``.
    Still a bound: unsharded stages step their parameters on every rank, and a stage's step waits for its
    synchronisation.
    """
    gpus = [g for rank, g in enumerate(inventory.gpus) if rank not in idle]
    per_sample = {t.name: [layer_sample_ms(l, sizes) for l in profile.times(t.name).layers] for t in inventory.gpu_types}
    counts = {t: sum(g.gpu_type.name == t for g in gpus) for t in per_sample}
    if with_step:
        step_ms = {t.name: optimizer_step_ms(profile.times(t.name), t, 1.0) for t in inventory.gpu_types}
        return _assignment_bound_ms(per_sample, counts, global_batch_size, (step_ms, profile.total_parameters))
    if all(len(set(times)) <= 1 for times in per_sample.values()):
        samples_per_ms = sum(1.0 / sum(per_sample[g.gpu_type.name]) for g in gpus)
        return global_batch_size / samples_per_ms
    return _assignment_bound_ms(per_sample, counts, global_batch_size)


def _assignment_bound_ms(
    per_sample: dict[str, list[float]], counts: dict[str, int], global_batch_size: int,
    step: tuple[dict[str, float], float] | None = None,
) -> float:
    """Least T such that each layer's ``global_batch_size`` samples, split freely over GPU types, keep every
    type's work within ``count x T``: no plan assigns layers better. ``step``: (each type's optimizer step
    per parameter in ms, the model's parameters), the parameters split over the types as freely."""
    import pulp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3's notices of PuLP 4's API and CBC extra
        problem = pulp.LpProblem("compute_bound", pulp.LpMinimize)
        limit = pulp.LpVariable("T", lowBound=0)
        used = [t for t in per_sample if counts[t] > 0]
        share = {(t, l): pulp.LpVariable(f"x_{i}_{l}", lowBound=0) for i, t in enumerate(used) for l in range(len(per_sample[t]))}
        stepped = {t: pulp.LpVariable(f"p_{i}", lowBound=0) for i, t in enumerate(used)}
        problem += limit
        for l in range(len(next(iter(per_sample.values())))):
            problem += pulp.lpSum(share[t, l] for t in used) == global_batch_size
        if step is not None:
            problem += pulp.lpSum(stepped.values()) == step[1]
        for t in used:
            work = pulp.lpSum(share[t, l] * ms for l, ms in enumerate(per_sample[t]))
            if step is not None:
                work += stepped[t] * step[0][t]
            problem += work <= counts[t] * limit
        problem.solve(pulp.PULP_CBC_CMD(msg=False))
    return pulp.value(limit)


def run_case(
    cluster: str, model: str, options: PlannerOptions, samples_per_gpu: int = SAMPLES_PER_GPU, compare_tp: bool = False,
) -> Case:
    inventory = load_cluster(cluster)
    profile = reference_profile(model, [t.name for t in inventory.gpu_types], SEQ_LEN, DTYPE)
    batch = samples_per_gpu * inventory.world_size
    programs = ProgramLog()
    try:
        plan = make_plan(inventory, profile, batch, options, programs)
    except PlanningError:
        plan = None
    found_baselines = all_baselines(inventory, profile, batch, options)
    baselines = {name: found and found.predicted.iteration_ms for name, found in found_baselines.items()}
    idle_baselines = tuple(  # the fastest type alone is planned on its sub-cluster: the rest of this one idles
        name for name, found in found_baselines.items()
        if found is not None and (found.idle_ranks or found.world_size < inventory.world_size)
    )
    shape = {} if plan is None else {
        "stages": len(plan.stages),
        "idle_gpus": len(plan.idle_ranks),
        "sharding": ",".join(s.sharding_label for s in plan.stages),
        "activations": ",".join(s.activations_label for s in plan.stages),
        "from_program": not plan.solver.status.startswith(("no program beat", EVEN_SPLIT.status)),
        "interleave": plan.interleave,
        "interleave_note": next((n for n in plan.notes if "interleaved" in n), ""),
        "closed_form_ms": plan.predicted.closed_form_ms or plan.predicted.iteration_ms,
        "simulated_ms": plan.predicted.iteration_ms if plan.predicted.closed_form_ms is not None else None,
        "tensor_parallel": ",".join(str(s.tensor_parallel) for s in plan.stages),
    }
    if compare_tp and plan is not None:
        shape["without_tp_ms"] = plan.predicted.iteration_ms if all(s.tensor_parallel == 1 for s in plan.stages) else _without_tp_ms(
            inventory, profile, batch, options)
    sizes = microbatch_sizes_of(batch, inventory.world_size, options)
    bound = compute_bound_ms(inventory, profile, batch, sizes)
    used_bound = plan and compute_bound_ms(inventory, profile, batch, sizes, plan.idle_ranks)
    return Case(
        cluster, model, batch, plan and plan.predicted.iteration_ms, baselines, bound, used_bound,
        step_bound_ms=compute_bound_ms(inventory, profile, batch, sizes, with_step=True),
        step_used_bound_ms=plan and compute_bound_ms(inventory, profile, batch, sizes, plan.idle_ranks, with_step=True),
        programs=tuple(programs.runs), idle_baselines=idle_baselines, **shape,
    )


def _without_tp_ms(inventory: ClusterInventory, profile: ModelProfile, batch: int, options: PlannerOptions) -> float | None:
    try:
        return make_plan(inventory, profile, batch, replace(options, max_tp=1)).predicted.iteration_ms
    except PlanningError:
        return None


def _ms(value: float | None) -> str:
    return "no fit" if value is None else f"{value:,.1f}"


def case_table(cases: list[Case], title: str) -> Table:
    baseline_names = list(cases[0].baselines_ms) if cases else []
    table = Table(title=title)
    columns = ("cluster", "model", "batch", "plan ms", "closed form ms", *(f"{n} ms" for n in baseline_names), "bound ms", "plan/bound", "stages", "idle", "interleave", "sharding", "activations")
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
            _ms(case.closed_form_ms),
            *(_ms(case.baselines_ms[n]) for n in baseline_names),
            _ms(case.bound_ms),
            "-" if ratio is None else f"{ratio:.2f}",
            "-" if case.stages is None else str(case.stages),
            "-" if case.idle_gpus is None else str(case.idle_gpus),
            "-" if case.interleave is None else str(case.interleave),
            case.sharding or "-",
            case.activations or "-",
        )
    return table


def ilp_summary(runs: list[ProgramRun]) -> dict:
    """What the integer programs added: ``programs`` solved; ``compared``: those with a heuristic
    start and a solution that fits (both priced); ``improved`` / ``worse``: faster / slower than
    their start; median, max and min relative gain over the compared ones (percent, negative: slower)
    and the median over the improving ones; ``beat_best``: faster than every plan the search
    held before it; ``no_solution``: infeasible or out of memory once priced."""
    gains = [r.gain for r in runs if r.gain is not None]
    improving = [g for g in gains if g > SLACK]
    pct = lambda values, f: None if not values else round(100 * f(values), 3)  # noqa: E731
    return {
        "programs": sum(r.solves for r in runs),
        "compared": len(gains),
        "improved": len(improving),
        "worse": sum(g < -SLACK for g in gains),
        "median_gain_pct": pct(gains, statistics.median),
        "median_gain_pct_of_improving": pct(improving, statistics.median),
        "max_gain_pct": pct(gains, max),
        "min_gain_pct": pct(gains, min),
        "beat_best": sum(
            r.plan_ms is not None and (r.best_before_ms is None or r.plan_ms < r.best_before_ms * (1 - SLACK)) for r in runs
        ),
        "no_solution": sum(r.plan_ms is None for r in runs),
    }


def _median(values) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summary(cases: list[Case], skipped: list[Case], allow_idle_ranks: bool) -> dict:
    ratios = [c.ratio_to_bound for c in cases if c.ratio_to_bound is not None]
    planned = [c for c in cases if c.stages is not None]
    return {
        "cases": len(cases),
        "worse_than_a_baseline": sum(c.worse_than_a_baseline for c in cases),
        "missing_plans": sum(c.missing_plan for c in cases),
        "median_ratio_to_bound": statistics.median(ratios) if ratios else None,
        "median_ratio_to_used_bound": statistics.median(used) if (used := [
            c.ratio_to_used_bound for c in cases if c.ratio_to_used_bound is not None
        ]) else None,
        "median_ratio_to_step_bound": _median(c.ratio_to_step_bound for c in cases),
        "median_ratio_to_step_used_bound": _median(c.ratio_to_step_used_bound for c in cases),
        "median_stages_per_plan": statistics.median(c.stages for c in planned) if planned else None,
        "median_idle_gpus_per_plan": statistics.median(c.idle_gpus for c in planned) if planned else None,
        "interleaved_plans": {str(d): sum(c.interleave == d for c in planned) for d in sorted({c.interleave for c in planned})},
        "ilp": ilp_summary([r for c in cases for r in c.programs]) | {"plans_from_program": sum(c.from_program for c in cases)},
        "tensor_parallel_plans": sum(any(t != "1" for t in c.tensor_parallel.split(",")) for c in planned),
        "median_tp_gain_pct_7b_13b": _median(c.tp_gain_pct for c in cases if c.model in ("llama_7b", "llama_13b", "gpt_6.7b")),
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
    parser.add_argument(
        "--interleaving", action=argparse.BooleanOptionalAction, default=True,
        help="let the planner interleave its plans where the engine runs them (--no-interleaving: max_interleave=1)",
    )
    parser.add_argument("--max-interleave", type=int, default=PlannerOptions.max_interleave)
    parser.add_argument("--max-tp", type=int, default=PlannerOptions.max_tp, help="most GPUs of a TP group (1: no TP)")
    parser.add_argument(
        "--compare-tp", action="store_true",
        help="plan again with max_tp=1 where a plan has TP: tp_gain_pct per case, the median on the 7B and 13B models",
    )
    args = parser.parse_args(argv)
    options = PlannerOptions(
        allow_idle_ranks=args.allow_idle_ranks, max_interleave=args.max_interleave if args.interleaving else 1, max_tp=args.max_tp,
    )
    console = Console(width=None if Console().is_terminal else 180)
    warnings.simplefilter("ignore", MixedProfileSourcesWarning)  # expected: the data has holes (issue 3, section 1)
    cases: list[Case] = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("planning", total=len(args.clusters) * len(args.models))
        for cluster in args.clusters:
            for model in args.models:
                progress.update(task, description=f"{cluster} / {model}")
                cases.append(run_case(cluster, model, options, args.samples_per_gpu, args.compare_tp))
                progress.advance(task)
    fitting = [c for c in cases if c.fits_somewhere]
    skipped = [c for c in cases if not c.fits_somewhere]
    console.print(case_table(fitting, f"plan quality (allow_idle_ranks={args.allow_idle_ranks}); ms per iteration"))
    result = summary(fitting, skipped, args.allow_idle_ranks)
    console.print(
        f"{result['cases']} cases ({len(skipped)} skipped: nothing fits); worse than a baseline: "
        f"{result['worse_than_a_baseline']}; missing plans: {result['missing_plans']}; "
        f"median plan / bound: {result['median_ratio_to_bound']:.3f} (over the GPUs each plan uses: "
        f"{result['median_ratio_to_used_bound']:.3f}); with the optimizer step in the bound: "
        f"{result['median_ratio_to_step_bound']:.3f} (over the GPUs each plan uses: "
        f"{result['median_ratio_to_step_used_bound']:.3f}); median stages per plan: "
        f"{result['median_stages_per_plan']}; median idle GPUs per plan: {result['median_idle_gpus_per_plan']}; "
        f"plans by interleaving degree: {result['interleaved_plans']} (interleaving offered: {args.interleaving}); "
        f"plans with TP: {result['tensor_parallel_plans']} (max_tp={args.max_tp}); median gain of TP on the 7B and 13B "
        f"models: {result['median_tp_gain_pct_7b_13b']} %"
    )
    ilp = result["ilp"]
    console.print(
        f"integer programs: {ilp['programs']} solved, {ilp['compared']} against a fitting heuristic start: "
        f"{ilp['improved']} faster, {ilp['worse']} slower; gain median {ilp['median_gain_pct']} %, max "
        f"{ilp['max_gain_pct']} %, min {ilp['min_gain_pct']} % (median of the faster: {ilp['median_gain_pct_of_improving']} %); "
        f"{ilp['beat_best']} beat the best plan so far; {ilp['plans_from_program']} final plans from a program"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

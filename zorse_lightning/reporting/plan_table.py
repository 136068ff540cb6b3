"""The plan as a terminal table, with the predicted cost of each baseline beside it.

Idle ranks (in no stage: the plan is faster without them) get a row of their own,
marked ``idle``, so a reader sees which GPUs the plan leaves unused and why none of
the stages lists them.

An interleaved plan has a row per group of ranks, since its GPUs, memory and sharding
are the group's: the row names the group's stages (its chunks, in layer order) and
their layers, and its time per microbatch sums them; the title gives the degree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from rich.console import Console
from rich.table import Table

from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.evaluate import plan_cost
from zorse_lightning.schedule.plan import Plan, StagePlan
from zorse_lightning.units import bytes_to_gib


def _ranks(ranks: tuple[int, ...]) -> str:
    if list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _grouped(values: list[str]) -> str:
    return ", ".join(f"{count}x {value}" if count > 1 else value for value, count in Counter(values).items())


def _title_extras(plan: Plan) -> str:
    interleaved = f"; interleaved x{plan.interleave}: {plan.num_groups} groups of ranks" if plan.interleave > 1 else ""
    idle = f"; {len(plan.idle_ranks)} of {plan.world_size} GPUs idle" if plan.idle_ranks else ""
    return interleaved + idle


def _layers(stage: StagePlan) -> str:
    return f"{stage.layers[0]}-{stage.layers[1] - 1}"


def _host(host_bytes: float) -> str:
    """What a rank that offloads activations pins in host memory, beside its GPU memory."""
    return f" +{bytes_to_gib(host_bytes):.3g} host" if host_bytes else ""


def _activations(ctx: CostContext, plan: Plan, group: StagePlan, chunks: tuple[int, ...]) -> str:
    """What the group does with its activations beyond keeping them; for offload, what its copies take per
    microbatch each way and what they add to its compute (they hide under it where they are shorter)."""
    if group.activations_label == "keep":
        return ""
    if not group.offload_activations:
        return f" +{group.activations_label}"
    copy_ms = added_ms = 0.0
    for gpu_type in set(group.gpu_types):
        copied = added = 0.0
        for stage in (plan.stages[c] for c in chunks):
            ends = (stage.layers[0] == 0, stage.layers[1] == plan.num_layers)
            args = (gpu_type, stage.layers, plan.microbatch_size, *ends, stage.recompute)
            copied += ctx.offload_copy_ms(gpu_type, stage.layers, plan.microbatch_size, stage.recompute)
            added += ctx.microbatch_times(*args, True).total_ms - ctx.microbatch_times(*args, False).total_ms
        copy_ms, added_ms = max(copy_ms, copied), max(added_ms, added)
    return f" +offload (copies {copy_ms:.1f} ms each way, +{added_ms:.1f} ms)"


def plan_table(plan: Plan, ctx: CostContext) -> Table:
    cost = plan_cost(ctx, plan)
    table = Table(title=f"plan for {plan.model} on {plan.cluster}: {plan.schedule.value}, microbatch {plan.microbatch_size}, "
                  f"{plan.num_microbatches} microbatches per iteration{_title_extras(plan)}")
    for column in ("stage", "ranks", "GPUs", "layers", "microbatches per GPU", "memory GiB used/capacity", "ms per microbatch", "sharding"):
        table.add_column(column, no_wrap=column in ("GPUs", "ranks"))
    for index, (stage, stage_cost) in enumerate(zip(plan.rank_groups, cost.stages)):
        chunks = plan.stages_of_group(index)
        memory = [
            f"{bytes_to_gib(m.total_bytes):.3g}/{ctx.inventory.gpus[r].memory_gib:g}" + _host(m.host_bytes)
            for r, m in zip(stage.ranks, stage_cost.memory)
        ]
        times = [f"{sum(cost.stages[s].times[k].total_ms for s in chunks):.1f}" for k in range(len(stage.ranks))]
        layers = sum(plan.stages[s].num_layers for s in chunks)
        table.add_row(
            str(index) if plan.interleave == 1 else f"{index} ({','.join(map(str, chunks))})",
            _ranks(stage.ranks) + (f" (TP {stage.tensor_parallel})" if stage.tensor_parallel > 1 else ""),
            _grouped(list(stage.gpu_types)),
            f"{', '.join(_layers(plan.stages[s]) for s in chunks)} ({layers})",
            " ".join(map(str, stage.microbatches_per_rank)),
            _grouped(memory) if len(set(memory)) < len(memory) else " ".join(memory),
            _grouped(times) if len(set(times)) < len(times) else " ".join(times),
            stage.sharding_label + _activations(ctx, plan, stage, chunks),
        )
    if plan.idle_ranks:
        gpus = [ctx.inventory.gpus[r] for r in plan.idle_ranks]
        table.add_row(
            "idle", _ranks(plan.idle_ranks), _grouped([g.gpu_type.name for g in gpus]), "none", "0",
            _grouped([f"0/{g.memory_gib:g}" for g in gpus]), "-", "-", style="dim",
        )
    return table


def comparison_table(plan: Plan, baselines: Mapping[str, Plan | None]) -> Table:
    """Predicted iteration time and throughput of the plan and each baseline (same cost model)."""
    table = Table(title="predicted, same cost model")
    for column in ("plan", "iteration ms", "samples/s", "plan is faster by"):
        table.add_column(column, justify="right" if column != "plan" else "left")
    ours = plan.predicted
    table.add_row("zorse plan", f"{ours.iteration_ms:.1f}", f"{ours.samples_per_s:.1f}", "")
    for name, baseline in baselines.items():
        if baseline is None or baseline.predicted is None:
            table.add_row(name, "does not fit", "", "")
            continue
        theirs = baseline.predicted
        table.add_row(name, f"{theirs.iteration_ms:.1f}", f"{theirs.samples_per_s:.1f}", f"{theirs.iteration_ms / ours.iteration_ms:.2f}x")
    return table


def print_plan(plan: Plan, ctx: CostContext, baselines: Mapping[str, Plan | None], console: Console | None = None) -> None:
    console = console or Console(width=160)
    console.print(plan_table(plan, ctx))
    for note in plan.notes:
        console.print(f"note: {note}")
    console.print(
        f"predicted: {plan.predicted.iteration_ms:.1f} ms per iteration, {plan.predicted.samples_per_s:.1f} samples/s; "
        f"profiles: {', '.join(f'{t}={s}' for t, s in plan.predicted.profile_source.items())}; "
        f"planned in {plan.planner_seconds:.2f} s ({plan.solver.name}: {plan.solver.status})"
    )
    console.print(comparison_table(plan, baselines))

"""Why no plan fits: the most memory-frugal plan the search could have made, and the GPU
that overflows it, by how much, and what would help."""

from __future__ import annotations

from zorse_lightning.capabilities import Schedule, Sharding
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.stage_state import free_memory_shard_fractions, stage_memory
from zorse_lightning.planner.search.layouts import Layout
from zorse_lightning.planner.cost.memory import RankMemory
from zorse_lightning.schedule.plan import Plan
from zorse_lightning.planner.search.problem import SEARCH_SHARDING, layout_plan, stage_plan
from zorse_lightning.planner.rounding import proportional_counts
from zorse_lightning.units import bytes_to_gib


def frugal_plan(
    ctx: CostContext, layout: Layout, microbatch_size: int, schedule: Schedule, global_batch_size: int, layer_counts,
    gather_per_microbatch: bool = False,
) -> Plan:
    """Layers by stage memory (or pinned), microbatches by GPU memory, state sharded as the
    search shards it (or fully, gathered per microbatch), recomputation on: the least memory
    per GPU a layout allows, roughly."""
    gpus = ctx.inventory.gpus
    memory = [sum(gpus[r].memory_gib for r in s) for s in layout]
    counts = layer_counts or proportional_counts(ctx.profile.num_layers, memory, minimum=1)
    num_m = global_batch_size // microbatch_size
    sharding = Sharding.FULL if gather_per_microbatch else SEARCH_SHARDING
    stages, start = [], 0
    for ranks, count in zip(layout, counts):
        microbatches = proportional_counts(num_m, [gpus[r].memory_gib for r in ranks])
        stages.append(stage_plan(ctx, ranks, (start, start + count), microbatches, sharding, True, gather_per_microbatch))
        start += count
    return layout_plan(ctx, stages, global_batch_size, microbatch_size, schedule)


def _worst_overrun(ctx: CostContext, plan: Plan) -> tuple[float, int, int, RankMemory]:
    """(bytes over capacity, stage index, rank, its memory) of the GPU the plan overflows most,
    with sharded state split by free memory."""
    worst = None
    for index, stage in enumerate(plan.stages):
        fractions = free_memory_shard_fractions(ctx, plan, index) if stage.sharding is not Sharding.NONE else stage.effective_shard_fractions()
        for rank, used in zip(stage.ranks, stage_memory(ctx, plan, index, fractions)):
            excess = used.total_bytes - ctx.capacity_bytes(rank)
            if worst is None or excess > worst[0]:
                worst = (excess, index, rank, used)
    return worst


def infeasible_error(ctx: CostContext, layouts: list[Layout], sizes: list[int], schedule: Schedule, global_batch_size: int, options) -> PlanningError:
    """The error when no plan fits: the most frugal plan the search could have made comes closest
    (the most stages, or, where one stage is allowed, every parameter sharded and gathered per
    microbatch), and its worst GPU says by how much it misses."""
    layout = max(layouts, key=lambda l: (sum(map(len, l)), len(l)))  # every GPU, most stages
    m = min(sizes)
    stages = f"{len(layout)} pipeline stages" if len(layout) > 1 else "one stage"
    frugal = [(f"{stages} with {SEARCH_SHARDING.value} sharding", frugal_plan(
        ctx, layout, m, schedule, global_batch_size, options.layer_counts))]
    whole = [l for l in layouts if len(l) == 1 and len(l[0]) > 1]
    if whole:
        (ranks,) = max(whole, key=lambda l: len(l[0]))
        gathered = frugal_plan(ctx, (ranks,), m, schedule, global_batch_size, None, gather_per_microbatch=True)
        frugal.append((f"one stage of {len(ranks)} GPUs with full sharding gathered block by block per microbatch", gathered))
    described = [(_worst_overrun(ctx, plan), text, plan) for text, plan in frugal]
    (excess, index, rank, used), description, plan = min(described, key=lambda item: item[0][0])
    gpu = ctx.inventory.gpus[rank]
    stage = plan.stages[index]
    pins = [name for name in ("stage_layout", "layer_counts", "microbatch_size", "schedule") if getattr(options, name) is not None]
    pinned = f" The pins {pins} restrict the search: removing them may help." if pins else ""
    if excess <= 0:
        return PlanningError(
            f"the solver found no plan for {ctx.profile.model!r} on {ctx.inventory.name!r} within "
            f"solver_time_limit_s={options.solver_time_limit_s}; raise the limit.{pinned}"
        )
    state_gib = bytes_to_gib(used.state_bytes + used.sharded_bytes)
    if not options.allow_offload and state_gib < gpu.memory_gib:  # activations are what overflows
        pinned += " allow_offload=False rules out keeping activations in host memory: allowing it may help."
    return PlanningError(
        f"no plan of {ctx.profile.model!r} fits in the memory of cluster {ctx.inventory.name!r}: even with "
        f"{description}, microbatch size {m} and recomputation on, "
        f"GPU rank {rank} ({gpu.gpu_type.name} on machine {gpu.machine!r}, stage {index} with layers "
        f"[{stage.layers[0]}, {stage.layers[1]})) needs {bytes_to_gib(used.total_bytes):.3g} GiB of its "
        f"{gpu.memory_gib:.3g} GiB, short by {bytes_to_gib(excess):.3g} GiB (training state alone: {state_gib:.3g} GiB). "
        f"What would help: more GPUs or GPUs with more memory, a smaller microbatch size "
        f"(smallest tried: {m}), or a smaller model.{pinned}"
    )

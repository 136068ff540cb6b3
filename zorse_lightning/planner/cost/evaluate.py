"""The cost model applied to a whole plan: iteration time, memory per rank, and why a plan
does not fit. Every plan the search or a baseline returns is priced here, so all of
them are compared in one model.

Interleaved plans (``Plan.interleave`` = V > 1) are priced per *group* of ranks, since
a rank holds and runs all of its group's chunks: its memory is every chunk's state
plus the peak of activations over its own program (:func:`.stage_state.rank_activation_bytes`,
what the engine holds), its synchronisation and optimizer step cover every chunk's
parameters, and the closed form's chain (:func:`pipeline_elements`) has one element
per group and per pair of neighbouring groups, whose work sums the chunks. A plain
plan is the case V = 1 of the same formulas, priced exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from zorse_lightning.planner.cost.boundaries import BoundaryCost, boundary_cost
from zorse_lightning.planner.cost.chain import pipeline_elements
from zorse_lightning.planner.cost.comm import gather_round_ms
from zorse_lightning.planner.cost.context import CostContext, StageCost
from zorse_lightning.planner.cost.compute import (
    lockstep_busy_ms,
    pipeline_ms,
    stage_busy_ms,
    stage_latency_ms,
)
from zorse_lightning.planner.cost.memory import host_memory_overruns, profile_state_bytes
from zorse_lightning.planner.cost.stage_state import stage_memory, stage_own_sync_ms, stage_parameters_of, stage_update_ms
from zorse_lightning.planner.cost.tensor_parallel import stage_rank_times
from zorse_lightning.schedule.plan import Plan, Prediction
from zorse_lightning.units import bytes_to_gib

@dataclass(frozen=True)
class PlanCost:
    stages: tuple[StageCost, ...]
    boundaries: tuple[BoundaryCost, ...]
    pipeline_ms: float
    sync_ms: float
    """The slowest stage's synchronisation (:meth:`stage_sync_ms`)."""
    tied_sync_ms: float = 0.0
    """The tied embedding/head all-reduce the first and last stages add (:func:`tied_sync_ms`)."""
    interleave: int = 1
    """The plan's chunks per group of ranks (``Plan.interleave``)."""
    fill_ms: float = 0.0
    """Of ``pipeline_ms``, the fill and drain: one microbatch through every element of the chain
    but the one that bounds it (the rest is that element's busy time)."""
    drain_ms: tuple[float, ...] = ()
    """Per group of ranks: how long before the pipeline's end its last backward ends (:func:`_drains_ms`);
    empty: every group's at the end."""

    @property
    def num_groups(self) -> int:
        return len(self.stages) // self.interleave

    def stage_sync_ms(self, index: int) -> float:
        """Synchronisation of stage ``index``'s group after its last backward, the tied weight's
        included (the first and the last group hold the embedding and the head)."""
        groups = self.num_groups
        ends = index % groups in (0, groups - 1) and groups > 1
        return self.stages[index].sync_ms + (self.tied_sync_ms if ends else 0.0)

    def stage_update_ms(self, index: int) -> float:
        """Optimizer step of stage ``index``: its slowest rank's (the stage's next forward waits for it)."""
        return max(self.stages[index].update_ms)

    def stage_tail_ms(self, index: int) -> float:
        """What stage ``index`` does after its last backward: synchronise, then step the optimizer."""
        return self.stage_sync_ms(index) + self.stage_update_ms(index)

    @property
    def update_ms(self) -> float:
        """The slowest optimizer step of any stage."""
        return max(self.stage_update_ms(i) for i in range(self.num_groups))

    def exposed_tail_ms(self, index: int) -> float:
        """What group ``index``'s synchronisation and optimizer step add to the pipeline: they start at its
        last backward, ``drain_ms`` before the pipeline's end."""
        return self.stage_tail_ms(index) - (self.drain_ms[index] if self.drain_ms else 0.0)

    @cached_property
    def tail_ms(self) -> float:
        """What the groups' synchronisations and optimizer steps add to the pipeline: the most any adds (each
        group does both on its own; asked of each plan many times)."""
        return max(self.exposed_tail_ms(i) for i in range(self.num_groups))

    @property
    def iteration_ms(self) -> float:
        """The pipeline, then the group whose synchronisation and step end last."""
        return self.pipeline_ms + self.tail_ms


def stage_cost(ctx: CostContext, plan: Plan, index: int, memory: bool = True, group: StageCost | None = None) -> StageCost:
    """The stage's costs; ``memory`` False leaves its memory out (empty: see :func:`plan_cost`). ``group``: the
    cost of another chunk of the stage's group, whose synchronisation, memory and optimizer step it shares."""
    stage = plan.stages[index]
    first, last = index == 0, index == len(plan.stages) - 1
    if stage.tensor_parallel > 1:
        times = stage_rank_times(ctx, stage, plan.microbatch_size, first, last)
    else:
        by_type = {
            t: ctx.microbatch_times(t, stage.layers, plan.microbatch_size, first, last, stage.recompute, stage.offload_activations)
            for t in set(stage.gpu_types)
        }
        times = tuple(by_type[t] for t in stage.gpu_types)
    totals = [t.total_ms for t in times]
    counts = list(stage.microbatches_per_rank)
    gathers_ms = gather_round_ms_of(ctx, plan, index) if stage.gather_per_microbatch else 0.0
    if stage.gather_per_microbatch:  # in any stage of any plan: a microbatch's round also delays its way through
        busy_ms = lockstep_busy_ms(totals, counts) + max(counts) * gathers_ms
    else:
        busy_ms = stage_busy_ms(totals, counts)
    latency_ms = stage_latency_ms(totals, counts) + gathers_ms
    if group is not None:
        return replace(group, times=times, busy_ms=busy_ms, latency_ms=latency_ms)
    return StageCost(
        times=times,
        busy_ms=busy_ms,
        latency_ms=latency_ms,
        sync_ms=stage_own_sync_ms(ctx, plan, index),
        memory=stage_memory(ctx, plan, index, stage.effective_shard_fractions()) if memory else (),
        update_ms=stage_update_ms(ctx, plan, index),
    )


def gather_round_ms_of(ctx: CostContext, plan: Plan, index: int) -> float:
    """One microbatch round of stage ``index``'s per-block gathers (every rank makes one per
    microbatch of the stage's busiest rank: :func:`gather_round_ms`)."""
    stage, parameters = plan.stages[index], stage_parameters_of(ctx, plan, index)
    per = profile_state_bytes(ctx.profile)
    return gather_round_ms(
        ctx.links, stage.ranks, parameters.layers * per.weights, parameters.layers * per.gradients, parameters.num_layers,
        stage.shard_fractions,
    )


def plan_cost(ctx: CostContext, plan: Plan, memory: bool = True) -> PlanCost:
    """The plan's costs. ``memory`` False prices its time only, with no memory per rank (an
    interleaved plan's memory needs its programs recorded: seconds at 1024 GPUs), to rank
    candidates before pricing the memory of the promising ones."""
    costs: list[StageCost] = []
    for i in range(len(plan.stages)):  # a group's later chunks share its synchronisation, memory and step
        costs.append(stage_cost(ctx, plan, i, memory, costs[i - plan.num_groups] if i >= plan.num_groups else None))
    stages = tuple(costs)
    boundaries = tuple(boundary_cost(ctx, plan, i) for i in range(len(plan.stages) - 1))
    latencies, busy = pipeline_elements(ctx, plan, stages, boundaries)
    bottleneck = max(range(len(busy)), key=lambda e: busy[e] - latencies[e])
    tied = tied_sync_ms(ctx, plan.stages[0].ranks, plan.stages[-1].ranks) if len(stages) > 1 else 0.0
    cost = PlanCost(
        stages, boundaries, pipeline_ms(latencies, busy), 0.0, tied, plan.interleave, sum(latencies) - latencies[bottleneck],
        _drains_ms(plan, stages, boundaries),
    )
    return with_stage_costs(cost, stages)


def _drains_ms(plan: Plan, stages: tuple[StageCost, ...], boundaries: tuple[BoundaryCost, ...]) -> tuple[float, ...]:
    """Per group of ranks: how long before the pipeline's end (the first group's last backward) its last
    backward ends. The last microbatch's gradient still has to pass every group before it, each at its
    first chunk's backward on its slowest rank that runs microbatches, and every boundary between: a later
    group's synchronisation and step overlap that much of the drain (the engine starts them at the group's
    last backward; the simulation plays them so)."""
    drains = [0.0]
    for group in range(plan.num_groups - 1):
        counts = plan.stages[group].microbatches_per_rank
        backward_ms = max((t.backward_ms for t, n in zip(stages[group].times, counts) if n > 0), default=0.0)
        drains.append(drains[-1] + backward_ms + boundaries[group].transfer_ms)
    return tuple(drains)


def with_stage_costs(cost: PlanCost, stages: tuple[StageCost, ...]) -> PlanCost:
    """``cost`` with these stage costs, for a plan whose stages differ only in what they do after
    their last backward (sharding): the pipeline is the same, the synchronisation is recomputed."""
    changed = replace(cost, stages=stages)
    return replace(changed, sync_ms=max(changed.stage_sync_ms(i) for i in range(len(stages))))


def tied_sync_ms(ctx: CostContext, first_ranks: tuple[int, ...], last_ranks: tuple[int, ...]) -> float:
    """The tied embedding/head weight's gradient summed between the first and the last stage, as the engine
    sums it (``schedule.step_collectives.SharedReduction``): reduced into one representative per machine over
    the holders there, all-reduced between the representatives (one copy each way over a link between
    machines, often the plan's slowest: the pipeline's two ends), broadcast back on each machine, every
    machine's at once. After each stage's own synchronisation and not overlapped with it. The shared weight
    is the head's (a tied head holds nothing else).
    """
    if not ctx.profile.tied_embedding_head:
        return 0.0
    gradient_bytes = ctx.profile.head.parameters * profile_state_bytes(ctx.profile).gradients
    return shared_reduction_ms(ctx, (*first_ranks, *last_ranks), gradient_bytes)


def shared_reduction_ms(ctx: CostContext, holders: tuple[int, ...], gradient_bytes: float) -> float:
    """A weight's gradient of ``gradient_bytes`` that ``holders`` share, summed over all of them: into each
    machine's first holder, between those, back out (see :func:`tied_sync_ms`)."""
    by_machine: dict[str, list[int]] = {}
    for rank in sorted(set(holders)):
        by_machine.setdefault(ctx.inventory.gpus[rank].machine, []).append(rank)
    inside = outside = 0.0
    for ranks in by_machine.values():
        order = tuple(ranks)
        shares = (1.0,) + (0.0,) * (len(order) - 1)
        inside = max(inside, ctx.links.to_owners_ms(order, gradient_bytes, shares))
        outside = max(outside, ctx.links.from_owners_ms(order, gradient_bytes, shares))
    representatives = tuple(sorted(ranks[0] for ranks in by_machine.values()))
    return inside + ctx.links.all_reduce_ms(representatives, gradient_bytes) + outside


def memory_overruns(ctx: CostContext, plan: Plan, cost: PlanCost) -> list[tuple[int, int, float]]:
    """(stage index, rank, GiB over capacity) for every rank that does not fit (interleaved: the
    index of its group, whose chunks' memory its first stage's cost holds); and for every rank that
    pins host memory on a machine whose ranks together pin more than it allows
    (:attr:`~zorse_lightning.cluster.inventory.Machine.pinnable_host_gib`), the machine's excess."""
    over = []
    for index, (stage, stage_cost_) in enumerate(zip(plan.rank_groups, cost.stages)):
        for rank, memory in zip(stage.ranks, stage_cost_.memory):
            excess = memory.total_bytes - ctx.capacity_bytes(rank)
            if excess > 0:
                over.append((index, rank, bytes_to_gib(excess)))
    excess_by_machine = host_memory_overruns(ctx.inventory, _host_gib_by_rank(plan, cost))
    for index, (stage, stage_cost_) in enumerate(zip(plan.rank_groups, cost.stages)):
        for rank, memory in zip(stage.ranks, stage_cost_.memory):
            machine = ctx.inventory.gpus[rank].machine
            if memory.host_bytes > 0 and machine in excess_by_machine:
                over.append((index, rank, excess_by_machine[machine]))
    return over


def _host_gib_by_rank(plan: Plan, cost: PlanCost) -> dict[int, float]:
    return {
        rank: bytes_to_gib(memory.host_bytes)
        for stage, stage_cost_ in zip(plan.rank_groups, cost.stages)
        for rank, memory in zip(stage.ranks, stage_cost_.memory)
    }


def prediction(ctx: CostContext, plan: Plan, cost: PlanCost) -> Prediction:
    memory = [0.0] * plan.world_size
    for stage, stage_cost_ in zip(plan.rank_groups, cost.stages):
        for rank, rank_memory in zip(stage.ranks, stage_cost_.memory):
            memory[rank] = round(bytes_to_gib(rank_memory.total_bytes), 4)
    types = {t for s in plan.stages for t in s.gpu_types}
    host = _host_gib_by_rank(plan, cost)
    return Prediction(
        iteration_ms=cost.iteration_ms,
        samples_per_s=plan.global_batch_size / cost.iteration_ms * 1000.0,
        memory_gib=tuple(memory),
        host_memory_gib=tuple(round(host.get(r, 0.0), 4) for r in range(plan.world_size)) if any(host.values()) else (),
        profile_source={t: ctx.profile.times(t).source.value for t in sorted(types)},
    )

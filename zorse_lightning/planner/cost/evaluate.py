"""The cost model applied to a whole plan: iteration time, memory per rank, and why a plan
does not fit. Every plan the search or a baseline returns is priced here, so all of
them are compared in one model.

Interleaved plans (``Plan.interleave`` = V > 1) are priced per *group* of ranks, since
a rank holds and runs all of its group's chunks: its memory is every chunk's state
plus the peak of activations over its own program (:func:`rank_activation_bytes`,
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
from zorse_lightning.planner.cost.comm import gather_round_ms, stage_sync_ms
from zorse_lightning.planner.cost.context import CostContext, StageCost
from zorse_lightning.planner.cost.compute import (
    lockstep_busy_ms,
    pipeline_ms,
    stage_busy_ms,
    stage_latency_ms,
)
from zorse_lightning.planner.cost.memory import (
    RankMemory,
    StageParameters,
    activation_bytes_per_microbatch,
    combined_parameters,
    host_memory_overruns,
    microbatches_in_flight,
    offload_working_bytes,
    offloaded_bytes_per_microbatch,
    shard_fractions_by_free_memory,
    stage_parameter_counts,
    optimizer_step_bytes,
    profile_state_bytes,
    stage_state_bytes,
    transient_bytes,
)
from zorse_lightning.planner.cost.tensor_parallel import rank_parameters, stage_rank_times, tensor_parallel_sync_ms
from zorse_lightning.schedule.plan import Plan, Prediction, StagePlan
from zorse_lightning.schedule.programs import Action, ActionKind
from zorse_lightning.planner.cost.recorded_programs import schedule_programs
from zorse_lightning.planner.cost.update import optimizer_step_ms, parameters_updated
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

    @cached_property
    def tail_ms(self) -> float:
        """The longest synchronisation plus optimizer step of any stage (asked of each plan many times)."""
        return max(self.stage_tail_ms(i) for i in range(self.num_groups))

    @property
    def iteration_ms(self) -> float:
        """The pipeline, then the stage that takes longest to synchronise and step (stages
        do both independently; the closed form starts every stage's at the pipeline's end)."""
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


def stage_parameters_of(ctx: CostContext, plan: Plan, index: int, stage: StagePlan | None = None) -> StageParameters:
    """Parameters each rank of stage ``index`` holds (with ``stage`` put in its place), embedding and
    head included: on an interleaved plan those of every chunk of the stage's group; under tensor
    parallelism its share of the split layers (:func:`.tensor_parallel.rank_parameters`)."""
    chunks = plan.stages_of_group(plan.group_of_stage(index))
    last = len(plan.stages) - 1
    def counts(layers: tuple[int, int], first: bool, last: bool) -> StageParameters:
        return ctx.memo(("parameters", layers, first, last), lambda: stage_parameter_counts(ctx.profile, layers, first=first, last=last))

    whole = combined_parameters(tuple(
        counts((stage or plan.stages[s] if s == index else plan.stages[s]).layers, s == 0, s == last) for s in chunks
    ))
    degree = (stage or plan.stages[index]).tensor_parallel
    return rank_parameters(whole, degree, ctx.profile.tensor_parallel.replicated_parameters_per_layer)


def gather_round_ms_of(ctx: CostContext, plan: Plan, index: int) -> float:
    """One microbatch round of stage ``index``'s per-block gathers (every rank makes one per
    microbatch of the stage's busiest rank: :func:`gather_round_ms`)."""
    stage, parameters = plan.stages[index], stage_parameters_of(ctx, plan, index)
    per = profile_state_bytes(ctx.profile)
    return gather_round_ms(
        ctx.links, stage.ranks, parameters.layers * per.weights, parameters.layers * per.gradients, parameters.num_layers,
        stage.shard_fractions,
    )


def _state_key(plan: Plan, index: int, stage: StagePlan) -> tuple:
    """What the synchronisation and the optimizer step of stage ``index`` (``stage`` in its place) depend on: its
    ranks, sharding and TP degree, and the layers of every chunk of its group, with whether each holds the
    embedding or the head. The search prices the same stage in many plans (a split's remedies change the
    others; its other orders move it): 3 in 4 of these were priced already at mix32 Llama 7B."""
    last = len(plan.stages) - 1
    layers = tuple(
        (stage.layers if s == index else plan.stages[s].layers, s == 0, s == last) for s in plan.stages_of_group(plan.group_of_stage(index))
    )
    return stage.ranks, stage.sharding, stage.shard_fractions, stage.tensor_parallel, stage.gather_per_microbatch, layers


def stage_own_sync_ms(ctx: CostContext, plan: Plan, index: int, stage: StagePlan | None = None) -> float:
    """Synchronisation of stage ``index`` (or of ``stage`` put in its place) over its own group
    after its last backward, by sharding level (:func:`.comm.stage_sync_ms`); gathered per microbatch,
    only the embedding and head are left to synchronise then. Once per :func:`_state_key`."""
    stage = stage or plan.stages[index]
    return ctx.memo(("own sync", *_state_key(plan, index, stage)), lambda: _own_sync_ms(ctx, plan, index, stage))


def _own_sync_ms(ctx: CostContext, plan: Plan, index: int, stage: StagePlan) -> float:
    parameters = stage_parameters_of(ctx, plan, index, stage)
    synced = parameters.edges if stage.gather_per_microbatch else parameters.total
    per = profile_state_bytes(ctx.profile)
    if stage.tensor_parallel > 1:
        return tensor_parallel_sync_ms(ctx.links, stage, synced * per.weights, synced * per.gradients)
    return stage_sync_ms(
        ctx.links, stage.ranks, synced * per.weights, synced * per.gradients, stage.sharding, stage.shard_fractions
    )


def stage_update_ms(ctx: CostContext, plan: Plan, index: int, stage: StagePlan | None = None) -> tuple[float, ...]:
    """Each rank's optimizer step on stage ``index`` (or on ``stage`` put in its place): its
    shard of the stage's parameters when the stage shards optimizer state, all of them otherwise. Once per
    :func:`_state_key`."""
    stage = stage or plan.stages[index]
    return ctx.memo(("update", *_state_key(plan, index, stage)), lambda: _update_ms(ctx, plan, index, stage))


def _update_ms(ctx: CostContext, plan: Plan, index: int, stage: StagePlan) -> tuple[float, ...]:
    parameters = stage_parameters_of(ctx, plan, index, stage).total
    updated = parameters_updated(parameters, stage.sharding, stage.effective_shard_fractions())
    return tuple(
        optimizer_step_ms(ctx.profile.times(t), ctx.inventory.gpus[r].gpu_type, n)
        for r, t, n in zip(stage.ranks, stage.gpu_types, updated)
    )


def stage_memory(
    ctx: CostContext, plan: Plan, index: int, fractions: tuple[float, ...], stage: StagePlan | None = None
) -> tuple[RankMemory, ...]:
    """Peak memory of each rank of stage ``index`` (or of ``stage`` put in its place, differing
    in sharding only where the plan is interleaved); on an interleaved plan, of all its chunks."""
    stage = stage or plan.stages[index]
    parameters = stage_parameters_of(ctx, plan, index, stage)
    held, sharded = stage_state_bytes(parameters, profile_state_bytes(ctx.profile), stage.sharding, stage.gather_per_microbatch)
    groups_of_ranks = (
        tuple(len(g.ranks) for g in plan.rank_groups), plan.group_of_stage(index), len(plan.stages) > 1,
        stage.tensor_parallel,
    )
    stepped = parameters_updated(parameters.total, stage.sharding, fractions)
    if plan.interleave > 1:
        peaks = rank_activation_bytes(ctx, plan, stage.ranks)
        offloads = any(s.offload_activations for s in plan.stages)  # a play of the programs costs seconds at 1024 GPUs
        host_peaks = rank_activation_bytes(ctx, plan, stage.ranks, host=True) if offloads else (0.0,) * len(stage.ranks)
        last_stage = len(plan.stages) - 1
        chunks = plan.stages_of_group(plan.group_of_stage(index))
        running = max(
            transient_bytes(ctx.profile, plan.microbatch_size, first=s == 0, last=s == last_stage)
            + _working_bytes(ctx, plan, plan.stages[s])
            for s in chunks
        )
        return tuple(
            RankMemory(
                held, sharded * fraction, peak + running, ctx.reserves_bytes[r], optimizer_step_bytes(ctx.profile, n), host,
                ctx.nccl_bytes(r, *groups_of_ranks),
            )
            for r, fraction, peak, n, host in zip(stage.ranks, fractions, peaks, stepped, host_peaks)
        )
    first, last = index == 0, index == len(plan.stages) - 1
    per_microbatch = activation_bytes_per_microbatch(
        ctx.profile, stage.layers, plan.microbatch_size, first=first, last=last, recompute=stage.recompute,
        offload=stage.offload_activations, tensor_parallel=stage.tensor_parallel,
    )
    host_per_microbatch = _host_bytes(ctx, plan, stage)
    running = transient_bytes(ctx.profile, plan.microbatch_size, first=first, last=last) + _working_bytes(ctx, plan, stage)
    widths, schedule = tuple(len(s.replicas) for s in plan.stages), plan.schedule
    alike: dict[tuple, RankMemory] = {}  # identical GPUs of big stages share one record
    out = []
    for rank, n, fraction, updated in zip(stage.ranks, stage.microbatches_per_rank, fractions, stepped):
        key = (n, fraction, ctx.reserves_bytes[rank], ctx.nccl_bytes(rank, *groups_of_ranks))
        if key not in alike:
            flight = microbatches_in_flight(schedule, widths, index, n)
            alike[key] = RankMemory(
                held, sharded * fraction, per_microbatch * flight + running, key[2], optimizer_step_bytes(ctx.profile, updated),
                host_per_microbatch * flight, key[3],
            )
        out.append(alike[key])
    return tuple(out)


def _host_bytes(ctx: CostContext, plan: Plan, stage: StagePlan) -> float:
    """What one microbatch of ``stage`` keeps in host memory (nothing unless it offloads)."""
    if not stage.offload_activations:
        return 0.0
    return offloaded_bytes_per_microbatch(ctx.profile, stage.layers, plan.microbatch_size, stage.recompute)


def _working_bytes(ctx: CostContext, plan: Plan, stage: StagePlan) -> float:
    """What an offloading ``stage``'s running microbatch brings back to the device (nothing unless it offloads)."""
    if not stage.offload_activations:
        return 0.0
    return offload_working_bytes(ctx.profile, stage.layers, plan.microbatch_size, stage.recompute)


def rank_activation_bytes(ctx: CostContext, plan: Plan, ranks: tuple[int, ...], host: bool = False) -> tuple[float, ...]:
    """Each of ``ranks``' peak of activations over its own program (:func:`schedule_programs`,
    which the engine runs): a forward keeps its chunk's activations of one microbatch until that
    chunk's backward of it frees them. Interleaved plans only: how many chunk-forwards a rank holds
    at once comes from the recorded play of its schedule, not from a formula (plain plans keep
    :func:`microbatches_in_flight`, which their programs follow and which costs no play). ``host``:
    the peak of what offloading chunks keep in host memory instead."""
    def peaks() -> dict[int, float]:  # every rank's at once: each chunk of a group asks for the same ranks
        last = len(plan.stages) - 1
        per_microbatch = [
            _host_bytes(ctx, plan, s) if host else activation_bytes_per_microbatch(
                ctx.profile, s.layers, plan.microbatch_size, first=i == 0, last=i == last, recompute=s.recompute,
                offload=s.offload_activations, tensor_parallel=s.tensor_parallel,
            )
            for i, s in enumerate(plan.stages)
        ]
        programs = schedule_programs(ctx, plan)
        return {r: _peak_bytes(programs[r], per_microbatch) for g in plan.rank_groups for r in g.ranks}

    stages = tuple((s.ranks, s.microbatches_per_rank, s.layers, s.recompute, s.offload_activations, s.tensor_parallel) for s in plan.stages)
    by_rank = ctx.memo(("activation peaks", plan.schedule, plan.interleave, plan.microbatch_size, stages, host), peaks)
    return tuple(by_rank[r] for r in ranks)


def _peak_bytes(program: tuple[Action, ...], per_microbatch: list[float]) -> float:
    held = peak = 0.0
    for action in program:
        held += per_microbatch[action.stage] if action.kind is ActionKind.FORWARD else -per_microbatch[action.stage]
        peak = max(peak, held)
    return peak


def free_memory_shard_fractions(ctx: CostContext, plan: Plan, index: int) -> tuple[float, ...]:
    """Shard fractions of a stage by each rank's memory left after its activations, reserve and
    the state it holds whole at its level (so every rank fills the same share of what is left); with
    tensor parallelism by each replica's least, which every rank of the replica repeats (each TP index's
    ranks shard their slice over the replicas)."""
    stage = plan.stages[index]
    unsharded = stage_memory(ctx, plan, index, tuple(0.0 for _ in stage.ranks))
    free = [ctx.capacity_bytes(r) - m.total_bytes for r, m in zip(stage.ranks, unsharded)]
    t = stage.tensor_parallel
    shares = shard_fractions_by_free_memory([min(free[i : i + t]) for i in range(0, len(free), t)])
    return tuple(share for share in shares for _ in range(t))


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
        stages, boundaries, pipeline_ms(latencies, busy), 0.0, tied, plan.interleave, sum(latencies) - latencies[bottleneck]
    )
    return with_stage_costs(cost, stages)


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

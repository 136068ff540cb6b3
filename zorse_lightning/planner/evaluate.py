"""The cost model applied to a whole plan: iteration time, memory per rank, and why a plan
does not fit. Every plan the search or a baseline returns is priced here, so all of
them are compared in one model."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from zorse_lightning.capabilities import Sharding
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.planner.comm import (
    LinkTable,
    gather_round_ms,
    stage_sync_ms,
    transfer_ms,
)
from zorse_lightning.planner.compute import (
    MicrobatchTimes,
    lockstep_busy_ms,
    pipeline_ms,
    receiving_busy_ms,
    round_trip_busy_ms,
    stage_busy_ms,
    stage_latency_ms,
    stage_microbatch_times,
)
from zorse_lightning.planner.memory import (
    RankMemory,
    StageParameters,
    activation_bytes_per_microbatch,
    microbatches_in_flight,
    reserve_gib,
    shard_fractions_by_free_memory,
    stage_parameter_counts,
    stage_state_bytes,
    state_bytes_per_parameter,
)
from zorse_lightning.planner.plan import Plan, Prediction, StagePlan
from zorse_lightning.planner.update import optimizer_step_ms, parameters_updated, update_lower_bound_ms
from zorse_lightning.profiling.profile import ModelProfile
from zorse_lightning.units import bytes_to_gib, gib_to_bytes

__all__ = ["update_lower_bound_ms"]  # re-exported: it lived here


@dataclass(frozen=True)
class CostContext:
    """What pricing a plan needs besides the plan itself."""

    inventory: ClusterInventory
    profile: ModelProfile
    links: LinkTable
    reserves_bytes: tuple[float, ...]
    """Framework reserve per rank (see :func:`reserve_gib`)."""
    capacities_bytes: tuple[float, ...]
    _microbatch_times: dict = field(default_factory=dict, compare=False, repr=False)
    """Memo of :meth:`microbatch_times`: the search prices the same stages in many plans."""

    def microbatch_times(
        self, gpu_type: str, layers: tuple[int, int], microbatch_size: int, first: bool, last: bool, recompute: bool
    ) -> MicrobatchTimes:
        """:func:`stage_microbatch_times` of this context's profile, computed once per arguments."""
        key = (gpu_type, layers, microbatch_size, first, last, recompute)
        if key not in self._microbatch_times:
            self._microbatch_times[key] = stage_microbatch_times(
                self.profile.times(gpu_type), layers, microbatch_size, first=first, last=last, recompute=recompute
            )
        return self._microbatch_times[key]

    @classmethod
    def build(cls, inventory: ClusterInventory, profile: ModelProfile, memory_reserve_gib: float | None = None) -> CostContext:
        """``memory_reserve_gib`` None: 0.5 GiB per real GPU, scaled on emulated clusters."""
        reserves = tuple(
            gib_to_bytes(reserve_gib(g.memory_gib, g.gpu_type.memory_gib, inventory.emulated, memory_reserve_gib))
            for g in inventory.gpus
        )
        return cls(inventory, profile, LinkTable(inventory), reserves, tuple(gib_to_bytes(g.memory_gib) for g in inventory.gpus))

    def reserve_bytes(self, rank: int) -> float:
        return self.reserves_bytes[rank]

    def capacity_bytes(self, rank: int) -> float:
        return self.capacities_bytes[rank]


@dataclass(frozen=True)
class StageCost:
    times: tuple[MicrobatchTimes, ...]
    """One microbatch on each rank of the stage."""
    busy_ms: float
    """Its slowest rank's work per iteration, with the gathers of per-microbatch sharding."""
    latency_ms: float
    sync_ms: float
    memory: tuple[RankMemory, ...]
    update_ms: tuple[float, ...]
    """Each rank's optimizer step (:func:`stage_update_ms`), in the order of the stage's ranks."""


@dataclass(frozen=True)
class BoundaryCost:
    transfer_ms: float
    """Slowest single transfer of one microbatch's activation across the boundary."""
    busy_ms: float
    """Busiest link's transfers per iteration, one direction (links are full duplex)."""
    routes: tuple[tuple[int, int, int], ...]
    """(sending rank, receiving rank, microbatches) in microbatch order."""


@dataclass(frozen=True)
class PlanCost:
    stages: tuple[StageCost, ...]
    boundaries: tuple[BoundaryCost, ...]
    pipeline_ms: float
    sync_ms: float
    """The slowest stage's synchronisation (:meth:`stage_sync_ms`)."""
    tied_sync_ms: float = 0.0
    """The tied embedding/head all-reduce the first and last stages add (:func:`tied_sync_ms`)."""

    def stage_sync_ms(self, index: int) -> float:
        """Synchronisation of stage ``index`` after its last backward, the tied weight's included."""
        ends = index in (0, len(self.stages) - 1) and len(self.stages) > 1
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
        return max(self.stage_update_ms(i) for i in range(len(self.stages)))

    @property
    def tail_ms(self) -> float:
        """The longest synchronisation plus optimizer step of any stage."""
        return max(self.stage_tail_ms(i) for i in range(len(self.stages)))

    @property
    def iteration_ms(self) -> float:
        """The pipeline, then the stage that takes longest to synchronise and step (stages
        do both independently; the closed form starts every stage's at the pipeline's end)."""
        return self.pipeline_ms + self.tail_ms


def routes(sender: StagePlan, receiver: StagePlan) -> list[tuple[int, int, int]]:
    """Which rank sends how many consecutive microbatches to which rank across a boundary."""
    send = [[r, n] for r, n in zip(sender.ranks, sender.microbatches_per_rank) if n > 0]
    recv = [[r, n] for r, n in zip(receiver.ranks, receiver.microbatches_per_rank) if n > 0]
    out: list[tuple[int, int, int]] = []
    i = j = 0
    while i < len(send) and j < len(recv):
        count = min(send[i][1], recv[j][1])
        out.append((send[i][0], recv[j][0], count))
        send[i][1] -= count
        recv[j][1] -= count
        i += send[i][1] == 0
        j += recv[j][1] == 0
    return out


def boundary_message_bytes(ctx: CostContext, plan: Plan, index: int) -> float:
    """One microbatch's activation across boundary ``index`` (its gradient back is as large)."""
    return ctx.profile.layers[plan.stages[index].layers[1] - 1].output_bytes_per_sample * plan.microbatch_size


def boundary_cost(ctx: CostContext, plan: Plan, index: int) -> BoundaryCost:
    sender, receiver = plan.stages[index], plan.stages[index + 1]
    message_bytes = boundary_message_bytes(ctx, plan, index)
    one_ms: dict = {}  # per link: one message
    messages: dict = {}  # per link: messages per iteration
    route_list = routes(sender, receiver)
    for a, b, count in route_list:
        _link_transfer_ms(ctx, a, b, message_bytes, one_ms)
        key = ctx.links.link(a, b)[0]
        messages[key] = messages.get(key, 0) + count
    slowest = max(one_ms.values(), default=0.0)
    return BoundaryCost(slowest, max((one_ms[k] * n for k, n in messages.items()), default=0.0), tuple(route_list))


def stage_cost(ctx: CostContext, plan: Plan, index: int) -> StageCost:
    stage = plan.stages[index]
    first, last = index == 0, index == len(plan.stages) - 1
    by_type = {
        t: ctx.microbatch_times(t, stage.layers, plan.microbatch_size, first, last, stage.recompute)
        for t in set(stage.gpu_types)
    }
    times = tuple(by_type[t] for t in stage.gpu_types)
    totals = [t.total_ms for t in times]
    counts = list(stage.microbatches_per_rank)
    if stage.gather_per_microbatch:
        busy_ms = lockstep_busy_ms(totals, counts) + max(counts) * gather_round_ms_of(ctx, plan, index)
    else:
        busy_ms = stage_busy_ms(totals, counts)
    return StageCost(
        times=times,
        busy_ms=busy_ms,
        latency_ms=stage_latency_ms(totals, counts),
        sync_ms=stage_own_sync_ms(ctx, plan, index),
        memory=stage_memory(ctx, plan, index, stage.effective_shard_fractions()),
        update_ms=stage_update_ms(ctx, plan, index),
    )


def stage_parameters_of(ctx: CostContext, plan: Plan, index: int, stage: StagePlan | None = None) -> StageParameters:
    """Parameters of stage ``index`` (or of ``stage`` put in its place), embedding and head included."""
    stage = stage or plan.stages[index]
    return stage_parameter_counts(ctx.profile, stage.layers, first=index == 0, last=index == len(plan.stages) - 1)


def gather_round_ms_of(ctx: CostContext, plan: Plan, index: int) -> float:
    """One microbatch round of stage ``index``'s per-block gathers (every rank makes one per
    microbatch of the stage's busiest rank: :func:`gather_round_ms`)."""
    stage, parameters = plan.stages[index], stage_parameters_of(ctx, plan, index)
    per = state_bytes_per_parameter(ctx.profile.dtype)
    return gather_round_ms(
        ctx.links, stage.ranks, parameters.layers * per.weights, parameters.layers * per.gradients, parameters.num_layers
    )


def stage_own_sync_ms(ctx: CostContext, plan: Plan, index: int, stage: StagePlan | None = None) -> float:
    """Synchronisation of stage ``index`` (or of ``stage`` put in its place) over its own group
    after its last backward, by sharding level (:func:`ring_sync_ms`); gathered per microbatch,
    only the embedding and head are left to synchronise then."""
    stage = stage or plan.stages[index]
    parameters = stage_parameters_of(ctx, plan, index, stage)
    synced = parameters.edges if stage.gather_per_microbatch else parameters.total
    per = state_bytes_per_parameter(ctx.profile.dtype)
    return stage_sync_ms(ctx.links, stage.ranks, synced * per.weights, synced * per.gradients, stage.sharding)


def stage_update_ms(ctx: CostContext, plan: Plan, index: int, stage: StagePlan | None = None) -> tuple[float, ...]:
    """Each rank's optimizer step on stage ``index`` (or on ``stage`` put in its place): its
    shard of the stage's parameters when the stage shards optimizer state, all of them otherwise."""
    stage = stage or plan.stages[index]
    parameters = stage_parameters_of(ctx, plan, index, stage).total
    updated = parameters_updated(parameters, stage.sharding, stage.effective_shard_fractions())
    return tuple(
        optimizer_step_ms(ctx.profile.times(t), ctx.inventory.gpus[r].gpu_type, n)
        for r, t, n in zip(stage.ranks, stage.gpu_types, updated)
    )


def plan_stage_widths(plan: Plan) -> tuple[int, ...]:
    return tuple(len(stage.ranks) for stage in plan.stages)


def stage_memory(
    ctx: CostContext, plan: Plan, index: int, fractions: tuple[float, ...], stage: StagePlan | None = None
) -> tuple[RankMemory, ...]:
    """Peak memory of each rank of stage ``index`` (or of ``stage`` put in its place)."""
    stage = stage or plan.stages[index]
    first, last = index == 0, index == len(plan.stages) - 1
    parameters = stage_parameters_of(ctx, plan, index, stage)
    held, sharded = stage_state_bytes(parameters, ctx.profile.dtype, stage.sharding, stage.gather_per_microbatch)
    per_microbatch = activation_bytes_per_microbatch(
        ctx.profile, stage.layers, plan.microbatch_size, first=first, last=last, recompute=stage.recompute
    )
    widths, schedule = plan_stage_widths(plan), plan.schedule
    alike: dict[tuple, RankMemory] = {}  # identical GPUs of big stages share one record
    out = []
    for rank, n, fraction in zip(stage.ranks, stage.microbatches_per_rank, fractions):
        key = (n, fraction, ctx.reserves_bytes[rank])
        if key not in alike:
            flight = microbatches_in_flight(schedule, widths, index, n)
            alike[key] = RankMemory(held, sharded * fraction, per_microbatch * flight, key[2])
        out.append(alike[key])
    return tuple(out)


def free_memory_shard_fractions(ctx: CostContext, plan: Plan, index: int) -> tuple[float, ...]:
    """Shard fractions of a stage by each rank's memory left after its activations, reserve and
    the state it holds whole at its level (so every rank fills the same share of what is left)."""
    stage = plan.stages[index]
    unsharded = stage_memory(ctx, plan, index, tuple(0.0 for _ in stage.ranks))
    return shard_fractions_by_free_memory(
        [ctx.capacity_bytes(r) - m.total_bytes for r, m in zip(stage.ranks, unsharded)]
    )


def _link_transfer_ms(ctx: CostContext, src: int, dst: int, message_bytes: float, by_link: dict) -> float:
    """One message from ``src`` to ``dst``, priced once per link in ``by_link`` (many routes share one)."""
    key, bandwidth_gbps, latency_us = ctx.links.link(src, dst)
    if key not in by_link:
        by_link[key] = transfer_ms(message_bytes, bandwidth_gbps, latency_us)
    return by_link[key]


def receive_ms_per_microbatch(ctx: CostContext, plan: Plan, boundaries: tuple[BoundaryCost, ...]) -> list[list[float]]:
    """Per stage, per rank: the transfers it waits for per microbatch (see :func:`receiving_busy_ms`).

    A rank of stage ``i`` receives each microbatch's activation from stage ``i - 1``
    and its gradient from stage ``i + 1`` (the slowest route where several senders
    feed it). Before an activation moves, the receiver's notice that it is ready
    crosses the link the other way, behind the gradient the receiver has just sent
    that peer (1F1B: a backward, then the next forward's receive): so each
    activation costs the receiver that gradient's transfer too.
    """
    slowest: dict[tuple[int, int, str], float] = {}  # (stage, rank, "previous" | "next" stage) -> ms
    for i, boundary in enumerate(boundaries):
        message_bytes = boundary_message_bytes(ctx, plan, i)
        by_link: dict = {}
        for a, b, _ in boundary.routes:
            forward = _link_transfer_ms(ctx, a, b, message_bytes, by_link)
            back = _link_transfer_ms(ctx, b, a, message_bytes, by_link)
            for key, ms in (((i + 1, b, "previous"), forward + back), ((i, a, "next"), back)):
                slowest[key] = max(slowest.get(key, 0.0), ms)
    position = [{r: k for k, r in enumerate(stage.ranks)} for stage in plan.stages]
    receive = [[0.0] * len(stage.ranks) for stage in plan.stages]
    for (stage, rank, _), ms in slowest.items():
        receive[stage][position[stage][rank]] += ms
    return receive


def plan_cost(ctx: CostContext, plan: Plan) -> PlanCost:
    stages = tuple(stage_cost(ctx, plan, i) for i in range(len(plan.stages)))
    boundaries = tuple(boundary_cost(ctx, plan, i) for i in range(len(plan.stages) - 1))
    latencies, busy = [], []
    widths = plan_stage_widths(plan)
    for i, stage in enumerate(stages):
        latencies.append(stage.latency_ms)
        busy.append(stage.busy_ms)
        if i < len(boundaries):
            latencies.append(2 * boundaries[i].transfer_ms)
            busy.append(boundaries[i].busy_ms)
    receive = receive_ms_per_microbatch(ctx, plan, boundaries)
    for i, (stage_plan, stage) in enumerate(zip(plan.stages, stages)):
        element = 2 * i  # stages and boundaries alternate
        counts = list(stage_plan.microbatches_per_rank)
        totals = [t.total_ms for t in stage.times]
        in_flight = [microbatches_in_flight(plan.schedule, widths, i, n) for n in counts]
        waiting = round_trip_busy_ms(totals, counts, in_flight, sum(latencies[element + 1 :]))
        busy[element] = max(busy[element], waiting, receiving_busy_ms(totals, counts, receive[i]))
    tied = tied_sync_ms(ctx, plan.stages[0].ranks, plan.stages[-1].ranks) if len(stages) > 1 else 0.0
    return with_stage_costs(PlanCost(stages, boundaries, pipeline_ms(latencies, busy), 0.0, tied), stages)


def with_stage_costs(cost: PlanCost, stages: tuple[StageCost, ...]) -> PlanCost:
    """``cost`` with these stage costs, for a plan whose stages differ only in what they do after
    their last backward (sharding): the pipeline is the same, the synchronisation is recomputed."""
    changed = replace(cost, stages=stages)
    return replace(changed, sync_ms=max(changed.stage_sync_ms(i) for i in range(len(stages))))


def tied_sync_ms(ctx: CostContext, first_ranks: tuple[int, ...], last_ranks: tuple[int, ...]) -> float:
    """All-reduce of a tied embedding/head weight's gradient between the first and the last stage.

    The engine sums that gradient over the ranks of both stages every step,
    after each stage's own synchronisation and not overlapped with it, over
    whatever link joins them (often the slowest: the pipeline's two ends). The
    shared weight is the head's (a tied head holds nothing else).
    """
    if not ctx.profile.tied_embedding_head:
        return 0.0
    gradient_bytes = ctx.profile.head.parameters * state_bytes_per_parameter(ctx.profile.dtype).gradients
    ranks = tuple(sorted(set(first_ranks) | set(last_ranks)))
    return stage_sync_ms(ctx.links, ranks, gradient_bytes, gradient_bytes, Sharding.NONE)


def memory_overruns(ctx: CostContext, plan: Plan, cost: PlanCost) -> list[tuple[int, int, float]]:
    """(stage index, rank, GiB over capacity) for every rank that does not fit."""
    over = []
    for index, (stage, stage_cost_) in enumerate(zip(plan.stages, cost.stages)):
        for rank, memory in zip(stage.ranks, stage_cost_.memory):
            excess = memory.total_bytes - ctx.capacity_bytes(rank)
            if excess > 0:
                over.append((index, rank, bytes_to_gib(excess)))
    return over


def prediction(ctx: CostContext, plan: Plan, cost: PlanCost) -> Prediction:
    memory = [0.0] * plan.world_size
    for stage, stage_cost_ in zip(plan.stages, cost.stages):
        for rank, rank_memory in zip(stage.ranks, stage_cost_.memory):
            memory[rank] = round(bytes_to_gib(rank_memory.total_bytes), 4)
    types = {t for s in plan.stages for t in s.gpu_types}
    return Prediction(
        iteration_ms=cost.iteration_ms,
        samples_per_s=plan.global_batch_size / cost.iteration_ms * 1000.0,
        memory_gib=tuple(memory),
        profile_source={t: ctx.profile.times(t).source.value for t in sorted(types)},
    )

"""What a stage holds and does after its last backward, per rank: its parameters (every chunk of its group's,
on an interleaved plan), their synchronisation over the stage and the optimizer step, and its peak memory (for an
interleaved plan, from the activations its own program keeps in flight: :func:`rank_activation_bytes`). The
stage's compute and the plan's chain are :mod:`.evaluate`'s, which prices a whole plan from these."""

from __future__ import annotations

from zorse_lightning.planner.cost.comm import stage_sync_ms
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.memory import (
    RankMemory,
    StageParameters,
    activation_bytes_per_microbatch,
    combined_parameters,
    microbatches_in_flight,
    offload_working_bytes,
    offloaded_bytes_per_microbatch,
    optimizer_step_bytes,
    profile_state_bytes,
    shard_fractions_by_free_memory,
    stage_parameter_counts,
    stage_state_bytes,
    transient_bytes,
)
from zorse_lightning.planner.cost.recorded_programs import action_orders
from zorse_lightning.planner.cost.tensor_parallel import rank_parameters, tensor_parallel_sync_ms
from zorse_lightning.planner.cost.update import optimizer_step_ms, parameters_updated
from zorse_lightning.schedule.plan import Plan, StagePlan
from zorse_lightning.schedule.programs import Action, ActionKind


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
    """Each of ``ranks``' peak of activations over its own program (:func:`.recorded_programs.action_orders`:
    the order the engine runs): a forward keeps its chunk's activations of one microbatch until that
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
        programs = action_orders(ctx, plan)
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

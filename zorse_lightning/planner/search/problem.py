"""From a candidate (stage layout, microbatch size, schedule, sharding, recomputation) to
the arrays of the integer program, and from its solution back to a :class:`Plan`.

The integer program chooses *how many* layers each stage gets. Where layers
differ (measured profiles are noisy), each count is priced by its worst window
of consecutive layers, so the program's times and memory are upper bounds of the
cost model's for the split it returns (equal when the layers are alike), except the
optimizer step of a sharded stage, priced at an even split of the state: the split by
free memory that the plan gets depends on the microbatches the program chooses.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from zorse_lightning.capabilities import TENSOR_PARALLEL_SHARDING, P2PRules, Schedule, Sharding
from zorse_lightning.planner.cost.comm import stage_sync_ms, transfer_ms
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.evaluate import tied_sync_ms
from zorse_lightning.planner.cost.stage_state import free_memory_shard_fractions
from zorse_lightning.planner.search.layouts import Layout, unused_ranks
from zorse_lightning.planner.search.ilp import Assignment, AssignmentProblem, GroupCosts, StageCosts
from zorse_lightning.planner.cost.memory import profile_state_bytes, stage_state_bytes
from zorse_lightning.schedule.programs import one_f_one_b_warmup
from zorse_lightning.schedule.plan import Plan, StagePlan
from zorse_lightning.planner.cost.update import optimizer_step_ms, parameters_updated


SEARCH_SHARDING = Sharding.OPTIMIZER_GRADIENTS
"""The level the search shards its candidates' stages at (before it unshards those that fit and
lose nothing). ``optimizer_gradients`` holds and steps what ``optimizer`` does at half its
traffic (a reduce-scatter of the gradients and an all-gather of the weights, against two
all-reduces), so ``optimizer`` never wins; ``full`` gathered once per step holds the same at
its peak and moves the same (its all-gather only moves to before the next step's first
forward), so it never wins either. ``full`` gathered per microbatch is the one level with
less memory; the search tries it apart (one-stage plans only)."""


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    microbatch_size: int
    schedule: Schedule
    sharding: Sharding
    """For stages of more than one GPU; a one-GPU stage has nothing to shard. The program
    models every level but gathering per microbatch (one-stage plans, made by the search
    without a program: their one choice, microbatches per GPU, is an even split)."""
    recompute: bool


def _window_max(values: list[float]) -> tuple[float, ...]:
    """For k = 1..n: the largest sum of k consecutive values."""
    n = len(values)
    if all(v == values[0] for v in values):
        return tuple(values[0] * k for k in range(1, n + 1))
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    return tuple(max(prefix[a + k] - prefix[a] for a in range(n - k + 1)) for k in range(1, n + 1))


@dataclass(frozen=True)
class WindowCosts:
    """Worst-window layer costs by layer count, cached for one planning run."""

    ctx: CostContext
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def _memo(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def time_ms(self, gpu_type: str, microbatch_size: int, recompute: bool) -> tuple[float, ...]:
        def make():
            layers = self.ctx.profile.times(gpu_type).layers
            return _window_max(
                [
                    b.forward.at(microbatch_size) * (1 + recompute) + b.backward.at(microbatch_size)
                    for b in layers
                ]
            )

        return self._memo(("time", gpu_type, microbatch_size, recompute), make)

    def parameters(self) -> tuple[float, ...]:
        return self._memo(("params",), lambda: _window_max([float(b.parameters) for b in self.ctx.profile.layers]))

    def stage_tail_ms(
        self, ranks: tuple[int, ...], sharding: Sharding, first: bool, last: bool, tied_ms: float
    ) -> tuple[float, ...]:
        """By layer count: a stage's synchronisation over ``ranks`` (and a tied weight's ``tied_ms``) and its
        slowest group's optimizer step at an even share of the state. No microbatch size changes it, so
        each stage of a layout is priced once for all sizes (a third of building a program, before)."""

        def make():
            ctx, per = self.ctx, profile_state_bytes(self.ctx.profile)
            extra_params = edge_parameters(ctx, first, last)
            even_share = parameters_updated(1.0, sharding, (1.0 / len(ranks),))[0]  # of the stage's parameters, per rank
            groups = stage_groups(ctx, ranks)
            return tuple(
                stage_sync_ms(ctx.links, ranks, p * per.weights, p * per.gradients, sharding)
                + tied_ms
                + max(_update_ms(ctx, group, p * even_share) for group in groups)
                for p in (p + extra_params for p in self.parameters())
            )

        return self._memo(("tail", ranks, sharding, first, last, tied_ms), make)

    def activation_bytes(self, microbatch_size: int, recompute: bool) -> tuple[float, ...]:
        """Per microbatch; with recomputation the inputs plus the largest layer once."""

        def make():
            profile = self.ctx.profile
            if not recompute:
                return _window_max([
                    b.activation_bytes_per_sample * microbatch_size + b.activation_bytes_per_microbatch for b in profile.layers
                ])
            inputs = [profile.embedding, *profile.layers[:-1]]
            largest = max(
                b.activation_bytes_per_sample * microbatch_size + b.activation_bytes_per_microbatch for b in profile.layers
            )
            kept = _window_max([b.output_bytes_per_sample for b in inputs])
            return tuple(k * microbatch_size + largest for k in kept)

        return self._memo(("act", microbatch_size, recompute), make)


def boundary_transfer_ms(
    ctx: CostContext, sender: tuple[int, ...], receiver: tuple[int, ...], message_bytes: float, activation: bool
) -> tuple[float, float]:
    """Bounds on one transfer of a message (an ``activation``, with its host header, or a gradient) from a GPU
    of one group to one of another: (at the best bandwidth and latency, at the worst) over the machines involved."""
    low_gbps, high_gbps, low_us, high_us = ctx.links.between(sender, receiver, header=activation)
    return transfer_ms(message_bytes, high_gbps, low_us), transfer_ms(message_bytes, low_gbps, high_us)


def round_trip_ms(
    ctx: CostContext, sender: tuple[int, ...], receiver: tuple[int, ...], message_bytes: float
) -> tuple[float, float]:
    """Bounds on an activation from ``sender`` to ``receiver`` and its gradient back (:func:`boundary_transfer_ms`)."""
    forward = boundary_transfer_ms(ctx, sender, receiver, message_bytes, activation=True)
    back = boundary_transfer_ms(ctx, receiver, sender, message_bytes, activation=False)
    return forward[0] + back[0], forward[1] + back[1]


def receive_wait_ms(ctx: CostContext, layout: Layout, stage: int, ranks: tuple[int, ...], message_bytes: float) -> float:
    """Per microbatch, the transfers a GPU of ``ranks`` (on stage ``stage`` of ``layout``) waits for,
    over the slowest link to each neighbouring stage: the activation from the previous stage (under
    gloo's rules with the gradient it sent there ahead of its notice), and the gradient from the next
    stage (:func:`.cost.boundaries.receive_ms_per_microbatch`).

    The engine's receives block (:func:`.cost.compute.receiving_busy_ms`), so these waits add to the
    stage's busy time per microbatch as its compute does: splits that balance compute alone leave
    the stages with the most or slowest transfers (the middle ones, across slow links) busiest.
    """
    wait = 0.0
    if stage > 0:
        wait = boundary_transfer_ms(ctx, layout[stage - 1], ranks, message_bytes, activation=True)[1]
        if ctx.p2p_rules is P2PRules.GLOO:
            wait += boundary_transfer_ms(ctx, ranks, layout[stage - 1], message_bytes, activation=False)[1]
    if stage < len(layout) - 1:
        wait += boundary_transfer_ms(ctx, layout[stage + 1], ranks, message_bytes, activation=False)[1]
    return wait


def block_extras(ctx: CostContext, gpu_type: str, microbatch_size: int, first: bool, last: bool) -> tuple[float, float, float]:
    """(time_ms, parameters, activation bytes per microbatch) of the embedding and head a stage holds, the
    engine's own time of the microbatch's two actions (forward and backward) counted in its time where the
    host does not overlap the device (on CUDA it hides under the compute, as :func:`.cost.compute.stage_microbatch_times` prices it)."""
    return ctx.memo(("block extras", gpu_type, microbatch_size, first, last), lambda: _block_extras(ctx, gpu_type, microbatch_size, first, last))


def _block_extras(ctx: CostContext, gpu_type: str, microbatch_size: int, first: bool, last: bool) -> tuple[float, float, float]:
    profile, device = ctx.profile, ctx.profile.times(gpu_type)
    time = 0.0 if device.host_overlaps_device else 2 * ctx.action_overhead_ms(gpu_type)
    act = 0.0
    if first:
        time += device.embedding.forward.at(microbatch_size) + device.embedding.backward.at(microbatch_size)
        act += profile.embedding.activation_bytes_per_sample * microbatch_size + profile.embedding.activation_bytes_per_microbatch
    if last:
        time += device.head.forward.at(microbatch_size) + device.head.backward.at(microbatch_size)
        act += profile.head.activation_bytes_per_sample * microbatch_size + profile.head.activation_bytes_per_microbatch
    return time, edge_parameters(ctx, first, last), act


def edge_parameters(ctx: CostContext, first: bool, last: bool) -> float:
    """Parameters of the embedding and head a stage holds (a tied head's once)."""
    profile = ctx.profile
    head = 0 if (profile.tied_embedding_head and first) else profile.head.parameters
    return (profile.embedding.parameters if first else 0.0) + (head if last else 0.0)


def _update_ms(ctx: CostContext, group: tuple[int, ...], parameters: float) -> float:
    gpu_type = ctx.inventory.gpus[group[0]].gpu_type
    return optimizer_step_ms(ctx.profile.times(gpu_type.name), gpu_type, parameters)


def stage_groups(ctx: CostContext, ranks: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Identical GPUs of a stage: same type, memory and reserve (NCCL's memory is a type's too)."""
    found: dict[tuple, list[int]] = {}
    for rank in ranks:
        gpu = ctx.inventory.gpus[rank]
        found.setdefault((gpu.gpu_type.name, gpu.memory_gib, ctx.reserve_bytes(rank)), []).append(rank)
    return [tuple(g) for g in found.values()]


def build_problem(
    ctx: CostContext, windows: WindowCosts, candidate: Candidate, global_batch_size: int, layer_counts: tuple[int, ...] | None
) -> tuple[AssignmentProblem, list[list[tuple[int, ...]]]]:
    """The integer program of a candidate, and the rank groups its variables refer to."""
    profile, m = ctx.profile, candidate.microbatch_size
    num_layers, num_stages = profile.num_layers, len(candidate.layout)
    widths = tuple(len(ranks) for ranks in candidate.layout)
    per = profile_state_bytes(profile)
    message_bytes = max(b.output_bytes_per_sample for b in profile.layers) * m
    tied_ms = tied_sync_ms(ctx, candidate.layout[0], candidate.layout[-1]) if num_stages > 1 else 0.0
    stages, all_groups = [], []
    for s, ranks in enumerate(candidate.layout):
        first, last = s == 0, s == num_stages - 1
        sharding = candidate.sharding if len(ranks) > 1 else Sharding.NONE
        groups = stage_groups(ctx, ranks)
        extra_params = block_extras(ctx, ctx.inventory.gpus[ranks[0]].gpu_type.name, m, first, last)[1]
        params = [p + extra_params for p in windows.parameters()]
        costs = []
        for group in groups:
            gpu_type = ctx.inventory.gpus[group[0]].gpu_type.name
            extra_ms, _, extra_act = block_extras(ctx, gpu_type, m, first, last)
            times = windows.time_ms(gpu_type, m, candidate.recompute)
            held = [stage_state_bytes(p, per, sharding)[0] for p in params]
            unplanned = ctx.reserve_bytes(group[0]) + ctx.nccl_bytes(group[0], widths, s, num_stages > 1)
            costs.append(
                GroupCosts(
                    count=len(group),
                    microbatch_ms=tuple(t + extra_ms for t in times),
                    fixed_bytes=tuple(h + unplanned for h in held),
                    activation_bytes=tuple(a + extra_act for a in windows.activation_bytes(m, candidate.recompute)),
                    capacity_bytes=ctx.capacity_bytes(group[0]),
                    receive_ms=receive_wait_ms(ctx, candidate.layout, s, group, message_bytes),
                )
            )
        stages.append(
            StageCosts(
                groups=tuple(costs),
                latency_ms=tuple(max(c.microbatch_ms[k] for c in costs) for k in range(num_layers)),
                tail_ms=windows.stage_tail_ms(ranks, sharding, first, last, tied_ms if first or last else 0.0),
                sharded_bytes=tuple(stage_state_bytes(p, per, sharding)[1] for p in params),
                max_in_flight=None if candidate.schedule is Schedule.GPIPE else one_f_one_b_warmup(widths, s) + 1,
            )
        )
        all_groups.append(groups)
    constant = sum(
        round_trip_ms(ctx, a, b, message_bytes)[1] for a, b in zip(candidate.layout, candidate.layout[1:])
    )
    problem = AssignmentProblem(
        num_layers, global_batch_size // m, tuple(stages), constant_ms=constant, layer_counts=layer_counts
    )
    return problem, all_groups


def stage_plan(
    ctx: CostContext,
    ranks: tuple[int, ...],
    layers: tuple[int, int],
    microbatches,
    sharding: Sharding,
    recompute: bool,
    gather_per_microbatch: bool = False,
    tensor_parallel: int = 1,
) -> StagePlan:
    """A stage of ``ranks`` (replica by replica, each of ``tensor_parallel`` ranks) with their types and
    machines filled in; a stage of one replica is never sharded, a TP stage at most at a level TP runs
    (:data:`~zorse_lightning.capabilities.TENSOR_PARALLEL_SHARDING`: ``optimizer`` for any other)."""
    gpus = [ctx.inventory.gpus[r] for r in ranks]
    sharded = len(ranks) > tensor_parallel
    sharding = level_with(sharding, tensor_parallel)
    return StagePlan(
        ranks=tuple(ranks),
        gpu_types=tuple(g.gpu_type.name for g in gpus),
        machines=tuple(g.machine for g in gpus),
        layers=layers,
        microbatches_per_rank=tuple(microbatches),
        sharding=sharding if sharded else Sharding.NONE,
        recompute=recompute,
        gather_per_microbatch=gather_per_microbatch and sharded,
        tensor_parallel=tensor_parallel,
    )


def level_with(sharding: Sharding, tensor_parallel: int) -> Sharding:
    """``sharding``, or ``optimizer`` where a stage of TP degree ``tensor_parallel`` does not run it (the one
    level of :data:`~zorse_lightning.capabilities.TENSOR_PARALLEL_SHARDING` that shards anything)."""
    return sharding if tensor_parallel == 1 or sharding in TENSOR_PARALLEL_SHARDING else Sharding.OPTIMIZER


def layout_plan(ctx: CostContext, stages, global_batch_size: int, microbatch_size: int, schedule: Schedule, **fields) -> Plan:
    """A plan over the stages, every rank outside them idle."""
    layout = tuple(s.ranks for s in stages)
    return Plan(
        model=ctx.profile.model,
        cluster=ctx.inventory.name,
        num_layers=ctx.profile.num_layers,
        world_size=ctx.inventory.world_size,
        global_batch_size=global_batch_size,
        microbatch_size=microbatch_size,
        schedule=schedule,
        stages=tuple(stages),
        idle_ranks=unused_ranks(ctx.inventory.world_size, layout),
        **fields,
    )


def to_plan(
    ctx: CostContext,
    candidate: Candidate,
    assignment: Assignment,
    groups: list[list[tuple[int, ...]]],
    global_batch_size: int,
    notes: tuple[str, ...] = (),
) -> Plan:
    """The plan of a solved candidate: contiguous layers, each group's microbatches spread
    evenly over its GPUs, sharded state split by free memory."""
    stages, start = [], 0
    for ranks, count, stage_groups_, shares in zip(candidate.layout, assignment.layer_counts, groups, assignment.group_microbatches):
        per_rank = {}
        for group, share in zip(stage_groups_, shares):
            base, extra = divmod(share, len(group))
            per_rank.update({r: base + (i < extra) for i, r in enumerate(group)})
        microbatches = [per_rank[r] for r in ranks]
        stages.append(stage_plan(ctx, ranks, (start, start + count), microbatches, candidate.sharding, candidate.recompute))
        start += count
    plan = layout_plan(
        ctx, stages, global_batch_size, candidate.microbatch_size, candidate.schedule, solver=assignment.record, notes=notes
    )
    return with_free_memory_shards(ctx, plan)


def with_free_memory_shards(ctx: CostContext, plan: Plan) -> Plan:
    """Set uneven shard fractions (by free memory) on every sharded stage."""
    stages = tuple(
        replace(stage, shard_fractions=free_memory_shard_fractions(ctx, plan, i)) if stage.sharding is not Sharding.NONE else stage
        for i, stage in enumerate(plan.stages)
    )
    return replace(plan, stages=stages)

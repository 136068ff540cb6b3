"""What tensor parallelism costs: a stage whose blocks are split over TP groups of ``t`` GPUs of one type on one
machine (``StagePlan.tensor_parallel`` = t > 1; the engine's split: :mod:`zorse_lightning.engine.tensor_parallel`).

Each rank of a TP group runs every microbatch of its replica, and per microbatch:

* **compute**: each layer's one-GPU time over ``t`` at the type's efficiency (:func:`tensor_parallel_efficiency`:
  measured where the profile holds a measurement on ``t`` GPUs of the type, else the catalogued
  :attr:`~zorse_lightning.cluster.gpu_type.GpuType.tensor_parallel_efficiency`); the embedding and head are not
  split (every rank computes them whole);
* **collectives** (:func:`block_collectives_ms`): Megatron's split sums a block's partial outputs twice in its
  forward (after the attention's and the MLP's row-wise projections) and their input gradients twice in its
  backward: four all-reduces of the block's activation (its output's bytes) over the group's links (the machine's
  GPU-to-GPU link, :meth:`~.comm.LinkTable.all_reduce_ms`), not overlapped with the compute; recomputation reruns
  the forward's two inside the backward;
* **memory** (:func:`rank_parameters`, :func:`split_layer_activation_bytes`): a layer's weights, gradients,
  optimizer state and most activations over ``t``; what the split leaves whole is held by every rank: the
  embedding and head, each layer's norms and row-wise biases
  (:attr:`~zorse_lightning.profiling.profile.TensorParallelSupport.replicated_parameters_per_layer`) and the
  activations around the split parts (:data:`REPLICATED_ACTIVATION_OUTPUTS`);
* **data-parallel reduction** (:func:`tensor_parallel_sync_ms`): each TP index's shard summed over the replicas'
  ranks of that index, the ``t`` groups at once, sharing the links they cross;
* **stage boundary**: the whole activation from TP rank ``r`` to rank ``r mod t`` of the next stage's replica
  (:func:`~zorse_lightning.schedule.actions.messages_of` routes it; :func:`tensor_parallel_pairs` for the closed
  form), so a boundary between machines carries it once per receiving rank.

The closed form (:mod:`.evaluate`) and the event simulation (:mod:`.simulate`, which plays the same per-rank
times and ``messages_of``'s messages) price these the same way. :func:`tensor_parallel_degrees` says which degrees
a group of ranks can take, for the search.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from zorse_lightning.capabilities import Sharding
from zorse_lightning.cluster.gpu_type import GpuType
from zorse_lightning.planner.cost.comm import LinkTable, stage_sync_ms
from zorse_lightning.planner.cost.compute import MicrobatchTimes
from zorse_lightning.profiling.profile import BlockShape, DeviceTimes, ModelProfile
from zorse_lightning.schedule.plan import StagePlan

if TYPE_CHECKING:
    from zorse_lightning.planner.cost.context import CostContext
    from zorse_lightning.planner.cost.memory import StageParameters

REPLICATED_ACTIVATION_OUTPUTS = 5
"""A split layer's saved activations that every rank of its TP group keeps whole, in units of the layer's output
bytes: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198,
section 4.2) count ``s b h (34 + 5 a s / h)`` bytes per layer at 16 bits, of which tensor parallelism without
sequence parallelism splits all but ``10 s b h``: the two layer norms' inputs and the dropout masks and inputs around
them, five times the layer's output (``2 s b h`` bytes). Capped at the layer's whole activations."""

ALL_REDUCES_PER_PASS = 2
"""All-reduces of a split block's activation per forward (after the attention's and the MLP's row-wise projection)
and per backward (the input gradients of their column-wise projections)."""


def tensor_parallel_efficiency(device: DeviceTimes, gpu_type: GpuType, degree: int) -> float:
    """The efficiency of ``degree``-way split blocks on ``gpu_type``: measured where the profile holds it, else the
    type's catalogued one."""
    measured = dict(device.tensor_parallel_efficiency).get(degree)
    return measured if measured is not None else gpu_type.tensor_parallel_efficiency


def split_device_times(device: DeviceTimes, factor: float) -> DeviceTimes:
    """``device``'s times with every layer's scaled by ``factor`` (:func:`split_factor`: split over a TP group);
    the embedding and head whole."""
    return replace(device, layers=tuple(layer.scaled(factor) for layer in device.layers))


def block_collectives_ms(
    links: LinkTable, group: Sequence[int], profile: ModelProfile, layers: tuple[int, int], microbatch_size: int,
    recompute: bool,
) -> tuple[float, float]:
    """(forward, backward) ms of one microbatch's TP all-reduces through ``layers`` on TP group ``group``: two of
    each layer's output per pass (:data:`ALL_REDUCES_PER_PASS`), two more in the backward where it recomputes."""
    order = tuple(sorted(group))
    forward = sum(
        ALL_REDUCES_PER_PASS * links.all_reduce_ms(order, block.output_bytes_per_sample * microbatch_size)
        for block in profile.layers[layers[0] : layers[1]]
    )
    return forward, forward * (2 if recompute else 1)


def layer_terms(
    ctx: CostContext, group: Sequence[int], degree: int, microbatch_size: int, recompute: bool
) -> tuple[float, float]:
    """(factor, ms) that give a layer's time per microbatch on TP group ``group`` (ranks of one type) from its
    one-GPU time: times ``factor`` (:func:`split_factor`), plus ``ms`` of all-reduces (the largest layer
    output's, :func:`block_collectives_ms`); (1, 0) at degree 1. For splits that balance layers by count."""
    if degree == 1:
        return 1.0, 0.0
    largest = max(b.output_bytes_per_sample for b in ctx.profile.layers) * microbatch_size
    passes = 2 + recompute  # forward, backward, and the forward again where it recomputes
    factor = split_factor(ctx, ctx.inventory.gpus[group[0]].gpu_type.name, degree)
    return factor, passes * ALL_REDUCES_PER_PASS * ctx.links.all_reduce_ms(tuple(sorted(group)), largest)


def split_factor(ctx: CostContext, gpu_type: str, degree: int) -> float:
    """What a layer's one-GPU time on ``gpu_type`` is multiplied by when split ``degree`` ways: 1 / (degree x
    efficiency)."""
    if degree == 1:
        return 1.0
    kind = next(t for t in ctx.inventory.gpu_types if t.name == gpu_type)
    return 1.0 / (degree * tensor_parallel_efficiency(ctx.profile.times(gpu_type), kind, degree))


def stage_rank_times(
    ctx: CostContext, stage: StagePlan, microbatch_size: int, first: bool, last: bool
) -> tuple[MicrobatchTimes, ...]:
    """One microbatch on each rank of a TP ``stage`` (in the order of its ranks): its split compute
    (:meth:`~.context.CostContext.microbatch_times` at the stage's degree) plus its group's collectives."""
    out: list[MicrobatchTimes] = []
    for group in stage.replicas:
        gpu_type = stage.gpu_types[len(out)]
        compute = ctx.microbatch_times(
            gpu_type, stage.layers, microbatch_size, first, last, stage.recompute, stage.offload_activations,
            tensor_parallel=stage.tensor_parallel,
        )
        forward_ms, backward_ms = block_collectives_ms(
            ctx.links, group, ctx.profile, stage.layers, microbatch_size, stage.recompute
        )
        times = MicrobatchTimes(compute.forward_ms + forward_ms, compute.backward_ms + backward_ms)
        out.extend(times for _ in group)
    return tuple(out)


def rank_parameters(parameters: StageParameters, degree: int, replicated_per_layer: int) -> StageParameters:
    """What one rank of a ``degree``-way TP group holds of a stage's ``parameters``: each layer's split part over
    ``degree`` (rounded up), its ``replicated_per_layer`` and the embedding and head whole."""
    if degree == 1:
        return parameters

    def split(layer_parameters: int, layers: int) -> int:
        kept = min(replicated_per_layer * layers, layer_parameters)
        return kept + -(-(layer_parameters - kept) // degree)

    layers = split(parameters.layers, parameters.num_layers)
    largest = split(parameters.largest_layer, 1 if parameters.num_layers else 0)
    return replace(parameters, total=parameters.edges + layers, layers=layers, largest_layer=largest)


def split_layer_activation_bytes(block: BlockShape, microbatch_size: int, degree: int) -> float:
    """Bytes one microbatch keeps of ``block`` (a layer) on one rank of a ``degree``-way TP group: what the split
    leaves whole (:data:`REPLICATED_ACTIVATION_OUTPUTS`), the rest and the per-microbatch part (autocast's copies of
    the split weights) over ``degree``."""
    whole = block.activation_bytes_per_sample
    kept = min(REPLICATED_ACTIVATION_OUTPUTS * block.output_bytes_per_sample, whole) if degree > 1 else whole
    return (kept + (whole - kept) / degree) * microbatch_size + block.activation_bytes_per_microbatch / degree


def tensor_parallel_sync_ms(
    links: LinkTable, stage: StagePlan, weight_bytes: float, gradient_bytes: float
) -> float:
    """Synchronisation of a TP ``stage`` after its last backward: each TP index's data-parallel group (the
    replicas' ranks of that index, :meth:`StagePlan.data_ranks`) reduces the bytes one rank holds, the ``t`` groups
    at once (:meth:`~.comm.LinkTable.concurrent_all_reduce_ms`: across machines their flows share the link).
    ``none`` and ``optimizer`` as :func:`~.comm.stage_sync_ms` runs them; the levels that move whole parameters
    (``optimizer_gradients``, ``full``), which the engine refuses with TP, are priced as one TP index's group alone."""
    groups = tuple(tuple(sorted(stage.data_ranks(i))) for i in range(stage.tensor_parallel))
    if stage.sharding is Sharding.NONE:
        return links.concurrent_all_reduce_ms(groups, gradient_bytes)
    if stage.sharding is Sharding.OPTIMIZER:
        return links.concurrent_all_reduce_ms(groups, gradient_bytes) + links.concurrent_all_reduce_ms(groups, weight_bytes)
    fractions = stage.effective_shard_fractions()[:: stage.tensor_parallel]
    return stage_sync_ms(links, stage.data_ranks(0), weight_bytes, gradient_bytes, stage.sharding, fractions)


def tensor_parallel_pairs(sender: tuple[int, ...], receiver: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The (sending, receiving) rank pairs between a replica of degree ``a`` and one of degree ``b`` (TP groups, or
    single ranks) that carry a microbatch's messages: TP rank ``q`` of the receiver takes the activation from rank
    ``q mod a``, rank ``p`` of the sender the gradient from ``p mod b``
    (:func:`~zorse_lightning.schedule.actions.messages_of`); both directions as one pair per index up to the larger
    degree."""
    a, b = len(sender), len(receiver)
    if a == b == 1:
        return ((sender[0], receiver[0]),)
    return tuple((sender[k % a], receiver[k % b]) for k in range(max(a, b)))


def tensor_parallel_degrees(ctx: CostContext, ranks: Sequence[int], most: int | None = None) -> tuple[int, ...]:
    """The degrees ``t > 1`` (at most ``most``, where given) a stage on ``ranks``, listed replica by replica, can
    take: the model's blocks admit ``t`` (``ctx.profile.tensor_parallel``), ``t`` divides the ranks, and each run of
    ``t`` consecutive ranks is on one machine and of one GPU type. Increasing; empty where none."""
    gpus = ctx.inventory.gpus
    where = [(gpus[r].machine, gpus[r].gpu_type.name) for r in ranks]
    return tuple(
        t for t in ctx.profile.tensor_parallel.degrees
        if (most is None or t <= most) and len(where) % t == 0
        and all(len(set(where[i : i + t])) == 1 for i in range(0, len(where), t))
    )

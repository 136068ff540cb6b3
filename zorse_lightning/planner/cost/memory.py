"""Memory of one GPU of a stage: training state, activations in flight, a reserve.

Every GPU is checked against its *own* capacity (``Gpu.memory_gib``), never the
smallest of its group: a stage that mixes a 40 GiB and a 16 GiB GPU gives the
big one more microbatches in flight and, when state is sharded, a bigger shard.

Bytes per parameter (ZeRO paper's accounting):

* mixed precision (float16 / bfloat16 training): weights 2 + gradients 2 +
  optimizer 12 (fp32 master copy 4 + Adam moments 4 + 4) = 16;
* float32 training: weights 4 + gradients 4 + optimizer 8 (two moments) = 16.

What a stage shards across its GPUs, by level (:func:`stage_state_bytes`; the
engine assigns whole parameters to owners by ``shard_fractions``):

* ``none``: every GPU holds weights, gradients and optimizer state;
* ``optimizer`` and ``optimizer_gradients``: optimizer state sharded; every GPU
  still holds all weights and, during the step, all gradients (the latter
  accumulates them locally over the step's microbatches and reduces each to its
  owner only at the end), so the peak is the same;
* ``full`` gathered once per step: between steps a GPU holds only its own
  parameters, but it gathers all of them before its first microbatch and keeps
  them, with full gradients, until the step ends: the same peak again;
* ``full`` gathered per microbatch (one-stage plans): the layers' weights,
  gradients and optimizer state are all sharded, and a GPU holds whole only the
  embedding and head (weights and gradients) and two gathered blocks (one in use
  with its gradient while the next gathers) -- the only level whose peak shrinks
  with the number of GPUs beyond the optimizer state.

Beside what torch allocates, a real GPU holds what nothing in torch counts: the
CUDA context and the allocator's fragmentation (the reserve)
and the buffers NCCL allocates for each communicator: :mod:`.framework_memory`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from zorse_lightning.capabilities import Schedule, Sharding
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.cost.tensor_parallel import split_layer_activation_bytes
from zorse_lightning.profiling.profile import BlockShape, ModelProfile
from zorse_lightning.schedule.programs import one_f_one_b_warmup

@dataclass(frozen=True)
class StateBytes:
    """Training-state bytes per parameter for one training precision."""

    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


_STATE_BYTES = {
    "float16": StateBytes(weights=2, gradients=2, optimizer=12),
    "bfloat16": StateBytes(weights=2, gradients=2, optimizer=12),
    "float32": StateBytes(weights=4, gradients=4, optimizer=8),
}


_ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def profile_state_bytes(profile: ModelProfile) -> StateBytes:
    """Training-state bytes per parameter of what the profile measured: weights and gradients in the dtype
    the weights are held in (float32 under autocast: its gradients are reduced in float32 too), and the
    state the user's optimizer keeps (AdamW two moments; SGD none); the ZeRO accounting of the profile's
    dtype where start-up did not say (reference and estimated profiles)."""
    if profile.weight_dtype is None:
        return state_bytes_per_parameter(profile.dtype)
    try:
        element = _ELEMENT_BYTES[profile.weight_dtype]
    except KeyError:
        raise PlanningError(
            f"profile weight_dtype={profile.weight_dtype!r} is not a dtype the planner knows "
            f"(known: {', '.join(_ELEMENT_BYTES)}); train the weights in one of those"
        ) from None
    optimizer = profile.optimizer.state_bytes_per_parameter if profile.optimizer is not None else 2 * element
    return StateBytes(weights=element, gradients=element, optimizer=round(optimizer))


def optimizer_step_bytes(profile: ModelProfile, parameters_stepped: float) -> float:
    """Temporaries of one optimizer step over ``parameters_stepped`` (foreach AdamW: about a copy of the
    parameters it steps), held at the step, when the activations are gone."""
    if profile.optimizer is None:
        return 0.0
    return profile.optimizer.step_bytes_per_parameter * parameters_stepped


def state_bytes_per_parameter(dtype: str) -> StateBytes:
    try:
        return _STATE_BYTES[dtype]
    except KeyError:
        raise PlanningError(
            f"profile dtype={dtype!r} is not a training precision the planner knows "
            f"(known: {', '.join(_STATE_BYTES)}); profile the model in one of those"
        ) from None


def stage_blocks(profile: ModelProfile, layers: tuple[int, int], *, first: bool, last: bool) -> list[BlockShape]:
    """The blocks a stage holds: its layers, plus the embedding on the first stage and the
    head on the last (a tied head on a one-stage plan shares the embedding's weights)."""
    blocks = list(profile.layers[layers[0] : layers[1]])
    if first:
        blocks.insert(0, profile.embedding)
    if last:
        blocks.append(_head_shape(profile, first))
    return blocks


def _head_shape(profile: ModelProfile, first: bool) -> BlockShape:
    if profile.tied_embedding_head and first:
        head = profile.head
        return BlockShape(head.name, 0, head.activation_bytes_per_sample, head.output_bytes_per_sample, head.forward_flops_per_sample)
    return profile.head


def stage_parameters(profile: ModelProfile, layers: tuple[int, int], *, first: bool, last: bool) -> int:
    return sum(b.parameters for b in stage_blocks(profile, layers, first=first, last=last))


@dataclass(frozen=True)
class StageParameters:
    """A stage's parameters as gathering block by block needs them (full sharding per microbatch):
    the layers are gathered and sharded, the embedding and head ("edges") are kept whole."""

    total: int
    """Every parameter the stage holds, embedding and head included."""
    layers: int
    """Those of its blocks (the model's layers)."""
    largest_layer: int
    num_layers: int

    @property
    def edges(self) -> int:
        return self.total - self.layers

    @property
    def gathered(self) -> int:
        """Layer parameters held whole at once: one block in use while the next gathers."""
        return min(2 * self.largest_layer, self.layers)


def combined_parameters(parts: tuple[StageParameters, ...]) -> StageParameters:
    """The parameters of several stages held by the same ranks (an interleaved group's chunks)."""
    if len(parts) == 1:
        return parts[0]
    return StageParameters(
        sum(p.total for p in parts), sum(p.layers for p in parts), max(p.largest_layer for p in parts), sum(p.num_layers for p in parts)
    )


def stage_parameter_counts(profile: ModelProfile, layers: tuple[int, int], *, first: bool, last: bool) -> StageParameters:
    chosen = [b.parameters for b in profile.layers[layers[0] : layers[1]]]
    total = stage_parameters(profile, layers, first=first, last=last)
    return StageParameters(total, sum(chosen), max(chosen, default=0), len(chosen))


def activation_bytes_per_microbatch(
    profile: ModelProfile, layers: tuple[int, int], microbatch_size: int, *, first: bool, last: bool, recompute: bool,
    offload: bool = False, tensor_parallel: int = 1,
) -> float:
    """Bytes one microbatch keeps on the stage between its forward and its backward.

    With recomputation a layer keeps only its input (the previous block's output)
    and the backward of one layer at a time rebuilds that layer's activations,
    hence the largest layer's activations once on top. Embedding and head are not
    recomputed. Each block's bytes per microbatch (autocast's weight copies) count
    once per microbatch, whatever its size. With offload the layers keep nothing on
    the device but the stage's output (held for its gradient); what they save is in
    host memory (:func:`offloaded_bytes_per_microbatch`: with recomputation, only their
    inputs), and the microbatch whose backward runs holds :func:`offload_working_bytes`
    besides. On a rank of a TP group (``tensor_parallel`` = t > 1) each layer keeps
    its split share (:func:`~.tensor_parallel.split_layer_activation_bytes`); the
    layers' inputs and the embedding and head stay whole.
    """
    start, end = layers
    edges = ([profile.embedding] if first else []) + ([profile.head] if last else [])
    per_sample = sum(b.activation_bytes_per_sample for b in edges)
    fixed = sum(b.activation_bytes_per_microbatch for b in edges)
    chosen = profile.layers[start:end]
    if offload:
        per_sample += chosen[-1].output_bytes_per_sample
    elif tensor_parallel > 1:
        split = [split_layer_activation_bytes(b, microbatch_size, tensor_parallel) for b in chosen]
        if not recompute:
            return per_sample * microbatch_size + fixed + sum(split)
        per_sample += sum(b.output_bytes_per_sample for b in _layer_inputs(profile, layers))
        fixed += max(split)
    elif recompute:
        per_sample += sum(b.output_bytes_per_sample for b in _layer_inputs(profile, layers))
        largest = max(chosen, key=lambda b: b.activation_bytes_per_sample * microbatch_size + b.activation_bytes_per_microbatch)
        per_sample += largest.activation_bytes_per_sample
        fixed += largest.activation_bytes_per_microbatch
    else:
        per_sample += sum(b.activation_bytes_per_sample for b in chosen)
        fixed += sum(b.activation_bytes_per_microbatch for b in chosen)
    return per_sample * microbatch_size + fixed


def _layer_inputs(profile: ModelProfile, layers: tuple[int, int]) -> list[BlockShape]:
    """The blocks whose outputs are the inputs of ``layers`` (the embedding's for layer 0)."""
    return [profile.layers[i - 1] if i > 0 else profile.embedding for i in range(*layers)]


def offloaded_bytes_per_microbatch(
    profile: ModelProfile, layers: tuple[int, int], microbatch_size: int, recompute: bool = False
) -> float:
    """Bytes one microbatch's forward copies to host memory on a stage that offloads: what its layers keep
    for the backward (the embedding and head keep theirs on the device); with ``recompute``, what
    recomputation keeps: each layer's input."""
    if recompute:
        return sum(b.output_bytes_per_sample for b in _layer_inputs(profile, layers)) * microbatch_size
    chosen = profile.layers[layers[0] : layers[1]]
    return sum(b.activation_bytes_per_sample * microbatch_size + b.activation_bytes_per_microbatch for b in chosen)


def offload_working_bytes(
    profile: ModelProfile, layers: tuple[int, int], microbatch_size: int, recompute: bool = False
) -> float:
    """Device bytes of an offloading stage's running microbatch: what it brings back for the block whose
    backward runs and for the one ahead of it (the engine prefetches one block), at most twice the largest
    layer's; with ``recompute`` those are two layer inputs, and the layer recomputed holds its activations."""
    chosen = profile.layers[layers[0] : layers[1]]
    if recompute:
        largest = max(b.activation_bytes_per_sample * microbatch_size + b.activation_bytes_per_microbatch for b in chosen)
        return largest + 2.0 * max(b.output_bytes_per_sample for b in _layer_inputs(profile, layers)) * microbatch_size
    largest = max(b.activation_bytes_per_sample * microbatch_size + b.activation_bytes_per_microbatch for b in chosen)
    return 2.0 * largest


def host_memory_overruns(inventory: ClusterInventory, host_gib_by_rank: Mapping[int, float]) -> dict[str, float]:
    """Machine -> GiB its ranks would pin beyond :attr:`~zorse_lightning.cluster.inventory.Machine.pinnable_host_gib`
    (activation offload's buffers; ``host_gib_by_rank``: what each rank pins), for the machines over it."""
    over = {}
    for machine in inventory.machines:
        pinned = sum(host_gib_by_rank.get(r, 0.0) for r in inventory.ranks_by_machine[machine.name])
        if pinned > machine.pinnable_host_gib:
            over[machine.name] = pinned - machine.pinnable_host_gib
    return over


def transient_bytes(profile: ModelProfile, microbatch_size: int, *, first: bool, last: bool) -> float:
    """Bytes a rank holds only while one microbatch runs (on top of every microbatch in flight): the
    edges' transients, the head's above all (its logits' gradients)."""
    edges = ([profile.embedding] if first else []) + ([profile.head] if last else [])
    return float(sum(b.transient_bytes_per_sample * microbatch_size + b.transient_bytes_per_microbatch for b in edges))


def microbatches_in_flight(
    schedule: Schedule, stage_widths: tuple[int, ...], stage_index: int, num_microbatches: int
) -> int:
    """Microbatches whose activations a rank holds at its peak.

    1F1B: the warm-up forwards (:func:`one_f_one_b_warmup`) and the one whose
    backward comes next; GPipe runs every forward first.
    """
    if schedule is Schedule.GPIPE:
        return num_microbatches
    return min(num_microbatches, one_f_one_b_warmup(stage_widths, stage_index) + 1)


@dataclass(frozen=True)
class RankMemory:
    """Peak bytes of one rank, by component."""

    state_bytes: float
    """Training state every rank of the stage holds whole (:func:`stage_state_bytes`)."""
    sharded_bytes: float
    """This rank's share of the sharded training state."""
    activation_bytes: float
    reserve_bytes: float
    step_bytes: float = 0.0
    """The optimizer step's temporaries (:func:`optimizer_step_bytes`): held after the last backward, when
    the activations are freed, so the peak holds the larger of the two."""
    host_bytes: float = 0.0
    """Pinned host memory of the rank's offloaded activations at its peak (not on the device: not in
    :attr:`total_bytes`); the machine's ranks share its host memory."""
    nccl_bytes: float = 0.0
    """NCCL's buffers of the rank's communicators (:class:`NcclBuffers` times :func:`nccl_communicators`;
    none on an emulated rank, whose groups are gloo's)."""

    @property
    def total_bytes(self) -> float:
        return (
            self.state_bytes + self.sharded_bytes + max(self.activation_bytes, self.step_bytes) + self.reserve_bytes
            + self.nccl_bytes
        )


def stage_state_bytes(
    parameters: int | StageParameters, dtype: str | StateBytes, sharding: Sharding, gather_per_microbatch: bool = False
) -> tuple[float, float]:
    """(bytes every rank of the stage holds at its peak, bytes the stage shards across its ranks),
    by sharding level (see the module docstring). Gathering per microbatch needs the stage's
    :class:`StageParameters` (which of them are layers, and the largest layer). ``dtype``: a training
    precision's accounting, or the bytes a profile measured (:func:`profile_state_bytes`)."""
    per = dtype if isinstance(dtype, StateBytes) else state_bytes_per_parameter(dtype)
    total = parameters.total if isinstance(parameters, StageParameters) else parameters
    if sharding is Sharding.NONE:
        return float(total * per.total), 0.0
    if not gather_per_microbatch:
        return float(total * (per.weights + per.gradients)), float(total * per.optimizer)
    if sharding is not Sharding.FULL or not isinstance(parameters, StageParameters):
        raise PlanningError(
            f"gathering per microbatch needs sharding 'full' (got {sharding.value!r}) and the stage's layer "
            f"parameters (StageParameters, got {type(parameters).__name__})"
        )
    whole = per.weights + per.gradients
    held = (parameters.edges + parameters.gathered) * whole
    return float(held), float(parameters.layers * per.total + parameters.edges * per.optimizer)


def shard_fractions_by_free_memory(free_bytes: list[float]) -> tuple[float, ...]:
    """Shares of a stage's sharded state, proportional to each rank's free memory.

    Every rank then fills the same fraction of its free memory, so the stage fits
    exactly when the sharded state fits into the sum of free memory (an even split
    needs the smallest free memory times the rank count).
    """
    positive = [max(f, 0.0) for f in free_bytes]
    total = sum(positive)
    if total <= 0:
        return tuple(1.0 / len(free_bytes) for _ in free_bytes)
    return tuple(f / total for f in positive)

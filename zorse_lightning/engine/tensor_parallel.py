"""A stage's blocks split over its TP groups, and the engine's view of what that makes of their weights.

After the stage is materialized (every rank of a TP group holds identical
values), each block is split with ``parallelize_module`` on a one-dimensional
mesh over the rank's TP group (``DeviceMesh.from_group``: no new communicator,
the group is one :func:`~.groups.build_groups` made and setup warmed), slicing
each rank's own full copy without communication (``src_data_rank=None``). The
split weights become DTensors: column-wise ``Shard(0)``, row-wise ``Shard(1)``,
a row-wise bias ``Replicate``. Everything the engine does to weights outside
autograd (flat gradient buckets, the global norm, shard updates) reads their
local tensors (:func:`local`): a DTensor's own ops would communicate, and
reshaping a ``Shard(1)`` one silently all-gathers it. A gradient given to a
DTensor weight must be a DTensor too (a plain one is accepted and wrong):
:func:`as_gradient` wraps a view of a flat bucket without copying, and autograd
accumulates into it in place.

What combines with TP so far (:func:`check_stage`): sharding ``none`` and
``optimizer`` (shards over the replicas' ranks of one TP index hold local
slices), recomputation, stages of different degrees (:func:`~zorse_lightning.schedule.actions.messages_of`
pairs their TP ranks). The random state agrees across each TP group from setup on (:func:`agree_random_state`):
a dropout on replicated activations draws one mask on every rank of the group; one inside a split part draws
the same mask for each rank's heads. Checkpoints hold whole tensors
(gathered over the TP group as they are written; optimizer state cut again as it is read), so a checkpoint
resumes on a plan with or without TP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from zorse_lightning.capabilities import TENSOR_PARALLEL_SHARDING
from zorse_lightning.errors import PlanningError
from zorse_lightning.module.tensor_parallel import BlockTensorPlan, local
from zorse_lightning.schedule.plan import Plan

__all__ = [
    "agree_random_state", "as_gradient", "check_stage", "is_split", "like_parameter", "local", "mesh_of",
    "parallelize_block",
]



def check_stage(plan: Plan, stage_index: int) -> None:
    """Refuse what the engine does not run with TP yet, naming the value and what to choose instead."""
    stage = plan.stages[stage_index]
    if stage.tensor_parallel == 1:
        return
    where = f"stage {stage_index} (tensor_parallel={stage.tensor_parallel})"
    if stage.sharding not in TENSOR_PARALLEL_SHARDING:
        raise PlanningError(
            f"{where} has sharding {stage.sharding.value!r}, which does not run with tensor parallelism yet (it moves "
            f"whole parameters between owners); use one of {[s.value for s in TENSOR_PARALLEL_SHARDING]} or tensor_parallel=1"
        )
    if stage.offload_activations:
        raise PlanningError(
            f"{where} offloads activations, which does not run with tensor parallelism yet; set offload_activations "
            f"false (recompute keeps less instead) or tensor_parallel=1"
        )
    if stage.gather_per_microbatch:
        raise PlanningError(f"{where} gathers per microbatch, which needs sharding 'full'; set gather_per_microbatch false")


def mesh_of(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """A one-dimensional mesh over the TP group (the engine's own group: no new communicator)."""
    return DeviceMesh.from_group(group, device.type)


def parallelize_block(block: nn.Module, plan: BlockTensorPlan, mesh: DeviceMesh) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """Split ``block`` over ``mesh`` by ``plan``; returns (old, new) for each parameter it replaced."""
    before = {(name, key): param for name, module in block.named_modules() for key, param in module._parameters.items()}
    parallelize_module(block, mesh, plan.torch_plan(), src_data_rank=None)
    after = {(name, key): param for name, module in block.named_modules() for key, param in module._parameters.items()}
    return [(before[slot], new) for slot, new in after.items() if before.get(slot) is not None and before[slot] is not new]


def is_split(param: torch.Tensor) -> bool:
    """Whether each rank of the TP group holds a different slice of ``param`` (else every rank holds it whole)."""
    return isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements)


def as_gradient(param: nn.Parameter, values: torch.Tensor) -> torch.Tensor:
    """``values`` (this rank's part, a view into a flat buffer) as ``param``'s gradient, without a copy."""
    if not isinstance(param, DTensor):
        return values
    return DTensor.from_local(values, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())


def like_parameter(param: nn.Parameter, whole: torch.Tensor) -> torch.Tensor:
    """A whole tensor of ``param``'s shape (a checkpoint's optimizer state) laid out as ``param`` is on this rank:
    its slice, cut locally without communication (every rank of the TP group read the same values)."""
    whole = whole.to(param.device)
    if not isinstance(param, DTensor):
        return whole
    return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)


def agree_random_state(group: dist.ProcessGroup, source: int, device: torch.device, call) -> None:
    """Give every rank of the TP group the random state of its rank ``source`` (collective over the group, at
    setup): its ranks compute the same replicated activations, so a dropout there must draw the same mask on
    each (start-up's profiling may have drawn different numbers on each). ``call``: the groups' gate of a
    collective (:meth:`~.groups.StageGroups.call`)."""
    states = [(torch.get_rng_state, torch.set_rng_state)]
    if device.type == "cuda":
        states.append((lambda: torch.cuda.get_rng_state(device), lambda s: torch.cuda.set_rng_state(s, device)))
    for get, put in states:
        state = get().to(device)
        dist.broadcast(state, src=source, group=call(group, "the TP group's random state"))
        put(state.cpu())

"""The rank's device: which GPU a process takes, and collectives that get tensors on it even where the
rank holds nothing (one process).

A recording stand-in for ``torch.distributed.all_reduce`` refuses any tensor that
is not on the rank's device, as NCCL refuses a host tensor between GPUs. The
"rank's device" here is the meta device: a CPU machine has no GPU, and a tensor
made on the host by mistake (``device="cpu"``) is then caught all the same.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from testing.plans import hand_plan
from zorse_lightning.capabilities import Sharding
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.engine.block_gathering import BlockGathering, block_units
from zorse_lightning.engine.gradients import clip_global_norm_
from zorse_lightning.engine.groups import StageGroups
from zorse_lightning.engine.sharding import StageShards, module_groups
from zorse_lightning.errors import ZorseUserError
from zorse_lightning.strategy.accelerator import cuda_index_for
from zorse_lightning.strategy.precision import DynamicLossScale

RANK_DEVICE = torch.device("meta")


class _Reduced(Exception):
    """Raised by the stand-in once it has checked the tensor: what follows would read meta values."""


@pytest.fixture
def collectives(monkeypatch) -> list[torch.device]:
    """Devices of every tensor all-reduced; a tensor on another device than the rank's fails the test."""
    seen: list[torch.device] = []

    def all_reduce(tensor: torch.Tensor, op=None, group=None, async_op=False):
        seen.append(tensor.device)
        if tensor.device != RANK_DEVICE:
            raise RuntimeError(f"all_reduce of a tensor on {tensor.device}; the rank's device is {RANK_DEVICE}")
        raise _Reduced

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    return seen


def _idle_rank_groups() -> StageGroups:
    plan = hand_plan([((0, 1), (2, 2), (0, 4))], inventory=load_cluster("cpu_sim4"), idle_ranks=(2, 3))
    return StageGroups(plan=plan, rank=3, stage_index=None, data_group=None, shared_groups={})


def test_an_idle_rank_joins_the_clipping_norm_on_its_device(collectives):
    """It holds no weight, so no gradient tells it a device: the norm once went to the host."""
    with pytest.raises(_Reduced):
        clip_global_norm_([], _idle_rank_groups(), max_norm=1.0, device=RANK_DEVICE)
    assert collectives == [RANK_DEVICE]


def test_a_rank_without_gradients_reduces_the_overflow_verdict_on_its_device(collectives):
    """fp16 loss scaling: a rank with no gradient (idle) once made its verdict on the host."""
    with pytest.raises(_Reduced):
        DynamicLossScale().unscale_([], RANK_DEVICE)
    assert collectives == [RANK_DEVICE]


def test_a_process_that_sees_only_its_own_gpu_uses_cuda_0():
    """SLURM --gpus-per-task or CUDA_VISIBLE_DEVICES per process: local rank 3 sees one GPU, cuda:0."""
    assert [cuda_index_for(rank, 4) for rank in range(4)] == [0, 1, 2, 3]  # every GPU of the machine visible
    assert [cuda_index_for(rank, 1) for rank in range(4)] == [0, 0, 0, 0]  # each its own
    with pytest.raises(ZorseUserError, match="local rank 3 sees 2 CUDA devices.*CUDA_VISIBLE_DEVICES"):
        cuda_index_for(3, 2)


class _Done:
    """A finished collective's handle."""

    def wait(self) -> bool:
        return True


@pytest.fixture
def owner_collectives(monkeypatch) -> list[tuple[str, torch.device]]:
    """(collective, device) of every reduce to an owner and broadcast from one; a tensor elsewhere than the
    rank's device fails the test."""
    seen: list[tuple[str, torch.device]] = []

    def recording(name: str):
        def collective(tensor: torch.Tensor, *args, async_op: bool = False, **kwargs):
            seen.append((name, tensor.device))
            if tensor.device != RANK_DEVICE:
                raise RuntimeError(f"{name} of a tensor on {tensor.device}; the rank's device is {RANK_DEVICE}")
            return _Done() if async_op else None

        return collective

    monkeypatch.setattr(dist, "reduce", recording("reduce"))
    monkeypatch.setattr(dist, "broadcast", recording("broadcast"))
    return seen


def test_sharded_stage_sends_device_tensors_also_in_empty_rounds(owner_collectives):
    """A rank with fewer microbatches makes empty rounds: the zeros it sends for gradients it never computed
    must be made on its device, as must the buffers it receives weights into."""
    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4, device=RANK_DEVICE) for _ in range(2)])
    root = torch.nn.Sequential(torch.nn.Linear(4, 4, device=RANK_DEVICE), *blocks)
    plan = hand_plan([((0, 1), (3, 1), (0, 2))], inventory=load_cluster("cpu_sim2"), sharding=Sharding.FULL,
                     shard_fractions={0: (0.5, 0.5)}, gather_per_microbatch=True)
    groups = StageGroups(plan=plan, rank=1, stage_index=0, data_group=None, shared_groups={})
    params = list(root.parameters())
    shards = StageShards(module_groups(root, params), groups, RANK_DEVICE)
    gathering = BlockGathering(blocks, block_units(root, blocks, params), shards)
    gathering.empty_forward()
    gathering.empty_backward()
    shards.reduce_to_owners(params[:2])  # the edge (first Linear): no gradient on this rank
    shards.broadcast_from_owners(params[:2])
    kinds = [name for name, _ in owner_collectives]
    assert kinds.count("broadcast") >= 4 and kinds.count("reduce") >= 3, kinds
    assert {device for _, device in owner_collectives} == {RANK_DEVICE}

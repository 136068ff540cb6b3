"""Emulated deadlines of blocks split over a tensor-parallel group: the one-GPU (whole-block) cost over the degree
at the type's efficiency, as the planner prices their compute; the collectives run for real."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from zorse_lightning.cluster.gpu_type import DEFAULT_TENSOR_PARALLEL_EFFICIENCY
from zorse_lightning.emulation import emulator as emulator_module
from zorse_lightning.emulation.emulator import ComputeEmulator
from zorse_lightning.emulation.spec import EmulationSpec
from zorse_lightning.emulation.stage import split_block_degrees
from zorse_lightning.emulation.timing import CallCost
from testing.launch import spawn_ranks

WIDTH, SAMPLES, SLOWDOWN = 64, 4, 3.0
KEY = f"block|({WIDTH},):torch.float32"
WHOLE = CallCost(0.02, 0.04)
"""The block's one-GPU cost per sample, as start-up calibrates it on the whole block."""


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _split_charge_s(degree: int) -> float:
    return SLOWDOWN * SAMPLES * (WHOLE.forward_s_per_sample + WHOLE.backward_s_per_sample) / (
        degree * DEFAULT_TENSOR_PARALLEL_EFFICIENCY
    )


def test_a_split_block_is_charged_its_whole_cost_over_degree_and_efficiency(monkeypatch) -> None:
    block = _Mlp()
    emulator = ComputeEmulator(EmulationSpec("t4", SLOWDOWN, 1 << 30), costs={KEY: WHOLE})
    emulator.instrument([block], names=["block"])
    emulator.split = {id(block): 2}
    block(torch.randn(SAMPLES, WIDTH, requires_grad=True)).sum().backward()
    assert emulator.emulated_compute_s == pytest.approx(_split_charge_s(2), rel=1e-9)
    # a split block that calibrates itself (no start-up cost) measured its split compute: charged as measured
    monkeypatch.setattr(emulator_module, "calibrate_call", lambda *args: CallCost(1e-4, 2e-4))
    fresh = ComputeEmulator(EmulationSpec("t4", SLOWDOWN, 1 << 30))
    fresh.instrument([block], names=["block"])
    fresh.split = {id(block): 2}
    block(torch.randn(SAMPLES, WIDTH, requires_grad=True)).sum().backward()
    assert fresh.emulated_compute_s == pytest.approx(SLOWDOWN * SAMPLES * 3e-4, rel=1e-9)


def _tensor_parallel_rank(rank: int, out_dir: Path) -> dict:
    """Rank ``rank`` of a TP group of two: the MLP split (up column-wise, down row-wise), emulated at the whole
    block's cost, timed over three steps."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    block = _Mlp()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    emulator = ComputeEmulator(EmulationSpec("t4", SLOWDOWN, 1 << 30), rank=rank, costs={KEY: WHOLE})
    emulator.instrument([block], names=["block"])
    emulator.split = split_block_degrees([block])
    x = torch.randn(SAMPLES, WIDTH, requires_grad=True)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(3):
        block(x).sum().backward()
    wall_s = time.perf_counter() - start
    return {
        "degrees": list(emulator.split.values()), "emulated_s": emulator.emulated_compute_s, "wall_s": wall_s,
        "overruns": emulator.overruns,
    }


@pytest.mark.multiprocess
def test_an_emulated_tensor_parallel_block_meets_the_priced_deadline(tmp_path: Path) -> None:
    """Two gloo ranks split a block for real; each forward and backward lasts the whole block's cost over 2 x 0.9
    (the collectives run inside the window)."""
    for record in spawn_ranks(_tensor_parallel_rank, 2, tmp_path):
        assert record["degrees"] == [2]
        assert record["emulated_s"] == pytest.approx(3 * _split_charge_s(2), rel=1e-9)
        assert record["overruns"] == 0
        assert record["emulated_s"] <= record["wall_s"] < 1.2 * record["emulated_s"] + 0.1

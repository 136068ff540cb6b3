"""What one emulated rank is: its GPU type's speed relative to this CPU, its memory, its host link.

Taken from the cluster inventory, the same on every rank and in every place that emulates
(start-up profiling, the run, the callback), so they cannot disagree on a rank's slowdown."""

from __future__ import annotations

from dataclasses import dataclass

from zorse_lightning.cluster.gpu_type import DEFAULT_TENSOR_PARALLEL_EFFICIENCY, PCIE3_X16_GBPS
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import InventoryError, ZorseUserError
from zorse_lightning.units import gib_to_bytes

DEFAULT_FASTEST_SLOWDOWN = 3.0
"""Slowdown of the fastest type: 3 leaves real compute a wide margin before its deadline (DESIGN.md)."""


@dataclass(frozen=True)
class EmulationSpec:
    """What one emulated rank is: its GPU type, how much slower than its CPU cost it runs, its memory."""

    gpu_type: str
    slowdown: float
    """Emulated time / calibrated CPU cost; >= 1 so that real compute can meet the deadline."""
    memory_budget_bytes: int
    host_link_gbps: float = PCIE3_X16_GBPS
    """The type's link to host memory, each way (``GpuType.host_link_gbps``): the rate of activation offload's
    copies, which a call that offloads is charged where they outlast its compute."""
    tensor_parallel_efficiency: float = DEFAULT_TENSOR_PARALLEL_EFFICIENCY
    """The type's ``GpuType.tensor_parallel_efficiency``: a block split over ``t`` ranks is charged its one-GPU
    cost over ``t`` times this, as the planner prices it."""

    def __post_init__(self) -> None:
        if not self.slowdown >= 1.0:
            raise ZorseUserError(
                f"emulated {self.gpu_type}: slowdown={self.slowdown!r} must be >= 1, or real compute overruns "
                f"every deadline; raise fastest_slowdown (default {DEFAULT_FASTEST_SLOWDOWN})"
            )
        if not self.memory_budget_bytes > 0:
            raise ZorseUserError(
                f"emulated {self.gpu_type}: memory_budget_bytes={self.memory_budget_bytes!r} must be positive; "
                f"set the GPU's `memory_gib` in the cluster config"
            )
        if not self.host_link_gbps > 0:
            raise ZorseUserError(
                f"emulated {self.gpu_type}: host_link_gbps={self.host_link_gbps!r} must be positive; "
                f"give the GPU type's host link (PCIe 3/4/5 x16: 128/256/512 Gb/s)"
            )


def emulation_spec_for_rank(
    inventory: ClusterInventory, rank: int, fastest_slowdown: float = DEFAULT_FASTEST_SLOWDOWN
) -> EmulationSpec:
    """The emulation of global rank ``rank``: speed relative to the fastest type present, memory from the inventory."""
    if not 0 <= rank < inventory.world_size:
        raise InventoryError(
            f"rank {rank} is outside cluster {inventory.name!r}, which lists {inventory.world_size} GPUs; "
            f"launch exactly {inventory.world_size} processes (Trainer(devices={inventory.world_size})) "
            f"or use a cluster config that lists every rank"
        )
    gpu = inventory.gpus[rank]
    fastest_tflops = max(t.peak_tflops for t in inventory.gpu_types)
    return EmulationSpec(
        gpu_type=gpu.gpu_type.name,
        slowdown=fastest_slowdown * fastest_tflops / gpu.gpu_type.peak_tflops,
        memory_budget_bytes=int(gib_to_bytes(gpu.memory_gib)),
        host_link_gbps=gpu.gpu_type.host_link_gbps,
        tensor_parallel_efficiency=gpu.gpu_type.tensor_parallel_efficiency,
    )


def cpu_cores_demanded(inventory: ClusterInventory, fastest_slowdown: float = DEFAULT_FASTEST_SLOWDOWN) -> float:
    """CPU cores all ranks keep busy at once: each computes ``1 / slowdown`` of the time.

    Must stay under the machine's cores, or ranks contend and overrun deadlines.
    """
    return sum(1.0 / emulation_spec_for_rank(inventory, r, fastest_slowdown).slowdown for r in range(inventory.world_size))

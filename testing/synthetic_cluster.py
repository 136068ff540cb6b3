"""Synthetic clusters of any size for planner benchmarks and tests: machines of 8 GPUs,
four GPU types, and links of three speeds.

Links: 1600 Gb/s inside a machine, 200 Gb/s among the machines of a rack (four
consecutive machines), 50 Gb/s elsewhere, so the planner's graph cut has slow
links to put between stages at every size. Machine ``i`` holds type ``i mod 4``;
with fewer machines than types each machine holds several types (one machine of 8:
two GPUs of each), so every size has all four types.
"""

from __future__ import annotations

from zorse_lightning.cluster import (
    DEFAULT_CATALOG,
    ClusterInventory,
    Machine,
    MachineLink,
)
from zorse_lightning.errors import InventoryError

GPU_TYPES = ("a100x40", "v100x16", "a10g", "t4")
INTRA_MACHINE_GBPS = 1600.0
RACK_GBPS = 200.0
INTER_RACK_GBPS = 50.0
MACHINES_PER_RACK = 4


def synthetic_cluster(num_gpus: int = 1024, gpus_per_machine: int = 8) -> ClusterInventory:
    """``num_gpus`` GPUs (a multiple of ``gpus_per_machine``) of the four :data:`GPU_TYPES`."""
    if num_gpus < 1 or num_gpus % gpus_per_machine:
        raise InventoryError(
            f"num_gpus={num_gpus} must be a positive multiple of gpus_per_machine={gpus_per_machine}; "
            f"round it to whole machines"
        )
    num_machines = num_gpus // gpus_per_machine
    kinds = max(1, len(GPU_TYPES) // num_machines)  # types per machine
    machines = tuple(
        Machine(
            f"m{i:03d}",
            tuple(
                DEFAULT_CATALOG.get(GPU_TYPES[(i * kinds + j * kinds // gpus_per_machine) % len(GPU_TYPES)])
                for j in range(gpus_per_machine)
            ),
            intra_bandwidth_gbps=INTRA_MACHINE_GBPS,
        )
        for i in range(num_machines)
    )
    rack_links = tuple(
        MachineLink(f"m{i:03d}", f"m{j:03d}", RACK_GBPS)
        for i in range(0, num_machines, MACHINES_PER_RACK)
        for j in range(i + 1, min(i + MACHINES_PER_RACK, num_machines))
    )
    return ClusterInventory(
        f"synthetic{num_gpus}", machines, inter_machine_bandwidth_gbps=INTER_RACK_GBPS, machine_links=rack_links
    )


def four_machines_four_types() -> ClusterInventory:
    """16 GPUs: one machine of 4 of each of four types (A100-40GB, A6000, V100-16GB, A10G), 100 Gb/s between
    machines: the cluster shape of the peers' planners' plans (issue 30), where the order of whole machines
    as pipeline groups is left to the embedding, the head and the activations in flight."""
    types = ("a100x40", "a6000", "v100x16", "a10g")
    machines = tuple(Machine(f"m{i}-{t}", (DEFAULT_CATALOG.get(t),) * 4, intra_bandwidth_gbps=600.0) for i, t in enumerate(types))
    return ClusterInventory("four16", machines, inter_machine_bandwidth_gbps=100.0)

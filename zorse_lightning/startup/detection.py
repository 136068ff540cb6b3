"""The cluster from the devices the ranks hold, when the user names none.

Every rank reports its own device (hostname, name, memory); the reports are
gathered and grouped by machine in rank order, so machines may differ in GPU
count and type. Ranks of one machine must be contiguous (as torchrun and srun
number them), because the inventory numbers ranks machine by machine.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from zorse_lightning.cluster.detect import DeviceReport, MachineReport, inventory_from_reports
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import InventoryError


def my_device_report(device: torch.device) -> tuple[str, DeviceReport]:
    props = torch.cuda.get_device_properties(device)
    return socket.gethostname(), DeviceReport(name=props.name, total_memory_bytes=int(props.total_memory))


def machine_reports(per_rank: list[tuple[str, DeviceReport]]) -> list[MachineReport]:
    """Group per-rank reports (in global rank order) into machines; ranks of a machine must be contiguous."""
    machines: list[tuple[str, list[DeviceReport]]] = []
    for rank, (hostname, device) in enumerate(per_rank):
        if machines and machines[-1][0] == hostname:
            machines[-1][1].append(device)
            continue
        if any(name == hostname for name, _ in machines):
            raise InventoryError(
                f"rank {rank} is on machine {hostname!r}, whose other ranks are not contiguous; launch with "
                f"torchrun or srun (which number a machine's ranks together) or pass cluster=... explicitly"
            )
        machines.append((hostname, [device]))
    return [MachineReport(hostname=name, devices=tuple(devices)) for name, devices in machines]


def detect_cluster(device: torch.device, world_size: int) -> ClusterInventory:
    """Collective: every rank calls it once the default process group exists."""
    if device.type != "cuda":
        raise InventoryError(
            "ZorseStrategy was given no cluster and this rank has no GPU to detect; pass "
            "cluster=... (for CPU ranks emulating GPU types: cluster='cpu_sim4' or 'cpu_sim2')"
        )
    gathered: list[tuple[str, DeviceReport] | None] = [None] * world_size
    dist.all_gather_object(gathered, my_device_report(device))
    return inventory_from_reports(machine_reports(gathered))

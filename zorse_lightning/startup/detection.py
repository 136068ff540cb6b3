"""The cluster from the devices the ranks hold, when the user names none.

Every rank reports its own device with its hostname; the reports are gathered
in rank order, so machines may differ in GPU count and type. What a report holds
and how reports become an inventory (machine by machine, a machine's ranks
contiguous) is the cluster layer's, :mod:`zorse_lightning.cluster.detection`;
here is only the gathering, which needs the process group.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from zorse_lightning.cluster.detection import DeviceReport, inventory_from_reports, local_device_report, machine_reports
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import InventoryError


def detect_cluster(device: torch.device, world_size: int) -> ClusterInventory:
    """Collective: every rank calls it once the default process group exists."""
    report = local_device_report(device)
    if report is None:
        raise InventoryError(
            "ZorseStrategy was given no cluster and this rank has no GPU to detect; pass "
            "cluster=... (for CPU ranks emulating GPU types: cluster='cpu_sim4' or 'cpu_sim2')"
        )
    gathered: list[tuple[str, DeviceReport] | None] = [None] * world_size
    dist.all_gather_object(gathered, (socket.gethostname(), report))
    return inventory_from_reports(machine_reports(gathered))

"""The cluster from the devices the ranks hold: detected when the user names none, placed on the hosts
when the user gives one.

Every rank reports its own device with its hostname; the reports are gathered
in rank order, so machines may differ in GPU count and type. What a report holds,
how reports become an inventory (machine by machine, a machine's ranks
contiguous) and how a given inventory's machines are matched to the hosts is the
cluster layer's, :mod:`zorse_lightning.cluster.detection`; here is only the
gathering, which needs the process group. Each rank also times its device's host link (one copy each
way), which activation offload's copies are priced by, and reports what NCCL's first communicator took on its
device (measured at setup, :mod:`zorse_lightning.engine.nccl_memory`), which the memory model prices each of
its communicators by.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from zorse_lightning.cluster.detection import (
    DeviceReport,
    inventory_from_reports,
    local_device_report,
    machine_reports,
    match_machines,
    with_measured_host_links,
    with_measured_nccl,
)
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import InventoryError


def detect_cluster(device: torch.device, world_size: int, nccl_communicator_bytes: int | None = None) -> ClusterInventory:
    """Collective: every rank calls it once the default process group exists. ``nccl_communicator_bytes``: what
    NCCL's first communicator took on this rank's device (None: not measured)."""
    report = local_device_report(device, measure_host_link=True, nccl_communicator_bytes=nccl_communicator_bytes)
    if report is None:
        raise InventoryError(
            "ZorseStrategy was given no cluster and this rank has no GPU to detect; pass "
            "cluster=... (for CPU ranks emulating GPU types: cluster='cpu_sim4' or 'cpu_sim2')"
        )
    gathered = _gathered_reports(report, world_size)
    return _with_measurements(inventory_from_reports(machine_reports(gathered)), [r for _, r in gathered])


def placed_inventory(
    inventory: ClusterInventory, device: torch.device, world_size: int, nccl_communicator_bytes: int | None = None
) -> ClusterInventory:
    """``inventory`` with its machines in the launcher's rank order, matched to the hosts by their GPUs
    (:func:`~zorse_lightning.cluster.detection.match_machines`), and what their ranks measured. Collective: every
    rank calls it once the default process group exists; the same inventory on every rank."""
    if inventory.emulated:  # CPU ranks emulate what the inventory lists where it lists it
        return inventory
    report = local_device_report(device, measure_host_link=True, nccl_communicator_bytes=nccl_communicator_bytes)
    gathered = _gathered_reports(report, world_size)
    return _with_measurements(match_machines(inventory, gathered), [r for _, r in gathered])


def _with_measurements(inventory: ClusterInventory, reports: list[DeviceReport | None]) -> ClusterInventory:
    return with_measured_nccl(with_measured_host_links(inventory, reports), reports)


def _gathered_reports(report: DeviceReport | None, world_size: int) -> list[tuple[str, DeviceReport | None]]:
    gathered: list[tuple[str, DeviceReport | None]] = [("", None)] * world_size
    dist.all_gather_object(gathered, (socket.gethostname(), report))
    return gathered

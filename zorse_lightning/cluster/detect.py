"""Recognising the local GPUs, and assembling one inventory from what each machine reports.

Each machine reports its own devices (:func:`local_machine_report`); a launcher
or the engine gathers the reports (one per machine, any number of GPUs each) and
:func:`inventory_from_reports` turns them into one inventory. Only
:func:`local_machine_report` touches torch, and only when called.
"""

from __future__ import annotations

import dataclasses
import socket
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from zorse_lightning.cluster.catalog import DEFAULT_CATALOG, GpuCatalog
from zorse_lightning.cluster.gpu_type import GpuType
from zorse_lightning.cluster.inventory import ClusterInventory, Machine
from zorse_lightning.errors import InventoryError
from zorse_lightning.units import BYTES_PER_GIB

MEMORY_MISMATCH_TOLERANCE = 0.15
"""Reported memory may differ from the datasheet (reserved memory, ECC); beyond this we trust the device."""

UNKNOWN_GPU_TFLOPS_PER_GIB = 2.0
"""Peak guessed for a GPU the catalog lacks, per GiB of its memory: a deliberately rough figure."""


@dataclass(frozen=True)
class DeviceReport:
    name: str
    """As ``torch.cuda.get_device_name`` spells it."""
    total_memory_bytes: int


@dataclass(frozen=True)
class MachineReport:
    hostname: str
    devices: tuple[DeviceReport, ...]


def local_machine_report() -> MachineReport:
    """The CUDA devices of this machine (an empty tuple without CUDA)."""
    import torch

    devices: list[DeviceReport] = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(DeviceReport(name=props.name, total_memory_bytes=int(props.total_memory)))
    return MachineReport(hostname=socket.gethostname(), devices=tuple(devices))


def match_device(device: DeviceReport, catalog: GpuCatalog = DEFAULT_CATALOG) -> GpuType:
    """The catalog entry for a reported device; an estimated entry (with a warning) if unknown."""
    memory_gib = device.total_memory_bytes / BYTES_PER_GIB
    known = catalog.find(device.name)
    if known is None:
        warnings.warn(
            f"GPU {device.name!r} is not in the catalog; planning with an estimate from its "
            f"{memory_gib:.1f} GiB of memory. Add it under `gpu_types:` in your cluster config for better plans",
            stacklevel=2,
        )
        return GpuType(
            name=device.name,
            memory_gib=memory_gib,
            fp16_tflops=UNKNOWN_GPU_TFLOPS_PER_GIB * memory_gib,
            bf16_tflops=0.0,
            memory_bandwidth_gbps=4000.0,
            peer_bandwidth_gbps=128.0,
            from_datasheet=False,
        )
    if abs(memory_gib - known.memory_gib) > MEMORY_MISMATCH_TOLERANCE * known.memory_gib:
        warnings.warn(
            f"GPU {device.name!r} matched catalog type {known.name!r} ({known.memory_gib:g} GiB) but reports "
            f"{memory_gib:.1f} GiB; using the reported memory",
            stacklevel=2,
        )
        return dataclasses.replace(known, memory_gib=memory_gib)
    return known


def inventory_from_reports(
    reports: Sequence[MachineReport],
    name: str = "detected",
    inter_machine_bandwidth_gbps: float = 100.0,
    catalog: GpuCatalog = DEFAULT_CATALOG,
) -> ClusterInventory:
    """One inventory from per-machine reports; machines may differ in GPU count and type."""
    machines = []
    seen: dict[str, int] = {}
    for report in reports:
        if not report.devices:
            raise InventoryError(
                f"machine {report.hostname!r} reported no CUDA devices; run on GPU machines, "
                f"or pass a cluster config (for CPU emulation: cluster=cpu_sim4)"
            )
        types = tuple(match_device(d, catalog) for d in report.devices)
        count = seen.get(report.hostname, 0)
        seen[report.hostname] = count + 1
        machine_name = report.hostname if count == 0 else f"{report.hostname}-{count}"
        machines.append(
            Machine(
                name=machine_name,
                gpu_types=types,
                intra_bandwidth_gbps=min(t.peer_bandwidth_gbps for t in types),
                memory_budget_gib=tuple(d.total_memory_bytes / BYTES_PER_GIB for d in report.devices),
            )
        )
    return ClusterInventory(name=name, machines=tuple(machines), inter_machine_bandwidth_gbps=inter_machine_bandwidth_gbps)

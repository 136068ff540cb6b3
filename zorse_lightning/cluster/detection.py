"""Recognising the local GPUs, and assembling one inventory from what the ranks report.

:func:`local_device_report` is the one place a device is described (every
layer that needs a device's name or memory asks it); each rank reports its own
device with its hostname, a launcher or the start-up gathers the reports in rank
order, :func:`machine_reports` groups them into machines (any number of GPUs
each) and :func:`inventory_from_reports` turns them into one inventory.
:func:`match_machines` places the machines of an inventory the user gave on the
hosts the launcher ordered. Only :func:`local_device_report` touches torch, and only when called, so
the cluster layer stays importable without it.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zorse_lightning.cluster.catalog import DEFAULT_CATALOG, GpuCatalog
from zorse_lightning.cluster.gpu_type import GpuType
from zorse_lightning.cluster.inventory import ClusterInventory, Machine
from zorse_lightning.errors import InventoryError
from zorse_lightning.units import BYTES_PER_GIB, bytes_per_s_to_gbps

if TYPE_CHECKING:
    import torch

MEMORY_MISMATCH_TOLERANCE = 0.15
"""Reported memory may differ from the datasheet (reserved memory, ECC); beyond this we trust the device."""

UNKNOWN_GPU_TFLOPS_PER_GIB = 2.0
"""Peak guessed for a GPU the catalog lacks, per GiB of its memory: a deliberately rough figure."""


@dataclass(frozen=True)
class DeviceReport:
    name: str
    """As ``torch.cuda.get_device_name`` spells it."""
    total_memory_bytes: int
    host_link_gbps: float | None = None
    """Measured at start-up (:func:`measured_host_link_gbps`); None: not measured, the catalog's figure holds."""
    nccl_communicator_bytes: int | None = None
    """What NCCL's first communicator took on the device, measured at setup; None: not measured (no NCCL)."""


@dataclass(frozen=True)
class MachineReport:
    hostname: str
    devices: tuple[DeviceReport, ...]


def local_device_report(
    device: torch.device, measure_host_link: bool = False, nccl_communicator_bytes: int | None = None
) -> DeviceReport | None:
    """A device of this machine as detection sees it; None for a non-CUDA device. ``measure_host_link``:
    with its host link timed (:func:`measured_host_link_gbps`: start-up, once per rank);
    ``nccl_communicator_bytes``: what NCCL's first communicator took there, as measured at setup.

    None rather than a description because a CPU rank has no GPU type to
    detect: it emulates the type its inventory lists, and callers skip it.
    """
    if device.type != "cuda":
        return None
    import torch

    props = torch.cuda.get_device_properties(device)
    link = measured_host_link_gbps(device) if measure_host_link else None
    return DeviceReport(props.name, int(props.total_memory), link, nccl_communicator_bytes)


HOST_COPY_BYTES = 64 * 2**20
"""Bytes of the timed copies each way: large enough to reach the link's rate (activation offload copies
a block's saved tensors at once, megabytes to gigabytes)."""


def measured_host_link_gbps(device: torch.device) -> float:
    """The device's host link as activation offload uses it: one timed copy each way between pinned host
    memory and the device (after one untimed copy), the slower direction, in Gb/s (the catalog's
    ``host_link_gbps`` is the PCIe generation's nominal rate; a slot of fewer lanes, or a switch, is slower)."""
    import torch

    with torch.cuda.device(device):
        host = torch.empty(HOST_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
        on_device = torch.empty(HOST_COPY_BYTES, dtype=torch.uint8, device=device)
        on_device.copy_(host)
        seconds = []
        for target, source in ((on_device, host), (host, on_device)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1000.0)
    return bytes_per_s_to_gbps(HOST_COPY_BYTES / max(seconds))


def with_measured_host_links(inventory: ClusterInventory, reports: Sequence[DeviceReport | None]) -> ClusterInventory:
    """``inventory`` (whose rank ``r`` reported ``reports[r]``) with each GPU type's ``host_link_gbps`` the
    slowest its ranks measured: one figure per type, as the planner prices a type's copies by its name.
    Types no rank measured keep the catalog's."""
    measured: dict[str, float] = {}
    for gpu, report in zip(inventory.gpus, reports):
        if report is not None and report.host_link_gbps is not None:
            name = gpu.gpu_type.name
            measured[name] = min(measured.get(name, math.inf), report.host_link_gbps)
    return _with_type_figures(inventory, "host_link_gbps", measured)


def with_measured_nccl(inventory: ClusterInventory, reports: Sequence[DeviceReport | None]) -> ClusterInventory:
    """``inventory`` (whose rank ``r`` reported ``reports[r]``) with each GPU type's ``nccl_communicator_bytes``
    the largest its ranks measured: one figure per type, as the planner prices a type by its name. Types no rank
    measured keep theirs (None: priced from NCCL's settings)."""
    measured: dict[str, int] = {}
    for gpu, report in zip(inventory.gpus, reports):
        if report is not None and report.nccl_communicator_bytes is not None:
            name = gpu.gpu_type.name
            measured[name] = max(measured.get(name, 0), report.nccl_communicator_bytes)
    return _with_type_figures(inventory, "nccl_communicator_bytes", measured)


def _with_type_figures(inventory: ClusterInventory, field_name: str, by_type: Mapping[str, Any]) -> ClusterInventory:
    """``inventory`` with ``field_name`` of each GPU type named in ``by_type`` set to its figure there."""
    if not by_type:
        return inventory
    machines = tuple(
        dataclasses.replace(m, gpu_types=tuple(
            dataclasses.replace(t, **{field_name: by_type[t.name]}) if t.name in by_type else t for t in m.gpu_types
        ))
        for m in inventory.machines
    )
    return dataclasses.replace(inventory, machines=machines)


def machine_reports(per_rank: Sequence[tuple[str, DeviceReport]]) -> list[MachineReport]:
    """Group per-rank reports (hostname, device; in global rank order) into machines.

    The inventory numbers ranks machine by machine, so a machine's ranks must be
    contiguous (as torchrun and srun number them); otherwise rank ``r`` of the
    inventory would not be the process of global rank ``r``.
    """
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


def match_machines(inventory: ClusterInventory, per_rank: Sequence[tuple[str, DeviceReport | None]]) -> ClusterInventory:
    """The inventory with its machines in the order the launcher gave their ranks, each matched to a host by
    its GPUs (types in local order, so count too); an inventory machine named as a host goes to that host.

    Why: the rendezvous, not the inventory, decides which machine's processes get ranks 0, 1, ...; torchrun's
    ``--rdzv-backend=c10d`` ignores ``--node-rank`` and orders machines by host. Where two machines have the
    same GPUs and are not named after their hosts, they take the hosts in inventory order; if they differ in
    anything else (datacenter, links, budgets) that choice would matter, and the user is asked to name them.
    ``per_rank``: each global rank's (host, :func:`local_device_report`); a None (a CPU rank emulating its
    listed type) has nothing to match, and the inventory stays as given.
    """
    if any(report is None for _, report in per_rank):
        return inventory
    hosts = machine_reports([(host, report) for host, report in per_rank if report is not None])
    detected = [tuple(match_device(d).name for d in h.devices) for h in hosts]
    by_name = {m.name: m for m in inventory.machines}
    placed: dict[int, Machine] = {}
    for index, host in enumerate(hosts):
        machine = by_name.get(host.hostname) or by_name.get(host.hostname.split(".")[0])
        if machine is None:
            continue
        if tuple(t.name for t in machine.gpu_types) != detected[index]:
            raise InventoryError(
                f"machine {machine.name!r} of cluster {inventory.name!r} is listed with GPUs "
                f"{[t.name for t in machine.gpu_types]}, but host {host.hostname!r} has {list(detected[index])}: "
                f"a machine named after a host must list that host's GPUs in local order; fix the cluster config, "
                f"or omit cluster=... to use the detected devices"
            )
        placed[index] = machine
    free = [m for m in inventory.machines if m not in placed.values()]
    for index, host in enumerate(hosts):
        if index in placed:
            continue
        alike = [m for m in free if tuple(t.name for t in m.gpu_types) == detected[index]]
        if not alike:
            raise InventoryError(_unmatched(inventory, hosts, detected, index, free))
        _check_interchangeable(alike, inventory, host.hostname)
        placed[index] = alike[0]
        free.remove(alike[0])
    if free:
        raise InventoryError(
            f"cluster {inventory.name!r} lists machines {[m.name for m in free]} that no launched host matches "
            f"(hosts: {_described(hosts, detected)}); launch processes on them too, or remove them from the config"
        )
    return dataclasses.replace(inventory, machines=tuple(placed[i] for i in range(len(hosts))))


def _described(hosts: Sequence[MachineReport], detected: Sequence[tuple[str, ...]]) -> str:
    return "; ".join(f"{h.hostname}: {len(types)} x {'/'.join(sorted(set(types)))}" for h, types in zip(hosts, detected))


def _unmatched(
    inventory: ClusterInventory, hosts: Sequence[MachineReport], detected: Sequence[tuple[str, ...]], index: int,
    free: Sequence[Machine],
) -> str:
    return (
        f"host {hosts[index].hostname!r} runs {len(detected[index])} processes on GPUs {list(detected[index])}, "
        f"and no machine of cluster {inventory.name!r} left unmatched lists those GPUs in that order (unmatched: "
        f"{', '.join(f'{m.name}: {[t.name for t in m.gpu_types]}' for m in free) or 'none'}; hosts: "
        f"{_described(hosts, detected)}). Each host's processes must match one machine's GPUs, one process per "
        f"GPU; fix the cluster config or the processes launched per host (--nproc-per-node), or omit cluster=... "
        f"to use the detected devices"
    )


def _check_interchangeable(alike: Sequence[Machine], inventory: ClusterInventory, hostname: str) -> None:
    """Machines with the same GPUs may take any host only where nothing else tells them apart."""
    def seen_as(machine: Machine) -> tuple:
        links = sorted((l.bandwidth_gbps, l.latency_us) for l in inventory.machine_links
                       if machine.name in (l.machine_a, l.machine_b))
        return (machine.datacenter, machine.intra_bandwidth_gbps, machine.intra_latency_us,
                machine.memory_budget_gib, tuple(links))

    differing = [m.name for m in alike if seen_as(m) != seen_as(alike[0])]
    if differing:
        raise InventoryError(
            f"host {hostname!r} matches machines {[m.name for m in alike]} of cluster {inventory.name!r}, which "
            f"have the same GPUs but differ in datacenter, links or budgets; the launcher's rank order does not "
            f"say which host is which: name each of them after its host (`name: {hostname}`)"
        )

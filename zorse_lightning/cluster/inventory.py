"""The cluster as the planner sees it: machines, their GPUs, and the links between them.

Global ranks are positions in :attr:`ClusterInventory.gpus`: machines in the
order given, GPUs in their order on the machine. Nothing here assumes machines
are alike: each has its own GPU count, types and internal bandwidth.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from itertools import combinations

from zorse_lightning.cluster.gpu_type import GpuType
from zorse_lightning.errors import InventoryError

HOST_MEMORY_PER_GPU_MEMORY = 2.0
"""Host memory a machine has per byte of its GPUs' memory unless its entry says (NVIDIA's sizing for DGX
systems: at least twice the GPU memory; emulated machines scale with their budgets alike)."""

PINNED_SHARE_OF_HOST = 0.5
"""Pinned host memory cannot be swapped out: what a run pins (activation offload's buffers, survivor
snapshots) may take at most this share of a machine's host memory."""


class LinkKind(str, Enum):
    """Where a link between two GPUs runs; decides its default bandwidth and latency."""

    SAME_GPU = "same_gpu"
    INTRA_MACHINE = "intra_machine"
    INTER_MACHINE = "inter_machine"
    INTER_DATACENTER = "inter_datacenter"


@dataclass(frozen=True)
class Gpu:
    """One device of a machine (a real GPU, or a CPU rank emulating one)."""

    gpu_type: GpuType
    memory_gib: float
    """Memory this rank may use: the type's memory, or a smaller budget the config sets."""
    machine: str
    local_index: int


@dataclass(frozen=True)
class Machine:
    name: str
    gpu_types: tuple[GpuType, ...]
    """One entry per GPU, in local index order; types may differ."""
    intra_bandwidth_gbps: float
    """GPU-to-GPU bandwidth inside the machine."""
    datacenter: str = "dc0"
    memory_budget_gib: tuple[float, ...] = ()
    """Per-GPU memory budgets (empty: each type's full memory)."""
    intra_latency_us: float | None = None
    """Per-message latency between this machine's GPUs (None: the cluster's ``latencies.intra_machine_us``);
    start-up raises it to what its ranks measure where that is later."""
    host_memory_gib: float | None = None
    """Host memory (RAM) all of the machine's processes share; None: :data:`HOST_MEMORY_PER_GPU_MEMORY` times
    its GPUs' memory. Activation offload keeps its copies there (:attr:`pinnable_host_gib`)."""

    def __post_init__(self) -> None:
        if not self.gpu_types:
            raise InventoryError(
                f"machine {self.name!r} has no GPUs; list at least one under its `gpus:` "
                f"(for example `- {{type: a100x40, count: 4}}`) or remove the machine"
            )
        _check_positive(f"machine {self.name!r}: intra_bandwidth_gbps", self.intra_bandwidth_gbps)
        if self.memory_budget_gib and len(self.memory_budget_gib) != len(self.gpu_types):
            raise InventoryError(
                f"machine {self.name!r}: {len(self.memory_budget_gib)} memory budgets for "
                f"{len(self.gpu_types)} GPUs; give one per GPU or none"
            )
        for budget in self.memory_budget_gib:
            _check_positive(f"machine {self.name!r}: memory_gib", budget)
        if self.host_memory_gib is not None:
            _check_positive(f"machine {self.name!r}: host_memory_gib (its RAM; leave it out for the default)", self.host_memory_gib)
        if self.intra_latency_us is not None and not (
            isinstance(self.intra_latency_us, (int, float)) and self.intra_latency_us >= 0
        ):
            raise InventoryError(
                f"machine {self.name!r}: intra_latency_us={self.intra_latency_us!r} must be a number of "
                f"microseconds >= 0; give the figure, or leave it out for the cluster's latencies.intra_machine_us"
            )

    @property
    def pinnable_host_gib(self) -> float:
        """Host memory the machine's processes may pin together (:data:`PINNED_SHARE_OF_HOST` of its RAM)."""
        memory = self.host_memory_gib
        if memory is None:
            memory = HOST_MEMORY_PER_GPU_MEMORY * sum(g.memory_gib for g in self.gpus)
        return PINNED_SHARE_OF_HOST * memory

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        budgets = self.memory_budget_gib or tuple(t.memory_gib for t in self.gpu_types)
        return tuple(
            Gpu(gpu_type=t, memory_gib=m, machine=self.name, local_index=i)
            for i, (t, m) in enumerate(zip(self.gpu_types, budgets))
        )


@dataclass(frozen=True)
class MachineLink:
    """A measured or configured bandwidth between two machines, overriding the default."""

    machine_a: str
    machine_b: str
    bandwidth_gbps: float
    latency_us: float | None = None


@dataclass(frozen=True)
class DatacenterLink:
    datacenter_a: str
    datacenter_b: str
    bandwidth_gbps: float
    latency_us: float | None = None


@dataclass(frozen=True)
class Latencies:
    """Per-message latency by kind of link (defaults: typical NVLink/PCIe, IB/Ethernet, WAN)."""

    intra_machine_us: float = 5.0
    inter_machine_us: float = 20.0
    inter_datacenter_us: float = 2000.0
    header_intra_machine_us: float = 0.0
    """What the engine's host header (an activation's dtype and shape, over the gloo group, before it) adds to
    each point-to-point message inside a machine: measured at start (:mod:`zorse_lightning.startup.link_probe`),
    0 until then."""
    header_inter_machine_us: float = 0.0
    """The same between machines (and datacenters)."""


@dataclass(frozen=True)
class ClusterInventory:
    name: str
    machines: tuple[Machine, ...]
    inter_machine_bandwidth_gbps: float = 100.0
    """Default bandwidth between two machines of one datacenter."""
    machine_links: tuple[MachineLink, ...] = ()
    datacenter_links: tuple[DatacenterLink, ...] = ()
    latencies: Latencies = field(default_factory=Latencies)
    emulated: bool = False
    """True when ranks are CPU processes that emulate the listed GPU types."""

    def __post_init__(self) -> None:
        if not self.machines:
            raise InventoryError(f"cluster {self.name!r} has no machines; list at least one under `machines:`")
        _check_positive(f"cluster {self.name!r}: inter_machine_bandwidth_gbps", self.inter_machine_bandwidth_gbps)
        duplicates = [n for n, c in Counter(m.name for m in self.machines).items() if c > 1]
        if duplicates:
            raise InventoryError(
                f"cluster {self.name!r}: machine name {duplicates[0]!r} is used {Counter(m.name for m in self.machines)[duplicates[0]]} times; "
                f"machine names must be unique, rename one of them"
            )
        names = {m.name for m in self.machines}
        for link in self.machine_links:
            for end in (link.machine_a, link.machine_b):
                if end not in names:
                    raise InventoryError(
                        f"cluster {self.name!r}: link {link.machine_a!r}-{link.machine_b!r} names machine "
                        f"{end!r}, which does not exist (machines: {', '.join(sorted(names))}); fix the name or add the machine"
                    )
            _check_positive(f"link {link.machine_a!r}-{link.machine_b!r}: bandwidth_gbps", link.bandwidth_gbps)
        datacenters = sorted({m.datacenter for m in self.machines})
        for link in self.datacenter_links:
            for end in (link.datacenter_a, link.datacenter_b):
                if end not in datacenters:
                    raise InventoryError(
                        f"cluster {self.name!r}: datacenter link names {end!r}, which no machine is in "
                        f"(datacenters: {', '.join(datacenters)}); fix the name or a machine's `datacenter:`"
                    )
            _check_positive(
                f"datacenter link {link.datacenter_a!r}-{link.datacenter_b!r}: bandwidth_gbps", link.bandwidth_gbps
            )
        linked = {frozenset((l.datacenter_a, l.datacenter_b)) for l in self.datacenter_links}
        for a, b in combinations(datacenters, 2):
            if frozenset((a, b)) not in linked:
                raise InventoryError(
                    f"cluster {self.name!r}: datacenters {a!r} and {b!r} have no link between them; "
                    f"add `- {{datacenter_a: {a}, datacenter_b: {b}, bandwidth_gbps: ...}}` under `datacenter_links:`"
                )

    # -- derived views ------------------------------------------------------------------

    @cached_property
    def gpus(self) -> tuple[Gpu, ...]:
        """Every GPU; the index is the global rank."""
        return tuple(g for m in self.machines for g in m.gpus)

    @property
    def world_size(self) -> int:
        return len(self.gpus)

    @cached_property
    def ranks_by_machine(self) -> dict[str, tuple[int, ...]]:
        """Each machine's global ranks, machines in inventory order (a machine's GPUs are consecutive ranks)."""
        ranks: dict[str, list[int]] = {m.name: [] for m in self.machines}
        for rank, gpu in enumerate(self.gpus):
            ranks[gpu.machine].append(rank)
        return {name: tuple(r) for name, r in ranks.items()}

    @cached_property
    def _machine_by_name(self) -> dict[str, Machine]:
        return {m.name: m for m in self.machines}

    def machine_of(self, rank: int) -> Machine:
        return self._machine_by_name[self.gpus[rank].machine]

    def link_kind(self, rank_a: int, rank_b: int) -> LinkKind:
        if rank_a == rank_b:
            return LinkKind.SAME_GPU
        ma, mb = self.machine_of(rank_a), self.machine_of(rank_b)
        if ma.name == mb.name:
            return LinkKind.INTRA_MACHINE
        if ma.datacenter == mb.datacenter:
            return LinkKind.INTER_MACHINE
        return LinkKind.INTER_DATACENTER

    def bandwidth_gbps(self, rank_a: int, rank_b: int) -> float:
        """Bandwidth between two ranks: per-pair override, else datacenter link, else default."""
        kind = self.link_kind(rank_a, rank_b)
        if kind is LinkKind.SAME_GPU:
            return float("inf")
        ma, mb = self.machine_of(rank_a), self.machine_of(rank_b)
        if kind is LinkKind.INTRA_MACHINE:
            return ma.intra_bandwidth_gbps
        override = self._machine_link(ma.name, mb.name)
        if override is not None:
            return override.bandwidth_gbps
        if kind is LinkKind.INTER_DATACENTER:
            return self._datacenter_link(ma.datacenter, mb.datacenter).bandwidth_gbps
        return self.inter_machine_bandwidth_gbps

    def latency_us(self, rank_a: int, rank_b: int) -> float:
        kind = self.link_kind(rank_a, rank_b)
        if kind is LinkKind.SAME_GPU:
            return 0.0
        ma, mb = self.machine_of(rank_a), self.machine_of(rank_b)
        if kind is LinkKind.INTRA_MACHINE:
            return ma.intra_latency_us if ma.intra_latency_us is not None else self.latencies.intra_machine_us
        override = self._machine_link(ma.name, mb.name)
        if override is not None and override.latency_us is not None:
            return override.latency_us
        if kind is LinkKind.INTER_DATACENTER:
            dc_link = self._datacenter_link(ma.datacenter, mb.datacenter)
            return dc_link.latency_us if dc_link.latency_us is not None else self.latencies.inter_datacenter_us
        return self.latencies.inter_machine_us

    def _machine_link(self, a: str, b: str) -> MachineLink | None:
        return self._machine_link_by_pair.get(frozenset((a, b)))

    @cached_property
    def _machine_link_by_pair(self) -> dict[frozenset[str], MachineLink]:
        """Each per-pair override by its two machines, the first listed where several name a pair (the planner
        asks for links hundreds of thousands of times on a large cluster)."""
        links: dict[frozenset[str], MachineLink] = {}
        for link in self.machine_links:
            links.setdefault(frozenset((link.machine_a, link.machine_b)), link)
        return links

    def _datacenter_link(self, a: str, b: str) -> DatacenterLink:
        for link in self.datacenter_links:
            if {link.datacenter_a, link.datacenter_b} == {a, b}:
                return link
        raise InventoryError(f"no link between datacenters {a!r} and {b!r}")  # excluded by __post_init__

    @cached_property
    def gpu_types(self) -> tuple[GpuType, ...]:
        """Distinct GPU types, in order of first appearance."""
        return tuple({g.gpu_type.name: g.gpu_type for g in self.gpus}.values())

    @property
    def total_memory_gib(self) -> float:
        return sum(g.memory_gib for g in self.gpus)

    @property
    def total_peak_tflops(self) -> float:
        return sum(g.gpu_type.peak_tflops for g in self.gpus)


def _check_positive(what: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and value > 0):
        raise InventoryError(f"{what}={value!r} must be a positive number; give the figure in the field's unit")

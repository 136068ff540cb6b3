"""Hydra structured configs for inventories, and their conversion to :class:`ClusterInventory`.

The schemas are registered in Hydra's ConfigStore by :func:`register_cluster_schema`
(called by the entry points, never at import time), so every file in
``conf/cluster/`` is type-checked by OmegaConf before it reaches the code here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from zorse_lightning.cluster.catalog import DEFAULT_CATALOG, GpuCatalog
from zorse_lightning.cluster.gpu_type import PCIE3_X16_GBPS, GpuType
from zorse_lightning.cluster.inventory import (
    ClusterInventory,
    DatacenterLink,
    Latencies,
    Machine,
    MachineLink,
)
from zorse_lightning.errors import InventoryError


@dataclass
class GpuTypeSpec:
    """A GPU type the catalog lacks (or a correction to one it has)."""

    name: str
    memory_gib: float
    fp16_tflops: float
    bf16_tflops: float = 0.0
    memory_bandwidth_gbps: float = 1000.0
    peer_bandwidth_gbps: float = 128.0
    host_link_gbps: float = PCIE3_X16_GBPS
    """The link to host memory, each way: what activation offload's copies cost (``GpuType.host_link_gbps``)."""
    aliases: list[str] = field(default_factory=list)


@dataclass
class GpuGroupSpec:
    """``count`` GPUs of one type on a machine."""

    type: str
    count: int = 1
    memory_gib: Optional[float] = None
    """A budget below the type's memory (emulated ranks, or memory kept for others)."""


@dataclass
class MachineSpec:
    name: str
    gpus: list[GpuGroupSpec] = field(default_factory=list)
    intra_bandwidth_gbps: Optional[float] = None
    """Default: the slowest peer bandwidth among the machine's GPU types."""
    datacenter: str = "dc0"
    intra_latency_us: Optional[float] = None
    """Default: the cluster's ``latencies.intra_machine_us``."""
    host_memory_gib: Optional[float] = None
    """The machine's RAM; default: twice its GPUs' memory (see ``Machine.host_memory_gib``)."""


@dataclass
class MachineLinkSpec:
    machine_a: str
    machine_b: str
    bandwidth_gbps: float
    latency_us: Optional[float] = None


@dataclass
class DatacenterLinkSpec:
    datacenter_a: str
    datacenter_b: str
    bandwidth_gbps: float
    latency_us: Optional[float] = None


@dataclass
class LatencySpec:
    intra_machine_us: float = 5.0
    inter_machine_us: float = 20.0
    inter_datacenter_us: float = 2000.0


@dataclass
class ClusterSpec:
    name: str = "unnamed"
    description: str = ""
    machines: list[MachineSpec] = field(default_factory=list)
    inter_machine_bandwidth_gbps: float = 100.0
    machine_links: list[MachineLinkSpec] = field(default_factory=list)
    datacenter_links: list[DatacenterLinkSpec] = field(default_factory=list)
    latencies: LatencySpec = field(default_factory=LatencySpec)
    gpu_types: list[GpuTypeSpec] = field(default_factory=list)
    emulated: bool = False


def register_cluster_schema(config_store: Any) -> None:
    """Register the schema that every ``conf/cluster/*.yaml`` extends (``defaults: [cluster_schema]``)."""
    config_store.store(group="cluster", name="cluster_schema", node=ClusterSpec)


def inventory_from_config(cfg: Any, catalog: GpuCatalog = DEFAULT_CATALOG) -> ClusterInventory:
    """Build and validate an inventory from a ClusterSpec-shaped DictConfig or mapping."""
    from omegaconf import OmegaConf

    if not isinstance(cfg, dict):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    extra = [GpuType(**{**t, "aliases": tuple(t.get("aliases", ()))}) for t in cfg.get("gpu_types", [])]
    catalog = catalog.with_types(extra) if extra else catalog
    name = cfg.get("name", "unnamed")
    machines = tuple(_machine(m, catalog, name) for m in cfg.get("machines", []))
    latencies = Latencies(**cfg.get("latencies", {}))
    return ClusterInventory(
        name=name,
        machines=machines,
        inter_machine_bandwidth_gbps=cfg.get("inter_machine_bandwidth_gbps", 100.0),
        machine_links=tuple(MachineLink(**l) for l in cfg.get("machine_links", [])),
        datacenter_links=tuple(DatacenterLink(**l) for l in cfg.get("datacenter_links", [])),
        latencies=latencies,
        emulated=bool(cfg.get("emulated", False)),
    )


def _machine(spec: dict, catalog: GpuCatalog, cluster_name: str) -> Machine:
    types: list[GpuType] = []
    budgets: list[float] = []
    for group in spec.get("gpus", []):
        count = group.get("count", 1)
        if not (isinstance(count, int) and count > 0):
            raise InventoryError(
                f"cluster {cluster_name!r}, machine {spec['name']!r}: GPU count {count!r} for type "
                f"{group['type']!r} must be a positive integer; remove the entry instead of giving 0"
            )
        gpu_type = catalog.get(group["type"])
        types += [gpu_type] * count
        budgets += [group.get("memory_gib") or gpu_type.memory_gib] * count
    intra = spec.get("intra_bandwidth_gbps")
    if intra is None and types:
        intra = min(t.peer_bandwidth_gbps for t in types)
    return Machine(
        name=spec["name"],
        gpu_types=tuple(types),
        intra_bandwidth_gbps=intra if intra is not None else 1.0,
        datacenter=spec.get("datacenter", "dc0"),
        memory_budget_gib=tuple(budgets),
        intra_latency_us=spec.get("intra_latency_us"),
        host_memory_gib=spec.get("host_memory_gib"),
    )


def load_cluster(cluster: Any, catalog: GpuCatalog = DEFAULT_CATALOG) -> ClusterInventory:
    """An inventory from what a Python user passes: a shipped config name, a YAML path,
    a DictConfig or mapping shaped like :class:`ClusterSpec`, or an inventory (returned as is)."""
    from pathlib import Path

    from omegaconf import DictConfig, OmegaConf

    if isinstance(cluster, ClusterInventory):
        return cluster
    if isinstance(cluster, (str, Path)):
        path = Path(cluster)
        if path.suffix not in (".yaml", ".yml"):
            path = Path(__file__).resolve().parent.parent / "conf" / "cluster" / f"{cluster}.yaml"
            if not path.is_file():
                shipped = sorted(p.stem for p in path.parent.glob("*.yaml"))
                raise InventoryError(
                    f"cluster {str(cluster)!r} is neither a shipped config ({', '.join(shipped)}) "
                    f"nor a path to a .yaml file; pass one of those names or a path"
                )
        if not path.is_file():
            raise InventoryError(f"cluster file {str(path)!r} does not exist; check the path")
        raw = OmegaConf.load(path)
        raw.pop("defaults", None)
        cluster = raw
    if isinstance(cluster, (dict, DictConfig)):
        typed = OmegaConf.merge(OmegaConf.structured(ClusterSpec), cluster)
        return inventory_from_config(typed, catalog)
    raise InventoryError(
        f"cluster={cluster!r} of type {type(cluster).__name__} is not understood; pass a config name, "
        f"a .yaml path, a mapping or a ClusterInventory"
    )

"""Layer 1: the cluster inventory (GPU types, machines, links). Imports neither torch nor Lightning."""

from zorse_lightning.cluster.catalog import DEFAULT_CATALOG, GpuCatalog
from zorse_lightning.cluster.gpu_type import GpuType
from zorse_lightning.cluster.inventory import (
    ClusterInventory,
    DatacenterLink,
    Gpu,
    Latencies,
    LinkKind,
    Machine,
    MachineLink,
)

__all__ = [
    "DEFAULT_CATALOG",
    "ClusterInventory",
    "DatacenterLink",
    "Gpu",
    "GpuCatalog",
    "GpuType",
    "Latencies",
    "LinkKind",
    "Machine",
    "MachineLink",
]

"""Datasheet figures of known GPU types, and lookup by any usual spelling.

Names are the keys of the reference profiles (``../shared/reference``) so the
profiling layer can find measured data for a type by its catalog name. Figures
come from the public datasheets (dense, no sparsity); bandwidths are converted
from GB/s to this project's Gb/s by :func:`zorse_lightning.units.gb_per_s_to_gbps`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from zorse_lightning.cluster.gpu_type import PCIE3_X16_GBPS, GpuType
from zorse_lightning.errors import InventoryError
from zorse_lightning.units import gb_per_s_to_gbps as _gbps

_NVLINK4 = _gbps(900)
_NVLINK3 = _gbps(600)
_NVLINK2 = _gbps(300)
_PCIE5 = _gbps(64)
_PCIE4 = _gbps(32)
_PCIE3 = PCIE3_X16_GBPS


def _entry(name, memory_gib, fp16, bf16, hbm_gb_per_s, peer_gbps, host_gbps, *aliases) -> GpuType:
    """``host_gbps``: the PCIe generation of the type's x16 host link (SXM boards too: their host link is PCIe)."""
    return GpuType(
        name=name,
        memory_gib=memory_gib,
        fp16_tflops=fp16,
        bf16_tflops=bf16,
        memory_bandwidth_gbps=_gbps(hbm_gb_per_s),
        peer_bandwidth_gbps=peer_gbps,
        host_link_gbps=host_gbps,
        aliases=tuple(aliases),
    )


_ENTRIES = (
    _entry("h100-sxm", 80, 989, 989, 3350, _NVLINK4, _PCIE5, "H100", "H100 SXM", "H100-SXM5-80GB", "H100 80GB HBM3"),
    _entry("h100-nvl", 94, 835, 835, 3900, _gbps(600), _PCIE5, "H100 NVL", "H100NVL"),
    _entry("h200", 141, 989, 989, 4800, _NVLINK4, _PCIE5, "H200", "H200 SXM", "H200-SXM-141GB"),
    _entry("a100x40", 40, 312, 312, 1555, _NVLINK3, _PCIE4, "A100", "A100-40GB", "A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB"),
    _entry("a100x80", 80, 312, 312, 1935, _PCIE4, _PCIE4, "A100-80GB", "A100 80GB PCIe", "A100-PCIE-80GB"),
    _entry("a100-sxm80", 80, 312, 312, 2039, _NVLINK3, _PCIE4, "A100-SXM4-80GB", "A100 SXM 80GB"),
    _entry("v100x16", 16, 125, 0, 900, _NVLINK2, _PCIE3, "V100", "V100-16GB", "V100-SXM2-16GB"),
    _entry("v100x32", 32, 125, 0, 900, _NVLINK2, _PCIE3, "V100-32GB", "V100-SXM2-32GB"),
    _entry("v100-pciex16", 16, 112, 0, 900, _PCIE3, _PCIE3, "V100-PCIE-16GB", "V100 PCIe"),
    _entry("a6000", 48, 154.8, 154.8, 768, _gbps(112.5), _PCIE4, "RTX A6000", "A6000"),
    _entry("l40s", 48, 362, 362, 864, _PCIE4, _PCIE4, "L40S"),
    _entry("a10g", 24, 125, 125, 600, _PCIE4, _PCIE4, "A10G", "A10", "A10-24GB"),
    _entry("l4", 24, 121, 121, 300, _PCIE4, _PCIE4, "L4"),
    _entry("t4", 16, 65, 0, 320, _PCIE3, _PCIE3, "T4", "Tesla T4"),
    _entry("p100", 16, 18.7, 0, 732, _PCIE3, _PCIE3, "P100", "P100-PCIE-16GB", "P100-SXM2-16GB"),
    _entry("p40", 24, 11.8, 0, 346, _PCIE3, _PCIE3, "P40"),
    _entry("rtx3090", 24, 71, 71, 936, _gbps(112.5), _PCIE4, "RTX 3090", "GeForce RTX 3090", "rtx_3090"),
    _entry("rtx4090", 24, 165, 165, 1008, _PCIE4, _PCIE4, "RTX 4090", "GeForce RTX 4090"),
    _entry("w6800", 32, 35.7, 0, 512, _PCIE4, _PCIE4, "Radeon PRO W6800", "W6800"),
)

_VENDOR_WORDS = re.compile(r"\b(nvidia|tesla|geforce|quadro|amd|radeon pro)\b")


_DEVICE_SUFFIX = re.compile(r"(sxm\d*|pcie|hbm\d*e?|\d+gb|mig.*)*")


def normalise_gpu_name(name: str) -> str:
    """Fold a spelling to a comparison key: vendor words and punctuation dropped."""
    return re.sub(r"[^a-z0-9]", "", _VENDOR_WORDS.sub("", name.lower()))


class GpuCatalog:
    """GPU types by name, immutable once built; extend with :meth:`with_types`."""

    def __init__(self, types: Iterable[GpuType]) -> None:
        by_name: dict[str, GpuType] = {}
        by_key: dict[str, GpuType] = {}
        for gpu_type in types:
            by_name[gpu_type.name] = gpu_type
        for gpu_type in by_name.values():
            for spelling in (gpu_type.name, *gpu_type.aliases):
                by_key.setdefault(normalise_gpu_name(spelling), gpu_type)
        self._by_name: Mapping[str, GpuType] = MappingProxyType(by_name)
        self._by_key: Mapping[str, GpuType] = MappingProxyType(by_key)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def with_types(self, extra: Iterable[GpuType]) -> GpuCatalog:
        """A catalog with ``extra`` added (an entry of the same name replaces the shipped one)."""
        return GpuCatalog([*self._by_name.values(), *extra])

    def find(self, name: str) -> GpuType | None:
        """The entry for ``name`` in any known spelling, or None."""
        key = normalise_gpu_name(name)
        if key in self._by_key:
            return self._by_key[key]
        # Device names carry suffixes the aliases omit ("H100 PCIe", "A100-SXM4-40GB MIG 1g.5gb"):
        # accept the longest known prefix when what follows is only such a suffix.
        for known_key in sorted(self._by_key, key=len, reverse=True):
            if key.startswith(known_key) and _DEVICE_SUFFIX.fullmatch(key[len(known_key) :]):
                return self._by_key[known_key]
        return None

    def get(self, name: str) -> GpuType:
        """The entry for ``name``; an :class:`InventoryError` suggesting close names otherwise."""
        found = self.find(name)
        if found is None:
            spellings = {normalise_gpu_name(s): s for t in self._by_name.values() for s in (t.name, *t.aliases)}
            close = difflib.get_close_matches(normalise_gpu_name(name), list(spellings), n=3, cutoff=0.5)
            hint = ", ".join(repr(self._by_key[c].name) for c in dict.fromkeys(close)) or "none close"
            raise InventoryError(
                f"unknown GPU type {name!r}: not in the catalog (closest: {hint}). "
                f"Use a catalog name ({', '.join(self.names)}) or describe the type under "
                f"`gpu_types:` in the cluster config"
            )
        return found


DEFAULT_CATALOG = GpuCatalog(_ENTRIES)
"""The shipped catalog (immutable; configs extend a copy)."""

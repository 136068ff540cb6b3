"""The accelerator for clusters whose ranks hold different device types.

Lightning's accelerators know one device kind for all ranks. Here each rank
also knows its GPU type: on CUDA the type detected on ``cuda:LOCAL_RANK``; on
CPU the type it emulates (from the cluster inventory), with the emulation
spec that slows its compute and bounds its memory.

Selection without naming it. Lightning refuses an accelerator given both by
``Trainer(accelerator=...)`` and by the strategy, but it hands its final choice
to the strategy through ``strategy.accelerator = ...`` (in
``_AcceleratorConnector._lazy_init_strategy``). A strategy that leaves its own
accelerator unset and overrides that setter with :func:`resolve_accelerator`
therefore accepts ``accelerator="cpu"``, ``"gpu"``, ``"cuda"``, ``"auto"`` or
``"zorse"`` and always ends up with this plugin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from typing_extensions import override

from zorse_lightning.cluster.detection import local_device_report, match_device
from zorse_lightning.cluster.gpu_type import GpuType
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.emulation.spec import DEFAULT_FASTEST_SLOWDOWN, EmulationSpec, emulation_spec_for_rank
from zorse_lightning.errors import ZorseUserError
from zorse_lightning.strategy.registration import ACCELERATOR_NAME



@dataclass(frozen=True)
class RankDevice:
    """What one rank computes on."""

    global_rank: int
    device: torch.device
    gpu_type: GpuType | None
    """The real or emulated GPU type; None for a CPU rank with no cluster to emulate."""
    emulation: EmulationSpec | None
    """Set on CPU ranks that emulate ``gpu_type``."""


class ZorseAccelerator(Accelerator):
    """Per-rank devices and GPU types; ``ZorseAccelerator()`` is the CUDA or the CPU variant.

    The CPU variant is chosen without CUDA, or when the inventory is emulated
    (its ranks are CPU processes by definition).
    """

    def __new__(cls, inventory: ClusterInventory | None = None, fastest_slowdown: float = DEFAULT_FASTEST_SLOWDOWN):
        if cls is ZorseAccelerator:
            emulated = inventory is not None and inventory.emulated
            cls = ZorseCUDAAccelerator if CUDAAccelerator.is_available() and not emulated else ZorseCPUAccelerator
        return super().__new__(cls)

    def __init__(
        self, inventory: ClusterInventory | None = None, fastest_slowdown: float = DEFAULT_FASTEST_SLOWDOWN
    ) -> None:
        super().__init__()
        self.inventory = inventory
        self.fastest_slowdown = fastest_slowdown

    def describe_rank(self, global_rank: int, local_rank: int, device: torch.device | None = None) -> RankDevice:
        """The device and GPU type of a rank (call it on that rank: CUDA detection reads the local device)."""
        raise NotImplementedError  # each variant knows its device kind

    # Lightning's registry asks these of the registered class itself (the variants override them).
    @staticmethod
    @override
    def is_available() -> bool:
        return True

    @staticmethod
    @override
    def parse_devices(devices: Any) -> Any:
        return (CUDAAccelerator if CUDAAccelerator.is_available() else CPUAccelerator).parse_devices(devices)

    @staticmethod
    @override
    def get_parallel_devices(devices: Any) -> Any:
        return (CUDAAccelerator if CUDAAccelerator.is_available() else CPUAccelerator).get_parallel_devices(devices)

    @staticmethod
    @override
    def auto_device_count() -> int:
        return CUDAAccelerator.auto_device_count() if CUDAAccelerator.is_available() else 1

    @staticmethod
    @override
    def name() -> str:
        return ACCELERATOR_NAME


class ZorseCPUAccelerator(CPUAccelerator, ZorseAccelerator):
    """CPU ranks; with an inventory, each emulates the GPU type listed at its global rank."""

    @override
    def describe_rank(self, global_rank: int, local_rank: int, device: torch.device | None = None) -> RankDevice:
        if self.inventory is None:
            return RankDevice(global_rank, torch.device("cpu"), gpu_type=None, emulation=None)
        spec = emulation_spec_for_rank(self.inventory, global_rank, self.fastest_slowdown)
        return RankDevice(
            global_rank, torch.device("cpu"), gpu_type=self.inventory.gpus[global_rank].gpu_type, emulation=spec
        )


def cuda_index_for(local_rank: int, visible_devices: int) -> int:
    """The CUDA device a process of local rank ``local_rank`` uses, among the ``visible_devices`` it sees.

    One process per GPU sees either every GPU of its machine (``cuda:LOCAL_RANK``)
    or, under SLURM's ``--gpus-per-task`` or a ``CUDA_VISIBLE_DEVICES`` per process,
    only its own (``cuda:0``).
    """
    if local_rank < visible_devices:
        return local_rank
    if visible_devices == 1:
        return 0
    raise ZorseUserError(
        f"local rank {local_rank} sees {visible_devices} CUDA devices: a process needs either its own GPU alone "
        f"or every GPU of its machine; set CUDA_VISIBLE_DEVICES per process (or srun --gpus-per-task=1), or "
        f"launch at most {visible_devices} processes on this machine"
    )


class ZorseCUDAAccelerator(CUDAAccelerator, ZorseAccelerator):
    """One CUDA device per rank (:func:`cuda_index_for`), its type detected and named from the catalog."""

    @override
    def describe_rank(self, global_rank: int, local_rank: int, device: torch.device | None = None) -> RankDevice:
        """``device``: the rank's own (the strategy's root device); None: ``cuda:LOCAL_RANK`` (:func:`cuda_index_for`)."""
        device = device or torch.device("cuda", cuda_index_for(local_rank, torch.cuda.device_count()))
        report = local_device_report(device)
        if report is None:
            raise ZorseUserError(f"{device} gave no device report; check the CUDA installation with nvidia-smi")
        return RankDevice(global_rank, device, gpu_type=match_device(report), emulation=None)


def resolve_accelerator(
    strategy_accelerator: Accelerator | None,
    flag: Accelerator | str | None,
    inventory: ClusterInventory | None = None,
    fastest_slowdown: float = DEFAULT_FASTEST_SLOWDOWN,
) -> ZorseAccelerator:
    """The zorse accelerator for what the user asked: the strategy's own, else the Trainer's flag.

    ``flag`` is what Lightning resolved from ``Trainer(accelerator=...)``: an
    instance (``CPUAccelerator`` for ``"cpu"``, ``CUDAAccelerator`` for ``"gpu"``)
    or a name. The device kind is kept; the inventory is attached.
    """
    chosen = strategy_accelerator if strategy_accelerator is not None else flag
    if isinstance(chosen, ZorseAccelerator) and chosen.inventory is inventory:
        return chosen
    if isinstance(chosen, CUDAAccelerator) or chosen in ("cuda", "gpu"):
        if inventory is not None and inventory.emulated:
            raise ZorseUserError(
                f"accelerator={_spelling(chosen)} asks for CUDA, but cluster {inventory.name!r} is emulated "
                f"(its ranks are CPU processes); use accelerator='cpu' or a cluster config of real GPUs"
            )
        return ZorseCUDAAccelerator(inventory, fastest_slowdown)
    if isinstance(chosen, CPUAccelerator) or chosen == "cpu":
        return ZorseCPUAccelerator(inventory, fastest_slowdown)
    if chosen in (None, "auto", ACCELERATOR_NAME):
        return ZorseAccelerator(inventory, fastest_slowdown)
    raise ZorseUserError(
        f"accelerator={_spelling(chosen)} is not supported by zorse, which runs on CUDA GPUs or on CPU ranks "
        f"emulating GPU types; use accelerator='gpu', 'cpu' or 'auto'"
    )


def _spelling(accelerator: Accelerator | str | None) -> str:
    return repr(accelerator) if isinstance(accelerator, str) or accelerator is None else type(accelerator).__name__

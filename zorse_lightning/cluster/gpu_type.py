"""What a kind of GPU can do, as its datasheet says."""

from __future__ import annotations

from dataclasses import dataclass, field

from zorse_lightning.errors import InventoryError
from zorse_lightning.units import gb_per_s_to_gbps

PCIE3_X16_GBPS = gb_per_s_to_gbps(16)
"""A PCIe 3.0 x16 link, each way (16 GB/s as sold; about 12 measured): the host link a type has unless it says."""

DEFAULT_TENSOR_PARALLEL_EFFICIENCY = 0.9
"""Compute of a block split over ``t`` GPUs of one type = its one-GPU time / (``t`` x this), its collectives apart
(priced on the machine's links by the cost model, run for real by the emulation). Each rank's matrix products are
``t`` times narrower, which runs a GPU further from its peak, and the parts a split leaves whole (norms, residual
adds, rotary embeddings) are not divided. Not measured here (no machine of this project holds two GPUs of a type):
a catalogued figure, bounded by Megatron-LM's 77 % weak-scaling efficiency at 8-way tensor parallelism of an 8.3 B
GPT on DGX-2H *including* its all-reduces (Shoeybi et al. 2019, arXiv 1909.08053, section 5.1), of which the
compute alone keeps more. A profile that measured a type's split blocks overrides it
(``DeviceTimes.tensor_parallel_efficiency``)."""


@dataclass(frozen=True)
class GpuType:
    """One kind of accelerator.

    Figures are dense (no sparsity) datasheet peaks; the planner scales them by
    an efficiency factor only when no measured or reference profile exists.
    """

    name: str
    """Catalog key, also the key of the reference profiles (``a100x40``)."""
    memory_gib: float
    """Device memory as sold (a machine entry may set a smaller budget)."""
    fp16_tflops: float
    """Peak dense fp16 tensor throughput (for P40, which has no fast fp16: its fp32 rate)."""
    bf16_tflops: float
    """Peak dense bf16 throughput; 0 where bf16 is not supported."""
    memory_bandwidth_gbps: float
    """Device memory bandwidth, gigabits per second."""
    peer_bandwidth_gbps: float
    """Typical GPU-to-GPU bandwidth inside one machine (NVLink or PCIe)."""
    host_link_gbps: float = PCIE3_X16_GBPS
    """Bandwidth between the GPU and its host's memory, each way (PCIe 3/4/5 x16: 16/32/64 GB/s): what activation
    offload's copies cost. The oldest of the three unless given, so that an unknown type's copies are not priced
    as cheaper than they are."""
    aliases: tuple[str, ...] = field(default=())
    """Other spellings: marketing names and ``torch.cuda.get_device_name`` strings."""
    from_datasheet: bool = True
    """False for entries guessed from a detected device the catalog lacks."""
    nccl_communicator_bytes: int | None = None
    """Device memory one NCCL communicator took on this type, outside torch's allocator: measured at setup (the
    largest of its ranks', :mod:`zorse_lightning.engine.nccl_memory`); None: priced from NCCL's settings
    (:class:`zorse_lightning.planner.cost.framework_memory.NcclBuffers`)."""
    tensor_parallel_efficiency: float = DEFAULT_TENSOR_PARALLEL_EFFICIENCY
    """One-GPU block time / (``t`` x the time of its ``1/t`` split on one of ``t`` GPUs of this type), collectives
    apart: what the planner prices a tensor-parallel block's compute by where no profile measured it, and what an
    emulated rank's split blocks are charged (see :data:`DEFAULT_TENSOR_PARALLEL_EFFICIENCY`)."""

    def __post_init__(self) -> None:
        for field_name in ("memory_gib", "fp16_tflops", "memory_bandwidth_gbps", "peer_bandwidth_gbps", "host_link_gbps"):
            value = getattr(self, field_name)
            if not value > 0:
                raise InventoryError(
                    f"GPU type {self.name!r}: {field_name}={value!r} must be positive; "
                    f"give the datasheet figure in the units of the field name"
                )
        if not 0 < self.tensor_parallel_efficiency <= 1:
            raise InventoryError(
                f"GPU type {self.name!r}: tensor_parallel_efficiency={self.tensor_parallel_efficiency!r} must be in "
                f"(0, 1] (a split block's compute runs at most t times faster); the default is "
                f"{DEFAULT_TENSOR_PARALLEL_EFFICIENCY}"
            )
        if self.bf16_tflops < 0:
            raise InventoryError(
                f"GPU type {self.name!r}: bf16_tflops={self.bf16_tflops!r} must be >= 0 "
                f"(0 means bf16 is not supported)"
            )

    @property
    def supports_bf16(self) -> bool:
        return self.bf16_tflops > 0

    @property
    def peak_tflops(self) -> float:
        """The best half-precision peak this GPU offers."""
        return max(self.fp16_tflops, self.bf16_tflops)

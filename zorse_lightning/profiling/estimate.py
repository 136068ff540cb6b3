"""Sizes, FLOPs and estimated times of a decoder-only transformer, from its shape alone.

The least trusted profile source (``ESTIMATED``): used for GPU types that have
neither a measurement nor reference data, and for arbitrary models in planner
tests. Formulas (per sample of ``s`` tokens, hidden size ``h``, ``a`` heads,
vocabulary ``V``, ``P`` parameters per layer, ``e`` bytes per element):

- layer forward FLOPs ``2 P s + 4 s^2 h``: every weight is used in one
  multiply-add per token, plus the two attention matmuls (``Q K^T`` and
  ``softmax V``, ``2 s^2 h`` each); backward costs twice the forward;
- layer activations kept for backward ``s h (34 + 5 a s / h)`` bytes at 16-bit
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", no sequence parallelism, no recomputation), scaled by
  ``e / 2`` for other widths; heads ``a = h / 128`` (the usual head size);
- a layer's output ``s h e`` bytes: what crosses a pipeline cut;
- head (output projection) forward FLOPs ``2 s h V``; its saved activations
  are its input plus the float32 logits the loss keeps (``s V 4`` bytes);
- embedding forward FLOPs ``s h`` (a gather: memory-bound and small); it keeps
  the token ids (``8 s`` bytes, int64) for its backward.

Estimated time = FLOPs / (peak x efficiency); intercepts are zero, since launch
overheads are not in the datasheet. The catalog lists no float32 peak, so every
dtype is timed against the half-precision peak and the efficiency for float32
(calibrated on the reference data) absorbs the difference.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from zorse_lightning.cluster.catalog import DEFAULT_CATALOG, GpuCatalog
from zorse_lightning.cluster.gpu_type import GpuType
from zorse_lightning.errors import PlanningError
from zorse_lightning.profiling.profile import BlockShape, BlockTimes, DeviceTimes, ModelProfile, ProfileSource, TimeCurve

BYTES_PER_ELEMENT = {"float16": 2, "bfloat16": 2, "float32": 4}
HEAD_DIM = 128
BACKWARD_OVER_FORWARD = 2.0
"""A backward pass computes gradients of inputs and of weights: two matmuls per forward one."""
DEFAULT_EFFICIENCY = {"float16": 0.39, "bfloat16": 0.39, "float32": 0.10}
"""Achieved / half-precision peak: medians over every (model of the alias table, GPU type)
pair of the shipped reference data at sequence length 512 (0.394 and 0.098 when written;
per GPU they range from 0.06 to 0.9). bfloat16 runs at the float16 rate."""
TOKEN_ID_BYTES = 8
LOGIT_BYTES = 4


def bytes_per_element(dtype: str) -> int:
    try:
        return BYTES_PER_ELEMENT[dtype]
    except KeyError:
        raise PlanningError(
            f"dtype={dtype!r} is not a training precision the profiles know; use one of {', '.join(BYTES_PER_ELEMENT)}"
        ) from None


def peak_flops_per_s(gpu_type: GpuType, dtype: str) -> float:
    """The peak the efficiency factor applies to (bf16 falls back to fp16 where the GPU lacks bf16)."""
    bytes_per_element(dtype)
    tflops = gpu_type.bf16_tflops if dtype == "bfloat16" and gpu_type.supports_bf16 else gpu_type.fp16_tflops
    return tflops * 1e12


@dataclass(frozen=True)
class TransformerShape:
    """The sizes that determine a decoder-only transformer's cost."""

    hidden_size: int
    num_layers: int
    seq_len: int
    vocab_size: int
    parameters_per_layer: int = 0
    """0: the GPT layout, ``12 h^2 + 13 h`` (attention 4 h^2, MLP 8 h^2, biases and norms)."""
    learned_positions: int = 0
    """Rows of a learned position-embedding table (0 for rotary embeddings)."""
    tied_embedding_head: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise PlanningError(f"TransformerShape.{name}={getattr(self, name)!r} must be a positive integer")
        if self.parameters_per_layer < 0 or self.learned_positions < 0:
            raise PlanningError(
                f"TransformerShape: parameters_per_layer={self.parameters_per_layer!r} and "
                f"learned_positions={self.learned_positions!r} must be >= 0 (0 means the default)"
            )

    @property
    def heads(self) -> int:
        return max(1, self.hidden_size // HEAD_DIM)

    @property
    def layer_parameters(self) -> int:
        h = self.hidden_size
        return self.parameters_per_layer or 12 * h * h + 13 * h

    @property
    def layer_forward_flops_per_sample(self) -> float:
        s, h = self.seq_len, self.hidden_size
        return 2.0 * self.layer_parameters * s + 4.0 * s * s * h

    @property
    def head_forward_flops_per_sample(self) -> float:
        return 2.0 * self.seq_len * self.hidden_size * self.vocab_size

    @property
    def embedding_forward_flops_per_sample(self) -> float:
        return float(self.seq_len * self.hidden_size)

    def block_shapes(self, dtype: str) -> tuple[BlockShape, tuple[BlockShape, ...], BlockShape]:
        """Embedding, layers and head sizes at ``dtype``."""
        e = bytes_per_element(dtype)
        s, h, a = self.seq_len, self.hidden_size, self.heads
        activation_16bit = s * h * (34 + 5 * a * s / h)
        layer = BlockShape(
            name="layer",
            parameters=self.layer_parameters,
            activation_bytes_per_sample=round(activation_16bit * e / 2),
            output_bytes_per_sample=s * h * e,
            forward_flops_per_sample=self.layer_forward_flops_per_sample,
        )
        embedding = BlockShape(
            name="embedding",
            parameters=(self.vocab_size + self.learned_positions) * h,
            activation_bytes_per_sample=TOKEN_ID_BYTES * s,
            output_bytes_per_sample=s * h * e,
            forward_flops_per_sample=self.embedding_forward_flops_per_sample,
        )
        head = BlockShape(
            name="head",
            parameters=self.vocab_size * h,
            activation_bytes_per_sample=s * h * e + s * self.vocab_size * LOGIT_BYTES,
            output_bytes_per_sample=0,
            forward_flops_per_sample=self.head_forward_flops_per_sample,
        )
        layers = tuple(replace(layer, name=f"layer{i}") for i in range(self.num_layers))
        return embedding, layers, head


def estimated_block_times(
    forward_flops_per_sample: float, gpu_type: GpuType, dtype: str, efficiency: float
) -> BlockTimes:
    """Lines through the origin: FLOPs / (peak x efficiency), backward twice the forward."""
    if not 0 < efficiency <= 1:
        raise PlanningError(f"efficiency={efficiency!r} must be in (0, 1]: the achieved fraction of the GPU's peak")
    forward_ms = forward_flops_per_sample / (peak_flops_per_s(gpu_type, dtype) * efficiency) * 1e3
    return BlockTimes(TimeCurve(forward_ms, 0.0), TimeCurve(forward_ms * BACKWARD_OVER_FORWARD, 0.0))


def device_times_from_layer(
    shape: TransformerShape, gpu_type: str, source: ProfileSource, layer: BlockTimes
) -> DeviceTimes:
    """Every block's times from one layer's: embedding and head scaled by their FLOPs relative to a layer.

    Scaling the GPU's own layer curve (rather than the datasheet peak) carries
    the efficiency this GPU achieves on this model over to the two end blocks.
    """
    layer_flops = shape.layer_forward_flops_per_sample
    return DeviceTimes(
        gpu_type=gpu_type,
        source=source,
        embedding=layer.scaled(shape.embedding_forward_flops_per_sample / layer_flops),
        layers=(layer,) * shape.num_layers,
        head=layer.scaled(shape.head_forward_flops_per_sample / layer_flops),
    )


def estimated_profile(
    shape: TransformerShape,
    gpu_types: Iterable[str],
    dtype: str = "float16",
    *,
    name: str = "",
    efficiency: float | None = None,
    catalog: GpuCatalog = DEFAULT_CATALOG,
) -> ModelProfile:
    """A profile of any transformer from its shape, on catalog GPU types, every time ``ESTIMATED``.

    ``efficiency`` defaults to :data:`DEFAULT_EFFICIENCY` for ``dtype``. GPU types
    are keyed by their catalog name (``"A100"`` becomes ``"a100x40"``).
    """
    embedding, layers, head = shape.block_shapes(dtype)
    eff = DEFAULT_EFFICIENCY[dtype] if efficiency is None else efficiency
    devices = {}
    for requested in gpu_types:
        gpu = catalog.get(requested)
        layer = estimated_block_times(shape.layer_forward_flops_per_sample, gpu, dtype, eff)
        devices[gpu.name] = device_times_from_layer(shape, gpu.name, ProfileSource.ESTIMATED, layer)
    return ModelProfile(
        model=name or f"transformer_h{shape.hidden_size}_l{shape.num_layers}_v{shape.vocab_size}",
        seq_len=shape.seq_len,
        dtype=dtype,
        embedding=embedding,
        layers=layers,
        head=head,
        devices=devices,
        tied_embedding_head=shape.tied_embedding_head,
    )

"""Synthetic model profiles and clusters for the planner tests (helpers; no tests here).

Sizes follow a GPT block: 12 h^2 parameters, 34 s h bytes of activations per sample
kept for backward at half precision, 2 s h bytes crossing a cut; times from the
catalog's fp16 peak at a fixed efficiency (forward 2 FLOPs per parameter and token,
backward twice the forward).
"""

from __future__ import annotations

from testing.synthetic_cluster import synthetic_cluster
from zorse_lightning.cluster import DEFAULT_CATALOG, ClusterInventory
from zorse_lightning.profiling.profile import BlockShape, BlockTimes, DeviceTimes, ModelProfile, ProfileSource, TimeCurve

EFFICIENCY = 0.35
INTERCEPT_MS = 0.05


def _times(flops_per_sample: float, gpu_type: str, scale: float) -> BlockTimes:
    peak = DEFAULT_CATALOG.get(gpu_type).fp16_tflops * 1e12 * EFFICIENCY
    forward_ms = flops_per_sample / peak * 1e3 * scale
    return BlockTimes(TimeCurve(forward_ms, INTERCEPT_MS), TimeCurve(2 * forward_ms, 2 * INTERCEPT_MS))


def synthetic_profile(
    gpu_types: tuple[str, ...],
    num_layers: int = 24,
    hidden: int = 2048,
    seq_len: int = 512,
    vocab: int = 50_000,
    dtype: str = "float16",
    name: str = "synthetic",
    layer_scale: tuple[float, ...] | None = None,
) -> ModelProfile:
    """A GPT-like profile; ``layer_scale`` makes layer times differ (noisy measurements)."""
    layer = BlockShape("layer", 12 * hidden * hidden, 34 * seq_len * hidden, 2 * seq_len * hidden, 24.0 * seq_len * hidden * hidden)
    embedding = BlockShape("embedding", vocab * hidden, 2 * seq_len * hidden, 2 * seq_len * hidden, 0.0)
    head = BlockShape("head", vocab * hidden, 4 * seq_len * vocab, 4 * seq_len * vocab, 2.0 * seq_len * hidden * vocab)
    scales = layer_scale or (1.0,) * num_layers
    devices = {
        t: DeviceTimes(
            gpu_type=t,
            source=ProfileSource.ESTIMATED,
            embedding=_times(2.0 * seq_len * hidden, t, 1.0),
            layers=tuple(_times(layer.forward_flops_per_sample, t, scales[i]) for i in range(num_layers)),
            head=_times(head.forward_flops_per_sample, t, 1.0),
        )
        for t in gpu_types
    }
    return ModelProfile(name, seq_len, dtype, embedding, (layer,) * num_layers, head, devices)


def real_gpu_profile(inventory: ClusterInventory) -> ModelProfile:
    """About 1.4B parameters in 24 layers: too big for plain data parallel on 16 GiB GPUs."""
    return synthetic_profile(tuple(t.name for t in inventory.gpu_types))


def tiny_profile(inventory: ClusterInventory) -> ModelProfile:
    """About 6M parameters in 8 layers, for the cpu_sim clusters' 0.16-0.4 GiB budgets."""
    return synthetic_profile(
        tuple(t.name for t in inventory.gpu_types), num_layers=8, hidden=256, seq_len=128, vocab=1000, name="tiny"
    )


def profile_for(inventory: ClusterInventory) -> ModelProfile:
    return tiny_profile(inventory) if inventory.emulated else real_gpu_profile(inventory)


def big_cluster() -> ClusterInventory:
    """128 machines of 8 GPUs, four types, racks of 4 machines on faster links."""
    return synthetic_cluster(1024)

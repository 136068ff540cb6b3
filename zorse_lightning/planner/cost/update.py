"""The optimizer step: after a stage's gradients are synchronised, each of its GPUs
updates the weights it owns, and nothing overlaps it (on cpu_sim4 about 20 ms a
step for 3.3M parameters of AdamW on one CPU thread, which predictions missed
until the cost model priced it).

An Adam step streams every parameter's training state through memory once and does
a few flops per byte, so it is bound by memory bandwidth: its time is the bytes it
touches over the GPU's bandwidth, unless the device measured its own rate
(``DeviceTimes.optimizer_ms_per_million_parameters``), which is preferred.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

from zorse_lightning.capabilities import Sharding
from zorse_lightning.cluster.gpu_type import GpuType
from zorse_lightning.profiling.profile import DeviceTimes
from zorse_lightning.units import gbps_to_bytes_per_s

if TYPE_CHECKING:
    from zorse_lightning.planner.cost.context import CostContext

ADAM_STEP_BYTES_PER_PARAMETER = 28
"""Memory traffic of one Adam(W) step per parameter, the same in both precisions.

Mixed precision (float16 / bfloat16, the accounting of :mod:`.memory`): read the
fp32 master weight (4), the low-precision gradient (2) and the two fp32 moments
(8); write the master weight (4), the moments (8) and the low-precision copy of
the weight (2): 28 bytes. float32 training: read weight, gradient and moments
(16), write weight and moments (12): 28 bytes. A fused kernel moves about this
much; unfused implementations move more, which a measured rate captures.
"""


def optimizer_step_ms(device_times: DeviceTimes, gpu_type: GpuType, parameters_updated: float) -> float:
    """Time of one optimizer step over ``parameters_updated`` parameters on one GPU.

    The device's measured rate when its profile has one, else
    :data:`ADAM_STEP_BYTES_PER_PARAMETER` per parameter at the GPU type's
    datasheet memory bandwidth.
    """
    measured = device_times.optimizer_ms_per_million_parameters
    if measured is not None:
        return measured * parameters_updated / 1e6
    seconds = parameters_updated * ADAM_STEP_BYTES_PER_PARAMETER / gbps_to_bytes_per_s(gpu_type.memory_bandwidth_gbps)
    return seconds * 1e3


def parameters_updated(stage_parameters: float, sharding: Sharding, shard_fractions: tuple[float, ...]) -> tuple[float, ...]:
    """Parameters each rank of a stage steps: its shard of the stage's at every sharded level
    (``optimizer``, ``optimizer_gradients`` and ``full`` all shard the optimizer state: each rank
    holds the state of, and steps, only its shard), all of them unsharded (every rank holds the
    whole state and steps it redundantly)."""
    if sharding is Sharding.NONE:
        return tuple(float(stage_parameters) for _ in shard_fractions)
    return tuple(stage_parameters * fraction for fraction in shard_fractions)


def update_lower_bound_ms(ctx: CostContext, ranks: list[int]) -> float:
    """No plan on ``ranks`` steps its optimizer faster than this: every parameter of the
    model spread over them in proportion to their speed.

    A stage of ``P`` parameters whose GPUs step one parameter in ``c_r`` ms waits for
    its slowest, ``max_r f_r P c_r >= P / sum_r 1 / c_r`` for any shares ``f_r``
    summing to one (all ones unsharded: slower still); the stages' ``P`` add up to at
    least the model's, so the slowest stage takes at least the model's over the sum of
    every GPU's ``1 / c_r``.
    """
    return update_lower_bound_of_counts(ctx, Counter(ctx.inventory.gpus[rank].gpu_type.name for rank in ranks))


def update_lower_bound_of_counts(ctx: CostContext, counts: Mapping[str, int]) -> float:
    """:func:`update_lower_bound_ms` of GPUs counted by type."""
    speed = 0.0
    for name, count in counts.items():
        cost = ctx.memo(("step per parameter", name), lambda: optimizer_step_ms(
            ctx.profile.times(name), next(t for t in ctx.inventory.gpu_types if t.name == name), 1.0,
        ))
        if cost <= 0:
            return 0.0  # a free step
        speed += count / cost
    return ctx.profile.total_parameters / speed

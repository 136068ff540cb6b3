"""What a training step costs beyond the block list, measured at start-up on this rank's device.

The start-up profile times the blocks alone. A step also runs what comes before
the first block (embeddings), what comes after the last one (final norm, head,
loss, the step's own Python) and the optimizer step; left out, they made every
prediction short (bench/fidelity.py: 15 % on cpu_sim4). Both are measured here
on the device (an emulated rank through its emulation), so the planner prices
them as this GPU type runs them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zorse_lightning.module.blocks import BlockList
from zorse_lightning.module.microbatch import microbatch_slice, samples_in
from zorse_lightning.profiling.measure import synchronize
from zorse_lightning.profiling.profile import BlockTimes, TimeCurve

BACKWARD_OVER_FORWARD = 2.0
"""Backward time of the edges as a multiple of their forward: the usual ratio for
matrix products (a gradient for the input and one for the weight). The edges are
timed forward only, without gradients, so that start-up never holds the whole
model's gradients on one device."""

OPTIMIZER_PROBE_PARAMETERS = 1 << 20
"""Parameters of the tensor the optimizer probe steps on (4 MiB in float32, plus its state)."""


@dataclass(frozen=True)
class StepEdges:
    """Times of the parts of a step outside the block list, per microbatch size 1, 2, ..."""

    embedding: BlockTimes
    head: BlockTimes


def _curve(forward_ms: list[float]) -> tuple[TimeCurve, TimeCurve]:
    slope = forward_ms[-1] - forward_ms[-2] if len(forward_ms) > 1 else forward_ms[0]
    forward = TimeCurve(slope, forward_ms[0] - slope, tuple(forward_ms))
    return forward, forward.scaled(BACKWARD_OVER_FORWARD)


def measure_step_edges(
    step: Callable[[Any], Any], blocks: BlockList, batch: Any, device: torch.device,
    max_microbatch_size: int = 2, warmup: int = 1, repeats: int = 3,
) -> StepEdges:
    """Forward time before the first block and after the last, around ``step(microbatch)`` without gradients.

    ``step`` runs the user's training step; timestamps are taken when the first
    block receives its input and when the last block returns, so the edges are
    what the rest of the step spends, whatever the module computes there.
    """
    marks: dict[str, float] = {}

    def mark(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            synchronize(device)
            marks[name] = time.perf_counter()
        return hook

    handles = [blocks.blocks[0].register_forward_pre_hook(mark("first")),
               blocks.blocks[-1].register_forward_hook(mark("last"))]
    before_ms: list[float] = []
    after_ms: list[float] = []
    samples = samples_in(batch)
    try:
        for size in range(1, min(max_microbatch_size, samples) + 1):
            micro = microbatch_slice(batch, 0, size)
            runs = []
            for run in range(warmup + repeats):
                synchronize(device)
                start = time.perf_counter()
                with torch.no_grad():
                    step(micro)
                synchronize(device)
                end = time.perf_counter()
                if run >= warmup:
                    runs.append(((marks["first"] - start) * 1e3, (end - marks["last"]) * 1e3))
            before_ms.append(statistics.median(r[0] for r in runs))
            after_ms.append(statistics.median(r[1] for r in runs))
    finally:
        for handle in handles:
            handle.remove()
    return StepEdges(BlockTimes(*_curve(before_ms)), BlockTimes(*_curve(after_ms)))


def measure_optimizer_ms_per_million_parameters(device: torch.device, warmup: int = 1, repeats: int = 3) -> float:
    """Milliseconds of one AdamW step per million float32 parameters on ``device``.

    Adam-type optimizers are what large models train with; their step streams
    the weights, gradients and two moments through memory, so its time grows
    with the parameters a rank updates (its stage's, or its shard of them).
    """
    weight = torch.zeros(OPTIMIZER_PROBE_PARAMETERS, device=device, requires_grad=True)
    weight.grad = torch.ones_like(weight)
    optimizer = torch.optim.AdamW([weight])
    runs = []
    for run in range(warmup + repeats):
        synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        synchronize(device)
        if run >= warmup:
            runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs) * 1e6 / OPTIMIZER_PROBE_PARAMETERS

"""One GPU type's profile, measured at start by the first rank of that type on its own device.

Block 0 stands for every block (one list holds one class, and start-up runs
the step with only block 0 real: :mod:`~zorse_lightning.module.first_block`);
it is timed in place on the calls captured from the user's step (its
gradients are put back after),
then what a step spends outside them (embedding, head, loss: :mod:`.step_costs`)
and the optimizer's rate. On an emulated cluster every measurement goes through
the rank's emulator on the costs calibrated once for the whole run: every type
is timed on the same CPU cost, so the profile's ratios between types are exactly
their speed ratios, and the run's emulation charges what was profiled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from zorse_lightning.emulation.emulator import named_emulated_modules
from zorse_lightning.emulation.rank import RankEmulation
from zorse_lightning.emulation.timing import CallCost
from zorse_lightning.module.blocks import BlockList
from zorse_lightning.module.microbatch import samples_in
from zorse_lightning.profiling.measure import Call, MeasureOptions, MeasuredBlocks, measure_block_calls
from zorse_lightning.startup.step_costs import measure_optimizer_ms_per_million_parameters, measure_step_edges

PROFILE_OPTIONS = MeasureOptions(max_microbatch_size=2, warmup=1, repeats=3)
"""Short: profiling runs at every start; the planner needs the slope per sample more than precision."""


def block_names(blocks: BlockList) -> list[str]:
    """Each block's name in the whole model (what calibrated costs are keyed by)."""
    return [f"{blocks.path}.{name}" for name, _ in blocks.container.named_children()]


def view_modules(root: torch.nn.Module, blocks: BlockList) -> list[tuple[str, torch.nn.Module]]:
    """The emulated modules that compute in the first-block view: all but blocks 1.. (they pass through)."""
    later = {id(b) for b in blocks.blocks[1:]}
    return [(n, m) for n, m in named_emulated_modules(root, blocks.path) if id(m) not in later]


def _as_every_block(measured: MeasuredBlocks, count: int) -> MeasuredBlocks:
    """Block 0's measurement repeated for each of ``count`` blocks."""
    times = replace(measured.times, layers=measured.times.layers * count)
    layers = tuple(replace(measured.layers[0], name=f"layer{i}") for i in range(count))
    return replace(measured, layers=layers, times=times)


def measure_type_profile(
    root: torch.nn.Module,
    blocks: BlockList,
    calls: Sequence[Call],
    batch: Any,
    run_step: Callable[[Any], Any],
    device: torch.device,
    gpu_type: str,
    emulation: RankEmulation | None,
    costs: Mapping[str, CallCost] | None,
) -> MeasuredBlocks:
    """Blocks, step edges and optimizer rate of this rank's GPU type (through ``emulation`` where given).

    ``run_step(microbatch)`` runs the user's training step without gradients; ``calls[b - 1]`` is what block 0
    receives at microbatch size ``b`` (:func:`~zorse_lightning.module.capture.first_block_call`). Runs inside
    the first-block view; block 0 is timed in place (its gradients are put back after).
    """
    block = blocks.blocks[0]
    emulator = None
    if emulation is not None:
        emulator = emulation.instrumented(root, costs, named=[(block_names(blocks)[0], block)])
    try:
        measured = measure_block_calls(
            block, calls, device=device, gpu_type=gpu_type,
            options=replace(PROFILE_OPTIONS, max_microbatch_size=len(calls)),
        )
    finally:
        if emulator is not None:
            emulator.remove()

    step_emulator = emulation.instrumented(root, costs, named=view_modules(root, blocks)) if emulation is not None else None

    def step(micro: Any) -> Any:
        if step_emulator is not None:
            step_emulator.batch_samples = samples_in(micro)
        return run_step(micro)

    try:
        edges = measure_step_edges(
            step, blocks, batch, device, max_microbatch_size=PROFILE_OPTIONS.max_microbatch_size,
            warmup=PROFILE_OPTIONS.warmup, repeats=PROFILE_OPTIONS.repeats,
        )
    finally:
        if step_emulator is not None:
            step_emulator.remove()
    times = replace(
        measured.times, embedding=edges.embedding, head=edges.head,
        optimizer_ms_per_million_parameters=measure_optimizer_ms_per_million_parameters(device),
    )
    return _as_every_block(replace(measured, times=times), len(blocks))

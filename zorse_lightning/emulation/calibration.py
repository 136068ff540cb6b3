"""One calibration of the emulated CPU costs, shared by the start-up profile and the run.

Why: the emulation's deadlines are ``slowdown x calibrated cost``, so the
planner's profile (timed through the emulation) and the run agree only if they
use the same costs. Calibrated separately, each met whatever contention the
shared cores had at that moment, with all ranks calibrating at once: runs
differed by up to 2x and predictions missed by that much. Here the ranks
calibrate one at a time (the others wait in a barrier, off the cores), every
module at the fixed :data:`~.emulation_timing.CALIBRATION_SAMPLES`, and then
agree on the minimum of each cost over ranks, the measurement least disturbed
by other work. Costs are keyed by the module's name in the whole model, so a
stage, a deep copy of the blocks and a data-parallel rank find the same entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from zorse_lightning.emulation.timing import CallCost, batch_size_and_signature, calibrate_call


def cost_key(name: str, signature: str) -> str:
    """Key of a calibrated cost: the module's name and its per-sample input shapes (``whole:`` and the
    whole shapes for a call charged once per call)."""
    return f"{name}|{signature}"


def as_every_block(costs: Mapping[str, CallCost], first: str, others: Iterable[str]) -> dict[str, CallCost]:
    """``costs`` with module ``first``'s entries also under each name of ``others`` (blocks of one class,
    calibrated on the first alone while the others passed their input through)."""
    spread = dict(costs)
    for key, cost in costs.items():
        name, _, signature = key.partition("|")
        if name == first:
            spread.update((cost_key(other, signature), cost) for other in others)
    return spread


def min_costs(gathered: Iterable[Mapping[str, CallCost] | None]) -> dict[str, CallCost]:
    """Per key, the minimum forward and backward cost over several ranks' calibrations."""
    merged: dict[str, CallCost] = {}
    for costs in gathered:
        for key, cost in (costs or {}).items():
            known = merged.get(key, cost)
            merged[key] = CallCost(
                min(known.forward_s_per_sample, cost.forward_s_per_sample),
                min(known.backward_s_per_sample, cost.backward_s_per_sample),
            )
    return merged


def calibrate_modules(
    named_modules: Sequence[tuple[str, nn.Module]], run: Callable[[], Any], batch_samples: int | None = None
) -> dict[str, CallCost]:
    """Costs of every named module that ``run()`` calls, calibrated at its first call (nothing is slowed);
    ``batch_samples``: the samples ``run`` steps on (:attr:`ComputeEmulator.batch_samples`)."""
    costs: dict[str, CallCost] = {}

    def pre_hook(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            samples, signature = batch_size_and_signature(args, kwargs, batch_samples)
            key = cost_key(name, signature)
            if key not in costs:
                costs[key] = calibrate_call(module, args, kwargs, samples)

        return hook

    handles = [m.register_forward_pre_hook(pre_hook(n), with_kwargs=True) for n, m in named_modules]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return costs


def calibrate_in_turn(
    named_modules: Sequence[tuple[str, nn.Module]], run: Callable[[], Any], group: Any = None,
    batch_samples: int | None = None,
) -> dict[str, CallCost]:
    """:func:`calibrate_modules` on each rank of ``group`` in turn, then the minimum over ranks (collective).

    Without a process group, this process calibrates alone.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return calibrate_modules(named_modules, run, batch_samples)
    me, world = dist.get_rank(group), dist.get_world_size(group)
    mine: dict[str, CallCost] = {}
    for turn in range(world):
        if turn == me:
            mine = calibrate_modules(named_modules, run, batch_samples)
        dist.barrier(group)
    gathered: list[dict[str, CallCost] | None] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    return min_costs(gathered)

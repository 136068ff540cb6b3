"""Which tensor-parallel (TP) degrees the user's module admits, for the profile start-up and the plan app plan from.

Why here: the planner prices only the degrees a profile lists
(:attr:`~zorse_lightning.profiling.profile.ModelProfile.tensor_parallel`). A
reference profile lists its model's; a measured one has to read them off the
module itself: its blocks' TP plan (found as the engine finds it,
:mod:`zorse_lightning.module.tensor_parallel`: the strategy's ``tp_plan``, the
module's ``tp_plan`` attribute, a Hugging Face model's) tried at each degree a
stage of the cluster could take. Start-up (rank 0, before planning) and the plan
app (whose real GPU types get estimated times) both call
:func:`module_tensor_parallel`, so a plan made without hardware sees the degrees
training's start-up sees.

A TP group is ``t`` GPUs of one type on one machine, so no degree above the most
GPUs of one type a machine holds is tried (:func:`largest_tensor_parallel_group`),
nor above the planner options' ``max_tp``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.module.blocks import BlockList
from zorse_lightning.module.tensor_parallel import Style, admitted_degrees
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.profiling.profile import TensorParallelSupport

NOTE_PREFIX = "no tensor parallelism"
"""How a plan's note about the module's missing TP begins (``no tensor parallelism: <reason>``, as the search's
own note says it)."""


@dataclass(frozen=True)
class ModuleTensorParallel:
    """The degrees a module admits on a cluster, and the note a plan made from it carries."""

    support: TensorParallelSupport
    """What the profile says (degrees, why not more, parameters a split leaves whole)."""
    largest_group_gpus: int
    """The largest degree tried: the most GPUs of one type on one machine, capped by ``max_tp``."""
    note: str = ""
    """For the plan's notes where the cluster could hold a TP group but the module's blocks admit no degree
    (why, in the words of :func:`~zorse_lightning.module.tensor_parallel.admitted_degrees`); empty otherwise: a
    cluster without two GPUs of a type on one machine, or ``max_tp=1``, is no news about the module."""


def gpus_of_one_type_per_machine(inventory: ClusterInventory) -> int:
    """The most GPUs of one type that one machine of ``inventory`` holds."""
    return max(Counter((gpu.machine, gpu.gpu_type.name) for gpu in inventory.gpus).values())


def largest_tensor_parallel_group(inventory: ClusterInventory, options: PlannerOptions) -> int:
    """The largest TP degree worth trying on ``inventory``: its most GPUs of one type on one machine, at most
    ``options.max_tp``."""
    return min(gpus_of_one_type_per_machine(inventory), options.max_tp)


def module_tensor_parallel(
    module: nn.Module, blocks: BlockList, inventory: ClusterInventory, options: PlannerOptions,
    given: Mapping[str, Style] | None = None,
) -> ModuleTensorParallel:
    """The TP degrees ``module``'s ``blocks`` admit up to :func:`largest_tensor_parallel_group` (``given``: the
    strategy's ``tp_plan``, which the engine splits by too), as the profile's
    :class:`~zorse_lightning.profiling.profile.TensorParallelSupport`, with the plan's note.

    Reads only the blocks' structure and parameter shapes: a module built on the meta device answers alike."""
    most = largest_tensor_parallel_group(inventory, options)
    if most < 2:
        if options.max_tp < 2:
            why = f"the planner options' max_tp={options.max_tp} allows none"
        else:
            why = (
                f"no machine of cluster {inventory.name!r} holds two GPUs of one type, and a TP group's GPUs are of "
                f"one type on one machine"
            )
        return ModuleTensorParallel(TensorParallelSupport((), why), most)
    admitted = admitted_degrees(module, blocks, most, given)
    support = TensorParallelSupport(admitted.degrees, admitted.reason, admitted.replicated_parameters)
    note = "" if admitted.degrees else f"{NOTE_PREFIX}: {admitted.reason}"
    return ModuleTensorParallel(support, most, note)

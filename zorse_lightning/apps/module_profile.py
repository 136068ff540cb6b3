"""A LightningModule config's profile for the plan app, measured on this machine's CPU as start-up measures.

Why start-up's way: a plan is only as good as its profile, and the profile the
run plans from is start-up's (block calls captured from the user's own
``training_step`` at every microbatch size the batch allows, the step's edges
with gradients, the user's optimizer, the engine's time per action). The plan
app runs that same measurement (:func:`~zorse_lightning.startup.device_profile.profile_on_device`)
on the CPU, as GPU type ``cpu``, without emulation, then gives each GPU type of
the inventory its times:

- on an emulated cluster, the CPU's block and edge times times the type's
  emulation slowdown (what its ranks measure through their emulation at
  start-up); the optimizer's rate and the time per action as measured (the
  emulation slows neither);
- on real GPU types, an estimate: each block's measured FLOPs at the type's
  datasheet peak (:data:`ESTIMATE_EFFICIENCY` of it), the edges scaled as the
  blocks are (they keep their share of the step), the optimizer's step left to
  the planner's estimate from memory bandwidth, and no time per action (the
  CPU's host time is not a GPU host's). The plan's profile sources say
  ``estimated``.

Either way the profile lists the tensor-parallel degrees the module's blocks
admit on the cluster, read as start-up reads them
(:func:`~zorse_lightning.startup.tensor_parallel_support.module_tensor_parallel`:
the module's ``tp_plan`` attribute or its Hugging Face model's), with the note
saying why where none.

The plan app has no Trainer, so the step runs in the module's own dtype (no
precision plugin's forward context) and its ``self.log`` calls are discarded.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
from hydra.utils import instantiate

from zorse_lightning.cluster.gpu_type import GpuType
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.emulation.spec import emulation_spec_for_rank
from zorse_lightning.errors import ZorseUserError
from zorse_lightning.module.blocks import find_block_list
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.profiling.estimate import estimated_block_times
from zorse_lightning.profiling.profile import DeviceTimes, ModelProfile, ProfileSource
from zorse_lightning.startup.device_profile import DeviceInputs, profile_on_device
from zorse_lightning.startup.profiled_sizes import ProfiledModel
from zorse_lightning.startup.step_costs import OptimizerFactory, optimizer_factory
from zorse_lightning.startup.tensor_parallel_support import module_tensor_parallel
from zorse_lightning.strategy.trainer_inputs import quiet_training_step

ESTIMATE_EFFICIENCY = 0.4
"""Fraction of the datasheet peak assumed for a module measured only on CPU."""

MEASURED_ON = "cpu"
"""The GPU type name the CPU's own times carry before each inventory type gets its times."""


def configured_optimizer(module: Any) -> OptimizerFactory | None:
    """The first optimizer of the module's ``configure_optimizers()`` (read as Lightning reads it), as a
    factory of its class and settings; None where it returns none (the planner then estimates AdamW)."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    configured = module.configure_optimizers()
    if configured is None:
        return None
    optimizers, _, _ = _configure_optimizers(configured)
    return optimizer_factory(optimizers[0]) if optimizers else None


def measured_module_profile(
    model_cfg: Any, data_cfg: Any, inventory: ClusterInventory, options: PlannerOptions
) -> ProfiledModel:
    """The module of ``model_cfg`` profiled on the first batch of ``data_cfg``'s training loader (one rank's
    batch, as at start-up), with times for every GPU type of ``inventory``."""
    if data_cfg is None:
        raise ZorseUserError("a LightningModule model needs a data config (data=bytes or data._target_=...) to profile it")
    module = instantiate(model_cfg)
    data = instantiate(data_cfg)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    inputs = DeviceInputs(
        module, find_block_list(module), torch.device("cpu"), MEASURED_ON, options, nullcontext,
        configured_optimizer(module),
    )
    profiled = profile_on_device(inputs, batch, quiet_training_step(module, nullcontext))
    profile = profiled.profile
    devices = {t.name: _type_times(t, profile, inventory) for t in inventory.gpu_types}
    tensor_parallel = module_tensor_parallel(module, inputs.blocks, inventory, options)
    return replace(
        profiled, profile=replace(profile, devices=devices, tensor_parallel=tensor_parallel.support),
        tensor_parallel_note=tensor_parallel.note,
    )


def _type_times(gpu_type: GpuType, profile: ModelProfile, inventory: ClusterInventory) -> DeviceTimes:
    """``gpu_type``'s times from the CPU's (see the module's docstring)."""
    cpu = profile.times(MEASURED_ON)
    if inventory.emulated:
        rank = next(r for r, g in enumerate(inventory.gpus) if g.gpu_type.name == gpu_type.name)
        factor = emulation_spec_for_rank(inventory, rank).slowdown
        return replace(
            cpu, gpu_type=gpu_type.name, embedding=cpu.embedding.scaled(factor),
            layers=tuple(layer.scaled(factor) for layer in cpu.layers), head=cpu.head.scaled(factor),
        )
    layers = tuple(
        estimated_block_times(shape.forward_flops_per_sample, gpu_type, "float16", ESTIMATE_EFFICIENCY)
        for shape in profile.layers
    )
    largest = max(cpu.layers[0].forward.sizes)
    on_cpu = sum(t.forward.at(largest) + t.backward.at(largest) for t in cpu.layers)
    estimated = sum(t.forward.at(largest) + t.backward.at(largest) for t in layers)
    edges = estimated / on_cpu
    return DeviceTimes(
        gpu_type.name, ProfileSource.ESTIMATED, cpu.embedding.scaled(edges), layers, cpu.head.scaled(edges)
    )

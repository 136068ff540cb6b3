"""Turn the ``model`` config group into a profile for the planner.

Two kinds of model config:
- ``source: reference`` names a reference model: per-layer times measured on real
  GPUs, no hardware needed;
- a LightningModule config (``_target_: my_pkg.MyModule`` plus its arguments): the
  module's blocks are measured on this machine's CPU. On an emulated cluster each
  type's times are those CPU times times the type's emulation slowdown, which is
  what the ranks themselves measure at start-up; on real GPU types the measured
  FLOPs are priced at each type's datasheet peak (an estimate, said in the report).
"""

from __future__ import annotations

from typing import Any

from hydra.utils import instantiate

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import ZorseUserError
from zorse_lightning.profiling import reference_profile
from zorse_lightning.profiling.profile import DeviceTimes, ModelProfile, ProfileSource

ESTIMATE_EFFICIENCY = 0.4
"""Fraction of the datasheet peak assumed for a module measured only on CPU."""


def profile_from_config(model_cfg: Any, inventory: ClusterInventory, data_cfg: Any = None) -> ModelProfile:
    if "_target_" in model_cfg:
        return _measured_here(model_cfg, data_cfg, inventory)
    source = model_cfg.get("source")
    if source == "reference":
        types = [t.name for t in inventory.gpu_types]
        return reference_profile(model_cfg.name, types, seq_len=model_cfg.seq_len, dtype=model_cfg.dtype)
    raise ZorseUserError(
        f"model config has neither `_target_` (a LightningModule) nor `source: reference` (got source={source!r}); "
        f"use model=llama_7b (reference) or model=gpt_tiny (a module), or give model._target_=my_pkg.MyModule"
    )


def _measured_here(model_cfg: Any, data_cfg: Any, inventory: ClusterInventory) -> ModelProfile:

    from zorse_lightning.module.blocks import find_block_list
    from zorse_lightning.module.capture import first_block_input
    from zorse_lightning.module.microbatch import microbatch_slice
    from zorse_lightning.emulation.emulator import emulation_spec_for_rank
    from zorse_lightning.profiling.estimate import estimated_block_times
    from zorse_lightning.profiling.measure import MeasureOptions, assemble_profile, measure_blocks

    if data_cfg is None:
        raise ZorseUserError("a LightningModule model needs a data config (data=bytes or data._target_=...) to profile it")
    module = instantiate(model_cfg)
    data = instantiate(data_cfg)
    data.setup("fit")
    blocks = find_block_list(module)
    batch = next(iter(data.train_dataloader()))
    example = first_block_input(blocks.blocks[0], lambda: module.training_step(microbatch_slice(batch, 0, 1), 0))
    measured = measure_blocks(blocks.blocks, example, gpu_type="cpu", options=MeasureOptions(max_microbatch_size=2), cache_dir=None)
    cpu = measured.times
    devices: dict[str, DeviceTimes] = {}
    for gpu_type in inventory.gpu_types:
        if inventory.emulated:
            rank = next(r for r, g in enumerate(inventory.gpus) if g.gpu_type.name == gpu_type.name)
            factor = emulation_spec_for_rank(inventory, rank).slowdown
            devices[gpu_type.name] = DeviceTimes(
                gpu_type.name, ProfileSource.MEASURED, cpu.embedding.scaled(factor),
                tuple(layer.scaled(factor) for layer in cpu.layers), cpu.head.scaled(factor),
            )
        else:
            layers = tuple(
                estimated_block_times(shape.forward_flops_per_sample, gpu_type, "float16", ESTIMATE_EFFICIENCY)
                for shape in measured.layers
            )
            devices[gpu_type.name] = DeviceTimes(gpu_type.name, ProfileSource.ESTIMATED, cpu.embedding.scaled(0), layers, cpu.head.scaled(0))
    profile = assemble_profile([measured], model=type(module).__name__)
    return ModelProfile(
        model=profile.model, seq_len=profile.seq_len, dtype=profile.dtype, embedding=profile.embedding,
        layers=profile.layers, head=profile.head, devices=devices, tied_embedding_head=profile.tied_embedding_head,
    )


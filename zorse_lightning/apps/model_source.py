"""Turn the ``model`` config group into a profile for the planner.

Two kinds of model config:
- ``source: reference`` names a reference model: per-layer times measured on real
  GPUs, no hardware needed;
- a LightningModule config (``_target_: my_pkg.MyModule`` plus its arguments): the
  module is profiled on this machine's CPU the way start-up profiles it, and each
  GPU type of the cluster gets its times from those (:mod:`.module_profile`).
"""

from __future__ import annotations

from typing import Any

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import ZorseUserError
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.profiling import reference_profile
from zorse_lightning.startup.profiled_sizes import ProfiledModel


def profile_from_config(
    model_cfg: Any, inventory: ClusterInventory, options: PlannerOptions, data_cfg: Any = None
) -> ProfiledModel:
    """The profile to plan from, and the microbatch sizes it measured (None for a reference model: the
    reference data holds what sizes it holds)."""
    if "_target_" in model_cfg:
        from zorse_lightning.apps.module_profile import measured_module_profile  # imports torch and Lightning

        return measured_module_profile(model_cfg, data_cfg, inventory, options)
    source = model_cfg.get("source")
    if source == "reference":
        types = [t.name for t in inventory.gpu_types]
        profile = reference_profile(model_cfg.name, types, seq_len=model_cfg.seq_len, dtype=model_cfg.dtype)
        return ProfiledModel(profile, None)
    raise ZorseUserError(
        f"model config has neither `_target_` (a LightningModule) nor `source: reference` (got source={source!r}); "
        f"use model=llama_7b (reference) or model=gpt_tiny (a module), or give model._target_=my_pkg.MyModule"
    )

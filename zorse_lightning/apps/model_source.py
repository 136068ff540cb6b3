"""Turn the ``model`` config group into a profile for the planner.

``source: reference`` names a reference model (planning without hardware).
"""

from __future__ import annotations

from typing import Any

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import ZorseUserError
from zorse_lightning.profiling import reference_profile
from zorse_lightning.profiling.profile import ModelProfile


def profile_from_config(model_cfg: Any, inventory: ClusterInventory) -> ModelProfile:
    source = model_cfg.get("source", "module")
    types = [t.name for t in inventory.gpu_types]
    if source == "reference":
        return reference_profile(model_cfg.name, types, seq_len=model_cfg.seq_len, dtype=model_cfg.dtype)
    raise ZorseUserError(
        f"model source {source!r} is not supported here; use `source: reference` with a reference model name"
    )

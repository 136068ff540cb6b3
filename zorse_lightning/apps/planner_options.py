"""The ``planner`` config group as :class:`PlannerOptions`."""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import OmegaConf

from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.search import PlannerOptions


def planner_options_from_config(cfg: Any) -> PlannerOptions:
    values = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else dict(cfg)
    known = {f.name for f in dataclasses.fields(PlannerOptions)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise PlanningError(f"planner option(s) {unknown} are unknown; known options: {sorted(known)}")
    if values.get("microbatch_sizes") is not None:
        values["microbatch_sizes"] = tuple(values["microbatch_sizes"])
    return PlannerOptions(**{k: v for k, v in values.items() if v is not None or k in ("memory_reserve_gib",)})

"""The ``planner`` config group: a schema generated from :class:`PlannerOptions`, and the conversion back.

The schema (``planner_schema`` in Hydra's ConfigStore, which ``conf/planner/*.yaml``
extend) has PlannerOptions' fields and defaults, so no YAML file restates a default,
and Hydra refuses a misspelt option or a value of the wrong type while composing.
Its types are what OmegaConf can check: tuples become lists, and the schedule stays
a string (``1f1b``, as users write it; OmegaConf would want the enum member's name,
``ONE_F_ONE_B``). The values are checked by PlannerOptions itself.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from enum import Enum
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.options import PlannerOptions


def _config_type(hint: Any) -> Any:
    """The OmegaConf type for a field of PlannerOptions."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if type(None) in typing.get_args(hint):  # X | None
        return Optional[_config_type(args[0])]
    if typing.get_origin(hint) is tuple:  # tuple[X, ...]
        return list[_config_type(args[0])]
    if isinstance(hint, type) and issubclass(hint, Enum):
        return str
    return hint


def _config_default(value: Any) -> Any:
    """A default as the config holds it: tuples as lists (nested too)."""
    return [_config_default(v) for v in value] if isinstance(value, tuple) else value


def _config_field(option: dataclasses.Field, hint: Any) -> tuple[str, Any, dataclasses.Field]:
    default = _config_default(option.default)
    if isinstance(default, list):  # a mutable default needs a factory
        return option.name, _config_type(hint), dataclasses.field(default_factory=lambda: _config_default(option.default))
    return option.name, _config_type(hint), dataclasses.field(default=default)


_HINTS = typing.get_type_hints(PlannerOptions)
PlannerConfig = dataclasses.make_dataclass(
    "PlannerConfig", [_config_field(f, _HINTS[f.name]) for f in dataclasses.fields(PlannerOptions)]
)
"""The ``planner`` group's schema: PlannerOptions' fields and defaults in OmegaConf's types."""


def register_planner_schema(config_store: Any) -> None:
    """Register the schema that every ``conf/planner/*.yaml`` extends (``defaults: [planner_schema]``)."""
    config_store.store(group="planner", name="planner_schema", node=PlannerConfig)


def planner_options_from_config(cfg: DictConfig) -> PlannerOptions:
    """The composed ``planner`` group (typed by the schema) as PlannerOptions, which checks the values.

    The schema refuses a misspelt override, but Hydra's refusal suggests adding it with
    ``+``, which it lets past: such a key is refused here.
    """
    values = OmegaConf.to_container(cfg, resolve=True)
    known = [f.name for f in dataclasses.fields(PlannerOptions)]
    for name in values:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise PlanningError(f"{name!r} is not a planner option; {hint}the options are {known}")
    return PlannerOptions(**values)

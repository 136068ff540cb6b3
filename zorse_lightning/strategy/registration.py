"""Registering the strategy under its names in Lightning's registries.

This runs inside Lightning's own import (the package's post-import hook), when
any module of ours that imports Lightning may itself be half imported. So it
imports only Lightning's registries and the accelerator (whose imports never
reach Lightning-dependent modules of ours), and registers a factory for the
strategy: Lightning's registry takes any callable, and ``ZorseStrategy`` is
imported when a Trainer first asks for it.
"""

from __future__ import annotations

from typing import Any

# (name, description, init_params): the presets ``Trainer(strategy=NAME)`` accepts.
STRATEGY_PRESETS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("zorse", "zorse: plans and trains on mixed GPU types", {}),
    ("zorse_gpipe", "zorse, planned and run with the GPipe schedule", {"schedule": "gpipe"}),
    ("zorse_spawn", "zorse, processes started with multiprocessing spawn", {"start_method": "spawn"}),
)


def register_with_lightning() -> None:
    """Make ``Trainer(strategy="zorse")`` and ``accelerator="zorse"`` work; safe to call more than once."""
    from lightning.pytorch.strategies import StrategyRegistry

    from zorse_lightning.strategy.accelerator import register_accelerator

    register_accelerator()
    for name, description, init_params in STRATEGY_PRESETS:
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, zorse_strategy, description=description, **init_params)


def zorse_strategy(**init_params: Any) -> Any:
    """A ``ZorseStrategy`` built from a preset's parameters (what the registry calls)."""
    from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

    return ZorseStrategy(**init_params)

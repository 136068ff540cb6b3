"""Registering the strategy and the accelerator under their names in Lightning's registries.

This runs inside Lightning's own import (the package's post-import hook), when any module of ours
that imports Lightning (the strategy, the accelerator, the emulation callback) may itself be half
imported: it is what imported Lightning. So it imports only Lightning's registries, and what it
registers imports our modules when a Trainer first asks for them: a factory for the strategy
(Lightning's strategy registry takes any callable) and :class:`AcceleratorEntry` for the accelerator.
"""

from __future__ import annotations

from typing import Any

ACCELERATOR_NAME = "zorse"

# (name, description, init_params): the presets ``Trainer(strategy=NAME)`` accepts.
STRATEGY_PRESETS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("zorse", "zorse: plans and trains on mixed GPU types", {}),
    ("zorse_gpipe", "zorse, planned and run with the GPipe schedule", {"schedule": "gpipe"}),
    ("zorse_spawn", "zorse, processes started with multiprocessing spawn", {"start_method": "spawn"}),
)


def register_with_lightning() -> None:
    """Make ``Trainer(strategy="zorse")`` and ``accelerator="zorse"`` work; safe to call more than once."""
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    if ACCELERATOR_NAME not in AcceleratorRegistry:
        AcceleratorRegistry.register(
            ACCELERATOR_NAME, AcceleratorEntry, description="zorse: per-rank GPU types, CPU ranks emulating them"
        )
    for name, description, init_params in STRATEGY_PRESETS:
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, zorse_strategy, description=description, **init_params)


def zorse_strategy(**init_params: Any) -> Any:
    """A ``ZorseStrategy`` built from a preset's parameters (what the registry calls)."""
    from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

    return ZorseStrategy(**init_params)


class AcceleratorEntry:
    """What Lightning's accelerator registry holds under ``"zorse"``: calling it builds a
    :class:`~zorse_lightning.strategy.accelerator.ZorseAccelerator` (its CUDA or CPU variant), imported
    then; and it answers the one question the registry asks of its entries themselves, whether the
    accelerator is available (always: CPU ranks emulate GPU types)."""

    def __new__(cls, **init_params: Any) -> Any:
        from zorse_lightning.strategy.accelerator import ZorseAccelerator

        return ZorseAccelerator(**init_params)

    @staticmethod
    def is_available() -> bool:
        return True

"""Registering the strategy under its names in Lightning's registry."""

from __future__ import annotations


def register_with_lightning() -> None:
    """Make ``Trainer(strategy="zorse")`` and ``accelerator="zorse"`` work; safe to call more than once."""
    from lightning.pytorch.strategies import StrategyRegistry

    from zorse_lightning.strategy.accelerator import register_accelerator

    register_accelerator()
    from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

    if "zorse" not in StrategyRegistry:
        ZorseStrategy.register_strategies(StrategyRegistry)

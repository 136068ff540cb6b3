"""``ZorseStrategy``: Lightning's view of a zorse plan.

Until the engine lands (issue 4) this strategy knows its cluster and otherwise
behaves as data parallel; the class and its registered names are the stable
part that users and configs refer to.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.cluster.inventory import ClusterInventory


class ZorseStrategy(DDPStrategy):
    strategy_name = "zorse"

    def __init__(self, cluster: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._cluster_source = cluster
        self._inventory: ClusterInventory | None = None

    @property
    def inventory(self) -> ClusterInventory | None:
        """The cluster this strategy trains on (None until given or detected)."""
        if self._inventory is None and self._cluster_source is not None:
            self._inventory = load_cluster(self._cluster_source)
        return self._inventory

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="zorse: plans and trains on mixed GPU types"
        )

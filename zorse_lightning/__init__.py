"""zorse_lightning: train one LightningModule on a cluster of mixed GPU types.

Everything a user needs is on this one import line::

    from zorse_lightning import ZorseStrategy, PlannerOptions, FaultPolicy, RecoveryPolicy, EmulateCluster

Importing the package registers the ``"zorse"`` strategy (and its presets) and
the ``"zorse"`` accelerator with Lightning (Lightning has no plugin entry points
for strategies); nothing else happens at import time: no process group, no CUDA
initialisation, no file or network access.
"""

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.emulation.callback import EmulateCluster
from zorse_lightning.engine.faults import FaultPolicy
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.planner.plan import Plan
from zorse_lightning.engine.checkpoint.survivors import RecoveryPolicy
from zorse_lightning.strategy.registration import register_with_lightning
from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

register_with_lightning()

__all__ = [
    "EmulateCluster",
    "FaultPolicy",
    "Plan",
    "PlannerOptions",
    "RecoveryPolicy",
    "ZorseStrategy",
    "load_cluster",
    "register_with_lightning",
]
__version__ = "0.1.0"

"""zorse_lightning: train one LightningModule on a cluster of mixed GPU types.

Everything a user needs is on this one import line::

    from zorse_lightning import ZorseStrategy, PlannerOptions, FaultPolicy, RecoveryPolicy, EmulateCluster

The names are loaded on first use (PEP 562), and the ``"zorse"`` strategy (with
its presets) and the ``"zorse"`` accelerator are registered with Lightning when
Lightning is imported, before or after this package (Lightning has no plugin
entry points for strategies; wrapt's post-import hook waits for it). So
``Trainer(strategy="zorse")`` works after ``import zorse_lightning`` whatever the
order, while the planner and its apps (``python -m zorse_lightning.plan``) never
pay the seconds of importing Lightning and torch they do not use. Nothing else
happens at import time: no process group, no CUDA initialisation, no file or
network access.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from wrapt import when_imported

if TYPE_CHECKING:
    from zorse_lightning.cluster.config import load_cluster
    from zorse_lightning.emulation.callback import EmulateCluster
    from zorse_lightning.engine.checkpoint.survivors import RecoveryPolicy
    from zorse_lightning.engine.faults import FaultPolicy
    from zorse_lightning.planner.options import PlannerOptions
    from zorse_lightning.schedule.plan import Plan
    from zorse_lightning.strategy.registration import register_with_lightning
    from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

_HOME_OF = {
    "EmulateCluster": "zorse_lightning.emulation.callback",
    "FaultPolicy": "zorse_lightning.engine.faults",
    "Plan": "zorse_lightning.schedule.plan",
    "PlannerOptions": "zorse_lightning.planner.options",
    "RecoveryPolicy": "zorse_lightning.engine.checkpoint.survivors",
    "ZorseStrategy": "zorse_lightning.strategy.zorse_strategy",
    "load_cluster": "zorse_lightning.cluster.config",
    "register_with_lightning": "zorse_lightning.strategy.registration",
}

__all__ = sorted(_HOME_OF)
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """Import a public name's module the first time the name is asked for."""
    home = _HOME_OF.get(name)
    if home is None:
        raise AttributeError(f"module 'zorse_lightning' has no attribute {name!r}; public names: {', '.join(__all__)}")
    value = getattr(import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


@when_imported("lightning.pytorch")
def _register(_lightning_pytorch: object) -> None:
    import_module("zorse_lightning.strategy.registration").register_with_lightning()

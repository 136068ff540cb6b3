"""zorse_lightning: train one LightningModule on a cluster of mixed GPU types.

Importing the package registers the ``"zorse"`` strategy with Lightning (Lightning
has no plugin entry points for strategies); nothing else happens at import time:
no process group, no CUDA initialisation, no file or network access.
"""

from zorse_lightning.strategy.registration import register_with_lightning

register_with_lightning()

__all__ = ["register_with_lightning"]
__version__ = "0.1.0"

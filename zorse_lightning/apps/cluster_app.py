"""The inventory app: compose a cluster config, validate it, print it."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from zorse_lightning.apps.hydra_support import CONF_DIR, register_schemas, report_user_errors
from zorse_lightning.cluster.config import inventory_from_config
from zorse_lightning.cluster.report import print_inventory


@report_user_errors
def _run(cfg: DictConfig) -> None:
    print_inventory(inventory_from_config(cfg.cluster))


def main() -> None:
    register_schemas()
    hydra.main(config_path=str(CONF_DIR), config_name="cluster_app", version_base="1.3")(_run)()

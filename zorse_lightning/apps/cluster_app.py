"""The inventory app: compose a cluster config, validate it, print it."""

from __future__ import annotations

from omegaconf import DictConfig

from zorse_lightning.apps.hydra_support import report_user_errors, run_app
from zorse_lightning.cluster.config import inventory_from_config
from zorse_lightning.cluster.report import print_inventory


@report_user_errors
def _run(cfg: DictConfig) -> None:
    print_inventory(inventory_from_config(cfg.cluster))


def main() -> None:
    run_app(_run, "cluster_app")

"""Assembling the cluster from per-rank device reports."""

from __future__ import annotations

import pytest

from zorse_lightning.cluster.detect import DeviceReport, inventory_from_reports
from zorse_lightning.errors import InventoryError
from zorse_lightning.startup.detection import machine_reports

GIB = 1024**3
A100 = DeviceReport("NVIDIA A100-SXM4-40GB", 40 * GIB)
T4 = DeviceReport("Tesla T4", 15 * GIB)


def test_ranks_group_into_machines_of_different_sizes():
    inventory = inventory_from_reports(machine_reports([("a", A100), ("a", A100), ("b", T4)]))
    assert [m.name for m in inventory.machines] == ["a", "b"]
    assert [g.gpu_type.name for g in inventory.gpus] == ["a100x40", "a100x40", "t4"]


@pytest.mark.multiprocess
def test_interleaved_ranks_are_refused_with_the_fix():
    with pytest.raises(InventoryError, match="not contiguous.*torchrun"):
        machine_reports([("a", A100), ("b", T4), ("a", A100)])

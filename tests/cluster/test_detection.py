"""Assembling the cluster from per-rank device reports."""

from __future__ import annotations

import pytest
import torch

from zorse_lightning.cluster.detection import DeviceReport, inventory_from_reports, local_device_report, machine_reports
from zorse_lightning.errors import InventoryError

GIB = 1024**3
A100 = DeviceReport("NVIDIA A100-SXM4-40GB", 40 * GIB)
T4 = DeviceReport("Tesla T4", 15 * GIB)


def test_a_cpu_device_reports_nothing_to_detect():
    assert local_device_report(torch.device("cpu")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_device_reports_its_name_and_memory():
    device = torch.device("cuda", 0)
    assert local_device_report(device) == DeviceReport(
        torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory
    )


def test_ranks_group_into_machines_of_different_sizes():
    inventory = inventory_from_reports(machine_reports([("a", A100), ("a", A100), ("b", T4)]))
    assert [m.name for m in inventory.machines] == ["a", "b"]
    assert [g.gpu_type.name for g in inventory.gpus] == ["a100x40", "a100x40", "t4"]


@pytest.mark.multiprocess
def test_interleaved_ranks_are_refused_with_the_fix():
    with pytest.raises(InventoryError, match="not contiguous.*torchrun"):
        machine_reports([("a", A100), ("b", T4), ("a", A100)])

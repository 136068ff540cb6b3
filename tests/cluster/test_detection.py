"""Assembling the cluster from per-rank device reports."""

from __future__ import annotations

import pytest
import torch

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.cluster.detection import (
    DeviceReport,
    inventory_from_reports,
    local_device_report,
    machine_reports,
    match_device,
    match_machines,
    with_measured_host_links,
    with_measured_nccl,
)
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_device_times_its_host_link_when_asked():
    report = local_device_report(torch.device("cuda", 0), measure_host_link=True)
    assert 1.0 < report.host_link_gbps < 2000.0  # PCIe 3 x4 .. beyond PCIe 5 x16: a rate, not a unit slip


def test_each_gpu_type_takes_the_slowest_host_link_its_ranks_measured():
    """Offload's copies are priced per type name, so one figure per type: the slowest of its ranks'."""
    reports = [DeviceReport(A100.name, A100.total_memory_bytes, 200.0), DeviceReport(A100.name, A100.total_memory_bytes, 150.0), T4]
    inventory = inventory_from_reports(machine_reports([("a", reports[0]), ("a", reports[1]), ("b", reports[2])]))
    measured = with_measured_host_links(inventory, reports)
    assert [g.gpu_type.host_link_gbps for g in measured.gpus] == [150.0, 150.0, inventory.gpus[2].gpu_type.host_link_gbps]
    assert with_measured_host_links(inventory, [A100, A100, None]) == inventory  # nothing measured: the catalog's


def test_each_gpu_type_takes_the_largest_nccl_communicator_its_ranks_measured():
    """The memory model prices a type's communicators by its name: the largest of its ranks' (558 and 390 MiB, as
    an H200's first and later communicators measured); a type no rank measured keeps None (priced from NCCL's
    settings)."""
    mib = 1024 * 1024
    reports = [DeviceReport(A100.name, A100.total_memory_bytes, None, 390 * mib),
               DeviceReport(A100.name, A100.total_memory_bytes, None, 558 * mib), T4]
    inventory = inventory_from_reports(machine_reports([("a", reports[0]), ("a", reports[1]), ("b", reports[2])]))
    measured = with_measured_nccl(inventory, reports)
    assert [g.gpu_type.nccl_communicator_bytes for g in measured.gpus] == [558 * mib, 558 * mib, None]
    assert with_measured_nccl(inventory, [A100, A100, None]) == inventory  # nothing measured: priced


def test_ranks_group_into_machines_of_different_sizes():
    inventory = inventory_from_reports(machine_reports([("a", A100), ("a", A100), ("b", T4)]))
    assert [m.name for m in inventory.machines] == ["a", "b"]
    assert [g.gpu_type.name for g in inventory.gpus] == ["a100x40", "a100x40", "t4"]


@pytest.mark.multiprocess
def test_interleaved_ranks_are_refused_with_the_fix():
    with pytest.raises(InventoryError, match="not contiguous.*torchrun"):
        machine_reports([("a", A100), ("b", T4), ("a", A100)])


V100 = DeviceReport("Tesla V100-SXM2-32GB", 32 * GIB)
TWO_KINDS = {
    "name": "two_kinds",
    "machines": [
        {"name": "a100-node", "intra_bandwidth_gbps": 4800, "gpus": [{"type": "a100x40", "count": 2}]},
        {"name": "v100-node", "intra_bandwidth_gbps": 2400, "gpus": [{"type": "v100x32", "count": 2}]},
        {"name": "t4-node", "intra_bandwidth_gbps": 64, "gpus": [{"type": "t4", "count": 1}]},
    ],
}


def _launched(*hosts: tuple[str, DeviceReport, int]) -> list[tuple[str, DeviceReport]]:
    """Per-rank reports, machine after machine, in the order the rendezvous gave the hosts."""
    return [(host, device) for host, device, count in hosts for _ in range(count)]


def test_machines_follow_the_rendezvous_order_whatever_it_is():
    """torchrun's c10d ignores --node-rank and orders hosts by name: every order of the three hosts places
    each machine on the host with its GPUs, and rank r is then the inventory's GPU r."""
    import itertools

    inventory = load_cluster(TWO_KINDS)
    hosts = [("node-x", A100, 2), ("node-y", V100, 2), ("node-z", T4, 1)]
    for order in itertools.permutations(hosts):
        per_rank = _launched(*order)
        placed = match_machines(inventory, per_rank)
        assert [match_device(report).name for _, report in per_rank] == [g.gpu_type.name for g in placed.gpus]
        assert sorted(placed.machines, key=lambda m: m.name) == sorted(inventory.machines, key=lambda m: m.name)
    assert match_machines(inventory, _launched(*hosts)) == inventory  # already in order: unchanged


def test_a_machine_named_after_its_host_goes_to_that_host():
    same = {"name": "same", "machines": [
        {"name": "gpu-b", "intra_bandwidth_gbps": 100, "gpus": [{"type": "a100x40", "count": 1}]},
        {"name": "gpu-a", "intra_bandwidth_gbps": 200, "gpus": [{"type": "a100x40", "count": 1}]},
    ]}
    placed = match_machines(load_cluster(same), _launched(("gpu-a.cluster.local", A100, 1), ("gpu-b", A100, 1)))
    assert [m.name for m in placed.machines] == ["gpu-a", "gpu-b"]
    assert placed.bandwidth_gbps(0, 0) == float("inf") and placed.machines[0].intra_bandwidth_gbps == 200
    with pytest.raises(InventoryError, match=r"machine 'gpu-a' .* listed with GPUs \['a100x40'\], but host 'gpu-a' "
                                             r"has \['t4'\]: a machine named after a host must list"):
        match_machines(load_cluster(same), _launched(("gpu-a", T4, 1), ("gpu-b", A100, 1)))


def test_alike_machines_that_differ_otherwise_must_be_named_after_their_hosts():
    two_dcs = {"name": "dcs", "machines": [
        {"name": "east", "datacenter": "e", "intra_bandwidth_gbps": 100, "gpus": [{"type": "a100x40", "count": 1}]},
        {"name": "west", "datacenter": "w", "intra_bandwidth_gbps": 100, "gpus": [{"type": "a100x40", "count": 1}]},
    ], "datacenter_links": [{"datacenter_a": "e", "datacenter_b": "w", "bandwidth_gbps": 5}]}
    with pytest.raises(InventoryError, match=r"host 'h1' matches machines \['east', 'west'\] .* differ in "
                                             r"datacenter.*name each of them after its host \(`name: h1`\)"):
        match_machines(load_cluster(two_dcs), _launched(("h1", A100, 1), ("h2", A100, 1)))


def test_a_host_that_matches_no_machine_is_an_error_with_values_rule_and_fix():
    inventory = load_cluster(TWO_KINDS)
    with pytest.raises(InventoryError, match=r"host 'node-y' runs 3 processes on GPUs \['v100x32', 'v100x32', "
                                             r"'v100x32'\], and no machine .* \(unmatched: v100-node: \['v100x32', "
                                             r"'v100x32'\].*one process per GPU; fix the cluster config or the "
                                             r"processes launched per host \(--nproc-per-node\)"):
        match_machines(inventory, _launched(("node-x", A100, 2), ("node-y", V100, 3)))
    with pytest.raises(InventoryError, match=r"lists machines \['t4-node'\] that no launched host matches"):
        match_machines(inventory, _launched(("node-x", A100, 2), ("node-y", V100, 2)))
    assert match_machines(inventory, [("cpu", None)] * 5) is inventory  # CPU ranks emulate their listed types

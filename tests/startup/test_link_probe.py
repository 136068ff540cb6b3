"""The start-up all-reduce probe: the rate it derives prices the measured time, and only a slower
measurement changes what the planner is told."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.errors import InventoryError
from zorse_lightning.startup.link_probe import (
    MAX_PROBE_BYTES,
    MIN_PROBE_BYTES,
    MachineAllReduce,
    effective_bandwidth_gbps,
    probe_bytes,
    probe_machines,
    with_measured_rates,
)
from zorse_lightning.planner.cost.comm import LINK_EFFICIENCY, ring_all_reduce_ms
from testing.launch import spawn_ranks

CLUSTER = {
    "name": "probe",
    "machines": [
        {"name": "m0", "intra_bandwidth_gbps": 1000, "gpus": [{"type": "a100x40", "count": 2}]},
        {"name": "m1", "intra_bandwidth_gbps": 10, "gpus": [{"type": "t4", "count": 1}]},
    ],
}


def test_effective_rate_prices_the_measured_time_exactly() -> None:
    num_bytes, ranks, latency_us = 13e6, 4, 20.0
    for measured_ms in (5.0, 47.0, 300.0):
        gbps = effective_bandwidth_gbps(num_bytes, ranks, measured_ms, latency_us)
        priced = ring_all_reduce_ms(num_bytes, ranks, gbps * LINK_EFFICIENCY, latency_us)
        assert priced == pytest.approx(measured_ms, rel=1e-12)
    assert effective_bandwidth_gbps(num_bytes, ranks, 0.05, latency_us) == math.inf  # latency alone explains it


def test_only_a_slower_measurement_lowers_the_configured_rate() -> None:
    inventory = load_cluster(CLUSTER)
    probe = MachineAllReduce("m0", 2, 4_000_000, 10.0, configured_gbps=1000.0, effective_gbps=3.2)
    lowered = with_measured_rates(inventory, [probe])
    assert lowered.bandwidth_gbps(0, 1) == 3.2 and lowered.bandwidth_gbps(2, 2) == inventory.bandwidth_gbps(2, 2)
    assert lowered.machines[1] == inventory.machines[1]
    (note,) = probe.notes()
    assert "planned with the measured rate" in note and "3.20 Gbit/s" in note
    faster = replace(probe, effective_gbps=5000.0)
    assert with_measured_rates(inventory, [faster]) is inventory


TWO_MACHINES = {
    "name": "two",
    "machines": [
        {"name": "m0", "intra_bandwidth_gbps": 1000, "gpus": [{"type": "a100x40", "count": 2}]},
        {"name": "m1", "intra_bandwidth_gbps": 10, "intra_latency_us": 40, "gpus": [{"type": "t4", "count": 2}]},
    ],
}


def test_only_a_later_message_raises_the_latency_inside_its_machine() -> None:
    """A small message measured at 1.5 ms on m0 against its configured 5 us: every message inside m0 is
    priced at the measured time; m1's ranks keep the latency their own config gives, the links between
    machines keep theirs, and the note says so; a message on time changes nothing."""
    inventory = load_cluster(TWO_MACHINES)
    configured_us = inventory.latency_us(0, 1)
    assert configured_us == inventory.latencies.intra_machine_us and inventory.latency_us(2, 3) == 40.0
    on_time = MachineAllReduce("m0", 2, 4_000_000, 10.0, 1000.0, 5000.0, configured_us / 2, configured_us)
    m1_on_time = MachineAllReduce("m1", 2, 4_000_000, 10.0, 10.0, 50.0, 30.0, 40.0)
    assert with_measured_rates(inventory, [on_time, m1_on_time]) is inventory and on_time.notes() == []
    late = replace(on_time, message_us=1500.0)
    raised = with_measured_rates(inventory, [late, m1_on_time])
    assert raised.latency_us(0, 1) == 1500.0 and raised.latency_us(2, 3) == 40.0
    assert raised.latency_us(0, 2) == inventory.latency_us(0, 2)
    assert raised.bandwidth_gbps(0, 1) == inventory.bandwidth_gbps(0, 1)
    assert raised.machines[1] == inventory.machines[1]
    (note,) = late.notes()
    assert "1.50 ms" in note and "planned with the measured latency" in note


def test_a_machines_own_latency_must_be_a_number_of_microseconds() -> None:
    bad = {**TWO_MACHINES, "machines": [{**TWO_MACHINES["machines"][1], "intra_latency_us": -1}]}
    with pytest.raises(InventoryError, match=r"machine 'm1': intra_latency_us=-1(\.0)? must be a number of microseconds >= 0"):
        load_cluster(bad)


def test_probe_size_is_the_gradient_bytes_within_bounds() -> None:
    assert probe_bytes(torch.nn.Linear(1000, 1000)) == 1001 * 1000 * 4
    assert probe_bytes(torch.nn.Linear(2, 2)) == MIN_PROBE_BYTES
    frozen = torch.nn.Linear(1000, 1000).requires_grad_(False)
    assert probe_bytes(frozen) == MIN_PROBE_BYTES
    assert MAX_PROBE_BYTES >= MIN_PROBE_BYTES


def _probe_worker(rank: int, out_dir: Path) -> list[dict]:
    dist.init_process_group("gloo")
    try:
        probes = probe_machines(load_cluster(CLUSTER), rank, torch.device("cpu"), MIN_PROBE_BYTES)
        dist.barrier()  # the default group still works after the machine groups are gone
        return [
            {"machine": p.machine, "ranks": p.num_ranks, "ms": p.measured_ms, "gbps": p.effective_gbps,
             "configured": p.configured_gbps, "message_us": p.message_us, "latency_us": p.configured_latency_us}
            for p in probes
        ]
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_each_machine_with_several_ranks_is_probed_and_every_rank_agrees(tmp_path: Path) -> None:
    results = spawn_ranks(_probe_worker, 3, tmp_path)
    assert results[0] == results[1] == results[2]  # gathered: the same list on every rank
    (probe,) = results[0]  # m1 has one rank: nothing to all-reduce
    assert probe["machine"] == "m0" and probe["ranks"] == 2 and probe["configured"] == 1000
    assert probe["ms"] > 0
    assert probe["message_us"] > 0 and probe["latency_us"] == load_cluster(CLUSTER).latency_us(0, 1)
    latency_us = max(probe["message_us"], probe["latency_us"])
    assert probe["gbps"] == pytest.approx(effective_bandwidth_gbps(MIN_PROBE_BYTES, 2, probe["ms"], latency_us))

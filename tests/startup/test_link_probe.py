"""The start-up all-reduce probe: the rate it derives prices the measured time, and only a slower
measurement changes what the planner is told."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
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
    MachinePairProbe,
    effective_bandwidth_gbps,
    pair_rounds,
    probe_bytes,
    probe_machines,
    with_measured_rates,
)
from zorse_lightning.planner.cost.comm import LINK_EFFICIENCY, LinkTable, ring_all_reduce_ms
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


RING_OF_THREE = {
    "name": "ring3",
    "machines": [
        {"name": "m0", "intra_bandwidth_gbps": 1000, "gpus": [{"type": "a100x40", "count": 3}]},
        {"name": "m1", "intra_bandwidth_gbps": 10, "gpus": [{"type": "t4", "count": 1}]},
    ],
}


def _probe_worker(rank: int, out_dir: Path) -> dict:
    """The probe on 4 ranks, every batch it posts recorded; a blocking send or receive (what the ring did
    before, and what hangs under NCCL with three ranks or more) raises."""
    dist.init_process_group("gloo")
    batches: list[list[tuple[str, int]]] = []
    real_batch = dist.batch_isend_irecv

    transfers: list[list[tuple[str, int]]] = []
    """The batches carrying the transfer between machines (its size, MIN_PROBE_BYTES)."""

    def recorded(ops: list) -> list:
        batches.append([(op.op.__name__, op.peer) for op in ops])
        if any(op.tensor.nbytes == MIN_PROBE_BYTES for op in ops) and dist.get_rank() in (0, 3):
            transfers.append([(op.op.__name__, op.peer) for op in ops])
        return real_batch(ops)

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("the probe posted a lone blocking send or receive")

    dist.batch_isend_irecv, dist.recv, dist.send = recorded, refused, refused
    try:
        probes = probe_machines(load_cluster(RING_OF_THREE), rank, torch.device("cpu"), MIN_PROBE_BYTES)
        dist.barrier()  # the default group still works after the machine groups are gone
        return {
            "inside": [
                {"machine": p.machine, "ranks": p.num_ranks, "ms": p.measured_ms, "gbps": p.effective_gbps,
                 "configured": p.configured_gbps, "message_us": p.message_us, "latency_us": p.configured_latency_us,
                 "header_us": p.header_us}
                for p in probes if isinstance(p, MachineAllReduce)
            ],
            "between": [
                {"pair": [p.machine_a, p.machine_b], "ms": p.transfer_ms, "message_us": p.message_us,
                 "header_us": p.header_us, "bytes": p.num_bytes}
                for p in probes if isinstance(p, MachinePairProbe)
            ],
            "peers": sorted({tuple(sorted(b)) for b in batches}),
            "transfers": sorted({tuple(b) for b in transfers}),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_each_machine_and_pair_of_machines_is_probed_in_batches_and_every_rank_agrees(tmp_path: Path) -> None:
    """m0's three ranks pass their ring (rank 0 -> 1 -> 2 -> 0), each pass one batch of a send to the next
    and a receive from the previous; m0's and m1's first ranks (0 and 3) exchange a small message over the
    default group and time the transfer one direction at a time: both ways at once between two ranks, one
    gloo connection took up to twice a direction's time across a shaped link (the module's docstring), and
    the link was priced at half its rate."""
    results = spawn_ranks(_probe_worker, 4, tmp_path)
    assert all(r["inside"] == results[0]["inside"] and r["between"] == results[0]["between"] for r in results)
    (probe,) = results[0]["inside"]  # m1 has one rank: nothing to all-reduce
    assert probe["machine"] == "m0" and probe["ranks"] == 3 and probe["configured"] == 1000
    assert probe["ms"] > 0 and probe["message_us"] > 0 and probe["header_us"] >= 0
    assert probe["latency_us"] == load_cluster(RING_OF_THREE).latency_us(0, 1)
    latency_us = max(probe["message_us"], probe["latency_us"])
    assert probe["gbps"] == pytest.approx(effective_bandwidth_gbps(MIN_PROBE_BYTES, 3, probe["ms"], latency_us))
    (pair,) = results[0]["between"]
    assert pair["pair"] == ["m0", "m1"] and pair["ms"] > 0 and pair["message_us"] > 0
    assert pair["bytes"] == MIN_PROBE_BYTES
    ring = {0: (1, 2), 1: (2, 0), 2: (0, 1)}  # rank: (next, previous)
    for rank in (0, 1, 2):
        send_to, receive_from = ring[rank]
        assert [["irecv", receive_from], ["isend", send_to]] in results[rank]["peers"]
    assert [["irecv", 3], ["isend", 3]] in results[0]["peers"]  # the small message, both ways at once
    assert results[3]["peers"] == [[["irecv", 0]], [["irecv", 0], ["isend", 0]], [["isend", 0]]]
    assert results[1]["peers"] == [[["irecv", 0], ["isend", 2]]]  # no rank but the first of each machine pairs up
    assert results[0]["transfers"] == [[["irecv", 3]], [["isend", 3]]]  # each direction alone, a batch of one
    assert results[3]["transfers"] == [[["irecv", 0]], [["isend", 0]]]


def test_pair_rounds_meet_every_pair_once_and_no_machine_twice_a_round() -> None:
    for machines in range(1, 10):
        rounds = pair_rounds(machines)
        pairs = [p for r in rounds for p in r]
        assert sorted(pairs) == [(a, b) for a in range(machines) for b in range(a + 1, machines)]
        assert all(len({m for p in r for m in p}) == 2 * len(r) for r in rounds)
        assert len(rounds) == (0 if machines == 1 else machines - 1 + machines % 2)


def test_a_slow_link_between_machines_lowers_the_inventory_and_the_header_is_priced_per_message() -> None:
    """A 4 MB transfer measured at 40 ms between m0 and m1 (configured: 100 Gb/s, 20 us) is a link of about
    0.85 Gbit/s; its 300 us message raises the latency; the planner then prices a message between them at the
    measured figures plus the host header's measured 150 us (collectives pay no header)."""
    inventory = load_cluster(TWO_MACHINES)
    configured_us = inventory.latency_us(0, 2)
    slow = MachinePairProbe("m0", "m1", 4_000_000, transfer_ms=40.0, message_us=300.0, header_us=150.0,
                            configured_gbps=inventory.bandwidth_gbps(0, 2), configured_latency_us=configured_us)
    assert slow.effective_gbps == pytest.approx(4e6 * 8 / 1e9 / (40e-3 - 300e-6) / LINK_EFFICIENCY)
    inside = MachineAllReduce("m0", 2, 4_000_000, 10.0, 1000.0, 5000.0, 2.0, 5.0, header_us=40.0)
    lowered = with_measured_rates(inventory, [inside, slow])
    assert lowered.bandwidth_gbps(0, 2) == pytest.approx(slow.effective_gbps) and lowered.latency_us(1, 3) == 300.0
    assert lowered.bandwidth_gbps(0, 1) == inventory.bandwidth_gbps(0, 1)  # inside m0: on time, as configured
    assert (lowered.latencies.header_intra_machine_us, lowered.latencies.header_inter_machine_us) == (40.0, 150.0)
    links = LinkTable(lowered)
    assert links.link(0, 2, header=True)[1:] == pytest.approx((slow.effective_gbps * LINK_EFFICIENCY, 300.0 + 150.0))
    assert links.link(0, 1, header=True)[2] == pytest.approx(lowered.latency_us(0, 1) + 40.0)
    assert links.ring((0, 2))[1] == 300.0  # a collective sends no header
    later, slower = slow.notes()
    assert "0.30 ms at start, above the 20 us configured" in later and "as at 0.848 Gbit/s" in slower
    fast = replace(slow, transfer_ms=0.2, message_us=configured_us / 2, header_us=0.0)
    assert with_measured_rates(inventory, [fast]) is inventory and fast.notes() == []


class _ProbedOn(Exception):
    """Raised by the probe stand-in, holding the host group start-up gave it."""


@dataclass(frozen=True)
class _Measured:
    """What start-up reads of a device's measurement before it probes (gathered: pickled by name)."""

    calibrated_costs: None = None
    output_bytes_per_sample: int = 64
    samples: int = 4


def test_start_up_probes_the_header_on_the_host_group_the_strategy_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine sends activation headers over the strategy's gloo group, so the probe times them there
    (it made a group of its own before, on another address and timeout: issue 36)."""
    from zorse_lightning.planner.options import PlannerOptions
    from zorse_lightning.startup import plan_at_start

    def probe(*args: object) -> None:
        raise _ProbedOn(args[-1])

    monkeypatch.setattr(plan_at_start, "measure_on_device", lambda *args, **kwargs: _Measured())
    monkeypatch.setattr(plan_at_start, "probe_machines", probe)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        host = dist.new_group([0])
        inputs = plan_at_start.StartupInputs(
            torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), load_cluster(CLUSTER), rank=0,
            world_size=1, device=torch.device("cpu"), global_batch_size=4, planner_options=PlannerOptions(),
            host_group=host,
        )
        with pytest.raises(_ProbedOn) as probed:
            plan_at_start.run_startup(inputs, None, lambda batch: None)
        assert probed.value.args[0] is host
    finally:
        dist.destroy_process_group()

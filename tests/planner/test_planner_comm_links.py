"""Collectives priced by how many times their bytes cross each link, as the backend sends them.

Expected values are worked out by hand from the backends' algorithms (gloo's
ring all-reduce, its reduce as a ring reduce-scatter then a gather to the root,
its broadcast as a binomial tree renumbered from the root) on the machines of
``bench/slow_link.py``: two machines of two ranks each, joined by 100 Mbit/s.
A ring formula over the ring's slowest link gets every sharded case wrong: it
prices a reduce and a broadcast at (n-1)/n of the bytes over the link each,
where gloo sends 1.25 and 2 times the bytes (measured: ``bench/slow_link.py
--collectives``).
"""

from __future__ import annotations

import pytest

from testing.netns import NetnsCluster, NetnsMachine
from zorse_lightning.capabilities import Sharding
from zorse_lightning.cluster import DEFAULT_CATALOG, ClusterInventory, Machine
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.planner.cost.phases import CollectiveBackend, gloo_broadcast_phases, gloo_reduce_phases
from zorse_lightning.planner.cost.comm import (
    LINK_EFFICIENCY,
    LinkTable,
    ring_all_gather_ms,
    ring_all_reduce_ms,
    ring_reduce_scatter_ms,
    stage_sync_ms,
)

MBIT_100 = 0.1
LATENCY_US = 50.0
BYTES = 4 * 1024 * 1024


def _two_machines(ranks_per_machine: tuple[int, int] = (2, 2)) -> ClusterInventory:
    """The bench's namespaces as the planner sees them (emulated: gloo runs the collectives)."""
    machines = tuple(
        NetnsMachine(f"box{i}", ("a100x40",) * n, link_gbps=MBIT_100) for i, n in enumerate(ranks_per_machine)
    )
    return load_cluster(NetnsCluster("two", machines, link_latency_us=LATENCY_US).inventory_mapping())


def _link_ms(times_the_bytes: float) -> float:
    """``times_the_bytes`` x BYTES over the 100 Mbit/s link at the transport's efficiency."""
    return times_the_bytes * BYTES / (MBIT_100 * 1e9 / 8 * LINK_EFFICIENCY) * 1000.0


def _crossing_bytes(phases, machine_of) -> list[dict[tuple[str, str], float]]:
    """Per phase, the bytes each direction of the machine link carries."""
    out = []
    for phase in phases:
        load: dict[tuple[str, str], float] = {}
        for flow in phase.flows:
            a, b = machine_of[flow.source_rank], machine_of[flow.destination_rank]
            if a != b:
                load[(a, b)] = load.get((a, b), 0.0) + flow.num_bytes
        out.append(load)
    return out


def test_an_emulated_cluster_runs_gloo_and_a_gpu_cluster_nccl() -> None:
    inventory = _two_machines()
    assert LinkTable(inventory).backend is CollectiveBackend.GLOO
    gpus = ClusterInventory("gpus", (Machine("box", (DEFAULT_CATALOG.get("a100x40"),) * 2, 600.0),))
    assert LinkTable(gpus).backend is CollectiveBackend.NCCL


def test_gloo_broadcast_crosses_the_link_twice_or_three_times_by_where_the_root_sits() -> None:
    machine_of = {0: "box0", 1: "box0", 2: "box1", 3: "box1"}
    # Root 0: it sends to 1 (inside box0) and 2 (across) at once, then 1 sends to 3 (across).
    phases = gloo_broadcast_phases((0, 1, 2, 3), 0, 1.0)
    assert [set((f.source_rank, f.destination_rank) for f in p.flows) for p in phases] == [{(0, 1), (0, 2)}, {(1, 3)}]
    assert _crossing_bytes(phases, machine_of) == [{("box0", "box1"): 1.0}, {("box0", "box1"): 1.0}]
    # Root 1 (virtual ranks 1, 2, 3, 0): it sends to 2 and 3 at once, both across; then 2 sends to 0, across.
    phases = gloo_broadcast_phases((0, 1, 2, 3), 1, 1.0)
    assert _crossing_bytes(phases, machine_of) == [{("box0", "box1"): 2.0}, {("box1", "box0"): 1.0}]
    links = LinkTable(_two_machines())
    for root, link_times in zip(range(4), (2.0, 3.0, 2.0, 3.0)):
        shares = tuple(1.0 if r == root else 0.0 for r in range(4))
        # The ring formula said 3/4 of one link-time whatever the root.
        assert links.from_owners_ms((0, 1, 2, 3), BYTES, shares) == pytest.approx(_link_ms(link_times), rel=0.01)


def test_owners_broadcasts_started_together_run_two_at_a_time() -> None:
    """Owners 0 and 1 together: 0 -> 2, 1 -> 2 and 1 -> 3 share the link (three quarters of the bytes),
    then 1 -> 3 and 2 -> 0 go opposite ways (one quarter); owners 2 and 3 the same mirrored: two
    link-times in all, where one after another the four would take 2.5."""
    links = LinkTable(_two_machines())
    together = links.from_owners_ms((0, 1, 2, 3), BYTES, (0.25,) * 4)
    assert together == pytest.approx(_link_ms(2.0) + 4 * LATENCY_US / 1000.0, rel=0.01)
    one_by_one = sum(links.from_owners_ms((0, 1, 2, 3), BYTES / 4, tuple(float(r == o) for r in range(4))) for o in range(4))
    assert one_by_one == pytest.approx(_link_ms(2.5), rel=0.01)


def test_gloo_reduce_crosses_the_link_one_and_a_quarter_times() -> None:
    phases = gloo_reduce_phases((0, 1, 2, 3), 0, 1.0)
    # Ring reduce-scatter: each rank sends 3/4 to the one before it (1 -> 0, 2 -> 1 across, 3 -> 2, 0 -> 3 across),
    # then ranks 1, 2, 3 send their quarter to the root, 2's and 3's across the link together.
    assert _crossing_bytes(phases, {0: "box0", 1: "box0", 2: "box1", 3: "box1"}) == [
        {("box1", "box0"): 0.75, ("box0", "box1"): 0.75}, {("box1", "box0"): 0.5},
    ]
    links = LinkTable(_two_machines())
    latencies_ms = (3 + 1) * LATENCY_US / 1000.0
    assert links.to_owners_ms((0, 1, 2, 3), BYTES, (1.0, 0.0, 0.0, 0.0)) == pytest.approx(
        _link_ms(1.25) + latencies_ms, rel=1e-3
    )


def test_sharded_gradients_across_the_link_cost_three_and_a_quarter_link_times_not_one_and_a_half() -> None:
    links = LinkTable(_two_machines())
    ranks = (0, 1, 2, 3)
    sharded = stage_sync_ms(links, ranks, BYTES, BYTES, Sharding.OPTIMIZER_GRADIENTS)
    # Each owner's quarter reduced, one after another: 1.25 link-times; broadcast two owners at a time: 2.
    # Latencies: four reduces of 3 + 1 messages, two pairs of broadcasts of two phases.
    latencies_ms = (4 * (3 + 1) + 2 * 2) * LATENCY_US / 1000.0
    assert sharded == pytest.approx(_link_ms(3.25) + latencies_ms, rel=2e-3)
    # What the ring formula over the slowest link gives, and what the bench measured twice its prediction for.
    ring_gbps, ring_us = links.ring(ranks)
    ring = ring_reduce_scatter_ms(BYTES, 4, ring_gbps, ring_us) + ring_all_gather_ms(BYTES, 4, ring_gbps, ring_us)
    assert sharded > 2.1 * ring
    # The all-reduce (no sharding) crosses each direction 1.5 times, as the ring formula says.
    plain = stage_sync_ms(links, ranks, BYTES, BYTES, Sharding.NONE)
    assert plain == pytest.approx(_link_ms(1.5) + 6 * LATENCY_US / 1000.0, rel=1e-3)
    assert plain == pytest.approx(ring_all_reduce_ms(BYTES, 4, ring_gbps, ring_us))
    # So across the slow link sharding gradients is the slowest level, slower even than two all-reduces.
    assert sharded > stage_sync_ms(links, ranks, BYTES, BYTES, Sharding.OPTIMIZER) > plain


def test_an_owners_collectives_cost_by_where_it_sits() -> None:
    """Three ranks on box0, one on box1: a reduce to rank 3 gathers three quarters over the link, to rank 0
    one quarter; a broadcast from rank 3 sends to 0 and 1 at once (twice across), from rank 0 only 1 -> 3 crosses."""
    links = LinkTable(_two_machines((3, 1)))
    ranks = (0, 1, 2, 3)
    ring_ms = _link_ms(0.75) + 3 * LATENCY_US / 1000.0
    to_far = links.to_owners_ms(ranks, BYTES, (0.0, 0.0, 0.0, 1.0))
    to_near = links.to_owners_ms(ranks, BYTES, (1.0, 0.0, 0.0, 0.0))
    assert to_far == pytest.approx(ring_ms + _link_ms(0.75) + LATENCY_US / 1000.0, rel=1e-3)
    assert to_near == pytest.approx(ring_ms + _link_ms(0.25) + LATENCY_US / 1000.0, rel=1e-3)
    assert links.from_owners_ms(ranks, BYTES, (0.0, 0.0, 0.0, 1.0)) == pytest.approx(_link_ms(2.0), rel=0.01)
    # (plus its first phase inside box0 at 10 Gbit/s: 1 % of this one)
    assert links.from_owners_ms(ranks, BYTES, (1.0, 0.0, 0.0, 0.0)) == pytest.approx(_link_ms(1.0), rel=0.02)
    # The plan's shares weigh each owner's price; a rank without a share makes no collective.
    weighted = stage_sync_ms(links, ranks, 0.0, BYTES, Sharding.OPTIMIZER_GRADIENTS, (0.5, 0.0, 0.0, 0.5))
    assert weighted == pytest.approx(links.to_owners_ms(ranks, BYTES / 2, (0.0, 0.0, 0.0, 1.0))
                                     + links.to_owners_ms(ranks, BYTES / 2, (1.0, 0.0, 0.0, 0.0)))
    # Shares are given in the order of the stage's ranks, which need not be the group's (ascending) order.
    assert stage_sync_ms(links, (3, 0, 1, 2), 0.0, BYTES, Sharding.OPTIMIZER_GRADIENTS, (0.5, 0.5, 0.0, 0.0)) == pytest.approx(weighted)


def test_nccl_clusters_keep_the_ring_share_prices() -> None:
    """Not measured here (no GPUs): sharded levels on NCCL are priced as a ring reduce-scatter and all-gather."""
    a100 = DEFAULT_CATALOG.get("a100x40")
    inventory = ClusterInventory(
        "gpus", (Machine("m0", (a100, a100), 600.0), Machine("m1", (a100, a100), 600.0)), inter_machine_bandwidth_gbps=25.0
    )
    links = LinkTable(inventory)
    ranks = (0, 1, 2, 3)
    gbps, us = links.ring(ranks)
    expected = ring_reduce_scatter_ms(BYTES, 4, gbps, us) + ring_all_gather_ms(BYTES, 4, gbps, us)
    assert stage_sync_ms(links, ranks, BYTES, BYTES, Sharding.OPTIMIZER_GRADIENTS, (0.7, 0.1, 0.1, 0.1)) == pytest.approx(expected)


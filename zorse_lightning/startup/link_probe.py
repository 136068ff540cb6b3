"""How fast each machine's ranks all-reduce, measured at start, so that the planner prices
synchronisation as this machine delivers it.

Why the rate: a stage's gradient all-reduce (and, with sharded optimizer state, the
exchange of updated weights) is priced from the inventory's
``intra_bandwidth_gbps``. That rate is what a user knows of the hardware (a NIC,
NVLink, "gloo over loopback"), not what a collective of the model's gradient
bytes achieves through the backend on these processes: on the 2-core CPU
machine that emulates cpu_sim4, gloo's all-reduce of 13 MB among 4 ranks
measured about 6 Gbit/s against the configured 10, and the planner, believing
the configured rate, sharded optimizer state whose weight exchange then cost
40-70 ms a step against the 16 ms it was priced at. So each machine with several ranks all-reduces the
model's gradient bytes (:data:`MAX_PROBE_BYTES` at most) a few times; where the
rate that reproduces the measured time (:func:`effective_bandwidth_gbps`) is
below the configured one, the planner gets the measured rate, and the plan's
notes say so. A faster measurement leaves the configured rate: it stays the
ceiling the user stated.

Why the latency: every activation and gradient between pipeline stages is a
message, and the engine's receives block. On that machine a small message
between gloo ranks took 1.5-2 ms (four processes on two cores, each woken when
its message lands) against the 5 us ``intra_machine_us`` it was priced at, so an
interleaved plan, with V times the messages, was predicted 12 % faster than it
ran and chosen where it lost. So the ranks of each machine also pass a small
message round their ring, and where that takes longer than the configured
latency the planner prices every message inside a machine at the measured time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.planner.cost.comm import LINK_EFFICIENCY, ring_all_reduce_ms
from zorse_lightning.profiling.timing import TimingOptions, time_ms

MAX_PROBE_BYTES = 64 * 1024 * 1024
"""Largest probe: larger gradients are all-reduced in pieces about this size anyway, at the same rate."""
MIN_PROBE_BYTES = 1024 * 1024
"""Smallest probe: below this, latency rather than rate would be measured."""
PROBE_TIMING = TimingOptions(min_warmup=1, max_warmup=1, repeats=3)
"""One warm-up, three timed all-reduces, the median kept: a fixed count, since every rank of a group must
make the same collectives (a warm-up until the time settles could end at another count on each)."""
MESSAGE_TIMING = TimingOptions(min_warmup=3, max_warmup=3, repeats=15)
"""Passes of a small message round a machine's ring: fixed counts, as :data:`PROBE_TIMING`; more of them, each
short and its wake-ups noisy."""
MESSAGE_ELEMENTS = 16
"""The small message: a header's size (latency, not rate)."""


@dataclass(frozen=True)
class MachineAllReduce:
    """One machine's probe: the slowest of its ranks' median times."""

    machine: str
    num_ranks: int
    num_bytes: int
    measured_ms: float
    configured_gbps: float
    effective_gbps: float
    """The ``intra_bandwidth_gbps`` at which the cost model prices this all-reduce at ``measured_ms``."""
    message_us: float = 0.0
    """A small message from one rank to the next round the machine's ring, as measured (the slowest rank's median)."""
    configured_latency_us: float = 0.0

    @property
    def slower_than_configured(self) -> bool:
        return self.effective_gbps < self.configured_gbps

    @property
    def later_than_configured(self) -> bool:
        return self.message_us > self.configured_latency_us

    def notes(self) -> list[str]:
        """What the plan's notes say of this machine: each measurement that the planner used instead of the
        configured figure."""
        said = []
        if self.later_than_configured:
            said.append(
                f"machine {self.machine!r}: a small message between its ranks took {self.message_us / 1e3:.2f} ms at "
                f"start, above the {self.configured_latency_us:g} us configured (its intra_latency_us, else the "
                f"cluster's latencies.intra_machine_us): planned with the measured latency"
            )
        if self.slower_than_configured:
            said.append(
                f"machine {self.machine!r}: an all-reduce of {self.num_bytes / 1e6:.1f} MB among its {self.num_ranks} "
                f"ranks took {self.measured_ms:.1f} ms at start, as at {self.effective_gbps:.2f} Gbit/s, below its "
                f"intra_bandwidth_gbps {self.configured_gbps:g}: planned with the measured rate"
            )
        return said


def effective_bandwidth_gbps(num_bytes: float, num_ranks: int, measured_ms: float, latency_us: float) -> float:
    """The link rate at which :func:`~zorse_lightning.planner.cost.comm.ring_all_reduce_ms`, after
    :data:`~zorse_lightning.planner.cost.comm.LINK_EFFICIENCY`, takes ``measured_ms`` (inf when latency
    alone explains it)."""
    transfer_ms = measured_ms - ring_all_reduce_ms(num_bytes, num_ranks, math.inf, latency_us)
    if transfer_ms <= 0:
        return math.inf
    return ring_all_reduce_ms(num_bytes, num_ranks, 1.0, 0.0) / transfer_ms / LINK_EFFICIENCY


def probe_bytes(module: torch.nn.Module) -> int:
    """The module's gradient bytes, within [MIN_PROBE_BYTES, MAX_PROBE_BYTES]."""
    total = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return int(min(max(total, MIN_PROBE_BYTES), MAX_PROBE_BYTES))


def probe_machines(
    inventory: ClusterInventory, rank: int, device: torch.device, num_bytes: int
) -> list[MachineAllReduce]:
    """Every machine with several ranks times a small message round its ring and an all-reduce of
    ``num_bytes`` among them, all machines at once (collective: every rank calls it; the same list on every
    rank). The all-reduce's rate is fitted with the larger of the measured and configured latencies."""
    machines = [(name, ranks) for name, ranks in inventory.ranks_by_machine.items() if len(ranks) > 1]
    groups = {name: dist.new_group(ranks) for name, ranks in machines}  # every rank creates every group
    mine = inventory.gpus[rank].machine
    median_ms = message_ms = 0.0
    if mine in groups:
        message_ms = _message_ms(inventory.ranks_by_machine[mine], rank, groups[mine], device)
        tensor = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
        median_ms = time_ms(lambda: dist.all_reduce(tensor, group=groups[mine]), device, PROBE_TIMING)
        dist.destroy_process_group(groups[mine])
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (median_ms, message_ms))
    results = []
    for name, ranks in machines:
        measured = max(gathered[r][0] for r in ranks)
        message_us = max(gathered[r][1] for r in ranks) * 1e3
        configured_us = inventory.latency_us(ranks[0], ranks[1])
        results.append(MachineAllReduce(
            machine=name, num_ranks=len(ranks), num_bytes=num_bytes, measured_ms=measured,
            configured_gbps=inventory.bandwidth_gbps(ranks[0], ranks[1]),
            effective_gbps=effective_bandwidth_gbps(num_bytes, len(ranks), measured, max(configured_us, message_us)),
            message_us=message_us, configured_latency_us=configured_us,
        ))
    return results


def _message_ms(ranks: tuple[int, ...], rank: int, group: Any, device: torch.device) -> float:
    """This rank's median time to send a small message to the next rank of ``ranks`` while receiving one from
    the previous (every rank of the ring at once, as the pipeline's stages pass activations)."""
    ring = sorted(ranks)
    at = ring.index(rank)
    send = torch.ones(MESSAGE_ELEMENTS, device=device)
    received = torch.empty(MESSAGE_ELEMENTS, device=device)

    def pass_on() -> None:
        sent = dist.isend(send, ring[(at + 1) % len(ring)], group=group)
        dist.recv(received, ring[at - 1], group=group)
        sent.wait()

    return time_ms(pass_on, device, MESSAGE_TIMING)


def with_measured_rates(inventory: ClusterInventory, probes: list[MachineAllReduce]) -> ClusterInventory:
    """The inventory with each machine's ``intra_bandwidth_gbps`` lowered to its probe's effective rate, and
    its ``intra_latency_us`` raised to its measured message, where those are slower than configured."""
    slower = {p.machine: p.effective_gbps for p in probes if p.slower_than_configured}
    later = {p.machine: p.message_us for p in probes if p.later_than_configured}
    if not (slower or later):
        return inventory
    machines = tuple(
        replace(m, intra_bandwidth_gbps=slower.get(m.name, m.intra_bandwidth_gbps),
                intra_latency_us=later.get(m.name, m.intra_latency_us))
        for m in inventory.machines
    )
    return replace(inventory, machines=machines)

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
The ring is posted as one ``batch_isend_irecv`` per pass (send to the next rank,
receive from the previous): under NCCL a lone ``isend`` creates a two-rank
communicator with its peer and blocks until the peer joins, and with three or
more ranks each waits on the next, round the ring. Batched, they run on the
machine group's own communicator (all its ranks take part in the first batch).

Why the links between machines: a detected cluster prices them at 100 Gb/s and a
configured one at what the user wrote; neither is what gloo or NCCL deliver
between these hosts. So the first ranks of each pair of machines exchange a
small message and time a transfer of ``transfer_bytes`` (the stage boundary's
size where the caller knows it) in each direction alone, pairs of disjoint
machines at once (:func:`pair_rounds`), batched as above on the default group
(its communicator exists by then); a slower or later measurement lowers that
pair's link in the inventory (a ``machine_links`` entry), as inside machines.

Why each direction alone: the cost model prices each direction of a link on its
own (links are full duplex), and a ring all-reduce across two machines sends
one way between one pair of ranks and the other way between another. Timed
both ways at once between the same two ranks, the transfer measured what a
single gloo connection carrying both directions delivers: across a link shaped
to 100 Mbit/s, 1 MiB took 174-243 ms both ways against 88 ms one way (4 and 13
MiB: 402-711 and 1177-2449 ms, as slow as one direction after the other in two
runs of five), where two connections in opposite directions, as the ring's,
took 95-126 ms (368 and 1186 ms). The link was priced at half its rate, and the
data-parallel plan across it predicted 1.8x its step (``bench/README.md``,
fidelity and slow_link).

Why the header: the engine sends each activation after a small host tensor (its
dtype and shape) over the gloo group for host tensors
(:mod:`zorse_lightning.engine.host_group`), so a message costs that header too.
Each probe also times its message preceded by such a header, and the difference
is priced per message (``Latencies.header_*_us``, added by the cost model's
:class:`~zorse_lightning.planner.cost.comm.LinkTable` to every point-to-point
message).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Union

import torch
import torch.distributed as dist

from zorse_lightning.cluster.inventory import ClusterInventory, MachineLink
from zorse_lightning.engine.host_group import host_group as make_host_group
from zorse_lightning.planner.cost.comm import LINK_EFFICIENCY, ring_all_reduce_ms, transfer_ms
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
HEADER_ELEMENTS = 10
"""The engine's header before each activation: dtype, dims and up to 8 sizes, int64 (:mod:`~zorse_lightning.engine.p2p`)."""


class _AgainstConfigured:
    """What a probe's record says against the inventory (its ``effective_gbps``, ``configured_gbps``,
    ``message_us`` and ``configured_latency_us``): the planner takes the measured figure where it is worse."""

    @property
    def slower_than_configured(self) -> bool:
        return self.effective_gbps < self.configured_gbps

    @property
    def later_than_configured(self) -> bool:
        return self.message_us > self.configured_latency_us


@dataclass(frozen=True)
class MachineAllReduce(_AgainstConfigured):
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
    header_us: float = 0.0
    """What the engine's host header adds to a message between its ranks, as measured."""

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


@dataclass(frozen=True)
class MachinePairProbe(_AgainstConfigured):
    """Two machines' first ranks exchanging a small message (both ways at once) and a transfer (each
    direction alone); the slower rank's median times."""

    machine_a: str
    machine_b: str
    num_bytes: int
    transfer_ms: float
    """The slower direction's transfer of ``num_bytes`` (the inventory holds one rate per pair of machines)."""
    message_us: float
    header_us: float
    """What the engine's host header adds to a message between the two machines, as measured."""
    configured_gbps: float
    configured_latency_us: float

    @property
    def effective_gbps(self) -> float:
        """The link rate at which :func:`~zorse_lightning.planner.cost.comm.transfer_ms`, after
        :data:`~zorse_lightning.planner.cost.comm.LINK_EFFICIENCY` and the larger of the measured and
        configured latencies, takes ``transfer_ms`` (inf when latency alone explains it)."""
        moving_ms = self.transfer_ms - max(self.message_us, self.configured_latency_us) / 1e3
        if moving_ms <= 0:
            return math.inf
        return transfer_ms(self.num_bytes, 1.0, 0.0) / moving_ms / LINK_EFFICIENCY

    def notes(self) -> list[str]:
        """What the plan's notes say of this link: each measurement the planner used instead of the configured
        figure."""
        said = []
        pair = f"machines {self.machine_a!r} and {self.machine_b!r}"
        if self.later_than_configured:
            said.append(
                f"{pair}: a small message took {self.message_us / 1e3:.2f} ms at start, above the "
                f"{self.configured_latency_us:g} us configured: planned with the measured latency"
            )
        if self.slower_than_configured:
            said.append(
                f"{pair}: a transfer of {self.num_bytes / 1e6:.1f} MB took {self.transfer_ms:.1f} ms at start, as at "
                f"{self.effective_gbps:.3g} Gbit/s, below the {self.configured_gbps:g} configured: planned with "
                f"the measured rate"
            )
        return said


LinkProbe = Union[MachineAllReduce, MachinePairProbe]
"""A probe of the links inside one machine or between two."""


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
    inventory: ClusterInventory, rank: int, device: torch.device, num_bytes: int, transfer_bytes: int | None = None,
    host_group: Any = None,
) -> list[LinkProbe]:
    """Every machine with several ranks times a small message round its ring and an all-reduce of
    ``num_bytes`` among them, all machines at once; then the first ranks of every pair of machines time a
    message and a transfer of ``transfer_bytes`` (None: ``num_bytes``) each way between them; each message is also
    timed behind the engine's host header, sent over ``host_group`` (None: the default group where it is gloo,
    else a gloo group made for the probe). Collective: every rank calls it; the same list on every rank.
    The all-reduce's rate is fitted with the larger of the measured and configured latencies."""
    made_host_group = host_group is None and dist.get_backend() != "gloo"
    if made_host_group:
        host_group = make_host_group()
    machines = [(name, ranks) for name, ranks in inventory.ranks_by_machine.items() if len(ranks) > 1]
    groups = {name: dist.new_group(ranks) for name, ranks in machines}  # every rank creates every group
    mine = inventory.gpus[rank].machine
    median_ms = message_ms = header_ms = 0.0
    if mine in groups:
        ring = sorted(inventory.ranks_by_machine[mine])
        at = ring.index(rank)
        message_ms, header_ms = _message_ms(ring[(at + 1) % len(ring)], ring[at - 1], groups[mine], host_group, device)
        tensor = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
        median_ms = time_ms(lambda: dist.all_reduce(tensor, group=groups[mine]), device, PROBE_TIMING)
        dist.destroy_process_group(groups[mine])
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (median_ms, message_ms, header_ms))
    results: list[LinkProbe] = []
    for name, ranks in machines:
        measured = max(gathered[r][0] for r in ranks)
        message_us = max(gathered[r][1] for r in ranks) * 1e3
        configured_us = inventory.latency_us(ranks[0], ranks[1])
        results.append(MachineAllReduce(
            machine=name, num_ranks=len(ranks), num_bytes=num_bytes, measured_ms=measured,
            configured_gbps=inventory.bandwidth_gbps(ranks[0], ranks[1]),
            effective_gbps=effective_bandwidth_gbps(num_bytes, len(ranks), measured, max(configured_us, message_us)),
            message_us=message_us, configured_latency_us=configured_us,
            header_us=max(gathered[r][2] for r in ranks) * 1e3,
        ))
    results += _probe_machine_pairs(inventory, rank, device, transfer_bytes or num_bytes, host_group)
    if made_host_group:
        dist.destroy_process_group(host_group)
    return results


def pair_rounds(num_machines: int) -> list[list[tuple[int, int]]]:
    """Every pair of machines once, in rounds where no machine is in two pairs (the circle method): pairs of
    one round are timed at once without sharing a machine's network, in ``num_machines - 1`` rounds (or as
    many as machines, when odd)."""
    seats = [*range(num_machines), *([None] if num_machines % 2 else [])]
    rounds = []
    for _ in range(len(seats) - 1):
        pairs = [(seats[i], seats[-1 - i]) for i in range(len(seats) // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
        seats = [seats[0], seats[-1], *seats[1:-1]]
    return [pairs for pairs in rounds if pairs]  # one machine: no pair


def _probe_machine_pairs(
    inventory: ClusterInventory, rank: int, device: torch.device, num_bytes: int, host_group: Any
) -> list[MachinePairProbe]:
    """The pairs of machines, timed by their first ranks over the default group (see the module's docstring):
    the transfer from ``a`` to ``b``, then from ``b`` to ``a``, each timed on both ends."""
    names = list(inventory.ranks_by_machine)
    first = [inventory.ranks_by_machine[name][0] for name in names]
    mine: dict[tuple[int, int], tuple[float, float, float]] = {}
    for pairs in pair_rounds(len(names)):
        for a, b in pairs:
            if rank in (first[a], first[b]):
                peer = first[b] if rank == first[a] else first[a]
                message_ms, header_ms = _message_ms(peer, peer, None, host_group, device)
                tensor = torch.ones(max(num_bytes // 4, 1), dtype=torch.float32, device=device)
                each_way_ms = [
                    time_ms(_one_way(rank == sender, peer, tensor, None), device, PROBE_TIMING)
                    for sender in (first[a], first[b])
                ]
                mine[(a, b)] = (max(each_way_ms), message_ms, header_ms)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    results = []
    for pairs in pair_rounds(len(names)):
        for a, b in pairs:
            both = [gathered[first[a]][(a, b)], gathered[first[b]][(a, b)]]
            results.append(MachinePairProbe(
                machine_a=names[a], machine_b=names[b], num_bytes=num_bytes,
                transfer_ms=max(t[0] for t in both), message_us=max(t[1] for t in both) * 1e3,
                header_us=max(t[2] for t in both) * 1e3,
                configured_gbps=inventory.bandwidth_gbps(first[a], first[b]),
                configured_latency_us=inventory.latency_us(first[a], first[b]),
            ))
    return results


def _one_way(sending: bool, peer: int, tensor: torch.Tensor, group: Any) -> Callable[[], None]:
    """This rank's end of a transfer of ``tensor`` to ``peer`` (``sending``) or from it, posted as a batch of
    one (see :func:`_batch`)."""
    return _batch([dist.P2POp(dist.isend if sending else dist.irecv, tensor, peer, group=group)])


def _exchange(to: int, source: int, outgoing: torch.Tensor, incoming: torch.Tensor, group: Any) -> Callable[[], None]:
    """Send ``outgoing`` to ``to`` while receiving ``incoming`` from ``source``, posted as one batch."""
    return _batch([dist.P2POp(dist.isend, outgoing, to, group=group), dist.P2POp(dist.irecv, incoming, source, group=group)])


def _batch(ops: list[dist.P2POp]) -> Callable[[], None]:
    """Post ``ops`` as one batch and wait for them: under NCCL a batch runs on the group's own communicator,
    where a lone ``isend`` would first create a two-rank one and block until its peer joins (see the
    module's docstring)."""

    def run() -> None:
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return run


def _message_ms(to: int, source: int, group: Any, host_group: Any, device: torch.device) -> tuple[float, float]:
    """This rank's median time to send a small message to ``to`` while receiving one from ``source`` (every
    rank of a ring at once, as the pipeline's stages pass activations), and what the engine's host header
    (over ``host_group``, before the message) adds to it (at least 0: the difference of two noisy medians)."""
    message = _exchange(to, source, torch.ones(MESSAGE_ELEMENTS, device=device),
                        torch.empty(MESSAGE_ELEMENTS, device=device), group)
    header = _exchange(to, source, torch.zeros(HEADER_ELEMENTS, dtype=torch.int64),
                       torch.empty(HEADER_ELEMENTS, dtype=torch.int64), host_group)

    def with_header() -> None:
        header()
        message()

    alone_ms = time_ms(message, device, MESSAGE_TIMING)
    return alone_ms, max(time_ms(with_header, device, MESSAGE_TIMING) - alone_ms, 0.0)


def with_measured_rates(inventory: ClusterInventory, probes: list[LinkProbe]) -> ClusterInventory:
    """The inventory with each machine's ``intra_bandwidth_gbps`` lowered to its probe's effective rate, and
    its ``intra_latency_us`` raised to its measured message, where those are slower than configured; each
    pair of machines' link likewise (a ``machine_links`` entry); and the host header's measured cost per
    message inside machines and between them (the largest measured)."""
    inside = [p for p in probes if isinstance(p, MachineAllReduce)]
    between = [p for p in probes if isinstance(p, MachinePairProbe)]
    slower = {p.machine: p.effective_gbps for p in inside if p.slower_than_configured}
    later = {p.machine: p.message_us for p in inside if p.later_than_configured}
    machines = tuple(
        replace(m, intra_bandwidth_gbps=slower.get(m.name, m.intra_bandwidth_gbps),
                intra_latency_us=later.get(m.name, m.intra_latency_us))
        for m in inventory.machines
    )
    measured_links = {
        frozenset((p.machine_a, p.machine_b)): MachineLink(
            p.machine_a, p.machine_b, min(p.effective_gbps, p.configured_gbps),
            max(p.message_us, p.configured_latency_us),
        )
        for p in between if p.slower_than_configured or p.later_than_configured
    }
    links = (
        *(l for l in inventory.machine_links if frozenset((l.machine_a, l.machine_b)) not in measured_links),
        *measured_links.values(),
    )
    latencies = replace(
        inventory.latencies,
        header_intra_machine_us=max((p.header_us for p in inside), default=inventory.latencies.header_intra_machine_us),
        header_inter_machine_us=max((p.header_us for p in between), default=inventory.latencies.header_inter_machine_us),
    )
    changed = replace(inventory, machines=machines, machine_links=links, latencies=latencies)
    return inventory if changed == inventory else changed

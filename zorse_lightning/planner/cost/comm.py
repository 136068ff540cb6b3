"""Communication costs: point-to-point transfers and ring collectives over real links.

What overlaps and what does not (the pipeline formula in :mod:`.compute` uses this):

* activations and their gradients between stages are sent asynchronously, but
  the transport (gloo) moves a message only once its receiver has posted the
  (blocking) receive, which the engine does when it reaches the action that needs
  it (its notice crosses the link the other way, behind what it has just sent
  there): the sender computes on, the receiver waits for the whole transfer. So each
  rank is busy its compute plus its incoming transfers per microbatch
  (:func:`.compute.receiving_busy_ms`); under NCCL's rules the receive is posted
  ahead, in the batch of the instant its message is sent, and no notice crosses
  (:func:`.boundaries.receive_ms_per_microbatch`); a boundary limits the iteration when its
  busiest link needs longer than that; during fill and drain each boundary adds
  one transfer each way to the critical path;
* gradient synchronisation of a stage (:func:`stage_sync_ms`, by sharding level)
  runs after the stage's last backward and is *not* overlapped (conservative: the
  drain of earlier stages would hide part of it); full sharding's gather of the
  weights before the next step's first forward is priced there too (it is on the
  critical path either way);
* full sharding gathered per microbatch (:func:`gather_round_ms`) gathers each
  block before its forward and its backward and reduces its gradient after, and
  every GPU of the stage waits for those collectives: not overlapped either.

Links between machines are shared by every GPU pair of the two machines (each
direction on its own: links are full duplex); links inside a machine are taken
per GPU pair.

Collectives are priced as the backend runs them (:class:`CollectiveBackend`),
as phases of point-to-point flows (:class:`.phases.Phase`) laid on those links: a phase
lasts as long as its most loaded link needs. How many times a collective's bytes
cross a slow link depends on its algorithm and on where the ranks sit, and a
formula of one ring's slowest link misses it. Measured across a 100 Mbit/s link
between two machines of two gloo ranks each (``bench/slow_link.py
--collectives``, 4 MiB): an all-reduce 568-584 ms (the ring: 1.5 x the bytes
each way, priced 530), a reduce into one rank 454-495 ms (a ring reduce-scatter,
then the far machine's two chunks to the root: 1.25 x, priced 442) and a
broadcast 706 ms from rank 0 and 1051 from rank 1 (gloo's binomial tree: 2 and
3 x the bytes one after another, priced 710 and 1059), where the ring formula
priced a reduce and a broadcast at 265 ms each. The data-parallel plan of
``bench/slow_link.py`` sharded gradients (a reduce and a broadcast per owner),
so its step took twice its prediction: 4192 ms against 2310.

Links are priced at :data:`LINK_EFFICIENCY` of their nominal rate (the
inventory's ``bandwidth_gbps``): what a transport delivers of a link's rate.
The functions of this module take the rate to use; :class:`LinkTable`, through
which every plan is priced, hands out the effective one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from zorse_lightning.capabilities import Sharding
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.cost.phases import (
    GLOO_ASYNC_THREADS,
    CollectiveBackend,
    Phase,
    all_reduce_phases,
    concurrent,
    gloo_broadcast_phases,
    gloo_reduce_phases,
    ring_phase,
)
from zorse_lightning.units import gbps_to_bytes_per_s

MS_PER_S = 1000.0
US_PER_MS = 1000.0

LINK_EFFICIENCY = 0.95
"""Fraction of a link's nominal rate that transfers and collectives achieve.

Measured here on links shaped with ``tc ... tbf`` (100 Mbit/s): a TCP stream
delivers about 95% of the shaped rate (headers, acknowledgements). One factor
on every link, so a link's rate in the cluster config stays the rate a user
knows (the shaper's, the NIC's) and the goodput is derived from it here.
"""


def transfer_ms(num_bytes: float, bandwidth_gbps: float, latency_us: float) -> float:
    """One message: latency plus bytes over bandwidth."""
    if num_bytes <= 0:
        return 0.0
    return latency_us / US_PER_MS + num_bytes / gbps_to_bytes_per_s(bandwidth_gbps) * MS_PER_S


def ring_reduce_scatter_ms(num_bytes: float, num_ranks: int, bandwidth_gbps: float, latency_us: float) -> float:
    """Ring reduce-scatter: (n-1) steps, each moving bytes/n over the slowest ring link."""
    if num_ranks <= 1 or num_bytes <= 0:
        return 0.0
    steps = num_ranks - 1
    return steps * latency_us / US_PER_MS + steps / num_ranks * num_bytes / gbps_to_bytes_per_s(bandwidth_gbps) * MS_PER_S


def ring_all_gather_ms(num_bytes: float, num_ranks: int, bandwidth_gbps: float, latency_us: float) -> float:
    """Ring all-gather moves the same volume as a reduce-scatter."""
    return ring_reduce_scatter_ms(num_bytes, num_ranks, bandwidth_gbps, latency_us)


def ring_all_reduce_ms(num_bytes: float, num_ranks: int, bandwidth_gbps: float, latency_us: float) -> float:
    """Ring all-reduce = reduce-scatter + all-gather: 2(n-1)/n x bytes / bandwidth, 2(n-1) latencies."""
    return ring_reduce_scatter_ms(num_bytes, num_ranks, bandwidth_gbps, latency_us) + ring_all_gather_ms(
        num_bytes, num_ranks, bandwidth_gbps, latency_us
    )


LinkKey = tuple
"""("machines", a, b) for a link between two machines, ("gpus", ra, rb) inside one (from the first to the second)."""


@dataclass(frozen=True)
class LinkTable:
    """Bandwidth and latency lookups with a per-instance cache.

    The inventory scans its link overrides on every call; planning a 1024-GPU
    cluster asks for the same machine pairs many thousand times.
    """

    inventory: ClusterInventory
    efficiency: float = LINK_EFFICIENCY
    """Effective rate / nominal rate of every link (see :data:`LINK_EFFICIENCY`); 1.0 prices nominal rates."""
    _cache: dict = field(default_factory=dict, repr=False, compare=False)
    _machines: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _backend: CollectiveBackend = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.efficiency <= 1.0:
            raise PlanningError(
                f"link efficiency={self.efficiency!r} must be in (0, 1]: it is the fraction of a link's nominal "
                f"rate that transfers achieve; use {LINK_EFFICIENCY} (measured) or 1.0 for nominal rates"
            )
        object.__setattr__(self, "_machines", tuple(g.machine for g in self.inventory.gpus))
        object.__setattr__(self, "_backend", CollectiveBackend.of(self.inventory))

    def link(self, rank_a: int, rank_b: int, header: bool) -> tuple[LinkKey, float, float]:
        """(key of the shared link, effective bandwidth_gbps, latency_us) of a point-to-point message between
        two ranks: the link's latency, and with ``header`` the engine's host header before the message too
        (the inventory's ``latencies.header_*_us``, measured at start). The engine sends a header before each
        activation only: a gradient has the shape of the activation it belongs to, which both ends know
        (:mod:`zorse_lightning.engine.p2p`), and collectives send none (:meth:`_link`)."""
        key, bandwidth_gbps, latency_us = self._link(rank_a, rank_b)
        return key, bandwidth_gbps, latency_us + (self.header_us(rank_a, rank_b) if header else 0.0)

    def header_us(self, rank_a: int, rank_b: int) -> float:
        """What the engine's host header before an activation adds to its message between two ranks (the
        inventory's ``latencies.header_*_us``, measured at start; 0 to itself)."""
        if rank_a == rank_b:
            return 0.0
        latencies = self.inventory.latencies
        if self._machines[rank_a] == self._machines[rank_b]:
            return latencies.header_intra_machine_us
        return latencies.header_inter_machine_us

    def _link(self, rank_a: int, rank_b: int) -> tuple[LinkKey, float, float]:
        """(key of the shared link, effective bandwidth_gbps, latency_us) between two ranks."""
        ma, mb = self._machines[rank_a], self._machines[rank_b]
        if ma == mb:
            key: LinkKey = ("gpus", rank_a, rank_b)
            cached = self._cache.get(("intra", ma, rank_a == rank_b))
        else:
            key = ("machines", ma, mb)
            cached = self._cache.get(key)
        if cached is None:
            cached = (
                self.inventory.bandwidth_gbps(rank_a, rank_b) * self.efficiency,
                self.inventory.latency_us(rank_a, rank_b),
            )
            self._cache[("intra", ma, rank_a == rank_b) if ma == mb else key] = cached
        return key, cached[0], cached[1]

    def between(
        self, ranks_a: tuple[int, ...], ranks_b: tuple[int, ...], header: bool
    ) -> tuple[float, float, float, float]:
        """(min, max bandwidth_gbps; min, max latency_us) over the links from any rank of one group to any of
        another (one representative GPU per machine), of a message with or without ``header`` (:meth:`link`)."""
        key = ("between", ranks_a, ranks_b, header)
        if key not in self._cache:
            reps_a = {self._machines[r]: r for r in ranks_a}.values()
            reps_b = {self._machines[r]: r for r in ranks_b}.values()
            found = [self.link(a, b, header)[1:] for a in reps_a for b in reps_b]
            bandwidths, latencies = [f[0] for f in found], [f[1] for f in found]
            self._cache[key] = (min(bandwidths), max(bandwidths), min(latencies), max(latencies))
        return self._cache[key]

    def bandwidth_gbps(self, rank_a: int, rank_b: int) -> float:
        return self._link(rank_a, rank_b)[1]

    def ring(self, ranks: tuple[int, ...]) -> tuple[float, float]:
        """(slowest bandwidth_gbps, largest latency_us) of a ring through the ranks in order.

        Ranks are in global order, so the GPUs of a machine sit next to each other
        and the ring crosses each machine boundary once per direction.
        """
        if len(ranks) <= 1:
            return float("inf"), 0.0
        key = ("ring", ranks)
        if key not in self._cache:
            links = [self._link(ranks[i], ranks[(i + 1) % len(ranks)]) for i in range(len(ranks))]
            self._cache[key] = (min(l[1] for l in links), max(l[2] for l in links))
        return self._cache[key]

    def group_order(
        self, ranks: tuple[int, ...], shard_fractions: tuple[float, ...] = ()
    ) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """A stage's ranks in the order of its process group (ascending: ``torch.distributed.new_group``
        numbers a group's ranks so), with each rank's share of the sharded state (``shard_fractions``, in
        the order of ``ranks``; empty: equal shares). Cached: the search prices the same stages many times."""
        key = ("order", ranks, shard_fractions)
        if key not in self._cache:
            fractions = shard_fractions or (1.0 / len(ranks),) * len(ranks)
            by_rank = dict(zip(ranks, fractions))
            order = tuple(sorted(ranks))
            self._cache[key] = (order, tuple(by_rank[r] for r in order))
        return self._cache[key]

    @property
    def backend(self) -> CollectiveBackend:
        return self._backend

    def _linear_ms(self, key: tuple, phases_of_one_byte: Callable[[], tuple[Phase, ...]]) -> tuple[float, float]:
        """(ms per byte, ms of latencies) of a collective whose every flow scales with its bytes, so
        that each phase's most loaded link does too; cached under ``key``."""
        if key not in self._cache:
            per_byte_ms = latency_ms = 0.0
            for phase in phases_of_one_byte():
                load: dict[LinkKey, float] = defaultdict(float)
                rate_gbps: dict[LinkKey, float] = {}
                phase_latency_us = 0.0
                for flow in phase.flows:
                    link_key, gbps, us = self._link(flow.source_rank, flow.destination_rank)
                    load[link_key] += flow.num_bytes
                    rate_gbps[link_key] = gbps
                    phase_latency_us = max(phase_latency_us, us)
                per_byte_ms += max(load[k] / gbps_to_bytes_per_s(rate_gbps[k]) for k in load) * MS_PER_S
                latency_ms += phase.message_latencies * phase_latency_us / US_PER_MS
            self._cache[key] = (per_byte_ms, latency_ms)
        return self._cache[key]

    def all_reduce_ms(self, ranks: tuple[int, ...], num_bytes: float) -> float:
        """All-reduce of ``num_bytes`` among ``ranks`` (group order: ascending)."""
        if len(ranks) <= 1 or num_bytes <= 0:
            return 0.0
        per_byte_ms, latency_ms = self.all_reduce_line(ranks)
        return num_bytes * per_byte_ms + latency_ms

    def all_reduce_line(self, ranks: tuple[int, ...]) -> tuple[float, float]:
        """(ms per byte, ms of latencies) of :meth:`all_reduce_ms`."""
        return self._linear_ms(("all_reduce", ranks), lambda: all_reduce_phases(ranks, 1.0))

    def concurrent_all_reduce_ms(self, groups: tuple[tuple[int, ...], ...], num_bytes: float) -> float:
        """All-reduces of ``num_bytes`` among each of ``groups`` (each in group order) at once: a TP stage's
        data-parallel groups, one per TP index, whose flows share the links between machines they cross."""
        if num_bytes <= 0 or all(len(g) <= 1 for g in groups):
            return 0.0
        per_byte_ms, latency_ms = self.concurrent_all_reduce_line(groups)
        return num_bytes * per_byte_ms + latency_ms

    def concurrent_all_reduce_line(self, groups: tuple[tuple[int, ...], ...]) -> tuple[float, float]:
        """(ms per byte, ms of latencies) of :meth:`concurrent_all_reduce_ms`."""
        return self._linear_ms(("all_reduce_concurrent", groups), lambda: concurrent(*(all_reduce_phases(g, 1.0) for g in groups)))

    def to_owners_ms(self, ranks: tuple[int, ...], num_bytes: float, shares: tuple[float, ...]) -> float:
        """Each owner's share of ``num_bytes`` summed over ``ranks`` into that owner, as the engine does
        (``engine.sharding.StageShards.reduce_to_owners``: one blocking reduce per owner with a share,
        in group order).

        ``shares``: each rank's fraction, in the order of ``ranks`` (group order).
        gloo: :func:`gloo_reduce_phases` per owner, one after another. NCCL: one
        ring reduce-scatter of all the bytes (not measured here: NCCL's ring
        reduce carries an owner's whole share over each edge of a chain, up to
        n/(n-1) of this price).
        """
        if len(ranks) <= 1 or num_bytes <= 0:
            return 0.0
        if self.backend is CollectiveBackend.NCCL:
            return self._ring_share_ms(ranks, num_bytes)
        per_byte_ms, latency_ms = self._linear_ms(("to_owners", ranks, shares), lambda: tuple(
            phase for root, share in zip(ranks, shares) for phase in gloo_reduce_phases(ranks, root, share)
        ))
        return num_bytes * per_byte_ms + latency_ms

    def from_owners_ms(self, ranks: tuple[int, ...], num_bytes: float, shares: tuple[float, ...]) -> float:
        """Each owner's share of ``num_bytes`` sent to every other rank of ``ranks``, as the engine does
        (``StageShards.start_broadcast``: one broadcast per owner with a share, all started at once, then
        waited for).

        gloo: :func:`gloo_broadcast_phases` per owner, :data:`GLOO_ASYNC_THREADS`
        owners at a time in group order (:func:`concurrent`): measured across
        100 Mbit/s, four owners' 1 MiB each took 724 ms started at once and 878
        ms one after another (priced 706 and 883). NCCL: one ring all-gather (see
        :meth:`to_owners_ms`).
        """
        if len(ranks) <= 1 or num_bytes <= 0:
            return 0.0
        if self.backend is CollectiveBackend.NCCL:
            return self._ring_share_ms(ranks, num_bytes)

        def phases() -> tuple[Phase, ...]:
            owners = [(root, share) for root, share in zip(ranks, shares) if share > 0]
            running = [owners[i : i + GLOO_ASYNC_THREADS] for i in range(0, len(owners), GLOO_ASYNC_THREADS)]
            return tuple(
                phase
                for together in running
                for phase in concurrent(*(gloo_broadcast_phases(ranks, root, share) for root, share in together))
            )

        per_byte_ms, latency_ms = self._linear_ms(("from_owners", ranks, shares), phases)
        return num_bytes * per_byte_ms + latency_ms

    def _ring_share_ms(self, ranks: tuple[int, ...], num_bytes: float) -> float:
        """(n-1)/n of the bytes over every ring edge: a ring reduce-scatter's or all-gather's traffic."""
        per_byte_ms, latency_ms = self.ring_share_line(ranks)
        return num_bytes * per_byte_ms + latency_ms

    def ring_share_line(self, ranks: tuple[int, ...]) -> tuple[float, float]:
        """(ms per byte, ms of latencies) of :meth:`_ring_share_ms`: NCCL's reduce-scatter or all-gather."""
        n = len(ranks)
        return self._linear_ms(("ring_share", ranks), lambda: (ring_phase(ranks, (n - 1) / n),))


def stage_sync_ms(
    links: LinkTable, ranks: tuple[int, ...], weight_bytes: float, gradient_bytes: float, sharding: Sharding,
    shard_fractions: tuple[float, ...] = (),
) -> float:
    """Synchronisation of one stage after its last backward, as the engine runs each level
    (:mod:`zorse_lightning.engine.sharding`), over the links between the stage's ranks.

    * ``none``: an all-reduce of the gradients;
    * ``optimizer``: the same all-reduce (every rank gets every reduced gradient),
      then an all-reduce of the updated weights (each owner's, zeros elsewhere);
    * ``optimizer_gradients``: each owner's gradients reduced to it, then each
      owner's updated weights broadcast (:meth:`LinkTable.to_owners_ms`,
      :meth:`LinkTable.from_owners_ms`);
    * ``full``: the same, the broadcasts before the next step's first forward
      instead of after this step. Gathered per microbatch, the caller passes only
      the embedding's and head's bytes, which are kept whole like
      ``optimizer_gradients`` (the layers move in :func:`gather_round_ms`).

    ``shard_fractions``: each rank's share of the sharded state, in the order of
    ``ranks`` (``StagePlan.effective_shard_fractions()``; empty: equal shares). With
    gloo an owner's collectives cost more or less by where it sits.
    """
    if len(ranks) <= 1:
        return 0.0
    order, shares = links.group_order(ranks, shard_fractions)
    if sharding is Sharding.NONE:
        return links.all_reduce_ms(order, gradient_bytes)
    if sharding is Sharding.OPTIMIZER:
        return links.all_reduce_ms(order, gradient_bytes) + links.all_reduce_ms(order, weight_bytes)
    return links.to_owners_ms(order, gradient_bytes, shares) + links.from_owners_ms(order, weight_bytes, shares)


def least_stage_sync_ms(
    links: LinkTable, ranks: tuple[int, ...], weight_bytes: float, gradient_bytes: float, degree: int = 1,
) -> tuple[float, float]:
    """(ms per unit, ms) such that a stage on ``ranks`` (TP groups of ``degree``, listed replica by replica)
    synchronising ``n`` units of ``weight_bytes`` and ``gradient_bytes`` each a rank (a layer's, say) takes no less
    than ``n`` times the first plus the second at any sharding level, shares or gathering per microbatch (whose three
    rounds a block move each block's bytes at least so: :func:`gather_round_ms`). Under NCCL, ``none`` and
    ``optimizer`` all-reduce the gradients at least (with TP, each TP index's group at once:
    :func:`~.tensor_parallel.tensor_parallel_sync_ms`); the others reduce-scatter the gradients and all-gather the
    weights in rings that do not depend on the shares (with TP, one TP index's group). (0, 0) under gloo, whose
    owners' collectives cost by where each owner sits and how much it holds."""
    groups = tuple(tuple(sorted(ranks[i::degree])) for i in range(degree))
    if len(groups[0]) <= 1 or links.backend is not CollectiveBackend.NCCL:
        return 0.0, 0.0
    reduce_ms, reduce_latency_ms = links.all_reduce_line(groups[0]) if degree == 1 else links.concurrent_all_reduce_line(groups)
    share_ms, share_latency_ms = links.ring_share_line(groups[0])
    return min(reduce_ms * gradient_bytes, share_ms * (gradient_bytes + weight_bytes)), min(reduce_latency_ms, 2 * share_latency_ms)


def gather_round_ms(
    links: LinkTable, ranks: tuple[int, ...], weight_bytes: float, gradient_bytes: float, num_blocks: int,
    shard_fractions: tuple[float, ...] = (),
) -> float:
    """One microbatch round of full sharding gathered per microbatch, over the stage's links.

    Each of ``num_blocks`` blocks (``weight_bytes`` and ``gradient_bytes`` are all of
    theirs together, spread evenly) is gathered from its owners before its forward
    and again before its backward, and its gradient reduced to its owners right
    after: three rounds of the owners' collectives per block
    (:meth:`LinkTable.from_owners_ms`, :meth:`LinkTable.to_owners_ms`), each paying
    its own latencies. A rank without a microbatch in the round joins them all the
    same. The engine starts the next block's gather while a block computes; this
    price does not count on that overlap (measured here, with four gloo processes
    on two cores, the step took longer than even this price: ``bench/README.md``,
    big_model), so the planner gathers per microbatch where memory leaves no
    cheaper choice.
    """
    if len(ranks) <= 1 or num_blocks <= 0:
        return 0.0
    order, shares = links.group_order(ranks, shard_fractions)
    gather = links.from_owners_ms(order, weight_bytes / num_blocks, shares)
    reduce = links.to_owners_ms(order, gradient_bytes / num_blocks, shares)
    return num_blocks * (2 * gather + reduce)

"""Communication costs: point-to-point transfers and ring collectives over real links.

What overlaps and what does not (the pipeline formula in :mod:`.compute` uses this):

* activations and their gradients between stages are sent asynchronously, but
  the transport (gloo) moves a message only once its receiver has posted the
  (blocking) receive, which the engine does when it reaches the action that needs
  it (its notice crosses the link the other way, behind what it has just sent
  there): the sender computes on, the receiver waits for the whole transfer. So each
  rank is busy its compute plus its incoming transfers per microbatch
  (:func:`.compute.receiving_busy_ms`); a boundary limits the iteration when its
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
as phases of point-to-point flows (:class:`Phase`) laid on those links: a phase
lasts as long as its most loaded link needs. The number of times a collective's
bytes cross a slow link depends on its algorithm and on where the ranks sit, and
a formula of one ring's slowest link misses it: measured across a 100 Mbit/s
link between two machines of two gloo ranks each (``bench/slow_link.py
--collectives``), a 4 MiB all-reduce took 568 ms (the ring: 1.5 x the bytes
each way, 530 ms priced), a reduce to one rank 462 ms (a ring reduce-scatter,
then the other machine's two chunks to the root: 1.25 x, 441 ms priced) and a
broadcast 706 ms (gloo's binomial tree sends to both ranks of the far machine in
its last round: 2 x the bytes in one direction, 706 ms priced), where the ring
formula priced the latter two at 265 ms each. The data-parallel plan of
``bench/slow_link.py`` shards gradients (one reduce and one broadcast per
owner), so its step took twice its prediction.

Links are priced at :data:`LINK_EFFICIENCY` of their nominal rate (the
inventory's ``bandwidth_gbps``): what a transport delivers of a link's rate.
The functions of this module take the rate to use; :class:`LinkTable`, through
which every plan is priced, hands out the effective one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from zorse_lightning.capabilities import Sharding
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import PlanningError
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


class CollectiveBackend(str, Enum):
    """Whose algorithms move a collective's bytes: the engine runs gloo on CPU ranks (an emulated
    cluster's) and NCCL on GPUs (``engine.groups.backend_for``), and the two send along different paths."""

    GLOO = "gloo"
    NCCL = "nccl"

    @classmethod
    def of(cls, inventory: ClusterInventory) -> CollectiveBackend:
        return cls.GLOO if inventory.emulated else cls.NCCL


@dataclass(frozen=True)
class Flow:
    """Bytes one rank sends another within a phase of a collective."""

    source_rank: int
    destination_rank: int
    num_bytes: float


@dataclass(frozen=True)
class Phase:
    """Flows that run at the same time. A phase ends when its most loaded link (bytes over rate,
    flows that share a link adding up) has carried them; the next phase starts then, because a
    rank forwards only what it has received."""

    flows: tuple[Flow, ...]
    message_latencies: int
    """Messages one after another on the phase's longest path (a ring's steps, one round of a
    tree), each paying the largest latency among the phase's links."""


def ring_phase(ranks: Sequence[int], bytes_per_edge: float) -> Phase:
    """Every rank sends ``bytes_per_edge`` to the previous one in the ring (gloo's direction; links are
    full duplex and symmetric, so NCCL's opposite direction costs the same), in ``len(ranks) - 1`` steps."""
    n = len(ranks)
    return Phase(tuple(Flow(ranks[i], ranks[i - 1], bytes_per_edge) for i in range(n)), n - 1)


def all_reduce_phases(ranks: Sequence[int], num_bytes: float) -> tuple[Phase, ...]:
    """Ring all-reduce (gloo's only algorithm the engine meets, and NCCL's for the message sizes of
    gradients): a reduce-scatter and an all-gather, each moving (n-1)/n of the bytes over every ring edge."""
    n = len(ranks)
    if n <= 1 or num_bytes <= 0:
        return ()
    share = (n - 1) / n * num_bytes
    return ring_phase(ranks, share), ring_phase(ranks, share)


def gloo_reduce_phases(ranks: Sequence[int], root: int, num_bytes: float) -> tuple[Phase, ...]:
    """gloo's reduce of ``num_bytes`` from every rank of ``ranks`` (group order) into ``root``
    (``gloo/reduce.cc``): a ring reduce-scatter, then every other rank sends its reduced chunk
    (1/n of the bytes) straight to the root, so the chunks of a far machine's ranks cross its
    link together."""
    n = len(ranks)
    if n <= 1 or num_bytes <= 0:
        return ()
    scatter = ring_phase(ranks, (n - 1) / n * num_bytes)
    return scatter, Phase(tuple(Flow(r, root, num_bytes / n) for r in ranks if r != root), 1)


def gloo_broadcast_phases(ranks: Sequence[int], root: int, num_bytes: float) -> tuple[Phase, ...]:
    """gloo's broadcast of ``num_bytes`` from ``root`` to every rank of ``ranks`` (group order).

    A binomial tree (``gloo/broadcast.cc``) over the ranks renumbered from the
    root (virtual rank ``v``: the ``v``-th rank after the root in group order): in
    round ``i`` every virtual rank ``v < 2**i`` sends the whole message to
    ``v + 2**i``, after it has received it. The stride doubles each round, so with
    machines of contiguous ranks the last rounds cross between machines from
    several ranks at once (four ranks on two machines: both ranks of the root's
    machine send to the other's in the last round, twice the bytes over the link).
    """
    n = len(ranks)
    if n <= 1 or num_bytes <= 0:
        return ()
    start = list(ranks).index(root)
    virtual = [ranks[(start + v) % n] for v in range(n)]
    phases, stride = [], 1
    while stride < n:
        phases.append(Phase(tuple(Flow(virtual[v], virtual[v + stride], num_bytes) for v in range(min(stride, n - stride))), 1))
        stride *= 2
    return tuple(phases)


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

    def __post_init__(self) -> None:
        if not 0.0 < self.efficiency <= 1.0:
            raise PlanningError(
                f"link efficiency={self.efficiency!r} must be in (0, 1]: it is the fraction of a link's nominal "
                f"rate that transfers achieve; use {LINK_EFFICIENCY} (measured) or 1.0 for nominal rates"
            )
        object.__setattr__(self, "_machines", tuple(g.machine for g in self.inventory.gpus))

    def link(self, rank_a: int, rank_b: int) -> tuple[LinkKey, float, float]:
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

    def between(self, ranks_a: tuple[int, ...], ranks_b: tuple[int, ...]) -> tuple[float, float, float, float]:
        """(min, max bandwidth_gbps; min, max latency_us) over the links from any rank of
        one group to any of another (one representative GPU per machine)."""
        key = ("between", ranks_a, ranks_b)
        if key not in self._cache:
            reps_a = {self._machines[r]: r for r in ranks_a}.values()
            reps_b = {self._machines[r]: r for r in ranks_b}.values()
            found = [self.link(a, b)[1:] for a in reps_a for b in reps_b]
            bandwidths, latencies = [f[0] for f in found], [f[1] for f in found]
            self._cache[key] = (min(bandwidths), max(bandwidths), min(latencies), max(latencies))
        return self._cache[key]

    def bandwidth_gbps(self, rank_a: int, rank_b: int) -> float:
        return self.link(rank_a, rank_b)[1]

    def ring(self, ranks: tuple[int, ...]) -> tuple[float, float]:
        """(slowest bandwidth_gbps, largest latency_us) of a ring through the ranks in order.

        Ranks are in global order, so the GPUs of a machine sit next to each other
        and the ring crosses each machine boundary once per direction.
        """
        if len(ranks) <= 1:
            return float("inf"), 0.0
        key = ("ring", ranks)
        if key not in self._cache:
            links = [self.link(ranks[i], ranks[(i + 1) % len(ranks)]) for i in range(len(ranks))]
            self._cache[key] = (min(l[1] for l in links), max(l[2] for l in links))
        return self._cache[key]

    @property
    def backend(self) -> CollectiveBackend:
        return CollectiveBackend.of(self.inventory)

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
                    link_key, gbps, us = self.link(flow.source_rank, flow.destination_rank)
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
        per_byte_ms, latency_ms = self._linear_ms(("all_reduce", ranks), lambda: all_reduce_phases(ranks, 1.0))
        return num_bytes * per_byte_ms + latency_ms

    def to_owners_ms(self, ranks: tuple[int, ...], num_bytes: float, shares: tuple[float, ...]) -> float:
        """Each owner's share of ``num_bytes`` summed over ``ranks`` into that owner, as the engine does
        (``engine.sharding.StageShards.reduce_to_owners``: one reduce per owner with a share).

        ``shares``: each rank's fraction, in the order of ``ranks`` (group order).
        gloo: :func:`gloo_reduce_phases` per owner. NCCL: one ring reduce-scatter
        of all the bytes (not measured here: NCCL's ring reduce carries an owner's
        whole share over each edge of a chain, up to n/(n-1) of this price).
        """
        if len(ranks) <= 1 or num_bytes <= 0:
            return 0.0
        if self.backend is CollectiveBackend.NCCL:
            return self._ring_share_ms(ranks, num_bytes)
        return sum(
            self._owner_ms(("gloo_reduce", ranks, root), share * num_bytes, lambda root=root: gloo_reduce_phases(ranks, root, 1.0))
            for root, share in zip(ranks, shares)
        )

    def from_owners_ms(self, ranks: tuple[int, ...], num_bytes: float, shares: tuple[float, ...]) -> float:
        """Each owner's share of ``num_bytes`` sent to every other rank of ``ranks``, as the engine does
        (``StageShards.broadcast_from_owners``: one broadcast per owner with a share). gloo:
        :func:`gloo_broadcast_phases` per owner. NCCL: one ring all-gather (see :meth:`to_owners_ms`)."""
        if len(ranks) <= 1 or num_bytes <= 0:
            return 0.0
        if self.backend is CollectiveBackend.NCCL:
            return self._ring_share_ms(ranks, num_bytes)
        return sum(
            self._owner_ms(("gloo_broadcast", ranks, root), share * num_bytes, lambda root=root: gloo_broadcast_phases(ranks, root, 1.0))
            for root, share in zip(ranks, shares)
        )

    def _ring_share_ms(self, ranks: tuple[int, ...], num_bytes: float) -> float:
        """(n-1)/n of the bytes over every ring edge: a ring reduce-scatter's or all-gather's traffic."""
        n = len(ranks)
        per_byte_ms, latency_ms = self._linear_ms(("ring_share", ranks), lambda: (ring_phase(ranks, (n - 1) / n),))
        return num_bytes * per_byte_ms + latency_ms

    def _owner_ms(self, key: tuple, num_bytes: float, phases_of_one_byte: Callable[[], tuple[Phase, ...]]) -> float:
        if num_bytes <= 0:  # an owner without a share makes no collective
            return 0.0
        per_byte_ms, latency_ms = self._linear_ms(key, phases_of_one_byte)
        return num_bytes * per_byte_ms + latency_ms


def ring_sync_ms(
    weight_bytes: float, gradient_bytes: float, num_ranks: int, bandwidth_gbps: float, latency_us: float, sharding: Sharding
) -> float:
    """Synchronisation of one stage by sharding level on a ring of equal links that nothing else
    shares: the integer program's closed form (it knows a stage's ring by its slowest link only).
    Plans are priced by :func:`stage_sync_ms`, which lays each collective's flows on the links.

    * ``none``: an all-reduce of the gradients;
    * ``optimizer``: the same all-reduce, then an all-reduce of the updated weights;
    * ``optimizer_gradients`` and ``full``: the traffic of a reduce-scatter of the
      gradients and an all-gather of the weights.
    """
    if num_ranks <= 1:
        return 0.0
    if sharding is Sharding.NONE:
        return ring_all_reduce_ms(gradient_bytes, num_ranks, bandwidth_gbps, latency_us)
    if sharding is Sharding.OPTIMIZER:
        return ring_all_reduce_ms(gradient_bytes, num_ranks, bandwidth_gbps, latency_us) + ring_all_reduce_ms(
            weight_bytes, num_ranks, bandwidth_gbps, latency_us
        )
    return ring_reduce_scatter_ms(gradient_bytes, num_ranks, bandwidth_gbps, latency_us) + ring_all_gather_ms(
        weight_bytes, num_ranks, bandwidth_gbps, latency_us
    )


def group_order(ranks: tuple[int, ...], shard_fractions: tuple[float, ...] = ()) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """A stage's ranks in the order of its process group (ascending: ``torch.distributed.new_group``
    numbers a group's ranks so), with each rank's share of the sharded state (``shard_fractions``, in
    the order of ``ranks``; empty: equal shares)."""
    fractions = shard_fractions or (1.0 / len(ranks),) * len(ranks)
    by_rank = dict(zip(ranks, fractions))
    order = tuple(sorted(ranks))
    return order, tuple(by_rank[r] for r in order)


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
    order, shares = group_order(ranks, shard_fractions)
    if sharding is Sharding.NONE:
        return links.all_reduce_ms(order, gradient_bytes)
    if sharding is Sharding.OPTIMIZER:
        return links.all_reduce_ms(order, gradient_bytes) + links.all_reduce_ms(order, weight_bytes)
    return links.to_owners_ms(order, gradient_bytes, shares) + links.from_owners_ms(order, weight_bytes, shares)


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
    order, shares = group_order(ranks, shard_fractions)
    gather = links.from_owners_ms(order, weight_bytes / num_blocks, shares)
    reduce = links.to_owners_ms(order, gradient_bytes / num_blocks, shares)
    return num_blocks * (2 * gather + reduce)

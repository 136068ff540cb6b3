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
* gradient synchronisation of a stage (:func:`ring_sync_ms`, by sharding level)
  runs after the stage's last backward and is *not* overlapped (conservative: the
  drain of earlier stages would hide part of it); full sharding's gather of the
  weights before the next step's first forward is priced there too (it is on the
  critical path either way);
* full sharding gathered per microbatch (:func:`gather_round_ms`) gathers each
  block before its forward and its backward and reduces its gradient after, and
  every GPU of the stage waits for those collectives: not overlapped either.

Links between machines are shared by every GPU pair of the two machines; links
inside a machine are taken per GPU pair.

Links are priced at :data:`LINK_EFFICIENCY` of their nominal rate (the
inventory's ``bandwidth_gbps``): what a transport delivers of a link's rate.
The functions of this module take the rate to use; :class:`LinkTable`, through
which every plan is priced, hands out the effective one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
"""("machines", a, b) for a link between two machines, ("gpus", ra, rb) inside one."""


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


def ring_sync_ms(
    weight_bytes: float, gradient_bytes: float, num_ranks: int, bandwidth_gbps: float, latency_us: float, sharding: Sharding
) -> float:
    """Synchronisation of one stage after its last backward, as the engine runs each level
    (:mod:`zorse_lightning.engine.sharding`).

    * ``none``: an all-reduce of the gradients;
    * ``optimizer``: the same all-reduce (every rank gets every reduced gradient),
      then an all-reduce of the updated weights (each owner's, zeros elsewhere);
    * ``optimizer_gradients``: each gradient reduced to its owner (a reduce-scatter),
      then the owners' updated weights to every rank (an all-gather): one all-reduce's
      traffic, half of ``optimizer``'s;
    * ``full``: the same reduce-scatter, and the all-gather of the weights before the
      next step's first forward instead of after this step. Gathered per microbatch, the
      caller passes only the embedding's and head's bytes, which are kept whole like
      ``optimizer_gradients`` (the layers move in :func:`gather_round_ms`).
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


def stage_sync_ms(links: LinkTable, ranks: tuple[int, ...], weight_bytes: float, gradient_bytes: float, sharding: Sharding) -> float:
    """:func:`ring_sync_ms` over the ring through the stage's ranks in rank order."""
    bandwidth_gbps, latency_us = links.ring(ranks)
    return ring_sync_ms(weight_bytes, gradient_bytes, len(ranks), bandwidth_gbps, latency_us, sharding)


def gather_round_ms(links: LinkTable, ranks: tuple[int, ...], weight_bytes: float, gradient_bytes: float, num_blocks: int) -> float:
    """One microbatch round of full sharding gathered per microbatch, over the stage's ring.

    Each of ``num_blocks`` blocks (``weight_bytes`` and ``gradient_bytes`` are all of
    theirs together, spread evenly) is all-gathered before its forward and again
    before its backward, and its gradient reduce-scattered to its owners right after:
    three collectives per block, each paying its own latencies. A rank without a
    microbatch in the round joins them all the same. The engine starts the next
    block's gather while a block computes; this price does not count on that
    overlap (measured here, with four gloo processes on two cores, the step took
    longer than even this price: ``bench/README.md``, big_model), so the planner
    gathers per microbatch where memory leaves no cheaper choice.
    """
    if len(ranks) <= 1 or num_blocks <= 0:
        return 0.0
    bandwidth_gbps, latency_us = links.ring(ranks)
    gather = ring_all_gather_ms(weight_bytes / num_blocks, len(ranks), bandwidth_gbps, latency_us)
    reduce = ring_reduce_scatter_ms(gradient_bytes / num_blocks, len(ranks), bandwidth_gbps, latency_us)
    return num_blocks * (2 * gather + reduce)

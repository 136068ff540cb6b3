"""Collectives as the backend runs them: phases of point-to-point flows, laid on links by
:class:`~zorse_lightning.planner.cost.comm.LinkTable`.

A phase lasts as long as its most loaded link needs; how many times a collective's bytes cross a slow
link depends on its algorithm (ring, gloo's reduce and binomial broadcast) and on where its ranks sit,
which the flows say and a ring formula over the slowest link does not. Pure data: no prices here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from zorse_lightning.cluster.inventory import ClusterInventory


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
    root (virtual rank ``v``: the ``v``-th rank after the root in group order):
    ``v`` receives the whole message from ``v`` without its highest set bit, then
    sends it to every ``v + 2**i`` (``2**i > v``, below n) at once: its sends are
    not waited on between rounds, only its receive. So phase ``d`` holds the sends
    of the ranks ``d - 1`` hops from the root (``popcount(v) == d - 1``), and the
    root's sends share its links: four ranks on two machines, root 1 sends to 2
    and 3 on the far machine together (twice the bytes over the link), then 2
    sends to 0 (once more): three times the bytes, where root 0 needs two
    (measured 1051 and 706 ms for 4 MiB at 100 Mbit/s; priced 1059 and 710).
    """
    n = len(ranks)
    if n <= 1 or num_bytes <= 0:
        return ()
    start = list(ranks).index(root)
    virtual = [ranks[(start + v) % n] for v in range(n)]
    by_depth: dict[int, list[Flow]] = defaultdict(list)
    for v in range(n):
        stride = 1 << v.bit_length()  # v's children are v + 2**i for 2**i > v
        while v + stride < n:
            by_depth[v.bit_count()].append(Flow(virtual[v], virtual[v + stride], num_bytes))
            stride *= 2
    return tuple(Phase(tuple(by_depth[d]), 1) for d in sorted(by_depth))


GLOO_ASYNC_THREADS = 2
"""Worker threads of a gloo process group (``ProcessGroupGloo``'s default, two per device): collectives
started asynchronously run this many at a time."""


def concurrent(*collectives: tuple[Phase, ...]) -> tuple[Phase, ...]:
    """Collectives running at the same time on threads of their own: their ``k``-th phases share the links."""
    return tuple(
        Phase(
            tuple(flow for c in collectives if k < len(c) for flow in c[k].flows),
            max(c[k].message_latencies for c in collectives if k < len(c)),
        )
        for k in range(max((len(c) for c in collectives), default=0))
    )

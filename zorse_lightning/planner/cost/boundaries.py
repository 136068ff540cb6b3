"""What crosses the boundaries between stages: who sends how many microbatches to whom,
how long one message takes, how busy the busiest link is, and how long each rank waits
for its messages per microbatch (the closed form's boundary elements, :mod:`.evaluate`).

Boundary ``b`` lies between stage ``b`` and ``b + 1`` of ``plan.stages``; on an
interleaved plan those are virtual stages, so the ranks of two groups meet at one
boundary per chunk (and the last group feeds the first group's next chunk).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from zorse_lightning.capabilities import P2PRules
from zorse_lightning.planner.cost.comm import transfer_ms
from zorse_lightning.planner.cost.tensor_parallel import tensor_parallel_pairs
from zorse_lightning.schedule.plan import Plan, StagePlan

if TYPE_CHECKING:
    from zorse_lightning.planner.cost.context import CostContext


@dataclass(frozen=True)
class BoundaryCost:
    transfer_ms: float
    """Slowest crossing of one microbatch's activation: its one message, or, between TP groups, the messages of
    its TP ranks that share a link, one after the other (each carries the whole activation, and the receiving
    group starts once the last is in: the fill and drain pay that at every boundary). In the steady state
    the closed form keeps one message's wait per route (:attr:`route_ms`): the group's other messages move
    while it computes."""
    busy_ms: float
    """Busiest link's transfers per iteration, one direction (links are full duplex)."""
    routes: tuple[tuple[int, int, int], ...]
    """(sending rank, receiving rank, microbatches) in microbatch order."""
    route_ms: tuple[tuple[float, float], ...]
    """Per route: one activation's transfer forward, one gradient's back (what the receivers wait for)."""
    link_ms: tuple[tuple[tuple, float], ...] = ()
    """Per link and direction (:meth:`~.comm.LinkTable.link`'s key): its transfers per iteration, activations
    one way and gradients the other (:func:`shared_link_ms` adds up the boundaries that share a link)."""
    arrival_ms: tuple[float, ...] = ()
    """Per route: from the microbatch's activations sent until the receiving group holds them all (between TP
    groups, the copies that share a link arrive one after the other; the group starts once the last is in)."""

    @cached_property
    def receiver_waits_ms(self) -> dict[int, float]:
        """Per receiving rank: its slowest route's activation and the gradient it sent ahead of it
        (:func:`receive_ms_per_microbatch`, gloo's rules)."""
        return _slowest((b, forward + back) for (_, b, _), (forward, back) in zip(self.routes, self.route_ms))

    @cached_property
    def receiver_posted_waits_ms(self) -> dict[int, float]:
        """Per receiving rank: its slowest route's activations alone, until its group holds them all
        (:func:`receive_ms_per_microbatch`, NCCL's rules)."""
        return _slowest((b, arrival) for (_, b, _), arrival in zip(self.routes, self.arrival_ms))

    @cached_property
    def sender_waits_ms(self) -> dict[int, float]:
        """Per sending rank: its slowest route's gradient back."""
        return _slowest((a, back) for (a, _, _), (_, back) in zip(self.routes, self.route_ms))


def _slowest(waits: Iterable[tuple[int, float]]) -> dict[int, float]:
    out: dict[int, float] = {}
    for rank, ms in waits:
        out[rank] = max(out.get(rank, 0.0), ms)
    return out


def routes(sender: StagePlan, receiver: StagePlan) -> list[tuple[int, int, int]]:
    """Which rank sends how many consecutive microbatches to which rank across a boundary (between TP groups,
    each pair of ranks that carries their messages: :func:`.tensor_parallel.tensor_parallel_pairs`)."""
    return [(a, b, count) for pairs, count in _replica_routes(sender, receiver) for a, b in pairs]


def _replica_routes(sender: StagePlan, receiver: StagePlan) -> list[tuple[tuple[tuple[int, int], ...], int]]:
    """Per pair of replicas that meet across a boundary, in microbatch order: the rank pairs that carry each of
    their microbatches' messages, and how many consecutive microbatches."""
    send = [[g, n] for g, n in zip(sender.replicas, sender.microbatches_per_rank[:: sender.tensor_parallel]) if n > 0]
    recv = [[g, n] for g, n in zip(receiver.replicas, receiver.microbatches_per_rank[:: receiver.tensor_parallel]) if n > 0]
    out: list[tuple[tuple[tuple[int, int], ...], int]] = []
    i = j = 0
    while i < len(send) and j < len(recv):
        count = min(send[i][1], recv[j][1])
        out.append((tensor_parallel_pairs(send[i][0], recv[j][0]), count))
        send[i][1] -= count
        recv[j][1] -= count
        i += send[i][1] == 0
        j += recv[j][1] == 0
    return out


def boundary_message_bytes(ctx: CostContext, plan: Plan, index: int) -> float:
    """One microbatch's activation across boundary ``index`` (its gradient back is as large)."""
    return ctx.profile.layers[plan.stages[index].layers[1] - 1].output_bytes_per_sample * plan.microbatch_size


def boundary_cost(ctx: CostContext, plan: Plan, index: int) -> BoundaryCost:
    """Boundary ``index``'s costs, once per pair of stages (their ranks, shares and TP degrees) and message size:
    the search meets the same boundary in a plan's draft, its fits, its other orders and every chunk of its
    interleavings (5,400 boundaries priced at 32 synthetic GPUs, most of them again)."""
    sender, receiver = plan.stages[index], plan.stages[index + 1]
    message_bytes = boundary_message_bytes(ctx, plan, index)
    key = ("boundary", sender.ranks, sender.microbatches_per_rank, sender.tensor_parallel, receiver.ranks,
           receiver.microbatches_per_rank, receiver.tensor_parallel, message_bytes)
    return ctx.memo(key, lambda: _boundary_cost(ctx, sender, receiver, message_bytes))


def _boundary_cost(ctx: CostContext, sender: StagePlan, receiver: StagePlan, message_bytes: float) -> BoundaryCost:
    one_ms: dict = {}  # per link: one message
    messages: dict = {}  # per link: messages per iteration
    loads: dict = {}  # per link and direction: activations and gradients per iteration
    route_list, route_ms, arrival_ms = [], [], []
    slowest = 0.0
    for pairs, count in _replica_routes(sender, receiver):
        sharing: dict = {}  # per link: this microbatch's activations on it, one after the other
        for a, b in pairs:
            key, forward = _link_transfer_ms(ctx.links.link(a, b, header=True), message_bytes, True, one_ms)
            back_key, back = _link_transfer_ms(ctx.links.link(b, a, header=False), message_bytes, False, one_ms)
            route_list.append((a, b, count))
            route_ms.append((forward, back))
            messages[key] = messages.get(key, 0) + count
            sharing[key] = sharing.get(key, 0.0) + forward
            loads[key] = loads.get(key, 0.0) + count * forward
            loads[back_key] = loads.get(back_key, 0.0) + count * back
        arrival_ms += [max(sharing.values())] * len(pairs)
        slowest = max(slowest, arrival_ms[-1])
    busiest = max((one_ms[(k, True)] * n for k, n in messages.items()), default=0.0)
    return BoundaryCost(slowest, busiest, tuple(route_list), tuple(route_ms), tuple(loads.items()), tuple(arrival_ms))


def shared_link_ms(boundaries: Iterable[BoundaryCost]) -> dict[tuple, float]:
    """Per link and direction, the transfers of every boundary of ``boundaries`` on it per iteration: one
    interleaved plan's chunk boundaries cross the same links again (a group's activations to the next group
    and the gradients it returns to the group before share one direction), as do a plain plan's stages that
    go back to a machine. Each boundary's own busiest link left the rest out: two datacenters joined by 5 Gb/s,
    interleaved x2, played 1.5x the closed form, whose links were two thirds as busy as the play's."""
    total: dict[tuple, float] = {}
    for boundary in boundaries:
        for key, ms in boundary.link_ms:
            total[key] = total.get(key, 0.0) + ms
    return total


def _link_transfer_ms(link: tuple[tuple, float, float], message_bytes: float, activation: bool, by_link: dict) -> tuple[tuple, float]:
    """``link``'s key (:meth:`~.comm.LinkTable.link`) and one message over it (an ``activation``, with its host
    header, or a gradient), priced once per link and kind in ``by_link`` (many routes share one)."""
    key, bandwidth_gbps, latency_us = link
    if (key, activation) not in by_link:
        by_link[(key, activation)] = transfer_ms(message_bytes, bandwidth_gbps, latency_us)
    return key, by_link[(key, activation)]


def receive_ms_per_microbatch(plan: Plan, boundaries: tuple[BoundaryCost, ...], rules: P2PRules) -> list[list[float]]:
    """Per stage, per rank: the transfers it waits for per microbatch (see :func:`.compute.receiving_busy_ms`).

    A rank of stage ``i`` receives each microbatch's activation from stage ``i - 1``
    and its gradient from stage ``i + 1`` (the slowest route where several senders
    feed it). Under gloo's ``rules`` a message moves once its receiver waits for it: before
    an activation moves, the receiver's notice that it is ready crosses the link the other
    way, behind the gradient the receiver has just sent that peer (1F1B: a backward, then
    the next forward's receive), so each activation costs the receiver that gradient's
    transfer too. Under NCCL's the receiver posts its receive in the batch of the instant
    the activation is sent (:mod:`~zorse_lightning.schedule.p2p_batches`), while it still
    computes: no notice crosses, it waits for the activation alone (two to four GPUs a
    group over 25 Gb/s, plain and interleaved: simulated 0.91-0.97 of the closed form
    with the notice, 0.97-1.03 without).
    """
    receive = [[0.0] * len(stage.ranks) for stage in plan.stages]
    position = [stage.rank_index for stage in plan.stages]
    for i, boundary in enumerate(boundaries):
        received = boundary.receiver_posted_waits_ms if rules is P2PRules.NCCL else boundary.receiver_waits_ms
        for stage, waits in ((i + 1, received), (i, boundary.sender_waits_ms)):
            for rank, ms in waits.items():
                receive[stage][position[stage][rank]] += ms
    return receive

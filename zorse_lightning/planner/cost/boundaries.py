"""What crosses the boundaries between stages: who sends how many microbatches to whom,
how long one message takes, how busy the busiest link is, and how long each rank waits
for its messages per microbatch (the closed form's boundary elements, :mod:`.evaluate`).

Boundary ``b`` lies between stage ``b`` and ``b + 1`` of ``plan.stages``; on an
interleaved plan those are virtual stages, so the ranks of two groups meet at one
boundary per chunk (and the last group feeds the first group's next chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zorse_lightning.planner.cost.comm import transfer_ms
from zorse_lightning.planner.cost.tensor_parallel import tensor_parallel_pairs
from zorse_lightning.schedule.plan import Plan, StagePlan

if TYPE_CHECKING:
    from zorse_lightning.planner.cost.context import CostContext


@dataclass(frozen=True)
class BoundaryCost:
    transfer_ms: float
    """Slowest single transfer of one microbatch's activation across the boundary."""
    busy_ms: float
    """Busiest link's transfers per iteration, one direction (links are full duplex)."""
    routes: tuple[tuple[int, int, int], ...]
    """(sending rank, receiving rank, microbatches) in microbatch order."""
    route_ms: tuple[tuple[float, float], ...]
    """Per route: one activation's transfer forward, one gradient's back (what the receivers wait for)."""


def routes(sender: StagePlan, receiver: StagePlan) -> list[tuple[int, int, int]]:
    """Which rank sends how many consecutive microbatches to which rank across a boundary (between TP groups,
    each pair of ranks that carries their messages: :func:`.tensor_parallel.tensor_parallel_pairs`)."""
    send = [[g, n] for g, n in zip(sender.replicas, sender.microbatches_per_rank[:: sender.tensor_parallel]) if n > 0]
    recv = [[g, n] for g, n in zip(receiver.replicas, receiver.microbatches_per_rank[:: receiver.tensor_parallel]) if n > 0]
    out: list[tuple[int, int, int]] = []
    i = j = 0
    while i < len(send) and j < len(recv):
        count = min(send[i][1], recv[j][1])
        out.extend((a, b, count) for a, b in tensor_parallel_pairs(send[i][0], recv[j][0]))
        send[i][1] -= count
        recv[j][1] -= count
        i += send[i][1] == 0
        j += recv[j][1] == 0
    return out


def boundary_message_bytes(ctx: CostContext, plan: Plan, index: int) -> float:
    """One microbatch's activation across boundary ``index`` (its gradient back is as large)."""
    return ctx.profile.layers[plan.stages[index].layers[1] - 1].output_bytes_per_sample * plan.microbatch_size


def boundary_cost(ctx: CostContext, plan: Plan, index: int) -> BoundaryCost:
    sender, receiver = plan.stages[index], plan.stages[index + 1]
    message_bytes = boundary_message_bytes(ctx, plan, index)
    one_ms: dict = {}  # per link: one message
    messages: dict = {}  # per link: messages per iteration
    route_list = routes(sender, receiver)
    route_ms = []
    for a, b, count in route_list:
        key = ctx.links.link(a, b, header=True)[0]
        route_ms.append((
            link_transfer_ms(ctx, a, b, message_bytes, True, one_ms), link_transfer_ms(ctx, b, a, message_bytes, False, one_ms)
        ))
        messages[key] = messages.get(key, 0) + count
    slowest = max((forward for forward, _ in route_ms), default=0.0)
    busiest = max((one_ms[(k, True)] * n for k, n in messages.items()), default=0.0)
    return BoundaryCost(slowest, busiest, tuple(route_list), tuple(route_ms))


def link_transfer_ms(
    ctx: CostContext, src: int, dst: int, message_bytes: float, activation: bool, by_link: dict
) -> float:
    """One message from ``src`` to ``dst`` (an ``activation``, with its host header, or a gradient), priced
    once per link and kind in ``by_link`` (many routes share one)."""
    key, bandwidth_gbps, latency_us = ctx.links.link(src, dst, header=activation)
    if (key, activation) not in by_link:
        by_link[(key, activation)] = transfer_ms(message_bytes, bandwidth_gbps, latency_us)
    return by_link[(key, activation)]


def receive_ms_per_microbatch(plan: Plan, boundaries: tuple[BoundaryCost, ...]) -> list[list[float]]:
    """Per stage, per rank: the transfers it waits for per microbatch (see :func:`.compute.receiving_busy_ms`).

    A rank of stage ``i`` receives each microbatch's activation from stage ``i - 1``
    and its gradient from stage ``i + 1`` (the slowest route where several senders
    feed it). Before an activation moves, the receiver's notice that it is ready
    crosses the link the other way, behind the gradient the receiver has just sent
    that peer (1F1B: a backward, then the next forward's receive): so each
    activation costs the receiver that gradient's transfer too.
    """
    slowest: dict[tuple[int, int, str], float] = {}  # (stage, rank, "previous" | "next" stage) -> ms
    for i, boundary in enumerate(boundaries):
        for (a, b, _), (forward, back) in zip(boundary.routes, boundary.route_ms):
            for key, ms in (((i + 1, b, "previous"), forward + back), ((i, a, "next"), back)):
                slowest[key] = max(slowest.get(key, 0.0), ms)
    position = [{r: k for k, r in enumerate(stage.ranks)} for stage in plan.stages]
    receive = [[0.0] * len(stage.ranks) for stage in plan.stages]
    for (stage, rank, _), ms in slowest.items():
        receive[stage][position[stage][rank]] += ms
    return receive

"""What a simulated iteration is made of (its events, its timeline) and what one message between stages
costs, shared by the two plays of the engine's programs: gloo's rules (:mod:`.simulate`) and NCCL's
(:mod:`.stream_play`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from zorse_lightning.schedule.actions import ActionKind, Message
from zorse_lightning.planner.cost.boundaries import boundary_message_bytes
from zorse_lightning.planner.cost.comm import LinkKey, transfer_ms
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.schedule.plan import Plan


class EventKind(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    SEND = "send"
    RECV = "recv"
    ALLREDUCE = "allreduce"
    OPTIMIZER = "optimizer"


class TimelineEvent(NamedTuple):
    """One span of a rank's iteration. A named tuple, as :class:`~zorse_lightning.schedule.actions.Action`: a play
    makes two per message and one per action (120,000 messages for some 512-GPU plans), and making frozen
    dataclasses was 9 % of a play's instructions."""

    rank: int
    kind: EventKind
    microbatch: int
    """-1 for the synchronisation and the optimizer step."""
    start_ms: float
    end_ms: float
    stage: int = -1
    """The stage a forward or backward runs (a chunk, on an interleaved plan), the boundary
    a transfer crosses (between ``stage`` and ``stage + 1``); -1 for the synchronisation and
    the optimizer step."""


@dataclass(frozen=True)
class Timeline:
    events: tuple[TimelineEvent, ...]
    predicted_iteration_ms: float
    """The cost model's figure, for comparison."""

    @property
    def makespan_ms(self) -> float:
        return max(e.end_ms for e in self.events)

    def of_rank(self, rank: int) -> tuple[TimelineEvent, ...]:
        return tuple(e for e in self.events if e.rank == rank)


@dataclass(frozen=True)
class Route:
    """How one message crosses from its sender to its receiver."""

    transfer_ms: float
    link: LinkKey
    notice_link: LinkKey
    """The link the other way, which the receiver's notice that it is ready crosses."""


def message_route(ctx: CostContext, plan: Plan, message: Message, header: bool) -> Route:
    """The cost model's price of ``message`` (both directions carry the boundary's activation size: a
    gradient is as large as its activation), with the engine's host header where ``header`` and the message
    is an activation (:meth:`~.comm.LinkTable.link`; a play that prices the header apart passes False)."""
    with_header = header and message.kind is ActionKind.FORWARD
    link, bandwidth_gbps, latency_us = ctx.links.link(message.src, message.dst, with_header)
    message_bytes = boundary_message_bytes(ctx, plan, message.boundary)
    notice_link = ctx.links.link(message.dst, message.src, with_header)[0]
    return Route(transfer_ms(message_bytes, bandwidth_gbps, latency_us), link, notice_link)

"""A plan as a timeline: every forward, backward, transfer, synchronisation and optimizer
step of one iteration, from an event simulation of the schedule (someone else draws it).

Each rank runs its microbatches in index order. Under 1F1B a rank of stage ``i``
of ``S`` starts at most ``min(n, S - i)`` forwards ahead of its backwards and, when
both are ready, runs the backward first; under GPipe it runs every forward, then
every backward. A forward needs the previous stage's output (after the transfer),
a backward the next stage's gradient (the last stage's, its own forward). A
message moves only once its receiver is free to take it, as the engine's
transport does (gloo sends when the blocking receive is posted, which the engine
does when it reaches the action that needs it; the receiver's notice crosses the
link the other way, behind what is queued there), and one at a time per link and
direction. Per-op times, transfer times, synchronisation and optimizer step
times are the cost model's (:mod:`.evaluate`); the stage's synchronisation starts when its last rank
ends its last backward, and each rank's optimizer step when the synchronisation
ends.

Relationship to the cost model's ``iteration_ms`` (tested): equal when stages
have no transfer time and every rank of a stage has the same work, and the stage
that takes longest to synchronise and step is one that finishes its backwards
last (the textbook ``(M + S - 1) t`` for single-GPU stages whose optimizer steps
are negligible, ``max_r n_r t_r`` plus the all-reduce plus the slowest optimizer
step for one stage); with transfers, the simulation may be longer (1F1B stalls
while a gradient makes its round trip, which the closed form bounds only on
average) or shorter (the closed form charges a shared link's whole traffic as a
separate pipeline element, while the simulation overlaps it with compute; and it
charges the fill and drain through every later element even where the busiest
stage is the first). It is also
shorter when a stage that ends early has the longest synchronisation and step:
the closed form starts every stage's at the pipeline's end.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from enum import Enum

from zorse_lightning.capabilities import Schedule
from zorse_lightning.planner.comm import transfer_ms
from zorse_lightning.planner.evaluate import CostContext, boundary_message_bytes, plan_cost, plan_stage_widths
from zorse_lightning.planner.memory import microbatches_in_flight
from zorse_lightning.planner.plan import Plan


class EventKind(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    SEND = "send"
    RECV = "recv"
    ALLREDUCE = "allreduce"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True)
class TimelineEvent:
    rank: int
    kind: EventKind
    microbatch: int
    """-1 for the synchronisation and the optimizer step."""
    start_ms: float
    end_ms: float


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


@dataclass
class _Rank:
    """Mutable state of one rank during the simulation (local to :func:`simulate`)."""

    rank: int
    stage: int
    microbatches: list[int]
    limit: int
    forward_ms: float
    backward_ms: float
    free_at: float = 0.0
    forwarded: int = 0
    backwarded: int = 0


def simulate(ctx: CostContext, plan: Plan) -> Timeline:
    """Event simulation of one iteration of ``plan`` (see module docstring)."""
    cost = plan_cost(ctx, plan)
    num_stages = len(plan.stages)
    owner = [{j: r for r, mbs in s.microbatch_ranges().items() for j in mbs} for s in plan.stages]
    transfer = [
        {(a, b): (_one_transfer(ctx, plan, i, a, b), ctx.links.link(a, b)[0], ctx.links.link(b, a)[0]) for a, b, _ in bc.routes}
        for i, bc in enumerate(cost.boundaries)
    ]
    link_free: dict = {}
    ranks: dict[int, _Rank] = {}
    widths = plan_stage_widths(plan)
    for s, (stage, stage_cost) in enumerate(zip(plan.stages, cost.stages)):
        for r, times, mbs in zip(stage.ranks, stage_cost.times, stage.microbatch_ranges().values()):
            limit = microbatches_in_flight(plan.schedule, widths, s, len(mbs))
            ranks[r] = _Rank(r, s, list(mbs), limit, times.forward_ms, times.backward_ms)
    forward_ready = {(0, j): _Message(0.0) for j in range(plan.num_microbatches)}
    backward_ready: dict[tuple[int, int], _Message] = {}
    events: list[TimelineEvent] = []

    def next_op(state: _Rank):
        """(start, is_backward) of the rank's next op, or None while it waits."""
        options = []
        if state.backwarded < state.forwarded:
            j = state.microbatches[state.backwarded]
            message = backward_ready.get((state.stage, j))
            gpipe_wait = plan.schedule is Schedule.GPIPE and state.forwarded < len(state.microbatches)
            if message is not None and not gpipe_wait:
                options.append((message.received_ms(state.free_at, link_free), 0))
        if state.forwarded < len(state.microbatches) and state.forwarded - state.backwarded < state.limit:
            message = forward_ready.get((state.stage, state.microbatches[state.forwarded]))
            if message is not None:
                options.append((message.received_ms(state.free_at, link_free), 1))
        return min(options) if options else None

    heap = []
    for state in ranks.values():
        op = next_op(state)
        if op is not None:
            heapq.heappush(heap, (op[0], op[1], state.rank))
    while heap:
        start, kind, r = heapq.heappop(heap)
        state = ranks[r]
        op = next_op(state)
        if op != (start, kind):  # stale entry: the rank's next op changed (a link got busier, say)
            if op is not None:
                heapq.heappush(heap, (op[0], op[1], r))
            continue
        touched = _run(plan, state, kind == 0, start, owner, transfer, link_free, forward_ready, backward_ready, events)
        for t in {r, *touched}:
            op = next_op(ranks[t])
            if op is not None:
                heapq.heappush(heap, (op[0], op[1], t))
    done = sum(s.backwarded for s in ranks.values())
    if done != plan.num_microbatches * num_stages:
        raise RuntimeError(f"simulation stalled after {done} of {plan.num_microbatches * num_stages} backwards")
    for index, (stage, stage_cost) in enumerate(zip(plan.stages, cost.stages)):
        end = max(ranks[r].free_at for r in stage.ranks)
        synced = end + cost.stage_sync_ms(index)
        for r, update_ms in zip(stage.ranks, stage_cost.update_ms):
            events.append(TimelineEvent(r, EventKind.ALLREDUCE, -1, end, synced))
            events.append(TimelineEvent(r, EventKind.OPTIMIZER, -1, synced, synced + update_ms))
    return Timeline(tuple(sorted(events, key=lambda e: (e.start_ms, e.rank))), cost.iteration_ms)


@dataclass(frozen=True)
class _Message:
    """An activation or gradient sent at ``sent_ms``; it moves once its receiver is free (see module docstring)."""

    sent_ms: float
    transfer_ms: float = 0.0
    link: tuple | None = None
    """None: nothing to move (the first stage's inputs, the last stage's own loss)."""
    notice_link: tuple | None = None
    """The link the other way, which the receiver's notice that it is ready crosses."""
    sender: int = -1

    def moves_at_ms(self, receiver_free_ms: float, link_free: dict) -> float:
        if self.link is None:
            return self.sent_ms
        notice_ms = max(receiver_free_ms, link_free.get(self.notice_link, 0.0))
        return max(self.sent_ms, notice_ms, link_free.get(self.link, 0.0))

    def received_ms(self, receiver_free_ms: float, link_free: dict) -> float:
        return max(receiver_free_ms, self.moves_at_ms(receiver_free_ms, link_free) + self.transfer_ms)


def _one_transfer(ctx: CostContext, plan: Plan, boundary: int, a: int, b: int) -> float:
    return transfer_ms(boundary_message_bytes(ctx, plan, boundary), *ctx.links.link(a, b)[1:])


def _run(plan, state: _Rank, backward: bool, start: float, owner, transfer, link_free, forward_ready, backward_ready, events) -> set[int]:
    """Run one op at ``start``: record the transfer it waited for (which held its link) and the op;
    leave its output for the next rank; return the ranks that may now proceed."""
    s, last = state.stage, len(plan.stages) - 1
    j = state.microbatches[state.backwarded if backward else state.forwarded]
    message = (backward_ready if backward else forward_ready).pop((s, j))
    if message.link is not None:
        moved = message.moves_at_ms(state.free_at, link_free)
        link_free[message.link] = moved + message.transfer_ms
        events.append(TimelineEvent(message.sender, EventKind.SEND, j, moved, moved + message.transfer_ms))
        events.append(TimelineEvent(state.rank, EventKind.RECV, j, moved, moved + message.transfer_ms))
    end = start + (state.backward_ms if backward else state.forward_ms)
    events.append(TimelineEvent(state.rank, EventKind.BACKWARD if backward else EventKind.FORWARD, j, start, end))
    state.free_at = end
    if backward:
        state.backwarded += 1
        if s == 0:
            return set()
        peer = owner[s - 1][j]
        delay, notice_link, link = transfer[s - 1][(peer, state.rank)]
        backward_ready[(s - 1, j)] = _Message(end, delay, link, notice_link, state.rank)
        return {peer}
    state.forwarded += 1
    if s == last:
        backward_ready[(s, j)] = _Message(end)
        return set()
    peer = owner[s + 1][j]
    delay, link, notice_link = transfer[s][(state.rank, peer)]
    forward_ready[(s + 1, j)] = _Message(end, delay, link, notice_link, state.rank)
    return {peer}

"""A plan as a timeline: every forward, backward, transfer, synchronisation and optimizer
step of one iteration, from an event simulation of the engine's own programs (someone
else draws it).

Each rank plays its program from :func:`..schedule.build_schedule`, the action lists
the engine executes, in their order: the picture shows what runs, not a schedule of
its own. An action starts when its rank has ended the previous one and the message it
needs (an activation from the previous stage, a gradient from the next) has arrived.
A message moves only once its receiver is free to take it, as the engine's transport
does (gloo sends when the blocking receive is posted, which the engine does when it
reaches the action that needs it; the receiver's notice crosses the link the other
way, behind what is queued there), and one at a time per link and direction. Per-op
times, transfer times, synchronisation and optimizer step times are the cost model's
(:mod:`.evaluate`); the stage's synchronisation starts when its last rank ends its
last backward, and each rank's optimizer step when the synchronisation ends. The
programs passed :func:`..schedule.play_in_steps`, which needs every message at the head
of its channel; this play needs it only sent, so it cannot stall.

That is gloo's rules (``CostContext.p2p_rules``, :class:`~zorse_lightning.capabilities.P2PRules`).
Under NCCL's, those of every run on GPUs and of a gloo run under ``ZORSE_P2P_RULES=nccl``,
the messages move as the batches the engine posts run, one at a time on each rank's
stream (:mod:`.stream_play`): a receive over a fast link may wait behind a send over a
slow one that its rank posted before, which gloo's play never makes it do.

Relationship to the cost model's ``iteration_ms`` (tested): equal when stages have no
transfer time and every rank of a stage has the same work, and the stage that takes
longest to synchronise and step is one that finishes its backwards last (the textbook
``(M + S - 1) t`` for single-GPU stages whose optimizer steps are negligible, ``max_r
n_r t_r`` plus the all-reduce plus the slowest optimizer step for one stage); with
transfers, the simulation may be longer (1F1B stalls while a gradient makes its round
trip, which the closed form bounds only on average, and the more so where a program,
recorded in unit steps, keeps fewer microbatches in flight than the warm-up the closed
form assumes) or shorter (the closed form charges a shared link's whole traffic as a
separate pipeline element, while the simulation overlaps it with compute; and it
charges the fill and drain through every later element even where the busiest stage is
the first). Both start a stage's synchronisation and step at its own last backward.

A tensor-parallel stage's TP group runs each action at once, when every one of its ranks can (the
all-reduces inside its blocks hold them together): messages of its ranks that share a link reach the
last of them later, and that delay is paid again at every boundary.

Interleaved plans play the same way: a rank's actions belong to several stages (its
group's chunks), each priced by its own chunk's times, each message by the boundary it
crosses (``Message.boundary``); a group synchronises and steps once, after the last
backward of any of its chunks. Equal single-GPU groups without transfer time come
within a few per cent of the closed form's ``(M + (S - 1) / V) t`` (tested).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple

from zorse_lightning.capabilities import P2PRules
from zorse_lightning.planner.cost.compute import MicrobatchTimes
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.evaluate import PlanCost, plan_cost, prediction
from zorse_lightning.planner.cost.recorded_programs import schedule_batches, schedule_programs
from zorse_lightning.planner.cost.events import EventKind, Route, Timeline, TimelineEvent, message_route
from zorse_lightning.planner.cost.stream_play import StreamPlay
from zorse_lightning.schedule.plan import Plan
from zorse_lightning.schedule.programs import Action, ActionKind, Message, messages_of

__all__ = ["EventKind", "Timeline", "TimelineEvent", "simulate", "with_simulated_prediction"]


def simulate(ctx: CostContext, plan: Plan) -> Timeline:
    """Event simulation of one iteration of ``plan`` (see module docstring), once per plan in ``ctx``
    (its prediction, notes and solver record do not change it)."""
    key = (plan.schedule, plan.interleave, plan.microbatch_size, plan.global_batch_size, plan.stages)
    if key not in ctx._timelines:
        cost = plan_cost(ctx, plan)
        if ctx.p2p_rules is P2PRules.NCCL and len(plan.stages) > 1:
            play: _Play | StreamPlay = StreamPlay(ctx, plan, cost, schedule_programs(ctx, plan), schedule_batches(ctx, plan))
        else:
            play = _Play(ctx, plan, cost, schedule_programs(ctx, plan))
        play.run()
        events = play.events + _tail_events(plan, cost, play.free_at, play.drained_at)
        ctx._timelines[key] = Timeline(tuple(sorted(events, key=attrgetter("start_ms", "rank"))), cost.iteration_ms)
    return ctx._timelines[key]


def with_simulated_prediction(ctx: CostContext, plan: Plan) -> Plan:
    """``plan`` predicted at the end of the simulation of the engine's own programs (what its timeline
    draws), not at the closed form's figure: one prediction, that of what runs. The closed form ranks
    candidates in the search (it needs no programs); the plan a user gets says what its programs take."""
    timeline = simulate(ctx, plan)
    ms = timeline.makespan_ms
    priced = plan if plan.predicted else plan.with_prediction(prediction(ctx, plan, plan_cost(ctx, plan)))
    return priced.predicted_at(ms, timeline.predicted_iteration_ms)


def _tail_events(plan: Plan, cost: PlanCost, free_at: list[float], drained_at: list[float]) -> list[TimelineEvent]:
    """Each group's synchronisation from its last backward on (of any of its chunks), then each
    rank's optimizer step, once the synchronisation has ended and the rank's messages have all moved
    (``drained_at``: the engine waits for every batch of the step before it returns)."""
    events = []
    for index, (stage, stage_cost) in enumerate(zip(plan.rank_groups, cost.stages)):
        end = max(free_at[r] for r in stage.ranks)
        synced = end + cost.stage_sync_ms(index)
        for r, update_ms in zip(stage.ranks, stage_cost.update_ms):
            stepped = max(synced, drained_at[r])
            events.append(TimelineEvent(r, EventKind.ALLREDUCE, -1, end, synced))
            events.append(TimelineEvent(r, EventKind.OPTIMIZER, -1, stepped, stepped + update_ms))
    return events


class _Upcoming(NamedTuple):
    """A rank's next action, what it receives first (each message with its key in
    :attr:`_Play.sent_at` and its route) and what it sends (with their keys)."""

    action: Action
    receives: tuple[tuple[Message, tuple, Route], ...]
    sends: tuple[tuple[Message, tuple], ...]


def _key(message: Message) -> tuple:
    """``message`` as a plain tuple: hashed and compared in C (a dataclass's hash and equality are
    Python calls, most of what looking a message up cost)."""
    return message.src, message.dst, message.microbatch, message.boundary, message.kind is ActionKind.FORWARD


@dataclass
class _Play:
    """Every rank's progress through its program, in event time (local to :func:`simulate`).

    The next action of the rank whose start is earliest runs first: starts only grow
    (ranks and links only get busier), so a start computed earlier is a lower bound
    and a popped one that still holds is the earliest of all.
    """

    ctx: CostContext
    plan: Plan
    cost: PlanCost
    programs: tuple[tuple[Action, ...], ...]
    events: list[TimelineEvent] = field(default_factory=list)
    free_at: list[float] = field(init=False)
    """When each rank ends its last action so far (and posts its next receive)."""
    drained_at: list[float] = field(init=False)
    """When each rank's last message has moved: its last receive is before its last action and gloo's
    sends are posted and left, so its end (:attr:`free_at`)."""
    cursor: list[int] = field(init=False)
    sent_at: dict[tuple, float] = field(default_factory=dict)
    """Messages sent and not yet received (by :func:`_key`), by when their sender ended the action that
    made them."""
    link_free: dict[tuple, float] = field(default_factory=dict)
    _times: dict[tuple[int, int], MicrobatchTimes] = field(init=False)
    """One microbatch's forward and backward on each (working rank, stage it runs)."""
    _routes: dict[tuple[int, int, int, bool], Route] = field(default_factory=dict)
    _upcoming: list[_Upcoming | None] = field(init=False)
    """Each rank's next action (:meth:`_next_of`), None once its program is done."""

    def __post_init__(self) -> None:
        self.free_at = [0.0] * len(self.programs)
        self.drained_at = self.free_at
        self.cursor = [0] * len(self.programs)
        self._times = {
            (r, index): times
            for index, (stage, stage_cost) in enumerate(zip(self.plan.stages, self.cost.stages))
            for r, times in zip(stage.ranks, stage_cost.times)
        }
        self._upcoming = [self._next_of(r) for r in range(len(self.programs))]

    def run(self) -> None:
        """Play every program to its end. Each rank has at most one live heap entry (``queued``): a rank
        waiting for several messages was pushed once per message, and every stale copy, popped, cost a
        fresh :meth:`start_of` (8 an action on the plans the search simulates on the shipped clusters; 4
        with one entry). Which rank steps next is the one of least (start, rank) either way, so the events
        are the same."""
        queued: list[float | None] = [None] * len(self.programs)
        heap: list[tuple[float, int]] = []

        def queue(rank: int) -> None:
            start = self.start_of(rank)
            if start is not None and start != queued[rank]:
                queued[rank] = start
                heapq.heappush(heap, (start, rank))

        for r in range(len(self.programs)):
            queue(r)
        while heap:
            start, r = heapq.heappop(heap)
            if start != queued[r]:  # a copy replaced by a later push
                continue
            queued[r] = None
            if self.start_of(r) != start:  # stale: a link it needs got busier
                queue(r)
                continue
            for t in {r, *self.step(r, start)}:
                queue(t)

    def _next_of(self, rank: int) -> _Upcoming | None:
        """The rank's next action with its receives (each with its route) and its sends, or None when its
        program is done; made once per action (routing a message walks the stage's shares, and
        :meth:`start_of` asks at every look at the rank)."""
        program, position = self.programs[rank], self.cursor[rank]
        if position == len(program):
            return None
        receives, sends = messages_of(self.plan, rank, program[position])
        return _Upcoming(
            program[position], tuple((m, _key(m), self.route(m)) for m in receives), tuple((m, _key(m)) for m in sends)
        )

    def start_of(self, rank: int) -> float | None:
        """When the rank's next action can start, or None while a message it needs is unsent: on a
        tensor-parallel stage, when it can start on every rank of the TP group (its all-reduces hold them
        together: :meth:`step` runs it on all of them)."""
        upcoming = self._upcoming[rank]
        return None if upcoming is None else self._received(self.plan.stages[upcoming.action.stage].tensor_group(rank), False)

    def _received(self, group: tuple[int, ...], commit: bool) -> float | None:
        """When every rank of ``group`` is free and has its next action's messages in, or None while one is
        unsent. Each message moves once sent, its receiver's notice across and its link free; the group's
        messages in turn where they share a link. ``commit``: move them (record them, hold their links)."""
        held = self.link_free if commit else {}

        def free(link) -> float:
            return held.get(link, self.link_free.get(link, 0.0))

        start = max(self.free_at[r] for r in group)
        for rank in group:
            upcoming = self._upcoming[rank]
            if upcoming is None:
                return None
            for message, key, route in upcoming.receives:
                if key not in self.sent_at:
                    return None
                moved = max(self.sent_at[key], self.free_at[message.dst], free(route.notice_link), free(route.link))
                held[route.link] = moved + route.transfer_ms
                start = max(start, moved + route.transfer_ms)
                if commit:
                    del self.sent_at[key]
                    for r, kind in ((message.src, EventKind.SEND), (rank, EventKind.RECV)):
                        self.events.append(TimelineEvent(r, kind, message.microbatch, moved, moved + route.transfer_ms, message.boundary))
        return start

    def step(self, rank: int, start: float) -> set[int]:
        """Run the rank's next action at ``start`` on every rank of its TP group (itself alone without):
        move the messages they waited for (which held their links), record the action; return the ranks this
        may let proceed."""
        group = self.plan.stages[self._upcoming[rank].action.stage].tensor_group(rank)
        self._received(group, True)
        return set(group).union(*(self._run(peer, start) for peer in group))

    def _run(self, rank: int, start: float) -> set[int]:
        action, _, sends = self._upcoming[rank]
        times = self._times[(rank, action.stage)]
        end = start + (times.forward_ms if action.kind is ActionKind.FORWARD else times.backward_ms)
        kind = EventKind.FORWARD if action.kind is ActionKind.FORWARD else EventKind.BACKWARD
        self.events.append(TimelineEvent(rank, kind, action.microbatch, start, end, action.stage))
        self.free_at[rank] = end
        self.cursor[rank] += 1
        self._upcoming[rank] = self._next_of(rank)
        for _, key in sends:
            self.sent_at[key] = end
        return {message.dst for message, _ in sends}

    def route(self, message: Message) -> Route:
        """:func:`.events.message_route`, its host header within (gloo's play sends it with the message),
        once per (sender, receiver, boundary, activation or not)."""
        key = (message.src, message.dst, message.boundary, message.kind is ActionKind.FORWARD)
        if key not in self._routes:
            self._routes[key] = message_route(self.ctx, self.plan, message, header=True)
        return self._routes[key]

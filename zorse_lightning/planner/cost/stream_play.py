"""One iteration of a plan under NCCL's point-to-point rules: each rank's batches on one stream.

On NCCL, which every run on GPUs uses, and on gloo under ``ZORSE_P2P_RULES=nccl``
(:mod:`zorse_lightning.engine.p2p_rules`), the engine posts exactly the schedule's batches
(:func:`..p2p_batches.rank_batches`) and they run as follows, which this play follows in
event time (:func:`..p2p_batches.play_rendezvous` checks the same rules without time):

* a rank posts its batches in order, each once it has run the actions before it
  (``P2PBatch.before``): it sends the headers of the batch's activations (a host tensor
  over gloo: dtype and shape), then receives those of the activations the batch receives,
  which holds its host until each sender has begun to post the batch that sends one and
  the header has crossed (:mod:`zorse_lightning.engine.p2p`; ``LinkTable.header_us``);
* a rank's stream runs its batches one at a time, in posting order: a batch starts once
  posted and once the batch before it completed, whatever peers either talks to;
* a message moves once the batches holding its two ends both run (a send completes only
  together with its matching receive) and its link is free (one transfer at a time per
  link and direction, as in gloo's play), and takes the message's time without header;
  on gloo's transport (``LinkTable.backend``: an emulated cluster's ranks, under
  ``ZORSE_P2P_RULES=nccl`` too) a pair of ranks also has one connection for both
  directions, which moves one message at a time: measured between two namespaces
  across 100 Mbit/s, both ways at once between the same two ranks took twice one
  way's time (medians of 9: 32 KiB 7 ms against 3, 128 KiB 21 against 12; 1 MiB
  180-243 against 88), two connections in opposite directions less (4, 19 and
  95-126 ms; ``bench/README.md``, slow_link). So a batch that sends a gradient to
  the rank it receives the next activation from (1F1B's steady state) waits for
  both in turn;
* a batch completes once all its messages have moved;
* an action runs once the rank's host has ended the one before it and the batches
  holding its receives have completed (a batch that only sends holds no action); on a
  tensor-parallel stage, once that holds for every rank of its TP group: the group's
  all-reduces inside each block hold its ranks together, so they run the action at once
  (their programs are the same), and messages that serialise on one link cost every
  later boundary again what they cost the first.

So a receive over a fast link waits behind a send over a slow one that its rank posted
before, and a send waits for its receiver's stream to reach the batch holding the
receive: neither happens under gloo's rules (:mod:`.simulate`), whose play lets each
message move when its receiver's action needs it. Messages are played in the order their
two ends start running: any message found later starts no earlier, since everything not
yet played waits on some message not yet moved (the heap in :meth:`StreamPlay.run`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from zorse_lightning.errors import PlanningError
from zorse_lightning.schedule.actions import Action, ActionKind, Message
from zorse_lightning.planner.cost.compute import MicrobatchTimes
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.evaluate import PlanCost
from zorse_lightning.planner.cost.events import EventKind, TimelineEvent, message_route
from zorse_lightning.planner.cost.phases import CollectiveBackend
from zorse_lightning.schedule.p2p_batches import P2PBatch
from zorse_lightning.schedule.plan import Plan

BatchAt = tuple[int, int]
"""(rank, index of the batch in the rank's posting order)."""


@dataclass
class _Stream:
    """One rank's host and stream, as far as played."""

    batches: Sequence[P2PBatch]
    gates: list[int]
    """Per action of the rank's program: the last batch holding one of its receives (-1: none)."""
    host_ms: float = 0.0
    """When the host is free: it has ended its last action or posting."""
    ended_ms: float = 0.0
    """When the host ended its last action so far."""
    done: int = 0
    """Actions run."""
    begun_ms: list[float] = field(default_factory=list)
    """When the host began to post each batch so far, sending its activations' headers."""
    posted_ms: list[float] = field(default_factory=list)
    """When each batch posted so far was posted (its receives' headers in)."""
    started_ms: list[float] = field(default_factory=list)
    """When each batch started so far began to run."""
    completed_ms: list[float] = field(default_factory=list)
    """When each batch completed so far completed: the stream runs (or waits to start) the next."""
    unmoved: list[int] = field(default_factory=list)
    """Per batch: its messages not yet moved."""
    moved_ms: list[float] = field(default_factory=list)
    """Per batch: when its last message moved so far ended (its start until then)."""


@dataclass
class StreamPlay:
    """Every rank's program and batches played to their end under NCCL's rules (see the module's docstring);
    local to :func:`.simulate.simulate`, whose timeline gets :attr:`events`, :attr:`free_at` and
    :attr:`drained_at`."""

    ctx: CostContext
    plan: Plan
    cost: PlanCost
    programs: tuple[tuple[Action, ...], ...]
    batches: tuple[tuple[P2PBatch, ...], ...]
    events: list[TimelineEvent] = field(default_factory=list)
    free_at: list[float] = field(init=False)
    """When each rank's host ended its last action (its gradients' reductions start then)."""
    drained_at: list[float] = field(init=False)
    """When each rank's host has posted everything and its last batch completed."""
    _streams: list[_Stream] = field(init=False)
    _sender: dict[Message, BatchAt] = field(init=False)
    """The batch holding each message's send."""
    _receiver: dict[Message, BatchAt] = field(init=False)
    """The batch holding each message's receive."""
    _ready: list[tuple[float, int, Message]] = field(default_factory=list)
    """Messages whose two batches run, by when the later of the two started (then in the order found)."""
    _found: itertools.count = field(default_factory=itertools.count)
    _link_free_ms: dict[tuple, float] = field(default_factory=dict)
    _paths: dict[tuple[int, int, int], tuple[tuple[tuple, ...], float]] = field(default_factory=dict)
    _times: dict[tuple[int, int], MicrobatchTimes] = field(init=False)
    """One microbatch's forward and backward on each (working rank, stage it runs)."""
    _waiting_ms: dict[int, float] = field(default_factory=dict)
    """Ranks of a TP group whose next action could run, by when: the group runs it once all could."""

    def __post_init__(self) -> None:
        self._sender = {m: (r, k) for r, mine in enumerate(self.batches) for k, b in enumerate(mine) for m in b.sends}
        self._receiver = {m: (r, k) for r, mine in enumerate(self.batches) for k, b in enumerate(mine) for m in b.receives}
        self._streams = [
            _Stream(mine, self._gates(rank, self.programs[rank])) for rank, mine in enumerate(self.batches)
        ]
        self._times = {
            (r, index): times
            for index, (stage, stage_cost) in enumerate(zip(self.plan.stages, self.cost.stages))
            for r, times in zip(stage.ranks, stage_cost.times)
        }

    def _gates(self, rank: int, program: Sequence[Action]) -> list[int]:
        """Per action of ``program``: the last of the rank's batches that receives a message for it (-1: none).
        Read from the batches, each receive's action found by its stage, kind and microbatch: asking every action
        for its messages (:func:`~..schedule.actions.messages_of`) was a seventh of a play."""
        position = {action: index for index, action in enumerate(program)}
        gates = [-1] * len(program)
        for index, batch in enumerate(self.batches[rank]):
            for m in batch.receives:
                stage = m.boundary + 1 if m.kind is ActionKind.FORWARD else m.boundary
                gates[position[Action(stage, m.kind, m.microbatch)]] = index
        return gates

    def run(self) -> None:
        """Advance every rank as far as what is known allows, then move the message whose ends started
        first, and again, until every message has moved; raise if a rank is left short of its end."""
        waiting = set(range(len(self.programs)))
        while True:
            while waiting:
                waiting |= self._advance(waiting.pop())
            if not self._ready:
                break
            ready_ms, _, message = heapq.heappop(self._ready)
            waiting |= self._move(message, ready_ms)
        stuck = [
            r for r, s in enumerate(self._streams) if s.done < len(self.programs[r]) or len(s.completed_ms) < len(s.batches)
        ]
        if stuck:
            raise PlanningError(
                f"the play of the plan's batches under NCCL's rules stopped short (ranks {stuck}): their batches are "
                f"not those of schedule.p2p_batches.rank_batches, which play_rendezvous would have refused"
            )
        self.free_at = [s.ended_ms for s in self._streams]
        self.drained_at = [max([s.host_ms, *s.completed_ms]) for s in self._streams]

    def _advance(self, rank: int) -> set[int]:
        """Post the rank's due batches, start and complete what its stream can, run the actions whose
        receives have completed; returns the ranks this may let proceed (receivers of posted headers)."""
        stream, program = self._streams[rank], self.programs[rank]
        batches, posted, completed, gates = stream.batches, stream.posted_ms, stream.completed_ms, stream.gates
        woken: set[int] = set()
        while True:
            posting = len(posted)
            if posting < len(batches) and batches[posting].before <= stream.done:
                if len(stream.begun_ms) == posting:
                    stream.begun_ms.append(stream.host_ms)
                    woken.update(m.dst for m in batches[posting].sends if m.kind is ActionKind.FORWARD)
                posted_ms = self._posting_ms(rank, batches[posting])
                if posted_ms is None:
                    break
                stream.host_ms = posted_ms
                posted.append(posted_ms)
                self._start_batches(stream)
                continue
            if stream.done < len(program):
                gate = gates[stream.done]
                if gate >= len(completed):
                    break
                ready_ms = max(stream.host_ms, completed[gate]) if gate >= 0 else stream.host_ms
                stage = self.plan.stages[program[stream.done].stage]
                if stage.tensor_parallel == 1:
                    self._run_action(rank, ready_ms)
                    continue
                self._waiting_ms[rank] = ready_ms
                group = stage.tensor_group(rank)
                if any(peer not in self._waiting_ms for peer in group):
                    break
                start_ms = max(self._waiting_ms.pop(peer) for peer in group)
                for peer in group:
                    self._run_action(peer, start_ms)
                woken |= set(group) - {rank}
                continue
            break
        return woken

    def _posting_ms(self, rank: int, batch: P2PBatch) -> float | None:
        """When the rank's host has posted ``batch``, which it has begun: once each activation's header it
        receives has come (None while a sender has not begun to post the batch sending it)."""
        posted_ms = self._streams[rank].host_ms
        for message in batch.receives:
            if message.kind is ActionKind.FORWARD:
                sender, index = self._sender[message]
                begun = self._streams[sender].begun_ms
                if index >= len(begun):
                    return None
                posted_ms = max(posted_ms, begun[index] + self.ctx.links.header_us(message.src, message.dst) / 1000.0)
        return posted_ms

    def _run_action(self, rank: int, start_ms: float) -> None:
        stream = self._streams[rank]
        action = self.programs[rank][stream.done]
        times = self._times[(rank, action.stage)]
        forward = action.kind is ActionKind.FORWARD
        end_ms = start_ms + (times.forward_ms if forward else times.backward_ms)
        kind = EventKind.FORWARD if forward else EventKind.BACKWARD
        self.events.append(TimelineEvent(rank, kind, action.microbatch, start_ms, end_ms, action.stage))
        stream.host_ms = stream.ended_ms = end_ms
        stream.done += 1

    def _start_batches(self, stream: _Stream) -> None:
        """Start the stream's next batch where it is posted and the one before it completed; each of its
        messages whose other end runs already is ready to move."""
        index, completed = len(stream.started_ms), stream.completed_ms
        if index == len(completed) and index < len(stream.posted_ms):
            started_ms = max(stream.posted_ms[index], completed[-1] if completed else 0.0)
            stream.started_ms.append(started_ms)
            batch = stream.batches[index]
            stream.unmoved.append(len(batch.sends) + len(batch.receives))
            stream.moved_ms.append(started_ms)
            for peers, messages in ((self._receiver, batch.sends), (self._sender, batch.receives)):
                for message in messages:
                    peer, peer_index = peers[message]
                    peer_started = self._streams[peer].started_ms
                    if peer_index < len(peer_started):
                        ready_ms = max(started_ms, peer_started[peer_index])
                        heapq.heappush(self._ready, (ready_ms, next(self._found), message))

    def _move(self, message: Message, ready_ms: float) -> set[int]:
        """Move ``message`` once its link (and connection) is free; complete the batches it was the last of;
        returns its ranks."""
        held, transfer_ms = self._path(message)
        free = self._link_free_ms
        start_ms = ready_ms
        for key in held:
            start_ms = max(start_ms, free.get(key, 0.0))
        end_ms = start_ms + transfer_ms
        for key in held:
            free[key] = end_ms
        self.events.append(TimelineEvent(message.src, EventKind.SEND, message.microbatch, start_ms, end_ms, message.boundary))
        self.events.append(TimelineEvent(message.dst, EventKind.RECV, message.microbatch, start_ms, end_ms, message.boundary))
        for rank, index in (self._sender[message], self._receiver[message]):
            stream = self._streams[rank]
            stream.unmoved[index] -= 1
            stream.moved_ms[index] = max(stream.moved_ms[index], end_ms)
            if stream.unmoved[index] == 0:  # the running batch: no other has started
                stream.completed_ms.append(stream.moved_ms[index])
                self._start_batches(stream)
        return {message.src, message.dst}

    def _path(self, message: Message) -> tuple[tuple[tuple, ...], float]:
        """What ``message`` holds while it moves (its link, and its connection: :meth:`_connection`) and how long:
        :func:`.events.message_route` without the header, which posting waits for (:meth:`_posting_ms`); once
        per sender, receiver and boundary."""
        key = (message.src, message.dst, message.boundary)
        if key not in self._paths:
            route = message_route(self.ctx, self.plan, message, header=False)
            self._paths[key] = ((route.link, *self._connection(message)), route.transfer_ms)
        return self._paths[key]

    def _connection(self, message: Message) -> tuple[tuple, ...]:
        """The connection of ``message``'s two ranks where the transport has one for both directions
        (gloo's: see the module's docstring), else none."""
        if self.ctx.links.backend is CollectiveBackend.GLOO:
            return (("pair", min(message.src, message.dst), max(message.src, message.dst)),)
        return ()

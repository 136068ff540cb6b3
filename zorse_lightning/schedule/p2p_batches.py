"""What a rank posts to its peers, as data: its program's messages grouped into batches, and a play of
every rank's batches under NCCL's rules.

NCCL is stricter than gloo, which every CPU run uses. A send larger than its
buffers completes only together with the peer's matching receive; a rank's
point-to-point operations run in posting order on one stream (batched ones on
the group's own communicator, one stream per rank); operations posted as one
batch (``dist.batch_isend_irecv``) progress together and complete as a whole.
Posting one send per message in program order deadlocks 1F1B as soon as an
activation outgrows the buffers: stage 0's stream holds *send a1* ahead of
*recv g0*, stage 1's holds *send g0* ahead of *recv a1*.

So a rank posts each message together with everything that must progress
beside it, as Megatron-LM (``send_forward_recv_backward``) and torch's
pipelining schedules (``fwd_send_bwd_recv``) fuse theirs, derived from a play
of the programs in which every action starts once the messages it needs were
sent (:func:`_balanced_play`): at each instant of that play every rank posts one
batch holding the messages its action ending then sends and every message sent
to it then (received then, consumed by a later action). Every message then meets
its peer's batch of the same instant, so the batches of an instant complete once
those of the instants before did: the programs cannot deadlock, whatever their
widths, shares or interleaving, and whatever the actions' durations in the play
(:func:`rank_batches`). The engine posts exactly these batches and waits only
where an action needs what one received; :func:`play_rendezvous` plays them
under the rules above (a send completes only when the peer's batch holding the
receive runs; a batch completes as a whole; a rank's batches run in order) and
raises, naming ranks and messages, where a GPU cluster would hang. A program
that passes cannot deadlock under looser rules (one stream per pair, small
sends buffered) either: those only remove waits.

The durations only decide which messages share a batch, and so what a batch
holds its rank back for. Unit steps (the schedule's grid) would make a stage
whose ranks take half the microbatches each as quick per microbatch as the
single-GPU stage feeding it; its batches then hold the feeder's next
activation together with a gradient the wide stage sends much later, and on
one H100 feeding two (Llama 13B, 544 microbatches, NCCL's play) the step took
12275 ms where it takes 10709 with the durations below (10712 in the closed
form). So each rank's actions last the iteration over their count, as in a
balanced plan, whose ranks are all busy about as long: where every rank runs
as many actions, these are the unit steps.

Receiving in the instant a message is sent holds it on the receiver until its
action runs: as many messages as the play keeps in its channels, which for
1F1B is at most one or two per rank.

Pure Python: no torch.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from zorse_lightning.errors import PlanningError
from zorse_lightning.schedule.actions import Action, ActionKind, Message, balanced_durations, deadlock_error, messages_of
from zorse_lightning.schedule.plan import Plan


@dataclass(frozen=True)
class P2PBatch:
    """The sends and receives one rank posts together, once it has run ``before`` actions of its program
    (several batches may follow one action: steps in which the rank only receives)."""

    before: int
    sends: tuple[Message, ...]
    """What the rank's action ``before - 1`` made: activations or gradients for other ranks."""
    receives: tuple[Message, ...]
    """Messages for later actions of the rank, taken now because their senders send them now."""

    def describe(self, rank: int) -> str:
        parts = [f"send {describe_message(m)} to rank {m.dst}" for m in self.sends]
        parts += [f"receive {describe_message(m)} from rank {m.src}" for m in self.receives]
        return f"rank {rank} [{', '.join(parts)}]"


def describe_message(message: Message) -> str:
    """``message`` in words: what it carries, of which microbatch, across which boundary."""
    if message.microbatch < 0:
        return "setup message connecting the pair"
    what = "activation" if message.kind is ActionKind.FORWARD else "gradient"
    return f"{what} of microbatch {message.microbatch} (stages {message.boundary}-{message.boundary + 1})"


def rank_batches(plan: Plan, programs: Sequence[Sequence[Action]]) -> tuple[tuple[P2PBatch, ...], ...]:
    """Every rank's batches, in posting order, from the balanced play of ``programs`` (:func:`_balanced_play`).

    A rank's batch at an instant holds what its action ending then sends and what the actions ending
    then send to it (in the order of their senders' ranks); ranks without a message then post nothing."""
    ends, sent = _balanced_play(plan, programs)
    sends: list[dict[int, list[Message]]] = [{} for _ in programs]
    receives: list[dict[int, list[Message]]] = [{} for _ in programs]
    for rank in range(len(programs)):  # ranks in order: each instant's receives keep the order of their senders
        for end, messages in sent[rank]:
            sends[rank].setdefault(end, []).extend(messages)
            for message in messages:
                receives[message.dst].setdefault(end, []).append(message)
    return tuple(
        tuple(
            P2PBatch(bisect_right(ends[rank], at), tuple(sends[rank].get(at, ())), tuple(receives[rank].get(at, ())))
            for at in sorted({*sends[rank], *receives[rank]})
        )
        for rank in range(len(programs))
    )


def _balanced_play(plan: Plan, programs: Sequence[Sequence[Action]]) -> tuple[list[list[int]], list[list[tuple[int, list[Message]]]]]:
    """Each rank's actions' end times, and what each action sends with its end, in a play where an action
    starts once the rank's previous one ended and its messages were sent and sit first in their channels
    (each sender's messages to a rank are received in the order sent), and a rank's actions each last the
    iteration over their count (:func:`~.actions.balanced_durations`). Raises where a rank can never
    go on (the programs deadlock with unbounded buffers)."""
    durations = balanced_durations({rank: len(program) for rank, program in enumerate(programs) if program})
    ends: list[list[int]] = [[] for _ in programs]
    sent: list[list[tuple[int, list[Message]]]] = [[] for _ in programs]
    at: dict[Message, int] = {}
    channels: dict[tuple[int, int], deque[Message]] = {}
    blocked: dict[tuple[int, int], int] = {}
    """The rank waiting for a message on each channel: woken when one is sent on it."""
    ready = deque(range(len(programs)))
    while ready:
        rank = ready.popleft()
        program = programs[rank]
        while len(ends[rank]) < len(program):
            receives, sends = messages_of(plan, rank, program[len(ends[rank])])
            missing = next(((m.src, m.dst) for m in receives if (channels.get((m.src, m.dst)) or [None])[0] != m), None)
            if missing is not None:
                blocked[missing] = rank
                break
            start = max([ends[rank][-1] if ends[rank] else 0] + [at[m] for m in receives])
            for m in receives:
                channels[(m.src, m.dst)].popleft()
            ends[rank].append(start + durations[rank])
            if sends:
                sent[rank].append((ends[rank][-1], sends))
            for m in sends:
                at[m] = ends[rank][-1]
                channels.setdefault((m.src, m.dst), deque()).append(m)
                if (m.src, m.dst) in blocked:
                    ready.append(blocked.pop((m.src, m.dst)))
    if any(len(ends[rank]) < len(program) for rank, program in enumerate(programs)):
        raise deadlock_error(plan, programs, [len(mine) for mine in ends])
    return ends, sent


@dataclass(frozen=True)
class HostCollective:
    """A collective a rank's host issues between its actions and batches.

    Played as if it blocked the host until every member of its group had called it: what NCCL does at a
    group's first collective (making the communicator) and, in effect, at any host-device synchronisation
    while a collective's kernel waits for its peers. A program that passes with every collective blocking
    cannot hang where collectives block less."""

    ranks: tuple[int, ...]
    """The group's members; a rank's calls on one group meet the members' calls in the order issued."""
    what: str
    after_actions: int = 0
    """Issued once the rank has run this many actions of its program..."""
    after_batches: int = 0
    """... and posted this many of its batches."""
    at_end: bool = False
    """Issued after the rank's last action and batch, once its batches have completed (the step's end)."""
    reduces: tuple[int, ...] = ()
    """The stages whose gradients it sums over the stage's group: where the engine starts their buckets."""


def play_rendezvous(
    plan: Plan,
    programs: Sequence[Sequence[Action]],
    batches: Sequence[Sequence[P2PBatch]],
    collectives: Sequence[Sequence[HostCollective]] | None = None,
) -> None:
    """Play every rank's ``batches`` and ``collectives`` beside its program under NCCL's rules; raise where
    they would hang.

    Each rank's host walks one list of events: it posts a batch once the actions before it have run, runs
    an action once the batches holding its receives completed, and passes a collective once every member
    of the collective's group reached the matching call. A rank's stream runs its posted batches one at a
    time, in order; a batch completes when each of its messages met the peer's running batch holding the
    other end. Compute takes no time: the play decides what can happen, not when.
    """
    count = len(programs)
    collectives = collectives if collectives is not None else [()] * count
    gate = [_receiving_batches(plan, rank, program, batches[rank]) for rank, program in enumerate(programs)]
    events = [_host_events(len(programs[rank]), batches[rank], collectives[rank]) for rank in range(count)]
    calls = [_call_keys(mine) for mine in collectives]
    cursor = [0] * count
    """Index of the next host event of each rank."""
    done, posted, current = [0] * count, [0] * count, [0] * count
    """Actions run, batches posted, and the index of the batch each rank's stream runs (or waits to start)."""
    left: list[set[Message]] = [{*mine[0].sends, *mine[0].receives} if mine else set() for mine in batches]
    """Messages of that batch not yet met."""

    def running(rank: int) -> P2PBatch | None:
        return batches[rank][current[rank]] if current[rank] < posted[rank] else None

    def waiting_call(rank: int) -> tuple | None:
        if cursor[rank] < len(events[rank]) and events[rank][cursor[rank]][0] == "call":
            return calls[rank][events[rank][cursor[rank]][1]]
        return None

    progress = True
    while progress:
        progress = False
        for rank in range(count):
            batch = running(rank)
            if batch is not None:
                for message in list(left[rank]):
                    peer = message.dst if message.src == rank else message.src
                    if running(peer) is not None and message in left[peer]:
                        left[rank].discard(message)
                        left[peer].discard(message)
                if not left[rank]:
                    current[rank] += 1
                    if current[rank] < len(batches[rank]):
                        following = batches[rank][current[rank]]
                        left[rank] = {*following.sends, *following.receives}
                    progress = True
        for rank in range(count):
            while cursor[rank] < len(events[rank]):
                kind, index = events[rank][cursor[rank]]
                if kind == "post":
                    posted[rank] += 1
                elif kind == "action" and gate[rank][index] < current[rank]:
                    done[rank] += 1
                elif kind == "drain" and current[rank] == len(batches[rank]):
                    pass
                elif kind == "call" and all(waiting_call(member) == calls[rank][index] for member in calls[rank][index][0]):
                    for member in calls[rank][index][0]:
                        if member != rank:
                            cursor[member] += 1
                else:
                    break
                cursor[rank] += 1
                progress = True
    stuck = [rank for rank in range(count) if cursor[rank] < len(events[rank]) or current[rank] < len(batches[rank])]
    if stuck:
        raise PlanningError(
            "the schedule deadlocks under NCCL's rules (a send completes only with its matching receive; a rank's "
            "batches run in order; a collective waits for every member of its group): "
            + "; ".join(_stuck_rank(rank, programs, batches, collectives, events, cursor, done, current, left, calls) for rank in stuck)
        )


def _receiving_batches(plan: Plan, rank: int, program: Sequence[Action], batches: Sequence[P2PBatch]) -> list[int]:
    """Per action of ``program``: the last batch holding one of its receives (-1: it receives nothing)."""
    holder = {message: index for index, batch in enumerate(batches) for message in batch.receives}
    gates = []
    for action in program:
        receives = messages_of(plan, rank, action)[0]
        missing = [m for m in receives if m not in holder]
        if missing:
            raise PlanningError(f"rank {rank}'s batches never receive {describe_message(missing[0])}, which {action} needs")
        gates.append(max((holder[m] for m in receives), default=-1))
    return gates


def _host_events(actions: int, batches: Sequence[P2PBatch], collectives: Sequence[HostCollective]) -> list[tuple[str, int]]:
    """A rank's host in order: each batch posted once the actions before it ran, each action, each collective
    where its counts are reached, then (the step's end) its batches drained and the collectives issued there."""
    events: list[tuple[str, int]] = []
    ran = sent = 0
    pending = [(c.after_actions, c.after_batches, i) for i, c in enumerate(collectives) if not c.at_end]

    def calls_due() -> None:
        while pending and pending[0][0] <= ran and pending[0][1] <= sent:
            events.append(("call", pending.pop(0)[2]))

    for action in range(actions + 1):
        for index in range(sent, len(batches)):
            if batches[index].before > action:
                break
            calls_due()
            events.append(("post", index))
            sent += 1
        calls_due()
        if action < actions:
            events.append(("action", action))
            ran += 1
    while sent < len(batches):  # batches due after the last action (a rank that only receives at its end)
        calls_due()
        events.append(("post", sent))
        sent += 1
    calls_due()
    if pending:
        raise PlanningError(f"a collective after {pending[0][0]} actions and {pending[0][1]} batches lies past the rank's program")
    events.append(("drain", 0))
    events += [("call", i) for i, c in enumerate(collectives) if c.at_end]
    return events


def _call_keys(collectives: Sequence[HostCollective]) -> list[tuple[tuple[int, ...], int]]:
    """Each call as (group, how many calls on that group came before it): what the members' calls must match."""
    seen: dict[tuple[int, ...], int] = {}
    keys = []
    for collective in collectives:
        keys.append((collective.ranks, seen.get(collective.ranks, 0)))
        seen[collective.ranks] = seen.get(collective.ranks, 0) + 1
    return keys


def _stuck_rank(rank, programs, batches, collectives, events, cursor, done, current, left, calls) -> str:
    """What one stuck rank waits for: its host at a collective or an action, or its stream at a batch."""
    where = f"rank {rank}, after {done[rank]} of its {len(programs[rank])} actions"
    waits = []
    if cursor[rank] < len(events[rank]) and events[rank][cursor[rank]][0] == "call":
        index = events[rank][cursor[rank]][1]
        collective = collectives[rank][index]
        absent = [m for m in collective.ranks if m != rank and not (
            cursor[m] < len(events[m]) and events[m][cursor[m]][0] == "call" and calls[m][events[m][cursor[m]][1]] == calls[rank][index]
        )]
        waits.append(f"waits in {collective.what} over ranks {list(collective.ranks)} for rank(s) {absent} to call it")
    if current[rank] < len(batches[rank]):
        batch = batches[rank][current[rank]]
        unmet = [m for m in (*batch.sends, *batch.receives) if m in left[rank]]
        waits.append("waits to " + ", ".join(
            f"{'send' if m.src == rank else 'receive'} {describe_message(m)} "
            f"{'to' if m.src == rank else 'from'} rank {m.dst if m.src == rank else m.src}"
            for m in unmet
        ) if unmet else "waits for its host to post its next batch")
    return f"{where}, {' and '.join(waits) or 'waits for a batch holding its next receive'}"

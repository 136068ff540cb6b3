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
pipelining schedules (``fwd_send_bwd_recv``) fuse theirs, derived from the
schedule's own unit-step play (:func:`..schedule.play_in_steps`, the grid): in
each step every rank posts one batch holding the messages its action of that
step sends and every message sent to it in that step (received then, consumed
by a later action). Every message then meets its peer's batch of the same step,
so the batches of step ``t`` complete once those of the steps before did: the
programs cannot deadlock, whatever their widths, shares or interleaving
(:func:`rank_batches`). The engine posts exactly these batches and waits only
where an action needs what one received; :func:`play_rendezvous` plays them
under the rules above (a send completes only when the peer's batch holding the
receive runs; a batch completes as a whole; a rank's batches run in order) and
raises, naming ranks and messages, where a GPU cluster would hang. A program
that passes cannot deadlock under looser rules (one stream per pair, small
sends buffered) either: those only remove waits.

Receiving in the step a message is sent holds it on the receiver until its
action runs: as many messages as the unit-step play keeps in its channels,
which for 1F1B is at most one or two per rank.

Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.actions import Action, ActionKind, Message, messages_of
from zorse_lightning.planner.plan import Plan


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
    what = "activation" if message.kind is ActionKind.FORWARD else "gradient"
    return f"{what} of microbatch {message.microbatch} (stages {message.boundary}-{message.boundary + 1})"


def rank_batches(
    plan: Plan, programs: Sequence[Sequence[Action]], grid: Sequence[Sequence[Action | None]]
) -> tuple[tuple[P2PBatch, ...], ...]:
    """Every rank's batches, in posting order, from the unit-step play's ``grid`` of ``programs``.

    Step ``t``'s batch of a rank holds what its action of step ``t`` sends and what the
    actions of step ``t`` send to it; ranks without a message in a step post nothing."""
    sends: list[dict[int, list[Message]]] = [{} for _ in programs]
    receives: list[dict[int, list[Message]]] = [{} for _ in programs]
    for rank, row in enumerate(grid):  # ranks in order: each step's receives keep the order of their senders
        for step, action in enumerate(row):
            if action is not None:
                for message in messages_of(plan, rank, action)[1]:
                    sends[rank].setdefault(step, []).append(message)
                    receives[message.dst].setdefault(step, []).append(message)
    batches = []
    for rank, row in enumerate(grid):
        done = list(accumulate(action is not None for action in row))  # per step: actions run by its end
        batches.append(tuple(
            P2PBatch(done[min(step, len(done) - 1)], tuple(sends[rank].get(step, ())), tuple(receives[rank].get(step, ())))
            for step in sorted({*sends[rank], *receives[rank]})
        ))
    return tuple(batches)


def play_rendezvous(
    plan: Plan, programs: Sequence[Sequence[Action]], batches: Sequence[Sequence[P2PBatch]]
) -> None:
    """Play every rank's ``batches`` beside its program under NCCL's rules; raise where they would hang.

    A rank's stream runs its batches one at a time, in order; a batch starts once the
    actions before it have run (its sends carry their outputs) and completes when each
    of its messages met the peer's running batch holding the other end. An action runs
    once the one before it ran and the batches holding its receives completed (a batch
    that only sends keeps no action waiting). Compute takes no time: the play decides
    what can happen, not when.
    """
    gate = [_receiving_batches(plan, rank, program, batches[rank]) for rank, program in enumerate(programs)]
    done = [0] * len(programs)
    """Actions each rank has run."""
    current = [0] * len(programs)
    """Index of the batch each rank's stream runs (or waits to start)."""
    left: list[set[Message]] = [set() for _ in programs]
    """Messages of that batch not yet met."""
    for rank, mine in enumerate(batches):
        if mine:
            left[rank] = {*mine[0].sends, *mine[0].receives}

    def running(rank: int) -> P2PBatch | None:
        mine = batches[rank]
        if current[rank] < len(mine) and done[rank] >= mine[current[rank]].before:
            return mine[current[rank]]
        return None

    progress = True
    while progress:
        progress = False
        for rank in range(len(programs)):
            batch = running(rank)
            if batch is None:
                continue
            for message in list(left[rank]):
                peer = message.dst if message.src == rank else message.src
                if running(peer) is not None and message in left[peer]:
                    left[rank].discard(message)
                    left[peer].discard(message)
                    progress = True
            if not left[rank]:
                current[rank] += 1
                if current[rank] < len(batches[rank]):
                    following = batches[rank][current[rank]]
                    left[rank] = {*following.sends, *following.receives}
                progress = True
        for rank, program in enumerate(programs):
            while done[rank] < len(program) and gate[rank][done[rank]] < current[rank]:
                done[rank] += 1
                progress = True
    stuck = [rank for rank, program in enumerate(programs) if done[rank] < len(program) or current[rank] < len(batches[rank])]
    if stuck:
        raise PlanningError(
            "the schedule deadlocks under NCCL's rules (a send completes only with its matching receive; a rank's "
            f"batches run in order): {_stuck_description(batches, programs, done, current, left, stuck)}"
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


def _stuck_description(batches, programs, done, current, left, stuck) -> str:
    """Each stuck rank's running batch: the messages in it that met no peer."""
    lines = []
    for rank in stuck:
        mine = batches[rank]
        batch = mine[current[rank]]  # a rank whose batches all completed runs to its program's end
        unmet = [m for m in (*batch.sends, *batch.receives) if m in left[rank]]
        waits = ", ".join(
            f"{'send' if m.src == rank else 'receive'} {describe_message(m)} "
            f"{'to' if m.src == rank else 'from'} rank {m.dst if m.src == rank else m.src}"
            for m in unmet
        )
        lines.append(f"rank {rank}, after {done[rank]} of its {len(programs[rank])} actions, waits to {waits}")
    return "; ".join(lines)

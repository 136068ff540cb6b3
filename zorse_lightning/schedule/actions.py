"""The vocabulary of schedules: actions (a forward or backward of one microbatch on one stage) and the
messages between ranks around them, routed by which rank of each stage owns a microbatch.

Pure Python: no torch. :mod:`.schedule` orders actions into programs; :mod:`.p2p_batches` groups their
messages into what the engine posts together.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from math import lcm
from typing import NamedTuple

from zorse_lightning.errors import PlanningError
from zorse_lightning.schedule.plan import Plan, StagePlan


class ActionKind(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"


class Action(NamedTuple):
    """One unit of work: forward or backward of one microbatch on one stage. A named tuple, as :class:`Message`:
    the planner's recordings and plays make, hash and compare millions of them (a frozen dataclass took three
    times as long for each), and the engine one per action and message of every step."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``"1F3"`` is stage 1, forward, microbatch 3."""
        for kind in ActionKind:
            stage, sep, microbatch = text.partition(kind.value)
            if sep and stage.isdigit() and microbatch.isdigit():
                return cls(int(stage), kind, int(microbatch))
        raise ValueError(f"cannot parse action {text!r}; expected <stage><F|B><microbatch>, e.g. '1F3'")


class Message(NamedTuple):
    """A point-to-point transfer the executor performs around an action."""

    src: int
    dst: int
    kind: ActionKind
    """FORWARD: an activation; BACKWARD: the gradient of one."""
    microbatch: int
    boundary: int
    """The boundary crossed: between stage ``boundary`` and ``boundary + 1`` (interleaved
    groups send several boundaries' messages over one channel)."""


def balanced_durations(actions: dict[int, int]) -> dict[int, int]:
    """How long each rank's actions last in a balanced plan, whose ranks are all busy about as long: the
    iteration over the rank's count of ``actions``, in units of ``1 / lcm`` of the counts (exact integers; 1
    where every rank runs as many). The plays that record 1F1B's order and the point-to-point batches use it."""
    span = lcm(*actions.values()) if actions else 1
    return {rank: span // count for rank, count in actions.items()}


def messages_of(plan: Plan, rank: int, action: Action) -> tuple[list[Message], list[Message]]:
    """(receives before, sends after) the action on ``rank``, routed by microbatch ownership.

    Every rank of a TP group holds the whole activation. Between stages of TP degrees ``a`` and ``b``, TP rank
    ``q`` of the receiving replica takes the activation from TP rank ``q mod a`` of the sending one, and TP rank
    ``p`` of the sending replica takes the gradient from TP rank ``p mod b`` of the receiving one: each rank
    receives one message, and sends to every rank its index feeds (none, one, or several)."""
    last = len(plan.stages) - 1
    j, s, kind = action.microbatch, action.stage, action.kind
    mine = plan.stages[s]
    degree = mine.tensor_parallel
    index = mine.tensor_index(rank) if degree > 1 else 0
    if kind is ActionKind.FORWARD:
        recv = [Message(_source(plan.stages[s - 1], j, index), rank, kind, j, s - 1)] if s > 0 else []
        send = [Message(rank, dst, kind, j, s) for dst in _targets(plan.stages[s + 1], j, index, degree)] if s < last else []
    else:
        recv = [Message(_source(plan.stages[s + 1], j, index), rank, kind, j, s)] if s < last else []
        send = [Message(rank, dst, kind, j, s - 1) for dst in _targets(plan.stages[s - 1], j, index, degree)] if s > 0 else []
    return recv, send


def deadlock_error(plan: Plan, programs: Sequence[Sequence[Action]], done: Sequence[int]) -> PlanningError:
    """The error of programs that cannot go on with unbounded buffers: each rank with actions left (``done[rank]``
    of them run), at the action it waits at, and the messages that action waits for."""
    waiting = [
        f"rank {rank} at {program[done[rank]]} waits for {[str(m) for m in messages_of(plan, rank, program[done[rank]])[0]]}"
        for rank, program in enumerate(programs) if done[rank] < len(program)
    ]
    return PlanningError("schedule deadlocks: " + "; ".join(waiting))


def _source(other: StagePlan, microbatch: int, index: int) -> int:
    """The rank of ``other`` (a neighbouring stage) that TP index ``index`` receives ``microbatch``'s message from."""
    if other.tensor_parallel == 1:
        return other.rank_of_microbatch(microbatch)
    return other.peer_of_microbatch(microbatch, index % other.tensor_parallel)


def _targets(other: StagePlan, microbatch: int, index: int, degree: int) -> list[int]:
    """The ranks of ``other`` that TP index ``index`` of a stage of ``degree`` sends ``microbatch``'s message to."""
    if other.tensor_parallel == 1:
        return [other.rank_of_microbatch(microbatch)] if index == 0 else []
    return [other.peer_of_microbatch(microbatch, q) for q in range(index, other.tensor_parallel, degree)]

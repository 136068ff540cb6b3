"""NCCL's rules kept on gloo, so that a CPU run fails where a GPU cluster would hang.

On gloo a send returns at once, whatever the receiver does. On NCCL a rank's
batches run one at a time on its stream, and a send completes only together
with the peer's matching receive. ``ZORSE_P2P_RULES=nccl`` makes every gloo
run keep those rules: a worker thread per rank plays the stream (it takes the
rank's batches in posting order, one at a time), and each receive it posts is
announced to the sender by a small acknowledgement on a tag of its own; a batch
completes when its receives have arrived and every one of its sends has been
acknowledged.

NCCL is also lazy, and its laziness blocks hosts, which gloo's never does. A
group's communicator is made at its first collective (Lightning initialises the
default group without ``device_id``), and making it blocks the host of each
member until every member has called it; a direction's first batched message
connects the pair inside ``ncclGroupEnd``, on the host of both ends. The rules
mode keeps both (:class:`LazyCommunicators`, and :meth:`RendezvousStream.post`):
the host meets its peers through the store, the way NCCL's unique id travels.

Whatever waits longer than ``ZORSE_P2P_RULES_TIMEOUT_S`` (default 60 s) raises
:class:`P2PRulesError`, naming the rank, what it waits in and the peers that
never met it. On NCCL the rules are the real ones, and nothing is emulated.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zorse_lightning.schedule.actions import Message
from zorse_lightning.schedule.p2p_batches import P2PBatch, describe_message

RULES_ENV = "ZORSE_P2P_RULES"
TIMEOUT_ENV = "ZORSE_P2P_RULES_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
DATA_TAG = 2
ACK_TAG = 3
"""Tags of their own: the worker's messages never match the headers or collectives of the main thread."""


class P2PRulesError(RuntimeError):
    """A batch that would wait forever under NCCL's rules."""


def rules_from_environment(group: Any = None) -> bool:
    """Whether messages over ``group`` (None: the default group) keep NCCL's rules on gloo
    (``ZORSE_P2P_RULES=nccl``); on NCCL they hold anyway."""
    value = os.environ.get(RULES_ENV, "").strip().lower()
    if value not in ("", "gloo", "nccl"):
        raise ValueError(
            f"{RULES_ENV}={os.environ[RULES_ENV]!r} is not a rule set; use 'nccl' (gloo runs keep NCCL's "
            f"point-to-point rules) or leave it unset (gloo's own)"
        )
    return value == "nccl" and dist.get_backend(group) == "gloo"


def _timeout_s() -> float:
    text = os.environ.get(TIMEOUT_ENV, "")
    try:
        timeout_s = float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        timeout_s = -1.0
    if timeout_s <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r} must be a positive number of seconds (default {DEFAULT_TIMEOUT_S})")
    return timeout_s


@dataclass
class _Posted:
    batch: P2PBatch
    sends: Sequence[tuple[Message, torch.Tensor]]
    receives: Sequence[tuple[Message, torch.Tensor]]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def _meet(key: str, members: Sequence[int], timeout_s: float, describe: Callable[[list[int]], str]) -> None:
    """Block this host until every one of ``members`` has reached ``key`` (a rendezvous through the default
    group's store, which outlives groups: a key once met stays met); raise ``describe(absent ranks)`` after
    ``timeout_s``."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{key}/{dist.get_rank()}", "1")
    keys = [f"{key}/{member}" for member in members]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as error:  # DistStoreError: a timeout
        absent = [member for member, one in zip(members, keys) if not store.check([one])]
        raise P2PRulesError(describe(absent)) from error


class LazyCommunicators:
    """NCCL's lazy communicators kept on gloo: a group's first collective blocks each member's host until
    every member has called it. Inert unless the rules mode is on."""

    def __init__(self) -> None:
        self.enabled = rules_from_environment()
        self.timeout_s = _timeout_s() if self.enabled else 0.0
        self._made: set[str] = set()
        """Groups this rank met its peers in (the store remembers for every rank; this only saves asking)."""

    def call(self, group: Any, what: str) -> Any:
        """``group`` (None: the default one), for the collective ``what`` this rank is about to issue on it."""
        if not self.enabled:
            return group
        name = dist.distributed_c10d._get_process_group_name(group if group is not None else dist.group.WORLD)
        if name not in self._made:
            members = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            rank = dist.get_rank()
            _meet(
                f"zorse/communicator/{name}", members, self.timeout_s,
                lambda absent: (
                    f"under NCCL's lazy rules this run would hang: rank {rank}'s first collective on group {name} "
                    f"(ranks {members}), {what}, makes the group's communicator, which blocks the host of every member "
                    f"until all have called it; after {self.timeout_s:g} s rank(s) {absent} had not. Make every "
                    f"communicator at setup, in one order on every rank (engine.communicators)"
                ),
            )
            self._made.add(name)
        return group


class RendezvousStream:
    """One rank's stream under NCCL's rules: batches run one at a time, in posting order, on a worker thread;
    a direction's first batch blocks the host until the peer posts the other end."""

    def __init__(self, group: Any = None) -> None:
        """``group``: the group of the messages (None: the default one)."""
        self.group = group
        self.rank = dist.get_rank()
        self.timeout_s = _timeout_s()
        self._name = dist.distributed_c10d._get_process_group_name(group if group is not None else dist.group.WORLD)
        self._connected: set[tuple[int, int]] = set()
        self._queue: queue.Queue[_Posted] = queue.Queue()
        self._failed: BaseException | None = None
        threading.Thread(target=self._run, name=f"zorse-p2p-rules-{self.rank}", daemon=True).start()

    def post(
        self, batch: P2PBatch, sends: Sequence[tuple[Message, torch.Tensor]], receives: Sequence[tuple[Message, torch.Tensor]]
    ) -> Callable[[], None]:
        """Queue ``batch`` behind those posted before, once each direction it opens is connected; returns a
        wait that raises the batch's error, if any."""
        for message in sorted({*batch.sends, *batch.receives}, key=lambda m: (m.src, m.dst)):
            self._connect(message, batch)
        posted = _Posted(batch, sends, receives)
        self._queue.put(posted)

        def wait() -> None:
            posted.done.wait()
            if posted.error is not None:
                raise posted.error

        return wait

    def _connect(self, message: Message, batch: P2PBatch) -> None:
        """The first batch holding a direction connects its two ranks inside ``ncclGroupEnd``, on both hosts."""
        direction = (message.src, message.dst)
        if direction in self._connected:
            return
        peer = message.dst if message.src == self.rank else message.src
        _meet(
            f"zorse/connection/{self._name}/{message.src}-{message.dst}", direction, self.timeout_s,
            lambda absent: (
                f"under NCCL's lazy rules this run would hang: {batch.describe(self.rank)} is the first batch from "
                f"rank {message.src} to rank {message.dst}, whose connection is made inside ncclGroupEnd on both hosts; "
                f"after {self.timeout_s:g} s rank {peer} had not posted its batch holding the {describe_message(message)}. "
                f"Connect every direction at setup, pair by pair in one order (engine.communicators)"
            ),
        )
        self._connected.add(direction)

    def _run(self) -> None:
        while True:
            posted = self._queue.get()
            try:
                if self._failed is not None:
                    raise P2PRulesError(f"{posted.batch.describe(self.rank)} never ran: {self._failed}")
                self._rendezvous(posted)
            except BaseException as error:  # handed to the waiting host, never lost in the thread
                self._failed = self._failed or error
                posted.error = error
            posted.done.set()

    def _rendezvous(self, posted: _Posted) -> None:
        waits: list[tuple[Message | None, dist.Work]] = []
        keep = []
        for message, tensor in posted.receives:
            token = torch.ones(1)
            keep.append(token)
            waits.append((message, dist.irecv(tensor, message.src, self.group, DATA_TAG)))
            waits.append((None, dist.isend(token, message.src, self.group, ACK_TAG)))  # "my receive is posted"
        for message, tensor in posted.sends:
            acknowledgement = torch.empty(1)
            keep.append(acknowledgement)
            waits.append((None, dist.isend(tensor, message.dst, self.group, DATA_TAG)))
            waits.append((message, dist.irecv(acknowledgement, message.dst, self.group, ACK_TAG)))  # the receiver's notice
        deadline = time.monotonic() + self.timeout_s
        for index, (_, work) in enumerate(waits):
            try:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError as error:
                unmet = [m for m, w in waits[index:] if m is not None and not w.is_completed()]
                raise P2PRulesError(self._describe(posted.batch, unmet)) from error

    def _describe(self, batch: P2PBatch, unmet: list[Message]) -> str:
        waits = "; ".join(
            f"its send of the {describe_message(m)} to rank {m.dst}: rank {m.dst} has not posted the matching receive"
            if m.src == self.rank
            else f"its receive of the {describe_message(m)} from rank {m.src}: rank {m.src} has not posted the send"
            for m in unmet
        )
        return (
            f"under NCCL's point-to-point rules this run would hang: {batch.describe(self.rank)} waited "
            f"{self.timeout_s:g} s for {waits}. A send completes only together with its peer's matching receive, "
            f"and a rank's batches run in order; the schedule's batches (schedule.p2p_batches) keep these rules"
        )

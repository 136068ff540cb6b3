"""Every communicator and connection a plan uses, made at setup in one order every rank agrees on.

NCCL is lazy, and its laziness blocks hosts. Lightning initialises the default
group without ``device_id``, so a group's NCCL communicator is made at its first
collective, blocking the host of every member until all have called it (torch
2.3 and later split new groups eagerly only from a default group bound to a
device); a direction's first batched message connects its pair inside
``ncclGroupEnd``, on both hosts; and since NCCL 2.22 (``NCCL_RUNTIME_CONNECT=1``,
its default) a collective algorithm connects the first time it runs. Inside a
step any of these can hold a host that a peer waits for. So before the first
step, :func:`make_communicators`:

1. runs each group's first collective, group after group in the order every
   rank made them (a rank skips the groups it is not in): the members of the
   first group not yet done have all done the ones before it, so the sequence
   cannot deadlock. On NCCL it runs at one element and at a gradient bucket's
   size, the two ends of the sizes a step reduces, so that the algorithms NCCL
   picks for them (tree for small messages, ring for large ones, which
   reduce, broadcast and gather use too) connect here. ``NCCL_RUNTIME_CONNECT=0``
   would connect every algorithm at once, but costs about 0.5 GiB more per
   communicator (measured on an H200, NCCL 2.28: 900 MiB against 388 per
   communicator after the first): left to the user, who may set it;
2. posts one small batch on the pipeline group for every pair of ranks the
   schedule's messages join, pair after pair in one order, holding each
   direction the schedule uses: each direction is connected before a step needs
   it, by the same argument.

gloo needs neither (its groups connect when made); the rules mode
(``ZORSE_P2P_RULES=nccl``) plays both rules on gloo, so a CPU run that skipped
them fails where a GPU cluster would hang.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zorse_lightning.engine.groups import StageGroups
from zorse_lightning.engine.p2p import Transport
from zorse_lightning.schedule.actions import ActionKind, Message
from zorse_lightning.schedule.p2p_batches import P2PBatch
from zorse_lightning.schedule.programs import PipelineSchedule

CONNECTION = -1
"""The microbatch of a setup message: it carries no microbatch's data."""


def make_communicators(
    groups: StageGroups, transport: Transport, schedule: PipelineSchedule, device: torch.device, bucket_elements: int
) -> None:
    """Make every group's communicator and connect every direction of the pipeline's messages (collective:
    every rank calls it, in the same place)."""
    sizes = (1, bucket_elements) if dist.get_backend() == "nccl" else (1,)
    for ranks, group in groups.in_order:
        if group is None:
            continue
        what = f"setup's first collective over ranks {list(ranks)}"
        for size in sizes:
            dist.all_reduce(torch.zeros(size, device=device), group=groups.call(group, what))
    used = {(m.src, m.dst) for mine in schedule.batches for b in mine for m in (*b.sends, *b.receives)}
    for pair in sorted({(min(src, dst), max(src, dst)) for src, dst in used}):
        if groups.rank in pair:
            _connect(groups.rank, [d for d in (pair, pair[::-1]) if d in used], transport, device)
    transport.finish()


def _connect(rank: int, directions: list[tuple[int, int]], transport: Transport, device: torch.device) -> None:
    """One batch between two ranks, holding each of the ``directions`` their messages take."""
    messages = [Message(src, dst, ActionKind.BACKWARD, CONNECTION, CONNECTION) for src, dst in directions]
    sends = tuple(m for m in messages if m.src == rank)
    receives = tuple(m for m in messages if m.dst == rank)
    one = torch.zeros(1, device=device)
    for message in sends:
        transport.stage(message, one)
    transport.post(P2PBatch(0, sends, receives), lambda message: one)
    for message in receives:
        transport.take(message)

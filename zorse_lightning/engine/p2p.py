"""Point-to-point transfers between stages, posted as the schedule's batches.

The schedule says what a rank posts together (:mod:`..schedule.p2p_batches`):
each batch is one ``dist.batch_isend_irecv``, so its sends and receives
progress together, and batches run in order. Under NCCL, batched operations run
on the group's own communicator (the engine's pipeline group, made and used once at setup)
rather than on a communicator per pair, which NCCL would make at the pair's
first message, blocking until the peer joins. The host waits only where an
action needs what a batch received; sends complete by the end of the step.

An activation is preceded by a small header (dtype and shape) so that nothing
is fixed at the first step: microbatches of different lengths or shapes pass.
The header is a host tensor sent over a group for host tensors (gloo): built
from the shape the sender knows and read by the receiver on the host, it never
makes either host wait for its device (a header on the GPU would: reading it is
a device-to-host copy behind everything queued). A gradient has the shape of
the activation it belongs to, which both sides know, so it travels without
header. Every tensor travels as contiguous bytes and is received into a
contiguous buffer made from shape and dtype alone: a buffer that copied an
output's strides (``channels_last``) would read those bytes permuted, silently
under NCCL, which accepts such a buffer for point-to-point (gloo refuses it).

gloo forgives what NCCL does not (its sends never wait for the receiver). With
``ZORSE_P2P_RULES=nccl`` in the environment, a gloo run keeps NCCL's rules
instead (:mod:`.p2p_rules`), so that a CPU test fails where a GPU cluster would
hang.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zorse_lightning.engine.p2p_rules import RendezvousStream, rules_from_environment
from zorse_lightning.schedule.actions import ActionKind, Message
from zorse_lightning.schedule.p2p_batches import P2PBatch

MAX_DIMS = 8
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
HEADER_TAG = 1
"""Headers go on their own tag: where the host group is also the data's (gloo), the two never interleave."""


class Transport:
    """One rank's posting of its batches during a step: what it sends is handed in by :meth:`stage`, what
    it receives taken by :meth:`take` (waiting for that batch only)."""

    def __init__(self, device: torch.device, group: Any = None, host_group: Any = None) -> None:
        """``group``: the group of the messages (None: the default one); ``host_group``: a gloo group over all
        ranks for the headers (None: ``group``, which is then gloo)."""
        self.device = device
        self.group = group
        self.host_group = host_group if host_group is not None else group
        self._outbox: dict[Message, torch.Tensor] = {}
        self._inbox: dict[Message, tuple[torch.Tensor, Callable[[], None]]] = {}
        self._pending: list[tuple[Callable[[], None], list[torch.Tensor]]] = []
        self._stream = RendezvousStream(group) if rules_from_environment(group) else None

    def stage(self, message: Message, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` (an activation or a gradient this rank made) until its batch is posted."""
        if message.kind is ActionKind.FORWARD:
            _check_sendable(tensor)
        self._outbox[message] = tensor.detach().contiguous()

    def post(self, batch: P2PBatch, gradient_like: Callable[[Message], torch.Tensor]) -> None:
        """Post ``batch``: its headers at once, its tensors as one batch. ``gradient_like(message)``: a tensor
        of the shape of the gradient ``message`` brings (the output it belongs to)."""
        sends = [(m, self._outbox.pop(m)) for m in batch.sends]
        for message, tensor in sends:
            if message.kind is ActionKind.FORWARD:
                header = _header(tensor)
                self._pending.append((_once([dist.isend(header, message.dst, self.host_group, HEADER_TAG)]), [header]))
        receives = [
            (m, self._recv_header(m.src) if m.kind is ActionKind.FORWARD else self._buffer_like(gradient_like(m)))
            for m in batch.receives
        ]
        wait = self._post(batch, sends, receives)
        for message, tensor in receives:
            self._inbox[message] = (tensor, wait)
        self._pending.append((wait, [t for _, t in sends]))

    def _post(self, batch: P2PBatch, sends, receives) -> Callable[[], None]:
        if self._stream is not None:
            return self._stream.post(batch, sends, receives)
        ops = [dist.P2POp(dist.isend, tensor, message.dst, self.group) for message, tensor in sends]
        ops += [dist.P2POp(dist.irecv, tensor, message.src, self.group) for message, tensor in receives]
        return _once(dist.batch_isend_irecv(ops))

    def _recv_header(self, src: int) -> torch.Tensor:
        header = torch.empty(2 + MAX_DIMS, dtype=torch.int64)
        dist.recv(header, src, group=self.host_group, tag=HEADER_TAG)
        fields = header.tolist()  # a host tensor: nothing waits for a device
        dtype, ndim = _DTYPES[fields[0]], fields[1]
        return torch.empty(tuple(fields[2 : 2 + ndim]), dtype=dtype, device=self.device)

    def _buffer_like(self, output: torch.Tensor) -> torch.Tensor:
        """A contiguous buffer of ``output``'s shape and dtype, whatever its strides: the sender sends the
        gradient's contiguous bytes (:meth:`stage`)."""
        return torch.empty(output.shape, dtype=output.dtype, device=self.device)

    def take(self, message: Message) -> torch.Tensor:
        """What ``message`` brought, once its batch has completed."""
        tensor, wait = self._inbox.pop(message)
        wait()
        return tensor

    def finish(self) -> None:
        """Wait for every batch of the step (the sends' tensors are kept alive until then)."""
        if self._outbox or self._inbox:
            left = [*self._outbox, *self._inbox]
            raise RuntimeError(f"the step ended with {len(left)} messages neither posted nor taken, first {left[0]}")
        for wait, _ in self._pending:
            wait()
        self._pending.clear()


def _once(works: list[dist.Work]) -> Callable[[], None]:
    """A wait for ``works`` that may be called again: a batch is waited for by each message taken from it
    and at the step's end, and gloo's ``Work.wait`` of a receive waits for another message when repeated."""
    left = list(works)

    def wait() -> None:
        while left:
            left[0].wait()
            left.pop(0)

    return wait


def _check_sendable(tensor: torch.Tensor) -> None:
    if tensor.dim() > MAX_DIMS or tensor.dtype not in _DTYPES:
        raise ValueError(
            f"cannot send a {tensor.dtype} activation of {tensor.dim()} dims between stages; supported: "
            f"up to {MAX_DIMS} dims of {[str(d) for d in _DTYPES]}"
        )


def _header(tensor: torch.Tensor) -> torch.Tensor:
    shape = list(tensor.shape)
    return torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *shape, *[0] * (MAX_DIMS - len(shape))])


def post_batches(
    transport: Transport, batches: Sequence[P2PBatch], ran: int, gradient_like: Callable[[Message], torch.Tensor]
) -> Sequence[P2PBatch]:
    """Post the leading ``batches`` due once ``ran`` actions have run; returns those still to post."""
    posted = 0
    while posted < len(batches) and batches[posted].before <= ran:
        transport.post(batches[posted], gradient_like)
        posted += 1
    return batches[posted:]

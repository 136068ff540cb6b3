"""Point-to-point transfers of activations and their gradients, of any shape.

An activation is preceded by a small header (dtype and shape) so that nothing
is fixed at the first step: microbatches of different lengths or shapes pass.
The header is a host tensor sent over a group for host tensors (gloo): built
from the shape the sender knows and read by the receiver on the host, it never
makes either host wait for its device (a header on the GPU would: reading it is
a device-to-host copy behind everything queued). A gradient has the shape of
the activation it belongs to, which both sides know, so it travels without
header. Sends are asynchronous; their handles are kept (with the tensors)
until :meth:`Transport.wait_sends`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

MAX_DIMS = 8
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)


class Transport:
    def __init__(self, device: torch.device, host_group: Any = None) -> None:
        """``host_group``: a gloo group over all ranks for the headers (None: the default group, where it is gloo)."""
        self.device = device
        self.host_group = host_group
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _isend(self, tensor: torch.Tensor, dst: int, group: Any = None) -> None:
        self._pending.append((dist.isend(tensor, dst, group=group), tensor))

    def send_activation(self, tensor: torch.Tensor, dst: int) -> None:
        if tensor.dim() > MAX_DIMS or tensor.dtype not in _DTYPES:
            raise ValueError(
                f"cannot send a {tensor.dtype} activation of {tensor.dim()} dims between stages; supported: "
                f"up to {MAX_DIMS} dims of {[str(d) for d in _DTYPES]}"
            )
        shape = list(tensor.shape)
        header = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *shape, *[0] * (MAX_DIMS - len(shape))])
        self._isend(header, dst, self.host_group)
        self._isend(tensor.detach().contiguous(), dst)

    def recv_activation(self, src: int) -> torch.Tensor:
        header = torch.empty(2 + MAX_DIMS, dtype=torch.int64)
        dist.recv(header, src, group=self.host_group)
        fields = header.tolist()  # a host tensor: nothing waits for a device
        dtype, ndim = _DTYPES[fields[0]], fields[1]
        tensor = torch.empty(tuple(fields[2 : 2 + ndim]), dtype=dtype, device=self.device)
        dist.recv(tensor, src)
        return tensor

    def send_gradient(self, gradient: torch.Tensor, dst: int) -> None:
        self._isend(gradient.detach().contiguous(), dst)

    def recv_gradient(self, like: torch.Tensor, src: int) -> torch.Tensor:
        gradient = torch.empty_like(like)
        dist.recv(gradient, src)
        return gradient

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

"""Gradients of a plan equal to those of the whole global batch on one device.

Each microbatch's loss (a mean over its samples) is scaled by
``microbatch_size / global_batch_size`` before backward, so summing the local
gradients over all ranks that hold a weight gives the global-batch mean. The
sum runs over the group of the stages that hold the weight: a stage's own
group for its blocks, first and last stage for a tied embedding.

The sum over a stage's own group can overlap the step, as DDP's does. As DDP's
``gradient_as_bucket_view``, the gradients are views into one persistent flat
buffer per dtype, cut into buckets, so a bucket is reduced in place: no
concatenation, no copy back. A stage of one rank has nothing to sum its own
weights over: no buffer, no hook, no collective. Where the reductions start is
the schedule's (:mod:`..schedule.step_collectives`): in a pipeline, once the rank
has posted the batch carrying its last gradient (started earlier, a reduction
can hold the host of a replica whose peer waits for that gradient's effects
upstream), overlapping the pipeline's drain; in a plan without stages to pass
between, during the last backward, each bucket as soon as every gradient in it
is final.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zorse_lightning.engine.groups import StageGroups
from zorse_lightning.engine.tensor_parallel import as_gradient, is_split, local


def _sorted_sets(sets) -> list[frozenset[int]]:
    """One order on every rank, so collectives over overlapping groups cannot cross."""
    return sorted(sets, key=lambda s: (len(s), sorted(s)))


BUCKET_BYTES = 4 * 1024 * 1024
"""Gradient bytes per asynchronous all-reduce: small enough that the reduction of the last layers
overlaps the backward of the first ones, large enough that per-call latency stays small."""


def _flat_gradients(bucket: Sequence[nn.Parameter]) -> torch.Tensor:
    """The bucket's gradients in one tensor (zeros for a parameter that got none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])


def _unflatten_into_gradients(flat: torch.Tensor, bucket: Sequence[nn.Parameter]) -> None:
    offset = 0
    for param in bucket:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        param.grad.copy_(flat[offset : offset + param.numel()].view_as(param))
        offset += param.numel()


def _by_holders(params: list[tuple[nn.Parameter, frozenset[int]]]) -> dict[frozenset[int], list[nn.Parameter]]:
    by_holders: dict[frozenset[int], list[nn.Parameter]] = defaultdict(list)
    for param, holders in params:
        by_holders[holders].append(param)
    return by_holders


@dataclass(frozen=True)
class _Bucket:
    """Parameters of one dtype whose gradients are one slice of the flat buffer of that dtype."""

    params: tuple[nn.Parameter, ...]
    flat: torch.Tensor
    views: tuple[torch.Tensor, ...]
    """Each parameter's gradient (this rank's part of a split one) as a view into ``flat``."""

    def adopt_gradients(self) -> None:
        """Make every gradient its view into the buffer, keeping its value: copied in where autograd made a new
        tensor (gradients accumulated before the buffer was used), zero where the parameter has none (one
        fill of the bucket when none has any, as at each step's start)."""
        if all(param.grad is None for param in self.params):
            self.flat.zero_()
            for param, view in zip(self.params, self.views):
                param.grad = as_gradient(param, view)
            return
        for param, view in zip(self.params, self.views):
            grad = param.grad
            if grad is None:
                view.zero_()
            elif local(grad).data_ptr() != view.data_ptr():
                view.copy_(local(grad))
            param.grad = as_gradient(param, view)


def _buckets(params: list[nn.Parameter], bucket_bytes: int, device: torch.device) -> list[_Bucket]:
    """``params`` in buckets of about ``bucket_bytes``, last parameters first (the order backward produces
    them), each bucket a slice of one flat buffer per dtype."""
    chunks: list[list[nn.Parameter]] = []
    size = bucket_bytes
    for param in reversed(params):
        nbytes = local(param).numel() * param.element_size()
        if not chunks or (size + nbytes > bucket_bytes and size > 0) or chunks[-1][-1].dtype != param.dtype:
            chunks.append([])
            size = 0
        chunks[-1].append(param)
        size += nbytes
    totals: dict[torch.dtype, int] = defaultdict(int)
    for chunk in chunks:
        totals[chunk[0].dtype] += sum(local(p).numel() for p in chunk)
    buffers = {dtype: torch.zeros(n, dtype=dtype, device=device) for dtype, n in totals.items()}
    offsets: dict[torch.dtype, int] = defaultdict(int)
    buckets = []
    for chunk in chunks:
        dtype = chunk[0].dtype
        start = offsets[dtype]
        flat = buffers[dtype][start : start + sum(local(p).numel() for p in chunk)]
        views, at = [], 0
        for param in chunk:
            views.append(flat[at : at + local(param).numel()].view_as(local(param)))
            at += local(param).numel()
        offsets[dtype] = start + flat.numel()
        buckets.append(_Bucket(tuple(chunk), flat, tuple(views)))
    return buckets


class OverlappedReduction:
    """Sums each local parameter's gradient over the ranks of the stages holding it, in place (a frozen one has
    none: left out); the stage-group part may start before :meth:`finish`.

    Gradients only the rank's own stage holds are views into a flat buffer cut into buckets of about
    :data:`BUCKET_BYTES`, last parameters first (the order backward produces them); a stage of one rank
    has none. :meth:`prepare_step` makes the gradients those views before a run whose gradients are the
    step's final ones, so autograd accumulates straight into the buffer. :meth:`start_all` starts every
    bucket's all-reduce asynchronously (a pipelined rank, at the schedule's point). :meth:`arm`, called
    before the last backward of a plan without pipeline messages, has a hook mark each parameter whose
    gradient has accumulated and start each bucket whose gradients are all final. Either way buckets start
    in bucket order only (every rank of the stage issues the same collectives in the same order, whatever
    order its hooks fire in). :meth:`finish` starts the buckets not started yet, waits for all of them,
    then reduces the weights shared with other stages (per set of stages, in one order on every rank: summed
    on each machine, exchanged once between machines, broadcast back). Without either, :meth:`finish` alone is the plain reduction after backward.
    """

    def __init__(
        self, params: list[tuple[nn.Parameter, frozenset[int]]], groups: StageGroups,
        bucket_bytes: int = BUCKET_BYTES, device: torch.device | None = None,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes!r} must be positive (default {BUCKET_BYTES})")
        self.groups = groups
        by_holders = _by_holders([(p, holders) for p, holders in params if p.requires_grad])  # frozen: no gradient
        own = frozenset({groups.stage_index})
        self.shared = [(holders, by_holders[holders]) for holders in _sorted_sets(by_holders) if holders != own]
        alone = groups.is_idle or len(groups.data_ranks) == 1
        own_params = [] if alone else by_holders.get(own, [])
        place = device if device is not None else (own_params[0].device if own_params else torch.device("cpu"))
        self.buckets: list[_Bucket] = _buckets(own_params, bucket_bytes, place) if own_params else []
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket.params}
        self._waiting: list[int] = []
        self._handles: list = []
        self._in_flight: list[dist.Work] = []

    @property
    def started(self) -> int:
        """Buckets whose all-reduce has started this step."""
        return len(self._in_flight)

    def prepare_step(self) -> None:
        """Before a run whose gradients are the step's final ones: gradients become views into the buffer
        (zeroed where there were none), so that autograd accumulates into it and nothing is copied at reduction."""
        for bucket in self.buckets:
            bucket.adopt_gradients()

    def arm(self) -> None:
        """From now on, the next accumulated gradient of each parameter is its final one for this step: start
        each bucket as soon as all of its are."""
        if not self.buckets:
            return
        self._forget_unfinished()
        self._waiting = [len(bucket.params) for bucket in self.buckets]
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulated) for b in self.buckets for p in b.params]

    def start_all(self) -> None:
        """Start every bucket's all-reduce now: the run's gradients are all final."""
        self._forget_unfinished()
        while self.started < len(self.buckets):
            self._start(self.started)

    def _forget_unfinished(self) -> None:
        """A step that never reached :meth:`finish` (it failed): its sums are dropped."""
        self._disarm()
        for work in self._in_flight:
            work.wait()
        self._in_flight = []

    def _accumulated(self, param: nn.Parameter) -> None:
        self._waiting[self._bucket_of[id(param)]] -= 1
        self._start_ready()

    def _start_ready(self) -> None:
        while self.started < len(self.buckets) and self._waiting[self.started] <= 0:
            self._start(self.started)

    def _start(self, index: int) -> None:
        bucket = self.buckets[index]
        bucket.adopt_gradients()
        group = self.groups.call(self.groups.data_group, "the stage's gradient reduction")
        self._in_flight.append(dist.all_reduce(bucket.flat, group=group, async_op=True))

    def _disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def finish(self) -> None:
        """Complete this step's reduction (whether or not :meth:`arm` was called); ready for the next step."""
        self._disarm()
        while self.started < len(self.buckets):
            self._start(self.started)
        for work in self._in_flight:
            work.wait()
        self._in_flight = []
        for holders, params in self.shared:
            flat = _flat_gradients(params)
            self._reduce_shared(holders, flat)
            _unflatten_into_gradients(flat, params)

    def _reduce_shared(self, holders: frozenset[int], flat: torch.Tensor) -> None:
        """Sum ``flat`` (the gradients of weights ``holders`` share) over every rank holding them, in place:
        into the representative of the rank's machine, between the machines' representatives, back out on each
        machine (:class:`~zorse_lightning.schedule.step_collectives.SharedReduction`: one copy crosses a link
        between machines)."""
        shared = self.groups.shared_reduction(holders)
        scale = self.groups.shared_scale(holders)
        if scale != 1.0:
            flat.mul_(scale)
        inside = self.groups.machine_groups.get(holders)
        if inside is not None:
            dist.reduce(flat, dst=shared.representative, group=self.groups.call(inside, "the shared weights' sum"))
        exchange = self.groups.shared_groups.get(holders)
        if exchange is not None:
            dist.all_reduce(flat, group=self.groups.call(exchange, "the shared weights' exchange"))
        if inside is not None:
            dist.broadcast(flat, src=shared.representative, group=self.groups.call(inside, "the shared weights' broadcast"))


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    grouped: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        grouped[tensor.dtype].append(tensor)
    return list(grouped.values())


def clip_global_norm_(
    params: list[tuple[nn.Parameter, frozenset[int]]], groups: StageGroups, max_norm: float, device: torch.device,
    counts: Callable[[nn.Parameter], bool] | None = None,
) -> torch.Tensor:
    """Scale gradients so that their norm over all stages is at most ``max_norm``; returns the norm.

    Gradients are already reduced, so each weight is counted once, on the first
    stage that holds it: by the first rank of the rank's data-parallel group
    (reduced gradients are equal on all of them), or by the rank ``counts``
    accepts (the owner, where gradients were summed into owners only); under
    TP, a weight split over the TP group by that rank of every TP index (each
    counts its slice), a weight every TP rank holds whole by TP index 0 alone.
    Norms read each rank's local slice (a DTensor's own norm would
    communicate). The sum of squares is one
    all-reduce, a tensor on ``device``, the rank's own, also on a rank that holds
    no weight (idle): NCCL refuses a host tensor. Norms and scaling are foreach
    kernels (one launch per dtype), as ``torch.nn.utils.clip_grad_norm_``'s; nothing waits on the host.
    """
    first_rank = not groups.is_idle and groups.rank == groups.data_ranks[0]  # idle: only joins the sum
    index = 0 if groups.is_idle else groups.tensor_index
    counted = [
        local(p.grad).detach()
        for p, holders in params
        if (counts(p) if counts is not None else first_rank) and min(holders) == groups.stage_index and p.grad is not None
        and (index == 0 or is_split(p))
    ]
    squares = [
        torch.stack(torch._foreach_norm(grads, 2.0)).float().square().sum() for grads in _by_dtype(counted)
    ]
    square = torch.stack(squares).sum().to(device) if squares else torch.zeros((), device=device)
    if groups.plan.world_size > 1:
        dist.all_reduce(square, group=groups.call(None, "the gradient norm"))
    total = square.sqrt()
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in _by_dtype([local(p.grad).detach() for p, _ in params if p.grad is not None]):
        torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))
    return total

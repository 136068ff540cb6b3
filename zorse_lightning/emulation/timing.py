"""Timing pieces of the emulation: calibration, deadlines, and autograd markers for backward.

Why deadlines (see DESIGN.md, "Testing without GPUs"): sleeping ``(f - 1) x`` the
measured time of each call multiplies whatever contention inflated that
measurement; sleeping until ``start + f x c`` with a cost ``c`` calibrated once
makes every call take exactly ``f x c`` as long as the real compute fits inside,
which a slowdown ``f >= 2`` guarantees here. A forward is timed by module hooks;
a backward by two identity autograd functions: one on the module's outputs
(its backward runs when the module's backward starts) and one on its inputs
(its backward runs when the module's backward ends).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zorse_lightning.module.call_inputs import flatten_tensors, fresh_side_state, own_state_kept, replace_tensors

CALIBRATION_REPEATS = 3
"""Timed runs per calibration after one warm-up; the minimum is kept (least disturbed by other ranks)."""

CALIBRATION_SAMPLES = 2
"""Samples every calibration runs, whatever the size of the call that triggers it.

The CPU cost per sample falls with the batch (measured on a GPT block: 1.3 to
1.7x higher at 1 sample than at 8), so a cost taken at the first call's size
depended on which call came first (a one-sample profile, a sanity check, a
microbatch). One fixed size gives every calibration the same per-sample cost.
Two is the largest microbatch the start-up profile times and so the largest
the planner chooses by default: calibrated there, a typical call's real cost is
its calibrated cost and the deadline leaves it the full slowdown as margin (at
8, the fastest rank overran half its deadlines on shared cores).
"""


@dataclass(frozen=True)
class CallCost:
    """Calibrated real CPU seconds of one module call, per sample (``n`` = the first input's dim 0), taken at
    :data:`CALIBRATION_SAMPLES` samples; for a call whose input does not carry the batch (see
    :func:`batch_size_and_signature`), seconds of the whole call, taken as it came."""

    forward_s_per_sample: float
    backward_s_per_sample: float


@dataclass
class BackwardWindow:
    """One call's backward: its emulated duration, when it started (set by the output marker), what ends it."""

    emulated_s: float
    on_end: Callable[[BackwardWindow], None]
    """Called when the module's backward is done (the emulator sleeps there)."""
    has_end_marker: bool = False
    """False when no input requires grad: then ``on_end`` runs at the start, as the best available point."""
    start: float | None = None
    copy_bound_s: float = 0.0
    """Seconds of ``emulated_s`` by which activation offload's copy back outlasts the compute (counted when it ends)."""


def wrap_for_backward(obj: Any, marker: type[torch.autograd.Function], window: BackwardWindow) -> tuple[Any, int]:
    """Route every tensor of ``obj`` that requires grad through one ``marker`` node; returns (obj, count)."""
    differentiable = [t for t in flatten_tensors(obj) if t.requires_grad]
    if not differentiable:
        return obj, 0
    marked: Iterator[torch.Tensor] = iter(marker.apply(window, *differentiable))
    return replace_tensors(obj, lambda t: next(marked) if t.requires_grad else t), len(differentiable)


def sleep_until(deadline: float) -> float:
    """Sleep until ``time.perf_counter()`` reaches ``deadline``; returns the time left on entry (<= 0: overrun)."""
    remaining = deadline - time.perf_counter()
    left = remaining
    while left > 0:
        time.sleep(left)
        left = deadline - time.perf_counter()
    return remaining


class _IdentityMarker(torch.autograd.Function):
    """Identity on tensors, carrying a :class:`BackwardWindow` to its backward (subclasses say what it marks).

    Each output shares its input's storage and version counter but is no autograd view of it: a model may
    modify a module's output (or a block its input) in place, as CTRL scales its embeddings
    (``inputs_embeds *= sqrt(d)``), which autograd forbids on a view made inside a custom Function."""

    @staticmethod
    def forward(ctx: Any, window: BackwardWindow, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.window = window
        return tuple(t.detach() for t in tensors)


class BackwardStartMarker(_IdentityMarker):
    """On a module's outputs: its backward marks the start of the module's backward."""

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.window.start = time.perf_counter()
        if not ctx.window.has_end_marker:
            ctx.window.on_end(ctx.window)
        return (None, *grads)


class BackwardEndMarker(_IdentityMarker):
    """On a module's inputs: its backward marks the end of the module's backward."""

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.window.on_end(ctx.window)
        return (None, *grads)


def batch_size_and_signature(args: tuple, kwargs: dict, batch_samples: int | None = None) -> tuple[int | None, str]:
    """Samples in a call (dim 0 of the first tensor input) and a key for its per-sample shape.

    Costs are kept per sample so that uneven microbatches of the same shape
    share one calibration, and the key is a string so ranks can exchange it.
    ``batch_samples``: the samples of the step now running, when known. A call
    whose first tensor's dim 0 differs from it does not carry the batch (GPT's
    positions, a mask or a table shared by every sample): its cost does not grow
    with the batch, so it is charged once per call (samples ``None``), keyed by
    its whole shapes. Read per sample, the 128 positions of a GPT were charged
    as 128 samples: 105 ms a microbatch on an emulated T4 for a lookup a GPU
    does in microseconds, which made small microbatches look slow.
    """
    tensors = flatten_tensors((args, kwargs))
    if not tensors:
        return 1, "()"
    first = tensors[0]
    samples = int(first.shape[0]) if first.dim() > 0 else 1
    if batch_samples is not None and first.dim() > 0 and samples != batch_samples:
        return None, "whole:" + ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors)
    signature = ";".join(f"{tuple(t.shape[1:])}:{t.dtype}" for t in tensors)
    return max(samples, 1), signature


def calibrate_call(module: nn.Module, args: tuple, kwargs: dict, samples: int | None) -> CallCost:
    """Time the module's forward and backward on this input resized to :data:`CALIBRATION_SAMPLES` samples
    (``samples`` None: on this input as it is, for a cost per call), without side effects on training.

    Tensors whose dim 0 is the call's ``samples`` are cut or repeated to the
    fixed size (others, such as masks shared by the batch, are kept); where the
    resized call fails, the call as it came is timed and divided by its samples. Runs on detached copies of the inputs
    (a stateful one, such as a key/value cache a layer appends to, copied afresh for every run, so the real
    call's never changes and no run reaches another's graph; the layers' own tensor attributes alike:
    :func:`~..module.call_inputs.own_state_kept`), takes gradients with
    ``torch.autograd.grad`` (nothing accumulates into ``.grad``), restores the
    RNG state (dropout masks of the real call are unchanged) and the buffers
    (batch-norm statistics), and works even when called under ``no_grad`` or
    ``inference_mode`` (Lightning's sanity check runs validation first).
    """
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = sorted({t.device.index for t in flatten_tensors((args, kwargs)) if t.device.type == "cuda"})
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.random.fork_rng(devices=devices):
            try:
                forward_s, backward_s = _timed_runs(module, args, kwargs, samples)
                per = CALIBRATION_SAMPLES if samples is not None else 1
            except RuntimeError:
                # Resizing dim 0 broke the call: an input folds the batch into dim 0 with something else
                # (Bloom's and Falcon's ALiBi biases are batch x heads), so it kept its size while the
                # activation changed. Calibrate on the call as it came instead.
                forward_s, backward_s = _timed_runs(module, args, kwargs, None)
                per = samples or 1
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return CallCost(min(forward_s[1:]) / per, min(backward_s[1:]) / per)


def _timed_runs(module: nn.Module, args: tuple, kwargs: dict, samples: int | None) -> tuple[list[float], list[float]]:
    """Seconds of each forward and backward of ``module`` on fresh copies of the call, resized to
    :data:`CALIBRATION_SAMPLES` where ``samples`` is given (the first run warms up)."""
    inputs = replace_tensors((args, kwargs), lambda t: _fresh_input(_resized(t, samples)))
    leaves = [t for t in flatten_tensors(inputs) if t.requires_grad]
    leaves += [p for p in module.parameters() if p.requires_grad]
    forward_s, backward_s = [], []
    for _ in range(CALIBRATION_REPEATS + 1):
        call_args, call_kwargs = fresh_side_state(inputs)
        start = time.perf_counter()
        with own_state_kept(module):
            outputs = [t for t in flatten_tensors(module.forward(*call_args, **call_kwargs)) if t.requires_grad]
        _synchronize(outputs)
        middle = time.perf_counter()
        if outputs and leaves:
            torch.autograd.grad(outputs, leaves, [torch.ones_like(t) for t in outputs], allow_unused=True)
        _synchronize(outputs)
        forward_s.append(middle - start)
        backward_s.append(time.perf_counter() - middle)
    return forward_s, backward_s


def _resized(tensor: torch.Tensor, samples: int | None) -> torch.Tensor:
    """``tensor`` with :data:`CALIBRATION_SAMPLES` along dim 0 when that dim holds the call's ``samples``."""
    if samples is None or tensor.dim() == 0 or tensor.shape[0] != samples or samples == CALIBRATION_SAMPLES:
        return tensor
    repeats = -(-CALIBRATION_SAMPLES // samples)
    return tensor.repeat(repeats, *([1] * (tensor.dim() - 1)))[:CALIBRATION_SAMPLES]


def _fresh_input(tensor: torch.Tensor) -> torch.Tensor:
    """A normal (non-inference) copy; float inputs require grad, as activations do in training.

    Always, not only when the real input does: the first call is often
    Lightning's sanity check under ``no_grad``, and the cost must be the training one.
    """
    copy = tensor.detach().clone()
    if copy.is_floating_point():
        copy.requires_grad_(True)
    return copy


def _synchronize(tensors: list[torch.Tensor]) -> None:
    if tensors and tensors[0].device.type == "cuda":
        torch.cuda.synchronize(tensors[0].device)

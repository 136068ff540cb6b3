"""What a training step costs beyond the block list, measured at start-up on this rank's device.

The start-up profile times the blocks alone. A step also runs what comes before
the first block (embeddings), what comes after the last one (final norm, head,
loss, the step's own Python), the optimizer step and the engine's own work per
action; left out, they made every prediction short (bench/fidelity.py: 15 % on
cpu_sim4). All are measured here on the device (an emulated rank through its
emulation), in the precision that trains (the step given runs inside the
precision plugin's forward context), with the one harness of
:mod:`zorse_lightning.profiling.timing`, so the planner prices them as this GPU
type runs them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zorse_lightning.module.block_output import OutputForm, activation_of
from zorse_lightning.module.blocks import BlockList
from zorse_lightning.module.microbatch import microbatch_slice
from zorse_lightning.profiling.measure import out_of_memory_errors
from zorse_lightning.profiling.profile import BlockTimes, OptimizerProfile, TimeCurve
from zorse_lightning.profiling.timing import PhaseMarks, TimingOptions, fixed_runs, synchronize, time_ms, time_phases

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
"""Builds the user's optimizer (its class and settings) on the parameters given."""


def optimizer_factory(optimizer: torch.optim.Optimizer) -> OptimizerFactory:
    """A factory of ``optimizer``'s class with its settings (its first parameter group's), for profiling to
    time on sample parameters: the strategy's optimizer at start-up, ``configure_optimizers``' in the plan app."""
    group = optimizer.param_groups[0]
    accepted = inspect.signature(type(optimizer)).parameters  # AdamW's defaults hold a key its constructor refuses
    settings = {key: group[key] for key in optimizer.defaults if key in group and key in accepted and key != "params"}
    return lambda parameters: type(optimizer)(parameters, **settings)


@dataclass(frozen=True)
class StepEdges:
    """Times of the parts of a step outside the block list at the sizes measured, and what they save for
    backward."""

    embedding: BlockTimes
    head: BlockTimes
    sizes: tuple[int, ...]
    """The microbatch sizes measured: those asked, up to the first that did not fit with gradients."""
    embedding_activation_bytes: tuple[int, int]
    """(per sample, per microbatch) saved for backward before the first block."""
    head_activation_bytes: tuple[int, int]
    """(per sample, per microbatch) saved for backward after the last block (head, loss)."""
    transient_bytes: tuple[int, int]
    """(per sample, per microbatch) the step holds at its peak beyond what it saves for backward (the
    gradients of a large head's logits, a loss's upcast copies): measured by the CUDA allocator; 0 elsewhere."""


def loss_of(output: Any) -> torch.Tensor:
    """The loss a Lightning ``training_step`` returned: the tensor, or a mapping's ``"loss"``."""
    if isinstance(output, Mapping):
        output = output["loss"]
    if not isinstance(output, torch.Tensor):
        raise TypeError(
            f"training_step returned {type(output).__name__}; start-up times its backward and needs the loss: "
            f"return a tensor, or a dict with a 'loss' tensor"
        )
    return output


def _curve(sizes: Sequence[int], times_ms: Sequence[float]) -> TimeCurve:
    """The measured points, and the line through the two largest (what lies beyond is never priced from it:
    start-up lets the planner use measured sizes only)."""
    if len(sizes) == 1:
        return TimeCurve(times_ms[0] / sizes[0], 0.0, tuple(times_ms), tuple(sizes))
    slope = (times_ms[-1] - times_ms[-2]) / (sizes[-1] - sizes[-2])
    return TimeCurve(slope, times_ms[-1] - slope * sizes[-1], tuple(times_ms), tuple(sizes))


class _Phase:
    """Marks the step's phases from hooks on the first and last block, and counts the bytes autograd saves
    in each part of the forward (before the blocks, in them, after them)."""

    def __init__(self, blocks: BlockList) -> None:
        self.marks: PhaseMarks | None = None
        self.part = 0
        self.saved = [0, 0, 0]
        self.backward_marks = 0
        first, last = blocks.blocks[0], blocks.blocks[-1]
        # First of the first block's pre-hooks: the input it sees is the one the edge before returned. A later
        # hook may route it through a node of its own (an emulated block sleeps to its backward's deadline in
        # one, after the gradient has passed): marked behind that node, the block's backward would end after it.
        self.handles = [
            first.register_forward_pre_hook(self._entering, prepend=True), last.register_forward_hook(self._leaving),
        ]

    def _mark_backward(self, _grad: torch.Tensor) -> None:
        if self.backward_marks < 2 and self.marks is not None:
            self.marks.mark()
            self.backward_marks += 1

    def _entering(self, _module: Any, args: tuple) -> None:
        if self.part == 0:
            self.marks.mark()
            self.part = 1
            x = args[0] if args else None
            self.first_input = x if isinstance(x, torch.Tensor) and x.requires_grad else None

    def _leaving(self, _module: Any, _args: tuple, output: Any) -> None:
        self.marks.mark()
        self.part = 2
        activation = activation_of(output)
        if activation is not None and activation.requires_grad:
            activation.register_hook(self._mark_backward)
        if self.first_input is not None:
            self.first_input.register_hook(self._mark_backward)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.saved[self.part] += tensor.untyped_storage().nbytes()
        return tensor

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def measure_step_edges(
    step: Callable[[Any], Any], blocks: BlockList, batch: Any, device: torch.device, sizes: Sequence[int],
    timing: TimingOptions = TimingOptions(),
) -> StepEdges:
    """Forward and backward time before the first block and after the last, around ``step(microbatch)``
    and the backward of its loss, at each of ``sizes`` (smallest first, up to the first that does not fit).

    Phases are marked when the first block receives its input, when the last
    block returns, when the forward ends, when the gradient reaches the last
    block's output and when it reaches the first block's input: the edges are
    what the rest of the step spends, whatever the module computes there. The
    edges' and the blocks' gradients are put back after.
    """
    phase = _Phase(blocks)
    module_parameters = {id(p): p for b in blocks.blocks for p in b.parameters()}
    before: list[list[float]] = []
    after: list[list[float]] = []
    saved: list[tuple[int, int]] = []
    measured: list[int] = []
    transient: list[int] = []
    kept_grads: dict[int, tuple[torch.nn.Parameter, Any]] = {}

    def run(marks: PhaseMarks) -> None:
        phase.marks, phase.part, phase.backward_marks, phase.first_input = marks, 0, 0, None
        loss = loss_of(step(micro))
        marks.mark()
        if loss.requires_grad:
            for p in _leaf_parameters(loss, module_parameters):
                kept_grads.setdefault(id(p), (p, p.grad))
            loss.backward()
        while phase.backward_marks < 2:  # no gradient reached a block (nothing trainable before it)
            phase._mark_backward(loss)

    try:
        for size in sorted(sizes):
            micro = microbatch_slice(batch, 0, size)
            try:
                phase.saved, phase.part, phase.marks, phase.first_input = [0, 0, 0], 0, PhaseMarks(device), None
                with torch.autograd.graph.saved_tensors_hooks(phase.pack, lambda t: t):
                    loss_of(step(micro))
                saved.append((phase.saved[0], phase.saved[2]))
                ms = time_phases(run, device, 6, timing)
                transient.append(_transient_bytes(run, device, sum(phase.saved)))
            except out_of_memory_errors():
                if not measured:
                    raise
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                break
            measured.append(size)
            before.append([ms[0], ms[5]])
            after.append([ms[2], ms[3]])
    finally:
        phase.remove()
        for p, grad in kept_grads.values():
            p.grad = grad
    return StepEdges(
        BlockTimes(_curve(measured, [f for f, _ in before]), _curve(measured, [b for _, b in before])),
        BlockTimes(_curve(measured, [f for f, _ in after]), _curve(measured, [b for _, b in after])),
        tuple(measured),
        _line(measured, [s[0] for s in saved]),
        _line(measured, [s[1] for s in saved]),
        _line(measured, transient[: len(measured)]),
    )


def _transient_bytes(run: Callable[[PhaseMarks], None], device: torch.device, saved_bytes: int) -> int:
    """Peak bytes one step (forward and backward) allocates beyond those it saves for backward, on CUDA;
    0 elsewhere (no allocator to ask). The gradients it accumulates are already there (the timed runs
    made them), so what is left is what the step holds only while it runs."""
    if device.type != "cuda":
        return 0
    synchronize(device)
    held = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run(PhaseMarks(device))
    synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - held - saved_bytes)


def _line(sizes: Sequence[int], saved: Sequence[int]) -> tuple[int, int]:
    """(bytes per sample, bytes per microbatch) through the smallest and the largest size."""
    if len(sizes) == 1:
        return max(0, round(saved[0] / sizes[0])), 0
    per_sample = max(0, round((saved[-1] - saved[0]) / (sizes[-1] - sizes[0])))
    return per_sample, max(0, saved[0] - per_sample * sizes[0])


def _leaf_parameters(loss: torch.Tensor, blocks: Mapping[int, torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Every parameter the backward of ``loss`` will accumulate into (walked from its graph)."""
    found: dict[int, torch.nn.Parameter] = {}
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.nn.Parameter):
            found[id(variable)] = variable
        stack.extend(n for n, _ in node.next_functions)
    return list(found.values())


@dataclass(frozen=True)
class OptimizerMeasurement:
    ms_per_million_parameters: float
    profile: OptimizerProfile


def measure_optimizer(
    factory: OptimizerFactory, shapes: Sequence[torch.nn.Parameter], device: torch.device,
    timing: TimingOptions = TimingOptions(),
) -> OptimizerMeasurement:
    """The user's optimizer (``factory``: its class and settings) stepped on fresh tensors of ``shapes``'
    shapes and dtypes (a block's own parameters: the stage's real shapes), timed, and its state and step
    temporaries counted per parameter.

    Its time is per million parameters: a stage's step streams each of its
    parameters' state through memory, as the sample's does, at the sample's mix
    of tensor sizes.
    """
    weights = [torch.nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=device)) for p in shapes]
    for w in weights:
        w.grad = torch.full_like(w, 1e-3)
    optimizer = factory(weights)
    optimizer.step()  # its state exists from here: the step measured is a training step's, not the first
    parameters = sum(w.numel() for w in weights)
    state_bytes = sum(
        t.untyped_storage().nbytes() for state in optimizer.state.values() for t in state.values()
        if isinstance(t, torch.Tensor) and t.numel() > 1
    )
    step_bytes = _step_temporaries(optimizer, weights, device)
    ms = time_phases(lambda _: optimizer.step(), device, 1, timing)[0]
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    return OptimizerMeasurement(
        ms * 1e6 / parameters, OptimizerProfile(name, state_bytes / parameters, step_bytes / parameters)
    )


def _step_temporaries(optimizer: torch.optim.Optimizer, weights: Sequence[torch.Tensor], device: torch.device) -> float:
    """Bytes the step allocates beyond what it keeps: measured on CUDA; elsewhere one copy of the parameters
    when it steps a group at once (``foreach``: torch's default on CUDA), none when it steps tensor by tensor."""
    if device.type == "cuda":
        synchronize(device)
        held = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        optimizer.step()
        synchronize(device)
        return float(max(0, torch.cuda.max_memory_allocated(device) - held))
    grouped = any(group.get("foreach") for group in optimizer.param_groups)
    return float(sum(w.untyped_storage().nbytes() for w in weights)) if grouped else 0.0


def measure_action_overhead_ms(
    step: Callable[[Any], Any], blocks: BlockList, batch: Any, device: torch.device,
    timing: TimingOptions = TimingOptions(), form: OutputForm = OutputForm(),
) -> float:
    """The engine's own time per action: the user's step on one sample with every block passing its input
    on (in ``form``, the blocks' own), without gradients, as the host spends it (no device synchronisation
    at its end).

    An action of the engine calls the user's step for one microbatch of one
    stage, whose blocks outside the stage pass their input on; on a GPU what
    the host spends there is time the device waits for it once kernels are
    short, and on emulated ranks it is what the deadlines cannot absorb. Host
    time, not device time: the harness's host clock. Every rank runs it at once
    at start-up, so the warm-up is a fixed count: all run it the same number of
    times, as they will run.
    """
    patched = [b for b in blocks.blocks if "forward" not in b.__dict__]
    for block in patched:
        block.forward = form.passing_forward()
    micro = microbatch_slice(batch, 0, 1)

    def one() -> None:
        with torch.no_grad():
            step(micro)

    try:
        return time_ms(one, device, fixed_runs(timing, max(timing.min_warmup, 1)), host_clock=True)
    finally:
        for block in patched:
            del block.forward


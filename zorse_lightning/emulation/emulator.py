"""CPU ranks that behave like the GPU types of a cluster: slowed compute and a memory budget.

This is what makes load balancing testable without GPUs (DESIGN.md, "Testing
without GPUs"). Every rank is slowed, the fastest one too: a rank of type ``t``
takes ``slowdown(t) x c`` for work whose calibrated CPU cost is ``c``, where
``slowdown(t) = fastest_slowdown x peak(fastest type) / peak(t)``. With
``fastest_slowdown >= 2`` the real compute always finishes before the deadline,
so the emulated time is exact; communication, schedule and balance stay real.
The rank is never told its factor through any other channel: profilers that
time instrumented modules see the emulated speed, as they would on the GPU.

A call whose stage offloads activations (``engine.activation_offload``) lasts at
least as long as its copies at the type's host link (``GpuType.host_link_gbps``):
the forward copies out, its backward copies the same bytes back, each beside the
compute it hides under, as the cost model's ``with_offload_copies`` prices them.
A block whose stage recomputes its activations reruns its forward in its backward,
and is charged it there, as the cost model's ``stage_microbatch_times`` prices it.
A block split over a tensor-parallel group of ``t`` ranks is charged its one-GPU
cost (calibrated on the whole block at start-up) over ``t`` times the type's
efficiency, as the cost model's :mod:`~zorse_lightning.planner.cost.tensor_parallel`
prices its compute; its collectives run for real inside that window.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zorse_lightning.emulation.memory import (
    EmulatedOutOfMemoryError,
    MemoryBreakdown,
    MemoryMeter,
    out_of_memory_message,
)
from zorse_lightning.emulation.calibration import cost_key, min_costs
from zorse_lightning.emulation.coverage import emulated_modules, named_emulated_modules
from zorse_lightning.emulation.timing import (
    BackwardEndMarker,
    BackwardStartMarker,
    BackwardWindow,
    CallCost,
    batch_size_and_signature,
    calibrate_call,
    sleep_until,
    wrap_for_backward,
)
from zorse_lightning.emulation.spec import EmulationSpec
from zorse_lightning.errors import ZorseUserError
from zorse_lightning.units import gbps_to_bytes_per_s

# Named here too: the memory budget's error and breakdown (.memory), and the modules to emulate (.coverage),
# which start-up and the benches import from here.
__all__ = [
    "ComputeEmulator",
    "EmulatedOutOfMemoryError",
    "MemoryBreakdown",
    "emulated_modules",
    "named_emulated_modules",
]


@dataclass
class _Call:
    """A forward in flight on one module."""

    start: float
    emulated_s: float
    saved_tensors: Any = None
    """The entered ``saved_tensors_hooks`` context, exited when the forward ends."""
    window: BackwardWindow | None = None
    uncharged: bool = False
    """A call that computes nothing now (:attr:`ComputeEmulator.uncharged`): neither slowed nor counted."""
    offloaded_before: int | None = None
    """The rank's offloaded bytes when the forward started (where :attr:`ComputeEmulator.offloaded_bytes` is set)."""


@dataclass
class _Counters:
    calls: int = 0
    overruns: int = 0
    approximate_backwards: int = 0
    emulated_compute_s: float = 0.0
    real_compute_s: float = 0.0
    overrun_s: float = 0.0
    copy_bound_s: float = 0.0
    in_flight: dict[int, list[_Call]] = field(default_factory=dict)


def _plain_cost(calibrated: CallCost, recomputed: bool) -> CallCost:
    """The cost of a module call without recomputation. Calibrated through a checkpointed forward
    (``recomputed``), the timed backward reran the forward; the emulator charges that rerun itself."""
    if not recomputed:
        return calibrated
    forward, backward = calibrated.forward_s_per_sample, calibrated.backward_s_per_sample
    return CallCost(forward, max(backward - forward, 0.0))


class ComputeEmulator:
    """Slows instrumented modules to a GPU type's speed and holds the rank to its memory budget.

    ``instrument(modules)`` hooks each module: its forward and its backward then
    take ``spec.slowdown x`` their calibrated CPU cost, by sleeping until a
    deadline counted from the start of that piece of compute. Costs are
    calibrated per module and per-sample input shape at first use, and can be
    made identical on every rank with :meth:`agree_costs`.
    """

    def __init__(
        self, spec: EmulationSpec, rank: int | None = None, costs: Mapping[str, CallCost] | None = None,
        meter: MemoryMeter | None = None,
    ) -> None:
        """``costs``: calibrated costs to use (from :func:`calibrate_in_turn`); others are calibrated at first use.
        ``meter``: the rank's meter, shared with its other emulators (default: this emulator's own)."""
        self.spec = spec
        self.rank = rank
        self._costs: dict[str, CallCost] = dict(costs or {})
        self._whole_costs: set[str] = set(self._costs)
        """Keys of the costs given (start-up calibrates whole blocks): a split block is charged those over its
        degree; one it calibrates itself, already split, is charged as measured."""
        self._handles: list[RemovableHandle] = []
        self._modules: tuple[nn.Module, ...] = ()
        self._counters = _Counters()
        self._memory = meter or MemoryMeter()
        self._memory_tracked = self._memory.is_tracking
        self.batch_samples: int | None = None
        """Samples of the step (or microbatch) now running, set by whoever runs it: a call whose first
        input's dim 0 differs is charged once per call, not per sample (:func:`batch_size_and_signature`).
        None: every call's dim 0 counts as its samples."""
        self.uncharged: Callable[[nn.Module], bool] | None = None
        """Whether a call of the module computes nothing now (set by whoever knows: in an interleaved rank's
        later chunk, its earlier chunks' blocks pass their input on), so it is neither slowed nor counted."""
        self.offloaded_bytes: Callable[[], int] | None = None
        """Bytes the rank's activation offload has copied to host memory so far (set by whoever holds the
        offload: :class:`~zorse_lightning.emulation.stage.StageEmulation`). A call during which it grows by
        ``n`` takes at least ``n`` at the type's host link in its forward (the copies out) and in its backward
        (the copies back): per instrumented module, that is per block, max(compute, copy), where the cost
        model takes max(compute, copy) over a stage's whole microbatch (the same for blocks alike)."""
        self.recomputed: frozenset[int] = frozenset()
        """Ids of the modules whose forward is checkpointed (their stage recomputes activations; set by
        :class:`~zorse_lightning.emulation.stage.StageEmulation`): the backward reruns the forward, so it is
        charged the forward's cost too. The rerun calls the forward inside the module, past its hooks: without
        this the rerun's real compute hid under the backward's deadline and recomputation cost nothing here."""
        self.split: Mapping[int, int] = {}
        """Ids of the blocks split over a tensor-parallel group -> the group's ranks (set by
        :class:`~zorse_lightning.emulation.stage.StageEmulation` from the blocks' split weights): charged their
        whole-block cost over the degree times ``spec.tensor_parallel_efficiency`` (:meth:`_charge_factor`)."""

    # -- counters ------------------------------------------------------------------------

    @property
    def overruns(self) -> int:
        """Pieces of compute whose real CPU time passed the deadline (the emulated time is then too long)."""
        return self._counters.overruns

    @property
    def overrun_s(self) -> float:
        """Total time by which overruns passed their deadlines: the error they add to emulated time."""
        return self._counters.overrun_s

    @property
    def calls(self) -> int:
        """Emulated pieces of compute (each forward and each backward of an instrumented module)."""
        return self._counters.calls

    @property
    def emulated_compute_s(self) -> float:
        """Sum of the deadlines' lengths: the compute time this rank's GPU type would have spent."""
        return self._counters.emulated_compute_s

    @property
    def real_compute_s(self) -> float:
        """CPU wall time spent computing inside those windows (before sleeping)."""
        return self._counters.real_compute_s

    @property
    def copy_bound_s(self) -> float:
        """Emulated seconds by which offload's copies outlasted the compute they ran beside (part of
        :attr:`emulated_compute_s`): 0 where the host link hides them."""
        return self._counters.copy_bound_s

    @property
    def approximate_backwards(self) -> int:
        """Backwards of modules with no differentiable input (embeddings): their end is not observable, so
        they sleep at their start for the emulated time less the expected real cost."""
        return self._counters.approximate_backwards

    @property
    def calibrated_costs(self) -> dict[str, CallCost]:
        """Per-sample CPU costs, keyed by ``"<module name>|<per-sample input shapes>"`` (:func:`cost_key`)."""
        return dict(self._costs)

    def load_costs(self, costs: Mapping[str, CallCost]) -> None:
        """Use ``costs`` (calibrated elsewhere: another run, :func:`calibrate_in_turn`) for their keys."""
        self._costs.update(costs)
        self._whole_costs.update(costs)

    # -- memory --------------------------------------------------------------------------

    def track_memory(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        """Count the parameters and gradients of ``model`` and the state of ``optimizers``."""
        self._memory.track((model,), optimizers)
        self._memory_tracked = True

    def memory_breakdown(self) -> MemoryBreakdown:
        return self._memory.measure()

    def memory_bytes_now(self) -> int:
        return self._memory.measure().total_bytes

    @property
    def peak_memory_bytes(self) -> int:
        return self._memory.peak_bytes

    @property
    def peak_memory_breakdown(self) -> MemoryBreakdown | None:
        return self._memory.peak_breakdown

    def check_memory(self, recount: bool = True) -> MemoryBreakdown:
        """Measure, and raise :class:`EmulatedOutOfMemoryError` when over budget (``recount``: see
        :meth:`MemoryMeter.measure`; the checks inside module calls keep the state's last count)."""
        held = self._memory.measure(recount)
        if held.total_bytes > self.spec.memory_budget_bytes:
            who = self.spec.gpu_type if self.rank is None else f"{self.spec.gpu_type} (rank {self.rank})"
            raise EmulatedOutOfMemoryError(out_of_memory_message(who, self.spec.memory_budget_bytes, held))
        return held

    # -- instrumentation -----------------------------------------------------------------

    def instrument(self, modules: Sequence[nn.Module], names: Sequence[str] | None = None) -> None:
        """Emulate the compute of ``modules`` (disjoint: none may contain another) from now on.

        ``names`` (default: the positions) key the calibrated costs: give each
        module's name in the whole model (:func:`named_emulated_modules`) so that
        costs calibrated once serve a stage, a profile's copy of the blocks and
        every rank alike.
        """
        modules = tuple(modules)
        names = tuple(names) if names is not None else tuple(str(i) for i in range(len(modules)))
        if len(names) != len(modules):
            raise ZorseUserError(f"instrument got {len(modules)} modules but {len(names)} names; give one name each")
        for outer in modules:
            for inner in modules:
                if inner is not outer and any(m is inner for m in outer.modules()):
                    raise ZorseUserError(
                        f"cannot emulate {type(inner).__name__} inside {type(outer).__name__}: instrumented "
                        f"modules must not contain one another (their compute would be slowed twice); "
                        f"pass the blocks or their parent, not both (emulated_modules() picks a valid set)"
                    )
        self.remove()
        self._modules = modules
        if not self._memory_tracked:
            self._memory.track(modules)
        for name, module in zip(names, modules):
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(
                module.register_forward_hook(self._post_hook(), with_kwargs=True, always_call=True)
            )

    def remove(self) -> None:
        """Undo :meth:`instrument`; modules run at CPU speed again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._modules = ()

    def agree_costs(self, group: Any = None) -> None:
        """Make calibrated costs identical on every rank of ``group``: the minimum of each, over ranks.

        A collective: every rank of the group calls it at the same point (after
        a first step, when each rank has calibrated what it runs). The minimum
        is the measurement least disturbed by other ranks sharing the cores.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        gathered: list[dict[str, CallCost] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, self._costs, group=group)
        self._costs = min_costs(gathered)

    def _pre_hook(self, name: str) -> Callable[..., tuple[tuple, dict]]:
        # A closure, not a bound method: a deepcopy of the module shares the emulator instead of copying it.
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if self.uncharged is not None and self.uncharged(module):
                self._counters.in_flight.setdefault(id(module), []).append(_Call(0.0, 0.0, uncharged=True))
                return args, kwargs
            samples, signature = batch_size_and_signature(args, kwargs, self.batch_samples)
            key = cost_key(name, signature)
            recomputed = id(module) in self.recomputed
            cost = self._costs.get(key)
            if cost is None:
                cost = self._costs[key] = _plain_cost(calibrate_call(module, args, kwargs, samples), recomputed)
            charged = self._charge_factor(module, key) * (samples or 1)
            call = _Call(start=time.perf_counter(), emulated_s=charged * cost.forward_s_per_sample)
            backward_s = cost.backward_s_per_sample + (cost.forward_s_per_sample if recomputed else 0.0)
            if self.offloaded_bytes is not None:
                call.offloaded_before = self.offloaded_bytes()  # after calibrating, which may run the offload too
            if torch.is_grad_enabled():
                call.window = BackwardWindow(emulated_s=charged * backward_s, on_end=self._end_backward)
                (args, kwargs), marked = wrap_for_backward((args, kwargs), BackwardEndMarker, call.window)
                call.window.has_end_marker = marked > 0
                if torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
                    # Under another saved-tensors hook (activation checkpointing), that hook decides what
                    # is kept; installing ours inside it would keep everything and defeat it.
                    call.saved_tensors = self._memory.saved_tensors_hooks()
                    call.saved_tensors.__enter__()
            self._counters.in_flight.setdefault(id(module), []).append(call)
            return args, kwargs

        return hook

    def _charge_factor(self, module: nn.Module, key: str) -> float:
        """Emulated seconds per calibrated second of ``module``'s call under ``key``: the slowdown, over the TP
        degree at the type's efficiency for a split block whose cost was calibrated whole."""
        degree = self.split.get(id(module), 1)
        if degree == 1 or key not in self._whole_costs:
            return self.spec.slowdown
        return self.spec.slowdown / (degree * self.spec.tensor_parallel_efficiency)

    def _post_hook(self) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            call = self._counters.in_flight[id(module)].pop()
            if call.saved_tensors is not None:
                call.saved_tensors.__exit__(None, None, None)
            if sys.exc_info()[1] is not None or call.uncharged:
                return None  # the forward raised (nothing to time, the error propagates), or computed nothing
            self.check_memory(recount=False)
            if call.offloaded_before is not None:
                self._charge_copies(call, self.offloaded_bytes() - call.offloaded_before)
            self._finish(call.start, call.emulated_s)
            if call.window is not None:
                output, _ = wrap_for_backward(output, BackwardStartMarker, call.window)
            return output

        return hook

    def _charge_copies(self, call: _Call, copied_bytes: int) -> None:
        """``call`` (its forward just computed, its backward still to come) copied ``copied_bytes`` out, and its
        backward brings them back: each lasts at least the copy at the host link."""
        if copied_bytes <= 0:
            return
        copy_s = copied_bytes / gbps_to_bytes_per_s(self.spec.host_link_gbps)
        if copy_s > call.emulated_s:
            self._counters.copy_bound_s += copy_s - call.emulated_s
            call.emulated_s = copy_s
        if call.window is not None and copy_s > call.window.emulated_s:
            call.window.copy_bound_s = copy_s - call.window.emulated_s
            call.window.emulated_s = copy_s

    def _end_backward(self, window: BackwardWindow) -> None:
        if window.start is None:
            return
        self._counters.copy_bound_s += window.copy_bound_s
        self.check_memory(recount=False)
        if window.has_end_marker:
            self._finish(window.start, window.emulated_s)
            return
        # The end of this backward is not observable: sleep for the emulated time less the real cost
        # still to come (1/slowdown of it), before that compute runs. Not checked for overrun.
        sleep_until(window.start + window.emulated_s * (1.0 - 1.0 / self.spec.slowdown))
        self._counters.approximate_backwards += 1
        self._counters.calls += 1
        self._counters.emulated_compute_s += window.emulated_s

    def _finish(self, start: float, emulated_s: float) -> None:
        remaining = sleep_until(start + emulated_s)
        counters = self._counters
        counters.calls += 1
        counters.emulated_compute_s += emulated_s
        counters.real_compute_s += emulated_s - remaining
        if remaining <= 0:
            counters.overruns += 1
            counters.overrun_s -= remaining

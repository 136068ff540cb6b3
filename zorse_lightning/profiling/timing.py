"""The one timing harness: every profile measurement (blocks, step edges, optimizer, the engine's own
time per action, the link probe), at start-up and in the plan app alike, is a median of repeats after a
warm-up that lasts until the time settles (or a fixed count, :func:`fixed_runs`).

Why not a host clock around each call: on a GPU the host returns long before the
device finishes, and a synchronisation between repeats drains the queue that a
real step keeps full. So on CUDA every phase boundary is a CUDA event recorded
on the current stream, the repeats run back to back with no host
synchronisation between them, and the device is synchronised once at the end
to read the events. On the CPU (emulated ranks included) the device is the
host: a host clock read at each boundary is the device's time.

What the host itself spends (the engine's own work per action: on a GPU the
device waits for it once kernels are short) is read with ``host_clock=True``:
the host clock on every device, each timed run starting on an empty device
queue (so the host does not wait for earlier work) and not waiting for the
device at its end.

A run is a callable that receives a :class:`PhaseMarks` and calls
``marks.mark()`` between its phases (forward | backward, say): one run yields
one time per phase, and the harness keeps each phase's median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zorse_lightning.errors import PlanningError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TimingOptions:
    """How long to warm up and how many repeats to keep."""

    min_warmup: int = 2
    """Untimed runs at least (allocator, lazy initialisation, cuDNN and autotuning); two are needed to
    compare, fewer only when ``max_warmup`` says so."""
    max_warmup: int = 8
    """Warm-up stops here even if the time has not settled (a noisy shared host)."""
    settle_tolerance: float = 0.1
    """Warm-up ends once a run's total time is within this fraction of the run before it."""
    repeats: int = 3
    """Timed runs, back to back; the median of each phase is kept."""

    def __post_init__(self) -> None:
        if not (0 <= self.min_warmup <= self.max_warmup and self.repeats >= 1 and self.settle_tolerance > 0):
            raise PlanningError(
                f"TimingOptions(min_warmup={self.min_warmup}, max_warmup={self.max_warmup}, repeats={self.repeats}, "
                f"settle_tolerance={self.settle_tolerance}): need 0 <= min_warmup <= max_warmup, repeats >= 1 and "
                f"settle_tolerance > 0"
            )


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU, whose work is done when the call returns)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseMarks:
    """The boundaries of one run's phases: CUDA events on CUDA, host clock readings elsewhere (and with
    ``host_clock``: what the host spends, not the device)."""

    def __init__(self, device: torch.device, host_clock: bool = False) -> None:
        self._cuda = device.type == "cuda" and not host_clock
        self._points: list[Any] = []
        self.mark()

    def mark(self) -> None:
        """A boundary here (in stream order on CUDA: no host wait)."""
        if self._cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._points.append(event)
        else:
            self._points.append(time.perf_counter())

    @property
    def count(self) -> int:
        """Boundaries marked so far, the start included."""
        return len(self._points)

    def phases_ms(self) -> list[float]:
        """Each phase's milliseconds (on CUDA, only once the device has passed the last mark)."""
        if self._cuda:
            return [a.elapsed_time(b) for a, b in zip(self._points, self._points[1:])]
        return [(b - a) * 1e3 for a, b in zip(self._points, self._points[1:])]


def time_phases(
    run: Callable[[PhaseMarks], Any], device: torch.device, phases: int, options: TimingOptions = TimingOptions(),
    *, host_clock: bool = False,
) -> tuple[float, ...]:
    """Median milliseconds of each of ``phases`` phases of ``run(marks)``, which calls ``marks.mark()`` at
    the boundaries between phases (``phases - 1`` times; the harness marks the start and the end).

    Warm-up runs are synchronised one by one (the settling test needs their
    times); the timed repeats are queued back to back and read after one
    synchronisation at the end. With ``host_clock`` the phases are the host's
    time (see the module's docstring): each timed run starts on an empty queue.
    """
    totals: list[float] = []
    while len(totals) < options.max_warmup:
        if len(totals) >= max(options.min_warmup, 2) and _settled(totals[-2], totals[-1], options):
            break
        totals.append(sum(_one_run(run, device, phases, host_clock)))
    synchronize(device)
    marks = []
    for _ in range(options.repeats):
        if host_clock:
            synchronize(device)
        marks.append(_marked(run, device, phases, host_clock))
    synchronize(device)
    per_run = [m.phases_ms() for m in marks]
    return tuple(statistics.median(r[p] for r in per_run) for p in range(phases))


def _settled(previous_ms: float, last_ms: float, options: TimingOptions) -> bool:
    return abs(last_ms - previous_ms) <= options.settle_tolerance * max(previous_ms, 1e-9)


def _marked(run: Callable[[PhaseMarks], Any], device: torch.device, phases: int, host_clock: bool) -> PhaseMarks:
    marks = PhaseMarks(device, host_clock)
    run(marks)
    marks.mark()
    if marks.count != phases + 1:
        raise PlanningError(
            f"a timed run marked {marks.count - 2} phase boundaries; it must mark {phases - 1} "
            f"(one between each two of its {phases} phases)"
        )
    return marks


def _one_run(run: Callable[[PhaseMarks], Any], device: torch.device, phases: int, host_clock: bool) -> list[float]:
    synchronize(device)
    marks = _marked(run, device, phases, host_clock)
    synchronize(device)
    return marks.phases_ms()


def time_ms(
    run: Callable[[], Any], device: torch.device, options: TimingOptions = TimingOptions(), *, host_clock: bool = False
) -> float:
    """Median milliseconds of ``run()`` (one phase; the host's time with ``host_clock``)."""
    return time_phases(lambda _: run(), device, 1, options, host_clock=host_clock)[0]


def fixed_runs(options: TimingOptions, warmup: int) -> TimingOptions:
    """``options`` with exactly ``warmup`` untimed runs, settled or not: ranks that time something at once
    (as they will run it) then all run it the same number of times."""
    return TimingOptions(min_warmup=warmup, max_warmup=warmup, settle_tolerance=options.settle_tolerance,
                         repeats=options.repeats)

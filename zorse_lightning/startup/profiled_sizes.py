"""Which microbatch sizes a profile measures, and which of them the planner may choose.

Start-up and the plan app profile the same sizes (:func:`sizes_to_profile`) and
plan with the measured ones only (:func:`within_profiled_sizes`): nothing is
priced off the measured points, so a plan never rests on a size no device ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.profiling.profile import ModelProfile



@dataclass(frozen=True)
class ProfiledModel:
    """A profile to plan from, and the microbatch sizes it may be planned at."""

    profile: ModelProfile
    sizes: tuple[int, ...] | None
    """The sizes every GPU type measured (None: none measured, as in a reference profile)."""
    why_not: str = ""
    """Why no larger size was measured (the batch's samples per rank, a type's memory): for the plan's note."""
    tensor_parallel_note: str = ""
    """Why the module's blocks admit no tensor-parallel degree on a cluster that could hold a TP group (for the
    plan's notes; :func:`~zorse_lightning.startup.tensor_parallel_support.module_tensor_parallel`); empty: nothing
    to say."""


def unsaid(note: str, reason: str, notes: Sequence[str]) -> tuple[str, ...]:
    """``(note,)`` where no note of ``notes`` gives ``reason`` already (the search notes a profile's reason for
    no TP itself: :mod:`zorse_lightning.planner.search.notes`), else ``()``; ``()`` for an empty note."""
    return (note,) if note and not any(reason in said for said in notes) else ()


def sizes_to_profile(options: PlannerOptions, samples: int) -> tuple[int, ...]:
    """Microbatch sizes start-up measures: 1, 2, 4, ... and the planner's candidates up to the ``samples`` a
    rank's batch holds, that number itself (one microbatch of the whole local batch), and a pinned size.

    Measuring every size the planner may choose is what lets it choose: a line
    through two small sizes once read a per-call overhead as a per-sample saving
    (and, on a GPU, missed the large microbatch that was twice as fast).
    """
    sizes = {1 << k for k in range(samples.bit_length())} | {m for m in options.microbatch_sizes if m <= samples}
    sizes.add(samples)
    if options.microbatch_size is not None:
        sizes.add(options.microbatch_size)
    return tuple(sorted(sizes))


def within_profiled_sizes(
    options: PlannerOptions, measured: tuple[int, ...] | None = None, why_not: str = ""
) -> tuple[PlannerOptions, str | None]:
    """The planner's candidates: the sizes measured on every GPU type (the largest, one microbatch of the
    whole local batch, among them), with a note naming those left out; a pinned size not measured is refused.

    ``why_not`` says why larger sizes were not measured (the batch's samples per rank, a type's memory).
    Nothing is priced off the measured points: a size beyond them is never planned. ``measured`` None
    (sizes not known yet, or a reference profile) leaves the options as they are: the planner itself keeps
    to the sizes a measured profile holds (:attr:`~zorse_lightning.profiling.profile.ModelProfile.measured_sizes`),
    without a note.
    """
    if measured is None:
        return options, None
    if options.microbatch_size is not None:
        if options.microbatch_size not in measured:
            raise PlanningError(
                f"planner microbatch_size={options.microbatch_size} was not measured at start-up (measured: "
                f"{list(measured)}{'; ' + why_not if why_not else ''}), and the planner prices only measured sizes; "
                f"pin one of {list(measured)}, or give the loader a batch that holds {options.microbatch_size} samples "
                f"(data.batch_size in the apps' configs)"
            )
        return options, None
    largest = max(measured)
    kept = tuple(sorted({m for m in options.microbatch_sizes if m in measured} | {largest}))
    dropped = [m for m in options.microbatch_sizes if m not in measured]
    note = None
    if dropped:
        note = (f"microbatch sizes {dropped} not considered: start-up measured sizes {list(measured)}"
                f"{' (' + why_not + ')' if why_not else ''}; pin planner microbatch_size to one of them")
    return replace(options, microbatch_sizes=kept), note

"""What a user can tell the planner: knobs of the search, and pins that fix part of the plan.

:class:`PlannerOptions` is the one place its fields, types and defaults are written:
the ``planner`` config group's schema is generated from it
(:mod:`zorse_lightning.apps.planner_options`), so the YAML, the command line and
Python callers cannot disagree about a default.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from zorse_lightning.capabilities import SUPPORTED_SCHEDULES, SUPPORTS_IDLE_RANKS, P2PRules, Schedule
from zorse_lightning.errors import PlanningError


@dataclass(frozen=True)
class PlannerOptions:
    """Knobs of the search, and pins: parts of the plan the user fixes (None: the planner chooses).

    Lists may be given for the tuple fields (as YAML and the command line give them);
    they are stored as tuples, and ``schedule`` as a :class:`Schedule`. Each value is
    checked here, before any planning, against rules that need no cluster or model;
    the rules that do (pins against the cluster's ranks and the model's layers) are
    checked when planning starts.
    """

    solver_time_limit_s: float = 1.0
    """Seconds each integer program may run. A program that reaches it keeps the best
    solution found so far, and the plan's solver record says so. At most
    ``max_programs`` + 1 programs run once a plan fits, so 1 s keeps the solver's share
    of planning within 9 s: the planning-time goals (2 s at 32 GPUs, 60 s at 1024;
    ``bench/plan_scaling.py``) were met with it."""
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """Candidate microbatch sizes, in samples; those that do not divide the global batch are skipped."""
    allow_pipeline: bool = True
    """False: data parallel only (one stage), for modules that cannot be cut into stages."""
    no_pipeline_reason: str = "the module cannot be cut into pipeline stages"
    """Why pipelining is off (``allow_pipeline=False``); recorded in the plan's notes."""
    memory_reserve_gib: float | None = None
    """GiB of each GPU left to the framework, never planned for: given, the whole of it (CUDA
    context, allocator slack, NCCL's buffers). None: 0.5 GiB for the context and slack, on an
    emulated cluster scaled by each rank's memory budget over its GPU type's memory, and on real
    GPUs NCCL's buffers besides, priced per communicator the plan gives the rank
    (:class:`~zorse_lightning.planner.cost.framework_memory.NcclBuffers`)."""
    allow_idle_ranks: bool = SUPPORTS_IDLE_RANKS
    """Let plans leave the slowest GPU types idle when they would slow the rest down.
    Defaults to what the engine executes (:data:`SUPPORTS_IDLE_RANKS`); False: every rank works."""
    allow_offload: bool = True
    """Let the search offer activation offload (a stage's saved activations in pinned host memory, copied
    over its GPU type's host link) where a split does not fit without it; the copies and the host memory
    are priced like everything else, so it is chosen only where it is the fastest plan that fits.
    False: never (a run that must not pin host memory, or to compare against the best plan without it)."""
    max_stages: int = 16
    """Most pipeline stages a candidate layout may have (and never more than the model's layers)."""
    max_programs: int = 8
    """Integer programs to solve per plan, for the candidates with the best heuristic splits
    first (one more may run: a candidate that fits only with recomputation is solved twice).
    More run only where no candidate gave a plan that fits, after every other candidate, and for
    the layout of the plan held at the stop where it is a heuristic split (its program may refine it).
    0: the heuristic splits only, unless none of them fits."""
    max_interleave: int = 4
    """Most layer chunks (virtual stages) per group of ranks the planner tries on its best plan
    (interleaving shortens the pipeline's fill and drain about V-fold at V times the activation
    transfers and more activations in flight: a dimension of the search, :mod:`.search.space`); 1: never interleave.
    Offered only where the engine runs interleaved plans (``capabilities.SUPPORTS_INTERLEAVING``)."""
    max_tp: int = 8
    """Most GPUs of a tensor-parallel group the planner tries (a stage's blocks split over GPUs of one type on
    one machine, at a degree the model's blocks admit: ``ModelProfile.tensor_parallel``); 1: never (the best
    plan without tensor parallelism, to compare against)."""
    stage_layout: tuple[tuple[int, ...], ...] | None = None
    """Pin: the stages in pipeline order, each a tuple of global ranks, every rank in exactly one."""
    layer_counts: tuple[int, ...] | None = None
    """Pin: layers per stage in pipeline order, summing to the model's layers."""
    microbatch_size: int | None = None
    """Pin: samples per microbatch (must divide the global batch); None: one of ``microbatch_sizes``."""
    schedule: Schedule | None = None
    """Pin: the pipeline schedule, by name (``1f1b`` or ``gpipe``); None: 1F1B, which runs
    as fast as GPipe in less memory."""
    p2p_rules: P2PRules | None = None
    """The rules the run's messages between stages keep, by name (``gloo`` or ``nccl``, :class:`P2PRules`),
    which the prediction plays. None: the cluster's backend's (NCCL's on GPUs, gloo's on an emulated cluster);
    start-up gives the run's own (an emulated run under ``ZORSE_P2P_RULES=nccl`` keeps NCCL's)."""

    def __post_init__(self) -> None:
        if not (_is_number(self.solver_time_limit_s) and self.solver_time_limit_s > 0):
            raise PlanningError(
                f"solver_time_limit_s={self.solver_time_limit_s!r} must be a positive number of seconds "
                f"(each integer program's limit); give e.g. 1.0, or more for a better plan on a large cluster"
            )
        self._set("microbatch_sizes", _integers("microbatch_sizes", self.microbatch_sizes, "sizes"))
        if not self.microbatch_sizes:
            raise PlanningError("microbatch_sizes=[] leaves the planner no candidate; give at least one size, e.g. [1, 2, 4]")
        if self.memory_reserve_gib is not None and not (_is_number(self.memory_reserve_gib) and self.memory_reserve_gib >= 0):
            raise PlanningError(
                f"memory_reserve_gib={self.memory_reserve_gib!r} must be a number of GiB, 0 or more; "
                f"give e.g. 0.5, or null to let the planner choose"
            )
        _check_count("max_stages", self.max_stages, 1, "1: data parallel only; give e.g. 16")
        _check_count("max_programs", self.max_programs, 0, "0: heuristic splits only; give e.g. 8")
        _check_count("max_tp", self.max_tp, 1, "GPUs per tensor-parallel group; 1: no tensor parallelism; give e.g. 8")
        _check_count("max_interleave", self.max_interleave, 1, "layer chunks per group of ranks; 1: no interleaving; give e.g. 4")
        if self.stage_layout is not None:
            ranks = _integers("stage_layout", [r for s in self.stage_layout for r in s], "ranks", minimum=0)
            stages = tuple(tuple(int(r) for r in s) for s in self.stage_layout)
            if not ranks or not all(stages):
                raise PlanningError(
                    f"stage_layout={[list(s) for s in stages]} has an empty stage; give every stage at least one "
                    f"rank, e.g. [[0, 1, 2, 3], [4, 5, 6, 7]], or null to let the planner choose"
                )
            self._set("stage_layout", stages)
        if self.layer_counts is not None:
            self._set("layer_counts", _integers("layer_counts", self.layer_counts, "layers per stage"))
        if self.microbatch_size is not None:
            _check_count("microbatch_size", self.microbatch_size, 1, "give e.g. 4, or null to let the planner choose")
            self._set("microbatch_size", int(self.microbatch_size))
        if self.schedule is not None:
            self._set_choice("schedule", SUPPORTED_SCHEDULES, Schedule, "a schedule the engine runs", ", or null to let the planner choose")
        if self.p2p_rules is not None:
            self._set_choice(
                "p2p_rules", tuple(P2PRules), P2PRules, "a set of point-to-point rules",
                " (those the run's messages keep), or null for the cluster's backend's",
            )

    def _set_choice(self, name: str, allowed, kind, what: str, fix: str) -> None:
        """Store option ``name`` as a member of the enum ``kind``, refusing a value outside ``allowed`` (``fix``
        ends the message)."""
        value, names = getattr(self, name), [member.value for member in allowed]
        if value not in names:
            raise PlanningError(f"{name}={value!r} is not {what}; use one of {names}{fix}")
        self._set(name, kind(value))

    def _set(self, name: str, value: Any) -> None:
        """Store a normalised value in the frozen instance (lists as tuples)."""
        object.__setattr__(self, name, value)


def _is_int(value: Any) -> bool:
    """An integer (NumPy's too), and not a bool: ``True`` for a count is a mistake."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_count(name: str, value: Any, minimum: int, hint: str) -> None:
    if not (_is_int(value) and value >= minimum):
        raise PlanningError(f"{name}={value!r} must be an integer of at least {minimum} ({hint})")


def _integers(name: str, values: tuple | list, what: str, minimum: int = 1) -> tuple[int, ...]:
    """``values`` as a tuple of ints, each checked to be an integer of at least ``minimum``."""
    bad = [v for v in values if not (_is_int(v) and v >= minimum)]
    if bad:
        raise PlanningError(
            f"{name} holds {bad}: {what} must be integers of at least {minimum}; fix or remove those"
        )
    return tuple(int(v) for v in values)


__all__ = ["PlannerOptions"]

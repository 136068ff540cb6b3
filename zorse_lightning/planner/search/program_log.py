"""What the integer programs add: a record of each program :func:`.search.make_plan` solves,
against the heuristic split it started from (``bench/plan_quality.py`` sums them up)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ProgramRun:
    """One integer program of the search, against the heuristic split of its candidate."""

    stages: int
    microbatch_size: int
    recompute: bool
    start_ms: float | None
    """The candidate's heuristic split, priced (None: none fits)."""
    warm_started: bool
    """The program started from that split (it did when the split has the same recomputation)."""
    plan_ms: float | None
    """The program's solution, priced as the search keeps it (None: infeasible, or out of memory once priced)."""
    best_before_ms: float | None
    """The fastest plan the search held before this program (None: none yet)."""
    solves: int = 1
    """Integer programs solved for it: 2 where the split without recomputation had none."""

    @property
    def gain(self) -> float | None:
        """Relative improvement on the heuristic split (negative: slower); None without both."""
        if self.start_ms is None or self.plan_ms is None:
            return None
        return (self.start_ms - self.plan_ms) / self.start_ms


@dataclass
class ProgramLog:
    """Receives every program :func:`make_plan` solves (a recorder the caller owns)."""

    runs: list[ProgramRun] = field(default_factory=list)

    def add(self, run: ProgramRun) -> None:
        self.runs.append(run)

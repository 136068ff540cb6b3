"""The search: one loop over the candidate space (:mod:`.loop`), the space and its bounds (:mod:`.space`,
:mod:`.bound`, :mod:`.layouts`), splits and the one fit (:mod:`.fit`, :mod:`.heuristic`, the integer program of
:mod:`.problem` and :mod:`.ilp`), and which plan it keeps (:mod:`.choice`)."""

from zorse_lightning.planner.search.loop import ProgramLog, ProgramRun, all_baselines, make_plan

__all__ = ["ProgramLog", "ProgramRun", "all_baselines", "make_plan"]

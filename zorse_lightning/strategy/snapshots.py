"""Survivor snapshots taken from Lightning's loop: after optimizer steps, at an interval chosen from their cost.

What a snapshot holds and how it is copied off the critical path is the engine's
(:mod:`zorse_lightning.engine.checkpoint.survivors`); here is only when to take one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from zorse_lightning.engine.checkpoint.survivors import (
    RecoveryPolicy,
    SurvivorKeeper,
    snapshot_interval,
    survivors_directory,
)


class SurvivorSnapshots(pl.Callback):
    """First of the callbacks, so that its snapshot holds what ``ModelCheckpoint`` would save at that step.

    Snapshots are taken every ``interval`` optimizer steps (``take`` answers whether one started, or None
    where the run keeps none at all: then the callback does nothing more). Unless the policy fixes it, the interval is
    chosen once the first snapshot is complete and a few steps were timed (snapshots are taken at every
    step until then): its cost (the host's time to take the first one plus its copy's time on the side
    stream, counted as if it did not overlap the step at all) over :attr:`RecoveryPolicy.max_snapshot_cost`
    of the median step. Every rank takes the largest interval any rank chose (``gather``: over all ranks),
    so all snapshot the same steps and the survivors of a loss share a kept step; a rank whose own choice
    is not ready yet (its first copy still running) delays the agreement by a step. The run says what it
    chose.
    """

    STEPS_TIMED = 4
    """Steps (end to end, host clock) timed before the interval is chosen."""

    def __init__(
        self, take: Callable[[pl.Trainer], bool], keeper: SurvivorKeeper, policy: RecoveryPolicy,
        gather: Callable[[Any], list[Any]],
    ) -> None:
        self._take = take
        self._gather = gather
        self._keeper = keeper
        self._policy = policy
        self.interval: int | None = policy.snapshot_every_steps
        self._last_step = -1
        self._last_end: float | None = None
        self._step_ms: list[float] = []
        self._take_ms: float | None = None
        self.cost_ms: float | None = None
        """One snapshot's measured cost: host time plus copy time (None until the interval is chosen)."""
        self.step_ms: float | None = None
        """The median step it was weighed against."""
        self._off = False
        """``take`` answered None: the run keeps no snapshots (every rank answers alike: its plan says so)."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._off or trainer.global_step == self._last_step:  # mid-accumulation: no optimizer step completed
            return
        self._last_step = trainer.global_step
        now = time.perf_counter()
        if self._last_end is not None and len(self._step_ms) < self.STEPS_TIMED:
            self._step_ms.append((now - self._last_end) * 1000)
        self._last_end = now
        if self.interval is None:
            self._choose_interval()
        # Until the interval is chosen, every step (the cost is being measured); then every ``interval`` steps.
        if self.interval is None or trainer.global_step % self.interval == 0:
            taken = self._take(trainer)
            if taken is None:  # this run keeps none: nothing more to time or agree on
                self._off = True
                return
            if taken and self._take_ms is None:
                self._take_ms = (time.perf_counter() - now) * 1000
            self._last_end = time.perf_counter()  # the snapshot's host time is timed apart from the step's

    def _choose_interval(self) -> None:
        """Collective once every rank has timed its steps (they do so at the same step): every rank proposes
        its interval (None while its first copy runs) and all take the largest, once none is None."""
        if len(self._step_ms) < self.STEPS_TIMED:
            return
        ready = self._take_ms is not None and self._keeper.newest_step is not None
        copy_ms = self._keeper.last_copy_ms or 0.0
        cost_ms = self._take_ms + copy_ms if ready else 0.0
        step_ms = statistics.median(self._step_ms)
        mine = snapshot_interval(cost_ms, step_ms, self._policy.max_snapshot_cost) if ready else None
        proposed = self._gather(mine)
        if any(p is None for p in proposed):
            return
        self.cost_ms, self.step_ms, self.interval = cost_ms, step_ms, max(proposed)
        rank_zero_info(
            f"zorse: survivor snapshots every {'step' if self.interval == 1 else f'{self.interval} steps'} (a recovery "
            f"redoes at most {self.interval}; the largest of the ranks' choices): on rank 0 "
            f"one costs {cost_ms:.1f} ms ({self._take_ms:.1f} on the host, {copy_ms:.1f} copying) against a "
            f"{step_ms:.1f} ms step, at most {100 * self._policy.max_snapshot_cost:g} % of step time "
            f"(RecoveryPolicy(snapshot_every_steps=...) fixes it)"
        )


def keeping_directory(policy: RecoveryPolicy, trainer: pl.Trainer) -> Path:
    """Where this run's survivors write: the checkpoints' directory, where the relaunch will look."""
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None) or trainer.default_root_dir
    return survivors_directory(policy, dirpath)



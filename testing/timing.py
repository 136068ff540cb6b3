"""Step timing for the benchmarks: wall time between the ends of consecutive training steps."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from zorse_lightning.errors import ZorseUserError


class StepTimer(pl.Callback):
    """Records when each training step ends; ``on_step_end(batch_idx)`` runs a probe there (e.g. a counter)."""

    def __init__(self, on_step_end: Callable[[int], Any] | None = None) -> None:
        self.ends_s: list[float] = []
        self.probes: list[Any] = []
        self._probe = on_step_end

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.ends_s.append(time.perf_counter())
        if self._probe is not None:
            self.probes.append(self._probe(batch_idx))

    def step_times_s(self, warmup: int) -> list[float]:
        """Durations of the steps after the first ``warmup`` (which cut, calibrate and agree costs)."""
        if warmup < 1 or len(self.ends_s) <= warmup:
            raise ZorseUserError(
                f"warmup={warmup} with {len(self.ends_s)} steps recorded: need warmup >= 1 (the first step has no "
                f"start) and more steps than warmup; raise max_steps"
            )
        return [b - a for a, b in zip(self.ends_s[warmup - 1:], self.ends_s[warmup:])]

    def median_step_s(self, warmup: int) -> float:
        return statistics.median(self.step_times_s(warmup))

"""Samples per second on the progress bar and in the metrics."""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning.pytorch as pl


class SamplesPerSecond(pl.Callback):
    """Global samples per second over each training step (the plan's global batch, or batch x ranks)."""

    def __init__(self) -> None:
        self._started: float | None = None
        self.rates: list[float] = []
        """Samples per second of each training step so far."""

    def median_after(self, warmup_steps: int) -> float | None:
        """The median rate of the steps after the first ``warmup_steps`` (None before any)."""
        rates = self.rates[warmup_steps:] or self.rates
        return statistics.median(rates) if rates else None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._started is None:
            return
        plan = getattr(trainer.strategy, "plan", None)
        samples = plan.global_batch_size if plan is not None else len(batch[0]) * trainer.world_size
        self.rates.append(samples / (time.perf_counter() - self._started))
        pl_module.log("samples_per_s", self.rates[-1], prog_bar=True, rank_zero_only=True)

"""Samples per second on the progress bar and in the metrics."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl


class SamplesPerSecond(pl.Callback):
    """Global samples per second over each training step (the plan's global batch, or batch x ranks)."""

    def __init__(self) -> None:
        self._started: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._started is None:
            return
        plan = getattr(trainer.strategy, "plan", None)
        samples = plan.global_batch_size if plan is not None else len(batch[0]) * trainer.world_size
        pl_module.log("samples_per_s", samples / (time.perf_counter() - self._started), prog_bar=True, rank_zero_only=True)

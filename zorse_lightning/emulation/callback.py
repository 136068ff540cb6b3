"""``EmulateCluster``: the same emulated ranks under any strategy, so baselines compare fairly.

``Trainer(strategy="ddp", devices=4, callbacks=[EmulateCluster("cpu_sim4")])``
runs DDP on four CPU ranks that each behave like the GPU listed at their
global rank in ``cpu_sim4``: slowed compute, enforced memory budget. The zorse
strategy applies the same emulation, so the two are measured alike.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.emulation.coverage import emulated_modules
from zorse_lightning.emulation.emulator import ComputeEmulator
from zorse_lightning.emulation.spec import DEFAULT_FASTEST_SLOWDOWN, cpu_cores_demanded
from zorse_lightning.emulation.rank import RankEmulation
from zorse_lightning.module.microbatch import samples_in
from zorse_lightning.errors import InventoryError

log = logging.getLogger(__name__)


class EmulateCluster(Callback):
    """Makes each rank emulate its GPU type of ``cluster`` (a config name, path, mapping or inventory).

    ``modules`` picks what to slow down (default :func:`emulated_modules`: the
    blocks, plus every other child with parameters). Each batch's samples are
    told to the emulator, which charges calls that do not carry the batch once
    per call. Costs are calibrated at first use and agreed across ranks
    (minimum) after the first training batch;
    memory is checked during every emulated forward and backward and after
    every batch; the peak per rank is logged at the end of fit.
    """

    def __init__(
        self,
        cluster: Any,
        fastest_slowdown: float = DEFAULT_FASTEST_SLOWDOWN,
        modules: Callable[[nn.Module], Sequence[nn.Module]] = emulated_modules,
    ) -> None:
        self.inventory = load_cluster(cluster)
        self.fastest_slowdown = fastest_slowdown
        self._select_modules = modules
        self._emulator: ComputeEmulator | None = None
        self._costs_agreed = False

    @property
    def emulator(self) -> ComputeEmulator:
        if self._emulator is None:
            raise RuntimeError("EmulateCluster.emulator exists once the Trainer has called setup on this rank")
        return self._emulator

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size != self.inventory.world_size:
            raise InventoryError(
                f"cluster {self.inventory.name!r} lists {self.inventory.world_size} GPUs but the Trainer runs "
                f"{trainer.world_size} processes; set Trainer(devices={self.inventory.world_size}) "
                f"(x num_nodes) or use a cluster config with one GPU per process"
            )
        demand = cpu_cores_demanded(self.inventory, self.fastest_slowdown)
        cores = len(os.sched_getaffinity(0))
        if demand > cores:
            log.warning(
                "emulating %s keeps %.2f CPU cores busy but this machine has %d: ranks will contend and overrun "
                "their deadlines; raise fastest_slowdown above %g",
                self.inventory.name, demand, cores, self.fastest_slowdown,
            )
        emulation = RankEmulation(self.inventory, trainer.global_rank, self.fastest_slowdown)
        if self._emulator is None or self._emulator.spec != emulation.spec:
            self._emulator = emulation.emulator()
        self._emulator.instrument(self._select_modules(pl_module))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.emulator.track_memory(pl_module, trainer.optimizers)

    def _set_batch(self, batch: Any) -> None:
        self.emulator.batch_samples = samples_in(batch)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._set_batch(batch)

    @override
    def on_validation_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._set_batch(batch)

    @override
    def on_test_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._set_batch(batch)

    @override
    def on_predict_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._set_batch(batch)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._costs_agreed:
            self.emulator.agree_costs()
            self._costs_agreed = True
        self.emulator.check_memory()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        emulator = self.emulator
        log.info(
            "rank %d emulating %s: peak memory %d bytes of a %d-byte budget (%s); %d emulated calls, "
            "%.3f s emulated compute, %d overruns",
            trainer.global_rank, emulator.spec.gpu_type, emulator.peak_memory_bytes,
            emulator.spec.memory_budget_bytes, emulator.peak_memory_breakdown, emulator.calls,
            emulator.emulated_compute_s, emulator.overruns,
        )
        peaks = trainer.strategy.all_gather(torch.tensor(float(emulator.peak_memory_bytes))).reshape(-1)
        if trainer.is_global_zero:
            metrics = {f"emulation/peak_memory_bytes/rank{r}": float(p) for r, p in enumerate(peaks.tolist())}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
                logger.save()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._emulator is not None:
            self._emulator.remove()

"""The strategy's checkpoint and failure hooks: what Lightning saves and loads, and what survivors keep.

A checkpoint is a directory of shards (:mod:`.checkpoint_io`); the strategy adds
a ``"zorse"`` section (plan, inventory, data position). A lost rank is named by
the watchdog; the survivors keep their state for a fast relaunch
(:mod:`.fast_recovery`). Kept apart from the training hooks so each file reads
as one job; the state these hooks share with training lives in :class:`ResumeState`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from typing_extensions import override

from zorse_lightning.engine.faults import Watchdog
from zorse_lightning.module.materialize import has_meta_tensors
from zorse_lightning.planner.plan import Plan
from zorse_lightning.strategy import checkpoint_io, fast_recovery
from zorse_lightning.strategy.fast_recovery import RecoveryPolicy, RecoveryReport, SurvivorKeeper
from zorse_lightning.strategy.processes import ProcessStrategy
from zorse_lightning.strategy.sampler import PlanBatchSampler, SamplerState


@dataclass
class ResumeState:
    """Where the data stands and what a loaded checkpoint left to apply."""

    sampler: PlanBatchSampler | None = None
    """The training loader's (the newest, when Lightning reloads it); evaluation loaders' have no position."""
    position: SamplerState | None = None
    """Where the training data continues, the data position a checkpoint records: restored from a checkpoint,
    then moved by each finished step; None before either."""
    checkpoint_global_batch_size: int | None = None
    """The resumed checkpoint's global batch size: a plan made at start keeps it (same data order)."""
    pending_optimizer_states: list[dict[str, Any]] = field(default_factory=list)
    """Applied once the optimizers are restricted to this rank's weights."""
    pending_module_state: dict[str, Any] | None = None
    """A checkpoint's weights for a module built on the meta device: read into the stage as it is placed."""

    def train_loader(self, sampler: PlanBatchSampler) -> None:
        """A new training loader continues at the position (a reload, at an epoch start, too)."""
        sampler.require_batches()
        if self.position is not None:
            sampler.restore(self.position)
        self.sampler = sampler

    def step_done(self, batches_done: int, epoch_batches: int) -> None:
        """After ``batches_done`` of the ``epoch_batches`` global batches of this epoch: the position a
        checkpoint taken now records (the next epoch's start after the last batch), and where the sampler's
        next pass starts (its pass of this epoch goes on as it began)."""
        if self.sampler is not None:
            self.position = self.sampler.state(batches_done, epoch_batches)
            self.sampler.restore(self.position)

    def sampler_state(self) -> SamplerState | None:
        if self.position is None and self.sampler is not None:
            return self.sampler.state(0, len(self.sampler))
        return self.position


class CheckpointHooks(ProcessStrategy):
    """Lightning's checkpoint hooks over sharded state. Subclasses set ``_recovery``, ``_resume``,
    ``_keeper``, ``_tensorless_dump``, ``_watchdog``, ``recovery_report`` and provide ``_plan``, ``inventory``."""

    _plan: Plan | None
    _recovery: RecoveryPolicy
    _resume: ResumeState
    _keeper: SurvivorKeeper
    _tensorless_dump: bool
    _watchdog: Watchdog | None
    recovery_report: RecoveryReport | None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._tensorless_dump:
            return {}
        return checkpoint_io.local_module_state(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if self._tensorless_dump:
            return {"param_groups": checkpoint_io.optimizer_hyperparameters(optimizer)}
        return checkpoint_io.local_optimizer_state(optimizer, self.lightning_module)

    def _snapshot_for_recovery(self, trainer: Any) -> bool:
        """Lightning's checkpoint of this step without its tensors (no collective): what survivors keep. What
        never changes over the run (plan, inventory) is given to the keeper once. False: none was started."""
        module, optimizers = self.lightning_module, self._raw_optimizers()
        if not self._keeper.static:
            if self._keeper.copies(module, optimizers):
                fast_recovery.check_host_memory(self._keeper.held_bytes(module, optimizers), len(self.parallel_devices))
            static = checkpoint_io.zorse_section(self._plan, self.inventory, None)
            self._keeper.static = {"zorse": {k: v for k, v in static.items() if k != "sampler"}}
        self._tensorless_dump = True
        try:
            common = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        finally:
            self._tensorless_dump = False
        del common["state_dict"]
        common["zorse"] = {"sampler": checkpoint_io.zorse_section(None, None, self._resume.sampler_state())["sampler"]}
        return self._keeper.snapshot(trainer.global_step, common, module, optimizers)

    def _keep_survivor_state(self) -> None:
        if self._recovery.enabled and self.lightning_module is not None:
            directory = fast_recovery.keeping_directory(self._recovery, self.lightning_module.trainer)
            self._keeper.keep(directory, self.global_rank, self.lightning_module, self._raw_optimizers())

    def _raw_optimizers(self) -> list[torch.optim.Optimizer]:
        return [getattr(o, "_optimizer", o) for o in self.optimizers]

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """A module built on the meta device has no memory to load into: its stage reads the checkpoint's
        weights when it reaches the device (``InitialValues.weights``)."""
        if has_meta_tensors(self.lightning_module):
            self._resume.pending_module_state = dict(checkpoint["state_dict"])
        else:
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("optimizer_states", [])
        if states and checkpoint_io.NAMED_STATE_KEY in states[0]:
            self._resume.pending_optimizer_states = list(states)
        else:
            super().load_optimizer_state_dict(checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Atomic across ranks: every rank writes its share, then rank 0 publishes (see checkpoint_io)."""
        checkpoint["zorse"] = checkpoint_io.zorse_section(self._plan, self.inventory, self._resume.sampler_state())
        checkpoint_io.save(checkpoint, filepath, checkpoint_io.manifest_metadata(self.lightning_module, self._plan))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if not checkpoint_io.is_checkpoint_directory(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if self._recovery.enabled:
            checkpoint, self.recovery_report = fast_recovery.load(
                checkpoint_path, self._recovery, self.lightning_module, self.global_rank, self.world_size
            )
        else:
            checkpoint = checkpoint_io.load(checkpoint_path, self.global_rank, self.world_size)
        zorse = checkpoint.get("zorse") or {}
        if zorse.get("plan"):
            self._resume.checkpoint_global_batch_size = zorse["plan"]["global_batch_size"]
        sampler = zorse.get("sampler")
        if sampler:
            self._resume.position = SamplerState(**sampler)
        return checkpoint

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Another rank's loss or failure is named here; an error of this rank's own is told to the others."""
        if self._watchdog is not None:
            lost = self._watchdog.explain(exception)
            if lost is not None:
                self._keep_survivor_state()
                raise lost from exception

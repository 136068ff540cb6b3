"""The checkpoint, survivor-snapshot and failure hooks of ``ZorseStrategy`` (its base class here).

Lightning asks a strategy for its state dicts, to save and load checkpoints and to handle an exception;
a zorse run answers with each rank's own share (:mod:`zorse_lightning.engine.checkpoint.shards`), keeps
survivors' copies of the step (:mod:`.snapshots`) and, relaunched, reads survivors' state first
(:mod:`zorse_lightning.engine.checkpoint.relaunch`). The rest of the strategy is
:class:`~.zorse_strategy.ZorseStrategy` (setup, start-up) and its other bases (:mod:`.steps`,
:mod:`.processes`); it sets the attributes these hooks read (``_state``, ``_recovery``, ``_timeout``,
``inventory``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from zorse_lightning.engine.checkpoint import relaunch, shards, survivors
from zorse_lightning.engine.host_group import host_group
from zorse_lightning.module.materialize import has_meta_tensors
from zorse_lightning.strategy.sampler import SamplerState
from zorse_lightning.strategy.snapshots import keeping_directory


class CheckpointHooks(ParallelStrategy):
    """Checkpoints written and read rank by rank, survivors' snapshots, a lost rank named."""

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._state.tensorless_dump:
            return {}
        return shards.local_module_state(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if self._state.tensorless_dump:
            return {"param_groups": shards.optimizer_hyperparameters(optimizer)}
        return shards.local_optimizer_state(optimizer, self.lightning_module)

    def _snapshot_for_recovery(self, trainer: Any) -> bool | None:
        """Lightning's checkpoint of this step without its tensors (no collective): what survivors keep. What
        never changes over the run (plan, inventory) is given to the keeper once. False: none was started;
        None: this run keeps none (:meth:`_keeps_no_survivors`)."""
        if self._keeps_no_survivors():
            rank_zero_info(
                f"zorse: no survivor snapshots: the plan splits blocks over tensor-parallel groups "
                f"(tensor_parallel {self._state.plan.stages[0].tensor_parallel}), whose slices snapshots do not keep yet; "
                f"a lost rank resumes from the last checkpoint"
            )
            return None
        module, optimizers = self.lightning_module, self._raw_optimizers()
        if not self._state.keeper.static:
            if self._state.keeper.copies(module, optimizers):
                survivors.check_host_memory(self._state.keeper.held_bytes(module, optimizers), len(self.parallel_devices))
            static = shards.zorse_section(self._state.plan, self.inventory, None)
            self._state.keeper.static = {"zorse": {k: v for k, v in static.items() if k != "sampler"}}
        self._state.tensorless_dump = True
        try:
            common = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        finally:
            self._state.tensorless_dump = False
        del common["state_dict"]
        common["zorse"] = {"sampler": shards.zorse_section(None, None, self._state.resume.sampler_state())["sampler"]}
        return self._state.keeper.snapshot(trainer.global_step, common, module, optimizers)

    @override
    def on_train_start(self) -> None:
        """Lightning has registered its SIGTERM handler by now: survivors' keeping takes SIGTERM first and goes on to
        Lightning's once the snapshot is kept."""
        super().on_train_start()
        if self._state.sigterm is not None:
            self._state.sigterm.take_over()

    def _host_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` over the host (gloo) group: pickles never staged on a GPU."""
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self._state.host_group)
        return gathered

    def _keeps_no_survivors(self) -> bool:
        """Whether the plan splits blocks over TP groups: survivors' files hold weights by name, whole, and a
        TP rank holds slices (checkpoints gather them whole, which a survivor, keeping alone, cannot)."""
        plan = self._state.plan
        return plan is not None and any(stage.tensor_parallel > 1 for stage in plan.stages)

    def _keep_survivor_state(self) -> None:
        if self._recovery.enabled and self.lightning_module is not None and not self._keeps_no_survivors():
            directory = keeping_directory(self._recovery, self.lightning_module.trainer)
            self._state.keeper.keep(directory, self.global_rank, self.lightning_module, self._raw_optimizers())

    def _raw_optimizers(self) -> list[torch.optim.Optimizer]:
        return [getattr(o, "_optimizer", o) for o in self.optimizers]

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """A module built on the meta device has no memory to load into: its stage reads the checkpoint's
        weights when it reaches the device (``InitialValues.weights``)."""
        if has_meta_tensors(self.lightning_module):  # kept lazy: only the stage's tensors are ever read
            self._state.resume.pending_module_state = checkpoint["state_dict"]
        else:
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("optimizer_states", [])
        if states and shards.NAMED_STATE_KEY in states[0]:
            self._state.resume.pending_optimizer_states = list(states)
        else:
            super().load_optimizer_state_dict(checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Atomic across ranks: every rank writes its share, then rank 0 publishes (see engine.checkpoint.shards)."""
        checkpoint["zorse"] = shards.zorse_section(self._state.plan, self.inventory, self._state.resume.sampler_state())
        shards.save(checkpoint, filepath, shards.manifest_metadata(self.lightning_module, self._state.plan))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if not shards.is_checkpoint_directory(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if self.world_size > 1 and self._state.host_group is None:  # files and verdicts go over gloo
            self._state.host_group = host_group(self._timeout, self.cluster_environment.main_address)
        if self._recovery.enabled:
            checkpoint, report, self._state.resume.remote_files = relaunch.load(
                checkpoint_path, self._recovery, self.lightning_module, self.global_rank, self.world_size,
                self._host_gather, self._state.host_group,
            )
            (rank_zero_warn if report.passed_over_survivors else rank_zero_info)(report.message)
            self._state.recovery_report = report
        else:
            checkpoint = shards.load(checkpoint_path, self.global_rank, self.world_size, self._host_gather)
        zorse = checkpoint.get("zorse") or {}
        if zorse.get("plan"):
            self._state.resume.checkpoint_global_batch_size = zorse["plan"]["global_batch_size"]
        sampler = zorse.get("sampler")
        if sampler:
            self._state.resume.position = SamplerState(**sampler)
        return checkpoint

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Another rank's loss or failure is named here; an error of this rank's own is told to the others."""
        if self._state.watchdog is not None:
            lost = self._state.watchdog.explain(exception)
            if lost is not None:
                self._keep_survivor_state()
                raise lost from exception

"""The steps of ``ZorseStrategy`` (one of its bases): Lightning's step hooks, run by the plan's schedule.

The strategy owns the step. Lightning calls ``training_step`` once per global
batch; inside it the engine runs the plan's schedule, calling the user's own
``training_step`` per microbatch, with backward included. Lightning's
``backward`` therefore only puts the schedule's gradients back between its
hooks, and ``optimizer_step`` reduces them (weighted by samples, over each
weight's stages) before Lightning's clipping and the optimizer; clipping uses
the global norm over all stages. ``self.log`` inside microbatches is captured
and replayed once per step. A module that optimises by hand owns its step
instead (:mod:`.manual_optimization`). Validation, test and prediction run the
schedule's forwards alone.

The attributes these hooks read (``_state``, ``plan``, ``engine``, ``_rank_emulation``) are
:class:`~.zorse_strategy.ZorseStrategy`'s.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from zorse_lightning.emulation.stage import StageEmulation
from zorse_lightning.engine.checkpoint import shards
from zorse_lightning.engine.checkpoint.by_name import ByName
from zorse_lightning.strategy.gradient_stash import GradientStash
from zorse_lightning.strategy.log_capture import LogCapture, LogMerger, capturing_logs, replay


class StepHooks(ParallelStrategy):
    """Training, evaluation and prediction steps by the schedule; backward and the optimizer step around it."""

    def _microbatch_step(self, hook: str, batch_idx: int, *rest: Any):
        method = getattr(self.lightning_module, hook)
        return lambda micro, j: method(micro, batch_idx, *rest)

    def _prepare_engine(self, batch: Any, batch_idx: int) -> None:
        """Cut the module (unless a validation before training did), then what training alone needs:
        optimizers restricted to this rank's weights or shard, their restored state, the emulation."""
        if not self.engine.prepared:
            silent = LogCapture(self.plan.microbatch_size)
            with capturing_logs(self.lightning_module, silent):
                self.engine.prepare(batch, self._microbatch_step("training_step", batch_idx))
        pending = self._state.resume.pending_module_state
        if isinstance(pending, ByName):  # the stage holds copies: the files' pages need not stay mapped
            pending.files.close()
        self._state.training_prepared = True
        for optimizer in self.optimizers:
            self.engine.setup_optimizer(optimizer)
        for optimizer, state in zip(self.optimizers, self._state.resume.pending_optimizer_states):
            shards.load_optimizer_state(optimizer, self.lightning_module, state)
        self._state.resume.pending_optimizer_states = []
        emulation = self._rank_emulation()
        if emulation is not None:
            costs = self._state.startup.calibrated_costs if self._state.startup is not None else None
            self._state.emulation = StageEmulation.start(
                emulation, costs, self.lightning_module, self.engine.cut, self.optimizers, self.plan.microbatch_size,
                offload=self.engine.offload, recompute=self.engine.recomputes,
            )

    def _captured(self, run, hook: str, batch_idx: int, *rest: Any):
        capture = LogCapture(self.plan.microbatch_size)
        with capturing_logs(self.lightning_module, capture):
            result = run(self._microbatch_step(hook, batch_idx, *rest))
        merger = self._state.log_mergers.setdefault(hook, LogMerger(self.root_device, self._state.host_group))
        replay(self.lightning_module, capture.merged_over_ranks(merger), self.plan.global_batch_size)
        return result

    @override
    def training_step(self, batch: Any, batch_idx: int, *rest: Any) -> torch.Tensor:
        if not self._state.training_prepared:
            self._prepare_engine(batch, batch_idx)
        if self._state.manual is not None:
            with self.precision_plugin.train_step_context():
                output = self._state.manual.training_step(batch, batch_idx, *rest)
            self._step_done(batch_idx)
            return output
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        scale = self.precision_plugin.loss_scale_value / accumulate
        # Accumulating over several batches adds the set-aside gradients after the run: no overlap then. Without
        # accumulation Lightning zeroes the last step's gradients in this step anyway: they are let go here (they
        # may be views into the reduction's buffer, which this run refills).
        overlap = accumulate == 1
        earlier = GradientStash.take(self.engine.local_parameters()) if not overlap else None
        if overlap:
            for param in self.engine.local_parameters():
                param.grad = None
        with self.precision_plugin.train_step_context():
            loss = self._captured(
                lambda step: self.engine.run(batch, step, scale, reduce_in_backward=overlap), "training_step", batch_idx, *rest
            )
        self._step_done(batch_idx)
        self._state.stashed = GradientStash.take(self.engine.local_parameters())
        if earlier is not None:
            earlier.put_back()
        return loss

    def _step_done(self, batch_idx: int) -> None:
        if self._state.emulation is not None:
            self._state.emulation.after_step()
        self._state.resume.step_done(batch_idx + 1, self.lightning_module.trainer.num_training_batches)

    def _evaluation_step(self, hook: str, batch: Any, batch_idx: int, *rest: Any) -> Any:
        if not self.engine.prepared:
            self._prepare_engine_for_evaluation(batch, batch_idx, hook)
        with self.precision_plugin.val_step_context():
            outputs = self._captured(lambda step: self.engine.evaluate(batch, step), hook, batch_idx, *rest)
        return [outputs[j] for j in sorted(outputs)] if outputs else None

    def _prepare_engine_for_evaluation(self, batch: Any, batch_idx: int, hook: str) -> None:
        """The cut is probed on a loss (its graph shows what crosses the stages): the training step gives
        one, where ``validation_step`` may only log and ``predict_step`` return no gradient."""
        probe = "training_step" if is_overridden("training_step", self.lightning_module) else hook
        silent = LogCapture(self.plan.microbatch_size)
        with capturing_logs(self.lightning_module, silent), torch.enable_grad():
            self.engine.prepare(batch, self._microbatch_step(probe, batch_idx))

    @override
    def validation_step(self, batch: Any, batch_idx: int, *rest: Any) -> Any:
        self._evaluation_step("validation_step", batch, batch_idx, *rest)

    @override
    def test_step(self, batch: Any, batch_idx: int, *rest: Any) -> Any:
        self._evaluation_step("test_step", batch, batch_idx, *rest)

    @override
    def predict_step(self, batch: Any, batch_idx: int, *rest: Any) -> Any:
        outputs = self._evaluation_step("predict_step", batch, batch_idx, *rest)
        if outputs and all(isinstance(o, torch.Tensor) for o in outputs):
            return torch.cat(outputs)
        return outputs

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The schedule already ran backward; its gradients come back here, between Lightning's hooks."""
        if self._state.manual is not None:
            return self._state.manual.backward(closure_loss, *args, **kwargs)  # manual_backward: a real backward
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._state.stashed.put_back()
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        def closure_then_reduce() -> Any:
            result = closure()
            if self._state.manual is None:  # manual_backward reduced its gradients already
                self.engine.reduce_gradients()
            # The step changes the weights: a survivor snapshot's copy still reading them (it overlapped this
            # step's forward and backward) finishes first, a wait on the device, not the host.
            self._state.keeper.before_optimizer_step()
            return result

        output = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
        self.engine.after_optimizer_step()
        return output

    def _patch_clipping(self) -> None:
        """Lightning clips by the norm of this rank's parameters; the global norm spans every stage. (By hand:
        one unsharded stage whose gradients are reduced at backward, so Lightning's clipping is right as it is.)"""
        if self._state.clip_patched or not self.lightning_module.automatic_optimization:
            return
        self.precision_plugin.clip_grad_by_norm = lambda optimizer, clip_val: self.engine.clip_grad_norm_(clip_val)
        self._state.clip_patched = True

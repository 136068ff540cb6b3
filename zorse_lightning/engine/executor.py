"""Running one step of a plan on this rank: the schedule's actions, routing, reductions.

The caller gives the rank's batch (the samples of its microbatches, in index
order) and ``step_fn(microbatch, index) -> loss``: the user's own step. On a
non-last stage the step ends inside the block chain (:class:`StageOutput`); on
the last it returns the loss. Activations go to the rank of the next stage that
owns the microbatch, their gradients come back the same way.

An idle rank (in no stage of the plan) runs no action and holds no weights (its
copy of the module is freed at :meth:`PipelineEngine.prepare`), but makes every
collective the working ranks make over the whole world: the probe's agreement,
the loss, the global gradient norm.

Putting the stage in place before the first step, and which parameters this rank
holds, is the base class's (:mod:`.preparation`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zorse_lightning.engine import gradients
from zorse_lightning.module.blocks import StageOutput
from zorse_lightning.engine.groups import StageGroups
from zorse_lightning.engine.preparation import StagePreparation, StepFn, loss_of
from zorse_lightning.module.microbatch import microbatch_slice
from zorse_lightning.engine.p2p import Transport, post_batches
from zorse_lightning.module.materialize import InitialValues
from zorse_lightning.schedule.actions import Action, ActionKind, Message, messages_of
from zorse_lightning.schedule.gathering_rounds import EMPTY_ROUND
from zorse_lightning.schedule.programs import build_schedule
from zorse_lightning.module.tensor_parallel import Style


def _holds_loss(output: Any) -> bool:
    """Whether an evaluation step returned a loss (a scalar, or a dict with one), not predictions."""
    loss = output.get("loss") if isinstance(output, dict) else output
    return isinstance(loss, torch.Tensor) and loss.dim() == 0


class PipelineEngine(StagePreparation):
    """One rank's executor of a plan: cut the module (:meth:`prepare`, of its base), then run steps."""

    def __init__(
        self,
        module: nn.Module,
        groups: StageGroups,
        device: torch.device,
        block_path: str | None = None,
        gradient_bucket_bytes: int = gradients.BUCKET_BYTES,
        initial: InitialValues = InitialValues(),
        host_group: Any = None,
        tp_plan: dict[str, Style] | None = None,
    ):
        """``initial``: the first values of what this rank places on ``device`` where the module was built on
        the meta device (or the state a resumed checkpoint holds). ``host_group``: a gloo group over all ranks
        for the small host tensors of the step (None: the default group, where it is gloo). ``tp_plan``: how a
        block splits over a TP group where the plan asks for one (None: the module's own,
        :mod:`zorse_lightning.module.tensor_parallel`)."""
        super().__init__(module, groups, device, block_path, gradient_bucket_bytes, initial, tp_plan)
        self.schedule = build_schedule(self.plan)
        self.forward_schedule = build_schedule(self.plan, forward_only=True)
        self.transport = Transport(device, groups.pipeline_group, host_group)

    # -- one step -----------------------------------------------------------------------

    def run(
        self, batch: Any, step_fn: StepFn, loss_scale: float = 1.0, reduce_in_backward: bool = False
    ) -> torch.Tensor:
        """Forward and backward of every scheduled microbatch; returns the global mean loss on every rank.

        Gradients accumulate into ``.grad`` (local, not yet reduced: call
        :meth:`reduce_gradients` before the optimizer step). ``loss_scale``
        multiplies the backward (for example ``1 / accumulate_grad_batches``).
        ``reduce_in_backward``: this run's gradients are the step's final ones
        (the last run before :meth:`reduce_gradients`, which nothing adds to
        before it), so their reduction over the stage starts during the rank's
        last backward and overlaps it.
        """
        return self._execute(batch, step_fn, loss_scale, train=True, reduce_in_backward=reduce_in_backward)

    @torch.no_grad()
    def evaluate(self, batch: Any, step_fn: StepFn) -> dict[int, Any]:
        """Forward only; returns the step outputs of this rank's microbatches on the last stage."""
        outputs: dict[int, Any] = {}
        self._execute(batch, step_fn, 0.0, train=False, outputs=outputs)
        return outputs

    def _execute(self, batch, step_fn, loss_scale, train, outputs=None, reduce_in_backward=False) -> torch.Tensor:
        if not self.prepared:
            raise RuntimeError("call PipelineEngine.prepare(batch, step_fn) once before the first step")
        share = self._my_share()
        weight = self.plan.microbatch_size / self.plan.global_batch_size
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        last = len(self.plan.stages) - 1
        loss_sum = torch.zeros((), device=self.device)
        program = self._program(train)
        gathered = self.sharded is not None and self.sharded.before_run(self.local_parameters())
        schedule = self.schedule if train else self.forward_schedule
        to_post = schedule.batches[self.groups.rank] if self.is_pipelined else ()
        arm_at, reduce_at = self._reduction_points(schedule, program) if reduce_in_backward else ({}, set())
        if reduce_in_backward:
            self.reduction.prepare_step()

        def gradient_like(message: Message) -> torch.Tensor:
            return saved[(message.boundary, message.microbatch)][1]

        ran = 0
        for i, action in enumerate(program):
            j = action.microbatch
            to_post = post_batches(self.transport, to_post, ran, gradient_like)
            if j == EMPTY_ROUND:  # after posting what this rank's actions made: a peer may wait for it
                self._empty_round(action.kind)
                continue
            if ran in reduce_at:
                self.reduction.start_all()
            ran += 1
            if action.kind is ActionKind.FORWARD:
                micro = microbatch_slice(batch, j - share.start, self.plan.microbatch_size)
                received, output = self._forward(action, micro, step_fn, train)
                if action.stage == last:
                    if outputs is not None:
                        outputs[j] = output
                    if train or _holds_loss(output):
                        loss = loss_of(output)
                        if self.groups.tensor_index == 0:  # every rank of a TP group computes the same loss
                            loss_sum += loss.detach().float() * weight
                        output = loss * (weight * loss_scale)
                if train:
                    saved[(action.stage, j)] = (received, output)
            else:
                if i in arm_at:
                    self.reduction.arm()
                self._backward(action, *saved[(action.stage, j)])
                del saved[(action.stage, j)]
        post_batches(self.transport, to_post, ran, gradient_like)
        if ran in reduce_at:
            self.reduction.start_all()
        self.transport.finish()
        if gathered and not train:
            self.sharded.release(self.local_parameters())
        if self.sharded is not None:
            self.sharded.settle(self.local_parameters())
        if self.plan.world_size > 1:
            dist.all_reduce(loss_sum, group=self.groups.call(None, "the step's loss"))
        return loss_sum

    def _program(self, train: bool) -> tuple[Action, ...]:
        """This rank's actions; with weights gathered per microbatch, padded with empty rounds to the stage's
        busiest rank (every rank makes the same gathers: ``PipelineSchedule.rounds``)."""
        schedule = self.schedule if train else self.forward_schedule
        return schedule.rounds[self.groups.rank]

    def _reduction_points(self, schedule, program: list) -> tuple[set[int], set[int]]:
        """Where this run's reduction over the stage's group starts: (indices of ``program`` before whose
        backward the hooks start each bucket as it becomes final, counts of actions after which, its batches
        posted, every bucket starts). A pipelined rank starts where the schedule says
        (:mod:`..schedule.step_collectives`: never while a peer may wait for a batch it has not posted); a
        plan without messages has none to hold, so its hooks start during the last backward, as DDP's do."""
        if self.groups.is_idle:
            return set(), set()
        if self.is_pipelined:
            rank = self.groups.rank
            return set(), {c.after_actions for c in schedule.collectives[rank] if c.reduces and not c.at_end}
        backwards = [i for i, a in enumerate(program) if a.kind is ActionKind.BACKWARD]
        return ({backwards[-1]} if backwards else set()), set()

    def _empty_round(self, kind: ActionKind) -> None:
        if kind is ActionKind.FORWARD:
            self.sharded.gathering.empty_forward()
        else:
            self.sharded.gathering.empty_backward()

    def _forward(self, action: Action, micro: Any, step_fn: StepFn, train: bool) -> tuple[torch.Tensor | None, Any]:
        """Stage ``action.stage``'s forward of its microbatch (one of this rank's stages: several if interleaved)."""
        stage, j = action.stage, action.microbatch
        receives, sends = messages_of(self.plan, self.groups.rank, action)
        received = None
        if self.cut is not None:
            self.cut.active = stage
        if receives:
            received = self.transport.take(receives[0])
            received.requires_grad_(train)
            self.cut.incoming = received
        try:
            output = step_fn(micro, j)
        except StageOutput as end:
            if self.sharded is not None and self.sharded.gathering is not None:
                self.sharded.gathering.stage_ended(end.output)
            for message in sends:  # none on a TP rank whose index feeds no rank of the next stage's replica
                self.transport.stage(message, end.output)
            return received, end.output
        finally:
            if self.cut is not None:
                self.cut.incoming = None
        if sends:
            raise RuntimeError(
                f"the step of microbatch {j} returned on stage {stage} without reaching the end of "
                f"its blocks {self.plan.stages[stage].layers}; does the step run the block list?"
            )
        return received, output

    def _backward(self, action: Action, received: torch.Tensor | None, output: torch.Tensor) -> None:
        """Outside autocast, as Lightning's backward is; the step's autocast region stays open around it, so
        its cache of low-precision weights lives for the whole step (nested, it is not cleared here)."""
        receives, sends = messages_of(self.plan, self.groups.rank, action)
        gradient = self.transport.take(receives[0]) if receives else None
        with torch.autocast(self.device.type, enabled=False):
            if output.requires_grad:  # else no weight up to here trains (a first stage fine-tuning leaves frozen)
                torch.autograd.backward(output, gradient)
        if self.sharded is not None and self.sharded.gathering is not None:
            self.sharded.gathering.finish_backward()
        for message in sends:
            self.transport.stage(message, received.grad)

    # -- between backward and optimizer step --------------------------------------------

    def reduce_gradients(self) -> None:
        """Sum the gradients over the ranks holding each weight (finishing what ``reduce_in_backward`` started)."""
        self.reduction.finish()
        if self.sharded is not None:
            self.sharded.reduce(*self._own_and_shared())

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        counts = self.sharded.counts_in_norm if self.sharded is not None else None
        return gradients.clip_global_norm_(self._local_with_holders(), self.groups, max_norm, self.device, counts)

    def after_optimizer_step(self) -> None:
        if self.sharded is not None:
            self.sharded.after_step(self.local_parameters())

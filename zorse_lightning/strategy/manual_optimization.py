"""Modules that optimise by hand (``automatic_optimization = False``) on a one-stage plan.

Such a module's ``training_step`` calls ``manual_backward`` and ``opt.step()``
itself, so the engine cannot run a pipeline schedule around it: the plan is
one data-parallel stage (microbatches by speed), and each rank calls the
user's step once, on its own samples (the rank's microbatches together, as the
plan-driven sampler loads them). Two rules make it equal to one process on the
global batch:

- ``manual_backward(loss)`` backpropagates ``loss x local samples / global
  samples`` and sums the gradients *of that backward* over the stage at once
  (as DDP does), so after it every rank holds the global-batch mean gradient,
  added to whatever the parameters held before. A loss that is a mean over the
  rank's samples (plus any sample-independent term) comes out as one process
  would compute it; a rank without samples backpropagates with weight 0.
- the optimizer state is not sharded: each rank steps every weight with the same
  reduced gradients, so what the module does between backward and step
  (``clip_gradients``, ``toggle_optimizer``, several optimizers, schedulers) sees
  what it would see in one process. A sharded optimizer keeps only its shard's
  parameters, and ``toggle_optimizer`` would then freeze different weights on
  different ranks.

``self.log`` calls are captured and merged once per step, weighted by each
rank's samples (one gather, never a collective per call).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zorse_lightning.capabilities import Sharding
from zorse_lightning.engine.executor import PipelineEngine
from zorse_lightning.engine.tensor_parallel import as_gradient, local
from zorse_lightning.errors import PlanningError
from zorse_lightning.strategy.log_capture import LogCapture, LogMerger, capturing_logs, replay
from zorse_lightning.schedule.plan import Plan

def check_manual_plan(plan: Plan, module: nn.Module, precision_plugin: Any) -> None:
    """A module that optimises by hand needs one stage of every rank, unsharded, without loss scaling."""
    if getattr(module, "automatic_optimization", True):
        return
    name = type(module).__name__
    if len(plan.stages) > 1:
        raise PlanningError(
            f"the plan cuts {name} into {len(plan.stages)} pipeline stages, but {name} optimises by hand "
            f"(automatic_optimization=False): its training_step calls manual_backward and opt.step() itself, which "
            f"a pipeline schedule cannot run stage by stage; give a one-stage (data-parallel) plan, or omit plan=... "
            f"to plan at start (a manual-optimisation module gets one stage)"
        )
    if plan.idle_ranks:
        raise PlanningError(
            f"the plan leaves ranks {list(plan.idle_ranks)} idle, but {name} optimises by hand and every rank runs its "
            f"training_step (and its optimizer steps); give a plan with every rank in the stage, or omit plan=..."
        )
    if plan.stages[0].sharding is not Sharding.NONE:
        raise PlanningError(
            f"the plan shards the optimizer state ({plan.stages[0].sharding.value!r}), but {name} optimises by hand "
            f"and its optimizers must hold every weight (clip_gradients and toggle_optimizer read them); give the "
            f"stage sharding 'none', or omit plan=... to plan at start"
        )
    if getattr(precision_plugin, "loss_scale", None) is not None:
        raise PlanningError(
            f"{name} optimises by hand, and fp16 with loss scaling is chosen (a GPU of the cluster lacks bf16); "
            f"loss scaling of hand-made optimizer steps is not supported: pass precision='32-true' (or "
            f"'bf16-mixed' where every GPU has bf16) to ZorseStrategy"
        )


class ManualOptimization:
    """One rank's share of a manual-optimisation step: the user's step on its samples, weighted backward."""

    def __init__(self, engine: PipelineEngine, module: nn.Module, precision_plugin: Any, host_group: Any = None) -> None:
        """``host_group``: a gloo group over all ranks for the log merge's flag (None: the default group)."""
        self.engine = engine
        self.module = module
        self.precision_plugin = precision_plugin
        plan, rank = engine.plan, engine.groups.rank
        self.local_samples = len(plan.stages[0].microbatch_ranges()[rank]) * plan.microbatch_size
        self.weight = self.local_samples / plan.global_batch_size
        """Of this rank's mean loss in the global-batch mean (0 for a rank without samples)."""
        self.log_merger = LogMerger(engine.device, host_group)
        """The metric layout each step's merge reuses (one small gather while names stay the same)."""

    def training_step(self, batch: Any, batch_idx: int, *rest: Any) -> Any:
        """The user's step once on this rank's samples; its logs merged over ranks."""
        capture = LogCapture(self.local_samples)
        with capturing_logs(self.module, capture):
            output = self.module.training_step(batch, batch_idx, *rest)
        if not self.local_samples:
            capture.records.clear()  # the step ran on a placeholder microbatch: nothing of it counts
        replay(self.module, capture.merged_over_ranks(self.log_merger), self.engine.plan.global_batch_size)
        return output

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``manual_backward``: Lightning's hooks see ``loss`` itself; the gradients are the global batch's."""
        loss = self.precision_plugin.pre_backward(loss, self.module)
        params = self.engine.local_parameters()
        earlier = [p.grad for p in params]
        for param in params:
            param.grad = None
        self.precision_plugin.backward(loss * self.weight, self.module, None, *args, **kwargs)
        if len(self.engine.groups.data_ranks) > 1:
            _sum_over_stage(params, self.engine.groups.data_group)
        for param, grad in zip(params, earlier):
            if grad is not None:
                param.grad = grad if param.grad is None else param.grad + grad
        return self.precision_plugin.post_backward(loss, self.module)


@torch.no_grad()
def _sum_over_stage(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Sum each gradient over ``group`` in one collective; a gradient no rank produced stays None.

    A rank may lack a gradient another has (a branch its samples did not take);
    it joins with zeros. One flag per parameter, summed with the gradients, says
    whether any rank had one, so an optimizer still skips weights no rank touched.
    """
    if not params:
        return
    dtype = next((p.grad.dtype for p in params if p.grad is not None), params[0].dtype)
    pieces = [
        local(p.grad).reshape(-1).to(dtype) if p.grad is not None else local(p).new_zeros(local(p).numel(), dtype=dtype)
        for p in params
    ]
    flags = torch.tensor([p.grad is not None for p in params], dtype=dtype, device=local(params[0]).device)
    flat = torch.cat([*pieces, flags])
    dist.all_reduce(flat, group=group)
    offset = 0
    for param, present in zip(params, flat[-len(params):].tolist()):
        numel = local(param).numel()  # this rank's slice of a weight split over a TP group
        if present:
            param.grad = as_gradient(param, flat[offset : offset + numel].view_as(local(param)).to(param.dtype, copy=True))
        offset += numel

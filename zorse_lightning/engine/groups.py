"""Process groups of a plan: each stage's group, the groups of weights shared by stages, and under tensor
parallelism (TP) each TP group and each TP index's data-parallel group.

``torch.distributed.new_group`` must be called by every rank, in the same order,
for every group, including groups the rank is not in; :func:`build_groups` does
so in an order derived from the plan alone. Every group gets the timeout, so a
dead peer surfaces as an error on the survivors instead of a hang; under NCCL
that needs :func:`tear_down_hung_collectives` before the first group exists.

Idle ranks (``Plan.idle_ranks``) are in no group of the plan: they take part only
in the collectives every rank makes over the whole world (the loss, the log
replay, the global gradient norm, checkpoint agreement), so a stage's reductions
never wait on a rank that holds none of its weights.

A weight shared by stages (a tied embedding and head) is summed among its
holders on each machine, then exchanged between one representative rank per
machine, then broadcast back (:class:`..schedule.step_collectives.SharedReduction`):
the exchange's group holds the representatives only, so a link between machines
carries one copy, not a ring over all of the stages' ranks.

A stage with TP degree t > 1 has no stage-wide group: its ranks sum gradients
with the replicas' ranks of their own TP index (which hold the same slices; over
the whole stage a replicated weight would be summed t times), and a shared
weight is summed likewise per TP index where the stages have one degree, else
by all of their ranks, each part scaled first by one over its rank's degree (:meth:`StageGroups.shared_scale`). TP
groups are made last, in the stages' and replicas' order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from zorse_lightning.engine.p2p_rules import LazyCommunicators
from zorse_lightning.schedule.plan import Plan
from zorse_lightning.schedule.step_collectives import (
    SharedReduction, shared_group_sets, shared_holders_by_machine, shared_reductions, shared_tensor_indices,
)

DEFAULT_TIMEOUT = timedelta(minutes=10)


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
TEAR_DOWN_WITHOUT_ABORT = "3"


def tear_down_hung_collectives(backend: str) -> None:
    """Under NCCL, have a collective that fails or outlives its group's timeout end the process, unless the
    user (or the launcher: torchrun sets 1) chose otherwise.

    A NCCL collective that a dead peer never joins does not fail: its kernel waits on the CUDA stream, and
    only this error handling, read by each NCCL process group as it is created (so before the first), turns
    the timeout into an end (0 leaves it hanging). Value 3, torch's present default, set so that the run
    does not depend on that default, ends the process without ``ncclCommAbort``: the abort can itself hang
    when a peer died mid-collective (torch's note on the value), and releasing the waiting kernels (1, 2)
    would let the aborted collective's partial result reach an optimizer step and a survivor's snapshot.
    Survivors keep their state before that: the watchdog (:mod:`zorse_lightning.engine.faults`) declares a
    silent peer lost well within the timeout (60 s against 10 min by default), and keeping reads only
    host copies (:mod:`zorse_lightning.engine.checkpoint.survivors`)."""
    if backend == "nccl":
        os.environ.setdefault(NCCL_ERROR_HANDLING, TEAR_DOWN_WITHOUT_ABORT)


@dataclass(frozen=True)
class StageGroups:
    """This rank's view of the plan's communicators."""

    plan: Plan
    rank: int
    stage_index: int | None
    """The rank's group of ranks, which is also its first stage (interleaved plans give each group
    several stages: :attr:`stages`); None on an idle rank (in no stage)."""
    data_group: dist.ProcessGroup | None
    """The ranks this rank sums its stage's gradients with and shards optimizer state over: all of its stage's,
    or under TP the replicas' ranks of its TP index (None when idle)."""
    shared_groups: dict[frozenset[int], dist.ProcessGroup]
    """Stages holding a shared weight (first+last for tied embeddings, all) -> the group of the machines'
    representatives that exchange its sum (:class:`..schedule.step_collectives.SharedReduction`), for the
    sets where this rank is one."""
    pipeline_group: dist.ProcessGroup | None = None
    """All ranks, for the point-to-point messages between stages alone (None without stages to pass
    between), as Megatron-LM keeps a pipeline group: under NCCL batched messages run on the group's own
    communicator and stream, made once for all pairs at setup, and apart from the default group's
    collectives (the loss, the gradient norm), which would otherwise queue behind them on one stream."""
    in_order: tuple[tuple[tuple[int, ...], dist.ProcessGroup | None], ...] = ()
    """Every group of the plan (members, group), the default one first, then in the one order every rank made
    them (the group is None where this rank is not a member): the order :mod:`.communicators` makes their
    communicators in."""
    lazy: LazyCommunicators | None = None
    """NCCL's lazy communicators kept on gloo in the rules mode (None: not modelled)."""
    tensor_group: dist.ProcessGroup | None = None
    """The ranks of this rank's TP group (None without tensor parallelism)."""
    machine_groups: dict[frozenset[int], dist.ProcessGroup] = field(default_factory=dict)
    """Stages holding a shared weight -> the group of its holders on this rank's machine (this rank's TP index),
    which sum it into their representative and receive the sum back, for the sets where there are several."""

    def call(self, group: dist.ProcessGroup | None, what: str) -> dist.ProcessGroup | None:
        """``group``, for the collective ``what`` this rank is about to issue on it: in the rules mode, a group's
        first collective waits for every member, as making its NCCL communicator does."""
        return self.lazy.call(group, what) if self.lazy is not None else group

    @property
    def is_idle(self) -> bool:
        """In no stage: holds no weights and no samples, joins only the world-wide collectives."""
        return self.stage_index is None

    @property
    def stage(self):
        return self.plan.stages[self.stage_index]

    @property
    def stages(self) -> tuple[int, ...]:
        """Every stage this rank runs (one unless interleaved)."""
        return self.plan.stages_of_group(self.stage_index)

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        return self.stage.ranks

    @property
    def tensor_index(self) -> int:
        """This rank's place in its TP group (0 without tensor parallelism)."""
        return self.stage.tensor_index(self.rank)

    @property
    def data_ranks(self) -> tuple[int, ...]:
        """The ranks of :attr:`data_group`, in stage order."""
        return self.stage.data_ranks(self.tensor_index)

    @property
    def data_shard_fractions(self) -> tuple[float, ...]:
        """Each of :attr:`data_ranks`' share of the state sharded over them (summing to 1)."""
        return self.stage.effective_shard_fractions()[self.tensor_index :: self.stage.tensor_parallel]

    def shared_scale(self, stages: frozenset[int]) -> float:
        """What this rank's gradient of a weight ``stages`` share is scaled by before it is summed over their
        ranks: 1, or where their TP degrees differ (all of their ranks sum it, and every rank of a TP group holds
        the same gradient) one over this rank's degree, so that each replica counts once (exact where the degree
        is a power of two, within a rounding otherwise)."""
        degrees = {self.plan.stages[s].tensor_parallel for s in stages}
        return 1.0 if len(degrees) == 1 else 1.0 / self.stage.tensor_parallel

    def shared_reduction(self, stages: frozenset[int]) -> SharedReduction:
        """How this rank sums the gradient of a weight ``stages`` share (which must include its own)."""
        return next(r for r in shared_reductions(self.plan, self.rank) if frozenset(r.groups) == stages)


def build_groups(plan: Plan, rank: int, timeout: timedelta = DEFAULT_TIMEOUT) -> StageGroups:
    """Create the plan's groups on every rank (a collective call: all ranks must call it)."""
    if not dist.is_initialized():
        raise RuntimeError("build_groups needs an initialised default process group (torch.distributed)")
    if dist.get_world_size() != plan.world_size:
        raise RuntimeError(
            f"the plan is for {plan.world_size} ranks but {dist.get_world_size()} processes were launched; "
            f"launch {plan.world_size} processes or plan for {dist.get_world_size()}"
        )
    in_order = [(tuple(range(plan.world_size)), dist.group.WORLD)]

    def made(ranks) -> dist.ProcessGroup | None:
        group = dist.new_group(list(ranks), timeout=timeout)
        in_order.append((tuple(ranks), group if rank in ranks else None))
        return group

    def mine(by_index: list[dist.ProcessGroup], ranks_of) -> dist.ProcessGroup | None:
        """Of one group per TP index, this rank's (None where it is in none)."""
        return next((g for i, g in enumerate(by_index) if rank in ranks_of(i)), None)

    data_groups = [
        mine([made(stage.data_ranks(i)) for i in range(stage.tensor_parallel)], stage.data_ranks)
        for stage in plan.rank_groups
    ]
    shared, machine_groups = {}, {}
    for stages in shared_group_sets(plan):
        for i in shared_tensor_indices(plan, stages):
            machines = shared_holders_by_machine(plan, stages, i)
            for ranks in machines:
                if len(ranks) > 1:
                    group = made(ranks)
                    if rank in ranks:
                        machine_groups[frozenset(stages)] = group
            representatives = tuple(m[0] for m in machines)
            if len(representatives) > 1:
                group = made(representatives)
                if rank in representatives:
                    shared[frozenset(stages)] = group
    pipeline = made(range(plan.world_size)) if len(plan.stages) > 1 else None
    tensor_groups = {replica: made(replica) for stage in plan.rank_groups for replica in stage.replicas if len(replica) > 1}
    lazy = LazyCommunicators()
    if rank in plan.idle_ranks:
        return StageGroups(plan, rank, None, None, {}, pipeline, tuple(in_order), lazy)
    stage_index = plan.stage_of_rank(rank)
    tensor_group = tensor_groups.get(plan.stages[stage_index].tensor_group(rank))
    shared = {stages: group for stages, group in shared.items() if group is not None}
    return StageGroups(
        plan, rank, stage_index, data_groups[stage_index], shared, pipeline, tuple(in_order), lazy, tensor_group,
        machine_groups,
    )

"""Where in a step each rank issues its collectives, as data: the engine starts its reductions there and
the schedule's play (:func:`.p2p_batches.play_rendezvous`) checks that no order of them can hang.

Two things make a collective dangerous inside a pipeline. NCCL makes a group's
communicator at its first collective and connects an algorithm the first time it
runs, blocking the host of each member until all have called it; and a running
collective's kernel waits on the device for its peers, so a host-device
synchronisation in that window (an allocator retry, ``.item()``) blocks the host
too. A stage's gradient reduction started inside its last backward, as DDP starts
its own, holds the host before it posts the batch carrying that backward's
gradient upstream; a replica of the same stage may be waiting for an activation
the upstream rank sends only after it has that gradient. So:

- a rank's reductions over its stage's group start once it has run its last
  action and posted the batch carrying its last gradient, before its batches
  complete: the overlap with the pipeline's drain stays, and nothing the rank
  still has to post can be waited for. Starting each interleaved chunk's
  reduction after its own last backward would overlap more, but a chunk's
  replica then holds its host while a peer of the same group waits, through
  other groups, for this rank's later chunks (the play finds such plans), and
  the cost model does not count that overlap (:mod:`.cost.comm`);
- a stage that gathers its weights per microbatch meets its peers in every
  round (:mod:`.gathering_rounds`), before its reduction;
- at the step's end, once its batches completed, every rank issues the same
  sequence: the loss over the world, the weights shared by several stages
  (one set after another, in one order: :func:`shared_reduction`), the gradient
  norm over the world.

The play treats every one of these calls as blocking its host until all members
of the group have called it, the strictest reading; a program that passes it
cannot hang where calls block less (warm communicators, no synchronisation).

Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zorse_lightning.schedule.actions import Action
from zorse_lightning.schedule.gathering_rounds import round_collectives
from zorse_lightning.schedule.p2p_batches import HostCollective, P2PBatch
from zorse_lightning.schedule.plan import Plan


def shared_group_sets(plan: Plan) -> tuple[tuple[int, ...], ...]:
    """The sets of several groups of ranks that may hold one weight, in the order every rank reduces them:
    first with last (a tied embedding and head), then all groups."""
    last = plan.num_groups - 1
    sets = [(0, last)] if last > 0 else []
    if last > 1:
        sets.append(tuple(range(last + 1)))
    return tuple(sets)


@dataclass(frozen=True)
class SharedReduction:
    """How one rank sums the gradient of a weight that the groups ``groups`` share, so that the link between
    the groups (between machines or datacenters, often the plan's slowest) carries one copy each way, not a
    ring over every rank of them: summed into the representative of the rank's data-parallel group (its
    first rank) over that group, exchanged between the groups' representatives, and broadcast back over the
    group. Under tensor parallelism each TP index does so among its own ranks where the groups' degrees
    agree; where they differ, the exchange joins every rank of the groups' first replicas, each part scaled
    by one over its rank's degree (``engine.groups.StageGroups.shared_scale``)."""

    groups: tuple[int, ...]
    data_ranks: tuple[int, ...]
    """The rank's data-parallel group (its stage's ranks of its TP index), whose first rank represents it."""
    exchange_ranks: tuple[int, ...]
    """The representatives that exchange the group's sum (this rank's among them only where it is one)."""

    @property
    def representative(self) -> int:
        return self.data_ranks[0]

    def collectives(self, rank: int) -> tuple[HostCollective, ...]:
        """The rank's calls, in the engine's order: reduce over its group, exchange (a representative only),
        broadcast over its group; a group of one rank skips its own two."""
        inside = len(self.data_ranks) > 1
        what = f"weights shared by groups {list(self.groups)}"
        calls = [HostCollective(self.data_ranks, f"the sum of {what} into rank {self.representative}", at_end=True)] if inside else []
        if rank == self.representative and len(self.exchange_ranks) > 1:
            calls.append(HostCollective(self.exchange_ranks, f"the exchange of {what} between their groups", at_end=True))
        if inside:
            calls.append(HostCollective(self.data_ranks, f"the broadcast of {what} from rank {self.representative}", at_end=True))
        return tuple(calls)


def exchange_ranks(plan: Plan, groups: Sequence[int], tensor_index: int) -> tuple[int, ...]:
    """The representatives of ``groups`` that TP index ``tensor_index`` exchanges a shared weight's sum with
    (see :class:`SharedReduction`), ascending."""
    stages = [plan.stages[g] for g in groups]
    if len({s.tensor_parallel for s in stages}) > 1:
        return tuple(sorted(r for s in stages for r in s.replicas[0]))
    return tuple(sorted(s.data_ranks(tensor_index)[0] for s in stages))


def shared_reductions(plan: Plan, rank: int) -> tuple[SharedReduction, ...]:
    """The rank's :class:`SharedReduction` for each set of :func:`shared_group_sets` holding its group, in order
    (none on an idle rank)."""
    if rank in plan.idle_ranks:
        return ()
    group = plan.stage_of_rank(rank)
    stage = plan.stages[group]
    index = stage.tensor_index(rank)
    return tuple(
        SharedReduction(groups, stage.data_ranks(index), exchange_ranks(plan, groups, index))
        for groups in shared_group_sets(plan) if group in groups
    )


def step_collectives(
    plan: Plan, programs: Sequence[Sequence[Action]], batches: Sequence[Sequence[P2PBatch]], forward_only: bool = False,
    rounds: Sequence[Sequence[Action]] | None = None,
) -> tuple[tuple[HostCollective, ...], ...]:
    """Every rank's collectives of one step, in the order it issues them (see the module's docstring); ``rounds``:
    each rank's program with the empty rounds of a stage gathering per microbatch
    (:func:`.gathering_rounds.gathering_programs`; None: ``programs``, where no stage gathers)."""
    rounds = programs if rounds is None else rounds
    world = tuple(range(plan.world_size))
    every = []
    for rank, program in enumerate(programs):
        mine = round_collectives(plan, rank, rounds[rank], batches[rank])
        if not forward_only:
            mine += _reductions(plan, rank, program, batches[rank])
        mine.append(HostCollective(world, "the step's loss over every rank", at_end=True))
        if not forward_only:
            mine += [call for shared in shared_reductions(plan, rank) for call in shared.collectives(rank)]
            mine.append(HostCollective(world, "the gradient norm over every rank", at_end=True))
        every.append(tuple(mine))
    return tuple(every)


def _reductions(plan: Plan, rank: int, program: Sequence[Action], batches: Sequence[P2PBatch]):
    """The rank's reduction over its stage's group (every stage it runs): once it has run its last action and
    posted its last batch, before they complete."""
    if rank in plan.idle_ranks:
        return
    group = plan.stage_of_rank(rank)
    ranks = plan.rank_groups[group].ranks
    if len(ranks) > 1:
        stages = tuple(sorted(plan.stages_of_group(group), reverse=True))
        yield HostCollective(ranks, f"the gradient reduction of stages {list(stages)}", len(program), len(batches), reduces=stages)

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
- at the step's end, once its batches completed, every rank issues the same
  sequence: the loss over the world, the weights shared by several stages
  (one group per set, in one order), the gradient norm over the world.

The play treats every one of these calls as blocking its host until all members
of the group have called it, the strictest reading; a program that passes it
cannot hang where calls block less (warm communicators, no synchronisation).

Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from zorse_lightning.schedule.actions import Action
from zorse_lightning.schedule.p2p_batches import HostCollective, P2PBatch
from zorse_lightning.schedule.plan import Plan


def shared_rank_sets(plan: Plan) -> tuple[tuple[int, ...], ...]:
    """The ranks of each set of groups that may hold one weight, in the order every rank reduces them: first
    with last (a tied embedding), then all groups."""
    last = plan.num_groups - 1
    sets = [(0, last)] if last > 0 else []
    if last > 1:
        sets.append(tuple(range(last + 1)))
    return tuple(tuple(sorted(r for g in groups for r in plan.rank_groups[g].ranks)) for groups in sets)


def step_collectives(
    plan: Plan, programs: Sequence[Sequence[Action]], batches: Sequence[Sequence[P2PBatch]], forward_only: bool = False
) -> tuple[tuple[HostCollective, ...], ...]:
    """Every rank's collectives of one step, in the order it issues them (see the module's docstring)."""
    world = tuple(range(plan.world_size))
    shared = shared_rank_sets(plan)
    every = []
    for rank, program in enumerate(programs):
        mine = [] if forward_only else list(_reductions(plan, rank, program, batches[rank]))
        mine.append(HostCollective(world, "the step's loss over every rank", at_end=True))
        if not forward_only:
            mine += [HostCollective(ranks, f"the reduction of weights shared by ranks {list(ranks)}", at_end=True)
                     for ranks in shared if rank in ranks]
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

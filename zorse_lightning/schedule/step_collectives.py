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
    """How one rank sums the gradient of a weight that the groups ``groups`` share, so that a link between
    machines (between datacenters, often the plan's slowest) carries one copy each way, not a ring over
    every rank of them: summed into the representative of the rank's machine (its first rank there among
    the holders) over the holders on that machine, exchanged between the machines' representatives, and
    broadcast back on each machine. Under tensor parallelism each TP index does so among its own ranks where
    the groups' degrees agree; where they differ, all of their ranks do, each part scaled first by one over
    its rank's degree (``engine.groups.StageGroups.shared_scale``)."""

    groups: tuple[int, ...]
    machine_ranks: tuple[int, ...]
    """The holders on the rank's machine (its TP index's, ascending), whose first rank represents them."""
    exchange_ranks: tuple[int, ...]
    """Every machine's representative (this rank among them only where it is one), ascending."""

    @property
    def representative(self) -> int:
        return self.machine_ranks[0]

    def collectives(self, rank: int) -> tuple[HostCollective, ...]:
        """The rank's calls, in the engine's order: reduce on its machine, exchange (a representative only),
        broadcast on its machine; a machine with one holder skips its own two."""
        inside = len(self.machine_ranks) > 1
        what = f"weights shared by groups {list(self.groups)}"
        calls = [HostCollective(self.machine_ranks, f"the sum of {what} into rank {self.representative}", at_end=True)] if inside else []
        if rank == self.representative and len(self.exchange_ranks) > 1:
            calls.append(HostCollective(self.exchange_ranks, f"the exchange of {what} between machines", at_end=True))
        if inside:
            calls.append(HostCollective(self.machine_ranks, f"the broadcast of {what} from rank {self.representative}", at_end=True))
        return tuple(calls)


def shared_holders_by_machine(plan: Plan, groups: Sequence[int], tensor_index: int) -> tuple[tuple[int, ...], ...]:
    """The ranks of ``groups`` that sum a shared weight together with TP index ``tensor_index`` (all of their
    ranks where their TP degrees differ), by machine: each machine's ascending, machines by their first."""
    stages = [plan.stages[g] for g in groups]
    alike = len({s.tensor_parallel for s in stages}) == 1
    by_machine: dict[str, list[int]] = {}
    for stage in stages:
        for rank, machine in zip(stage.ranks, stage.machines):
            if not alike or stage.tensor_index(rank) == tensor_index:
                by_machine.setdefault(machine, []).append(rank)
    return tuple(sorted(tuple(sorted(ranks)) for ranks in by_machine.values()))


def shared_tensor_indices(plan: Plan, groups: Sequence[int]) -> range:
    """The TP indices that sum a weight ``groups`` share apart (one, 0, where their degrees differ)."""
    degrees = {plan.stages[g].tensor_parallel for g in groups}
    return range(degrees.pop() if len(degrees) == 1 else 1)


def shared_reductions(plan: Plan, rank: int) -> tuple[SharedReduction, ...]:
    """The rank's :class:`SharedReduction` for each set of :func:`shared_group_sets` holding its group, in order
    (none on an idle rank)."""
    if rank in plan.idle_ranks:
        return ()
    group = plan.stage_of_rank(rank)
    found = []
    for groups in shared_group_sets(plan):
        if group in groups:
            index = plan.stages[group].tensor_index(rank) if len(shared_tensor_indices(plan, groups)) > 1 else 0
            machines = shared_holders_by_machine(plan, groups, index)
            mine = next(m for m in machines if rank in m)
            found.append(SharedReduction(groups, mine, tuple(m[0] for m in machines)))
    return tuple(found)


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

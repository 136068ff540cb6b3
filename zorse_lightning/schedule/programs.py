"""Pipeline schedules as data: a list of actions per rank, validated and printable.

A stage is a group of ranks and each rank of a stage processes its own share of
the iteration's microbatches (``StagePlan.microbatch_ranges``). Every rank walks
its microbatches in one *global* order (:func:`microbatch_order`), so the
messages between any two ranks are sent and received in the same order (NCCL
matches point-to-point messages by order, not by tag). Whether a program can
deadlock is then only a question of waiting: :func:`play_in_steps` runs all
programs step by step with unbounded send buffers (sends are asynchronous in the
executor) and raises if some rank can never proceed. The timeline picture plays
these same programs in event time (:mod:`.cost.simulate`). 1F1B's programs are
recorded from a play of their own (:mod:`.one_f_one_b`).

Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zorse_lightning.capabilities import Schedule
from zorse_lightning.errors import PlanningError
from zorse_lightning.schedule.actions import Action, ActionKind, Message, balanced_durations, deadlock_error, messages_of
from zorse_lightning.schedule.one_f_one_b import action_counts, one_f_one_b_programs
from zorse_lightning.schedule.one_f_one_b import one_f_one_b_limit, one_f_one_b_warmup  # noqa: F401  the planner's import path
from zorse_lightning.schedule.p2p_batches import HostCollective, P2PBatch, play_rendezvous, rank_batches
from zorse_lightning.schedule.plan import Plan, StagePlan
from zorse_lightning.schedule.gathering_rounds import PADDINGS, gathering_programs
from zorse_lightning.schedule.step_collectives import step_collectives


@dataclass(frozen=True)
class PipelineSchedule:
    """Programs of every rank; ``programs[rank]`` is that rank's ordered actions."""

    schedule: Schedule
    programs: tuple[tuple[Action, ...], ...]
    grid: tuple[tuple[Action | None, ...], ...]
    """``grid[rank][step]``: the action a rank runs at each unit time step (None: idle)."""
    batches: tuple[tuple[P2PBatch, ...], ...]
    """``batches[rank]``: what the rank posts to its peers, in order (:mod:`.p2p_batches`)."""
    collectives: tuple[tuple[HostCollective, ...], ...] = ()
    """``collectives[rank]``: where the rank issues its collectives of the step (:mod:`.step_collectives`)."""
    rounds: tuple[tuple[Action, ...], ...] = ()
    """``rounds[rank]``: what the rank runs, its program with the empty rounds of a stage that gathers per
    microbatch (:mod:`.gathering_rounds`); its program elsewhere."""

    def for_rank(self, rank: int) -> tuple[Action, ...]:
        return self.programs[rank]

    def format(self) -> str:
        """Rank-by-step grid, one row per rank, ``.`` where a rank waits."""
        width = max((len(str(a)) for row in self.grid for a in row if a is not None), default=3)
        lines = []
        for rank, row in enumerate(self.grid):
            cells = " ".join(str(a).rjust(width) if a is not None else ".".rjust(width) for a in row)
            lines.append(f"rank {rank}: {cells}")
        return "\n".join(lines)

    @property
    def num_steps(self) -> int:
        return max((len(row) for row in self.grid), default=0)


def microbatch_order(plan: Plan) -> tuple[int, ...]:
    """The order in which every rank walks its microbatches.

    Microbatches are interleaved by their relative position inside their rank's
    share in the widest stage, so that every rank of that stage receives work
    early instead of waiting for the first ranks' shares to drain (a narrow
    stage feeding a wide one would otherwise starve the wide stage's last ranks).
    """
    widest = max(plan.stages, key=lambda stage: len(stage.replicas))
    position: dict[int, float] = {}
    for microbatches in widest.microbatch_ranges().values():
        for offset, microbatch in enumerate(microbatches):
            position[microbatch] = (offset + 0.5) / len(microbatches)
    return tuple(sorted(range(plan.num_microbatches), key=lambda j: (position[j], j)))


def rank_programs(plan: Plan, forward_only: bool = False) -> tuple[tuple[Action, ...], ...]:
    """Each rank's actions: GPipe (all forwards, then all backwards) or 1F1B.

    Interleaved GPipe runs breadth first: every microbatch through the rank's first
    chunk, then its next; backwards from the last chunk back.
    """
    order = microbatch_order(plan)
    if not forward_only and plan.schedule is Schedule.ONE_F_ONE_B:
        if plan.interleave == 1:
            return one_f_one_b_programs(plan, order, strict=False)[0]
        programs, length = one_f_one_b_programs(plan, order, strict=True)
        if length == shortest_play(plan):  # no play is shorter: the relaxed one would lose the tie anyway
            return programs
        relaxed = one_f_one_b_programs(plan, order, strict=False, within=length)  # None: as long at least
        return relaxed[0] if relaxed is not None and relaxed[1] < length else programs
    programs: list[tuple[Action, ...]] = [()] * plan.world_size
    for group, stage in enumerate(plan.rank_groups):
        chunks = plan.stages_of_group(group)
        for rank, share in stage.microbatch_ranges().items():
            mine = [j for j in order if j in share]
            forwards = [Action(s, ActionKind.FORWARD, j) for s in chunks for j in mine]
            backwards = [Action(s, ActionKind.BACKWARD, j) for s in reversed(chunks) for j in mine]
            programs[rank] = tuple(forwards) if forward_only else tuple(forwards + backwards)
    return tuple(programs)


def shortest_play(plan: Plan) -> int:
    """No 1F1B play of ``plan`` (:func:`~.one_f_one_b.one_f_one_b_programs`, in its units) is shorter: a rank of
    group ``g`` waits for its first activation to pass the groups before it (a quickest action of each), runs
    its actions back to back over the whole span, and its last backward's gradient then passes them again.
    Megatron's interleaved order meets it on equal groups (``2 M V + 2 (G - 1)``), and did on 11 of the 14
    interleaved plans recorded at 32 synthetic GPUs: the second play (:func:`rank_programs`) is then not needed."""
    durations = balanced_durations(action_counts(plan))
    span = max(len(plan.stages_of_group(g)) * 2 * n * durations[r] for g, stage in enumerate(plan.rank_groups)
               for r, n in zip(stage.ranks, stage.microbatches_per_rank) if n > 0)
    passes = [min((durations[r] for r in stage.ranks if r in durations), default=0) for stage in plan.rank_groups]
    return max(
        (span + 2 * sum(passes[:g]) for g, stage in enumerate(plan.rank_groups) if any(n > 0 for n in stage.microbatches_per_rank)),
        default=0,
    )


def play_in_steps(plan: Plan, programs: tuple[tuple[Action, ...], ...]) -> tuple[tuple[Action | None, ...], ...]:
    """Run the programs in unit time steps with FIFO channels; raise on deadlock.

    A rank runs its next action in a step when every message it must receive is
    at the head of its channel (sent in an earlier step); sends never block.
    """
    channels: dict[tuple[int, int], list[Message]] = {}
    cursor = [0] * len(programs)
    grid: list[list[Action | None]] = [[] for _ in programs]
    upcoming = [messages_of(plan, rank, program[0]) if program else None for rank, program in enumerate(programs)]
    """Each rank's next action's (receives, sends): a waiting rank is looked at every step."""
    while any(c < len(p) for c, p in zip(cursor, programs)):
        ready = []
        for rank, program in enumerate(programs):
            if cursor[rank] < len(program):
                receives, sends = upcoming[rank]
                if all(channels.get((m.src, m.dst), [None])[:1] == [m] for m in receives):
                    ready.append((rank, receives, sends))
        if not ready:
            raise deadlock_error(plan, programs, cursor)
        running = {rank for rank, _, _ in ready}
        for rank in range(len(programs)):
            grid[rank].append(programs[rank][cursor[rank]] if rank in running else None)
        for rank, receives, sends in ready:
            for message in receives:
                channels[(message.src, message.dst)].pop(0)
            for message in sends:
                channels.setdefault((message.src, message.dst), []).append(message)
            cursor[rank] += 1
            if cursor[rank] < len(programs[rank]):
                upcoming[rank] = messages_of(plan, rank, programs[rank][cursor[rank]])
    leftovers = [m for queue in channels.values() for m in queue]
    if leftovers:
        raise PlanningError(f"schedule leaves {len(leftovers)} messages unreceived, first {leftovers[0]}")
    return tuple(tuple(row) for row in grid)


def check_coverage(plan: Plan, programs: tuple[tuple[Action, ...], ...], forward_only: bool = False) -> None:
    """Every microbatch is forwarded (and backwarded) exactly once per stage, backward after forward."""
    kinds = (ActionKind.FORWARD,) if forward_only else (ActionKind.FORWARD, ActionKind.BACKWARD)
    for index, stage in enumerate(plan.stages):
        for rank, share in stage.microbatch_ranges().items():
            mine = plan.stages_of_rank(rank)
            if any(a.stage not in mine for a in programs[rank]):
                raise PlanningError(f"rank {rank} of stage {index} has actions of another group's stage: {programs[rank]}")
            program = [a for a in programs[rank] if a.stage == index]
            for kind in kinds:
                done = sorted(a.microbatch for a in program if a.kind is kind)
                if done != list(share):
                    raise PlanningError(
                        f"stage {index} rank {rank}: {kind.name.lower()} microbatches {done} != its share {list(share)}"
                    )
            if not forward_only:
                position = {(a.kind, a.microbatch): i for i, a in enumerate(program)}
                late = [j for j in share if position[(ActionKind.BACKWARD, j)] < position[(ActionKind.FORWARD, j)]]
                if late:
                    raise PlanningError(f"stage {index} rank {rank}: backward before forward for microbatches {late}")


def played_programs(
    plan: Plan, forward_only: bool = False
) -> tuple[tuple[tuple[Action, ...], ...], tuple[tuple[Action | None, ...], ...]]:
    """Each rank's program of ``plan``, checked to cover every microbatch and to end with unbounded
    buffers, and the unit-step play that shows it: what pricing needs (the planner prices hundreds of
    plans; the batches and their rendezvous play, a third of building a schedule, are built for the one
    that runs, and :func:`rank_batches` cannot deadlock a play that ends, tests/planner/test_p2p_batches.py)."""
    leaders = _one_rank_per_replica(plan)
    if leaders is not plan:  # a TP group's ranks run the same program in the same steps: played once
        programs, grid = played_programs(leaders, forward_only)
        return _for_every_rank(plan, programs), _for_every_rank(plan, grid)
    programs = rank_programs(plan, forward_only)
    check_coverage(plan, programs, forward_only)
    return programs, play_in_steps(plan, programs)


def lane_template(schedule: Schedule, groups: int, chunks: int, microbatches: int) -> tuple[Plan, tuple[tuple[Action, ...], ...]]:
    """A pipeline of ``groups`` one-GPU groups holding ``chunks`` chunks each, every rank running
    ``microbatches``, and its programs. A plan whose groups hold as many replicas, each running as many
    microbatches, is lanes of this one: each replica passes its microbatches to the next group's replica of its
    place alone, and runs the program of its group's rank here, action for action (the same stages, kinds and
    batches; its own microbatches), so what depends on that order is read here at a fraction of the recording
    (the activations a rank holds at its peak, the messages it waits for)."""
    stages = tuple(
        StagePlan(ranks=(s % groups,), gpu_types=("template",), machines=("template",), layers=(s, s + 1), microbatches_per_rank=(microbatches,))
        for s in range(groups * chunks)
    )
    template = Plan("template", "template", groups * chunks, groups, microbatches, 1, schedule, stages, interleave=chunks)
    return template, rank_programs(template)  # covered and deadlock-free: a lane of plans whose programs are checked


def lanes(plan: Plan) -> int | None:
    """The microbatches of each replica of a plan that is lanes of :func:`lane_template` (every group as many
    replicas, each as many microbatches); None where it is not."""
    widths = {len(group.replicas) for group in plan.rank_groups}
    counts = {n for group in plan.rank_groups for n in group.microbatches_per_rank}
    return counts.pop() if len(widths) == 1 and len(counts) == 1 else None


def lane_programs_of(plan: Plan, microbatches: int, programs: tuple[tuple[Action, ...], ...]) -> tuple[tuple[Action, ...], ...]:
    """``plan``'s programs from its :func:`lane_template`'s: the ``k``-th rank of each group (no TP) runs its
    group's template program on the ``k``-th share of ``microbatches``."""
    out: list[tuple[Action, ...]] = [()] * plan.world_size
    for g, group in enumerate(plan.rank_groups):
        for k, rank in enumerate(group.ranks):
            out[rank] = tuple(Action(a.stage, a.kind, a.microbatch + k * microbatches) for a in programs[g])
    return tuple(out)


def lane_batches_of(plan: Plan, microbatches: int, batches: tuple[tuple[P2PBatch, ...], ...]) -> tuple[tuple[P2PBatch, ...], ...]:
    """``plan``'s batches (:func:`.p2p_batches.rank_batches`) from its :func:`lane_template`'s: each message moved
    to the lane's ranks and microbatches, an instant's receives kept in the order of their senders' ranks."""
    ranks = [group.ranks for group in plan.rank_groups]
    out: list[tuple[P2PBatch, ...]] = [()] * plan.world_size
    for g, group in enumerate(plan.rank_groups):
        for k, rank in enumerate(group.ranks):
            def moved(m: Message, k: int = k) -> Message:
                return Message(ranks[m.src][k], ranks[m.dst][k], m.kind, m.microbatch + k * microbatches, m.boundary)
            out[rank] = tuple(
                P2PBatch(b.before, tuple(map(moved, b.sends)), tuple(sorted(map(moved, b.receives), key=lambda m: m.src)))
                for b in batches[g]
            )
    return tuple(out)


def waited_receives(template: Plan, programs: tuple[tuple[Action, ...], ...]) -> tuple[tuple[int, int], ...]:
    """Per group of a :func:`lane_template`: how many of a rank's received messages the action right after the
    batch receiving them needs (:mod:`.p2p_batches`: a rank takes each message in the batch of the instant its
    sender sends it), and how many it receives. Under NCCL's rules only those are waited for: a message received
    a batch or more ahead arrives while the rank runs the actions between. A plain pipeline's ranks need nearly
    every message at once (all but one of each rank's, the first group's every one); in Megatron's interleaved
    order the later groups take most of theirs ahead (four groups x3, 32 microbatches: 85, 86, 56 and 9 %)."""
    counts = []
    for rank, (program, batches) in enumerate(zip(programs, rank_batches(template, programs))):
        needed = {m: index for index, action in enumerate(program) for m in messages_of(template, rank, action)[0]}
        received = [needed[m] == batch.before for batch in batches for m in batch.receives]
        counts.append((sum(received), len(received)))
    return tuple(counts)


def _one_rank_per_replica(plan: Plan) -> Plan:
    """``plan`` with each TP group reduced to its first rank, the others idle (``plan`` itself without TP).
    Its play is the TP plan's, rank for rank: every rank of a group receives one message per action, sent in
    the same step by a rank of the sending group (:func:`.actions.messages_of`), so the group moves together
    in unit steps as its leader does alone, and recording 1F1B takes a t-th of the ranks' looks."""
    if all(stage.tensor_parallel == 1 for stage in plan.stages):
        return plan
    stages = tuple(
        replace(
            stage, ranks=stage.ranks[::t], gpu_types=stage.gpu_types[::t], machines=stage.machines[::t],
            microbatches_per_rank=stage.microbatches_per_rank[::t], shard_fractions=(), tensor_parallel=1,
        ) if (t := stage.tensor_parallel) > 1 else stage
        for stage in plan.stages
    )
    working = {r for stage in stages for r in stage.ranks}
    return replace(plan, stages=stages, idle_ranks=tuple(r for r in range(plan.world_size) if r not in working))


def _for_every_rank(plan: Plan, rows: tuple[tuple, ...]) -> tuple[tuple, ...]:
    """Rows of :func:`_one_rank_per_replica`'s ranks given to every rank of their TP groups."""
    out = list(rows)
    for group in plan.rank_groups:
        for replica in group.replicas:
            for rank in replica[1:]:
                out[rank] = rows[replica[0]]
    return tuple(out)


def build_schedule(plan: Plan, forward_only: bool = False) -> PipelineSchedule:
    """The validated schedule of ``plan`` (forward-only for evaluation and prediction): covered, deadlock-free
    with unbounded buffers (the unit-step play) and under NCCL's rules (its batches' and collectives'
    rendezvous play)."""
    programs, grid = played_programs(plan, forward_only)
    batches = rank_batches(plan, programs)
    if not any(stage.gather_per_microbatch for stage in plan.stages):
        collectives = step_collectives(plan, programs, batches, forward_only)
        play_rendezvous(plan, programs, batches, collectives)
        return PipelineSchedule(plan.schedule, programs, grid, batches, collectives, programs)
    hangs = []
    for padding in PADDINGS:  # the first whose rounds pass
        rounds = gathering_programs(plan, programs, grid, padding)
        collectives = step_collectives(plan, programs, batches, forward_only, rounds)
        try:
            play_rendezvous(plan, programs, batches, collectives)
        except PlanningError as hang:
            hangs.append(f"padded {padding.value}: {hang}")
            continue
        return PipelineSchedule(plan.schedule, programs, grid, batches, collectives, rounds)
    raise PlanningError(
        "no placement of the empty rounds of the stages gathering per microbatch keeps the schedule from hanging "
        "(give their ranks more even shares, or gather once per step): " + " | ".join(hangs)
    )

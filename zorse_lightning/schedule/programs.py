"""Pipeline schedules as data: a list of actions per rank, validated and printable.

A stage is a group of ranks and each rank of a stage processes its own share of
the iteration's microbatches (``StagePlan.microbatch_ranges``). Every rank walks
its microbatches in one *global* order (:func:`microbatch_order`), so the
messages between any two ranks are sent and received in the same order (NCCL
matches point-to-point messages by order, not by tag). Whether a program can
deadlock is then only a question of waiting: :func:`play_in_steps` runs all
programs step by step with unbounded send buffers (sends are asynchronous in the
executor) and raises if some rank can never proceed. The timeline picture plays
these same programs in event time (:mod:`.cost.simulate`).

Pure Python: no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from zorse_lightning.capabilities import Schedule
from zorse_lightning.errors import PlanningError
from zorse_lightning.schedule.actions import Action, ActionKind, Message, messages_of
from zorse_lightning.schedule.p2p_batches import HostCollective, P2PBatch, play_rendezvous, rank_batches
from zorse_lightning.schedule.plan import Plan
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
            return _one_f_one_b_programs(plan, order, strict=False)[0]
        return min((_one_f_one_b_programs(plan, order, strict) for strict in (True, False)), key=lambda r: r[1])[0]
    programs: list[tuple[Action, ...]] = [()] * plan.world_size
    for group, stage in enumerate(plan.rank_groups):
        chunks = plan.stages_of_group(group)
        for rank, share in stage.microbatch_ranges().items():
            mine = [j for j in order if j in share]
            forwards = [Action(s, ActionKind.FORWARD, j) for s in chunks for j in mine]
            backwards = [Action(s, ActionKind.BACKWARD, j) for s in reversed(chunks) for j in mine]
            programs[rank] = tuple(forwards) if forward_only else tuple(forwards + backwards)
    return tuple(programs)


def one_f_one_b_limit(plan: Plan, group: int) -> int:
    """Forwards a rank of ``group`` may have in flight (not yet backwarded) under 1F1B.

    Without interleaving: the warm-up of :func:`one_f_one_b_warmup` (the planner's
    memory model) and the one whose backward comes next. Interleaved, Megatron's
    warm-up, ``2 (G - g - 1) + (V - 1) G`` chunk-forwards for ``G`` equal groups,
    with each later group counted ``ceil(w_h / w_g)`` times where widths differ
    (a narrow group feeding a wide one must give each of its ranks work).
    """
    widths = tuple(len(stage.replicas) for stage in plan.rank_groups)
    if plan.interleave == 1:
        return one_f_one_b_warmup(widths, group) + 1
    feeds = [-(-width // widths[group]) for width in widths]
    return 2 * sum(feeds[group + 1 :]) + (plan.interleave - 1) * sum(feeds) + 1


def _one_f_one_b_programs(
    plan: Plan, order: tuple[int, ...], strict: bool
) -> tuple[tuple[tuple[Action, ...], ...], int]:
    """1F1B programs recorded from a step-by-step play of the pipeline.

    Writing each rank's program on its own (warm-up forwards, then alternate)
    deadlocks once stages differ in width and shares are uneven: a rank waits for
    a gradient whose forward is queued behind a rank that waits in turn. So the
    programs are recorded from a play in unit steps with FIFO channels, the rules
    :func:`play_in_steps` checks: each step every rank runs one action whose inputs are
    at the head of their channels: a forward while fewer than the limit
    (:func:`one_f_one_b_limit`) are in flight, else a ready backward: the classic
    warm-up, then one forward, one backward. Only when no rank can move within
    the limits do ranks exceed them, so the play, and the engine, cannot deadlock.

    Interleaved, a rank prefers its chunk-forwards and chunk-backwards in Megatron's
    order: ``G`` microbatches through one chunk, then the same ``G`` through the next
    (backwards from the last chunk), then the next ``G`` microbatches. ``strict``: it
    keeps to that order (waits for its next action's input), which for equal groups
    gives Megatron's ``2 M V + 2 (G - 1)`` chunk-steps exactly; else a ready action runs
    ahead of one still waiting, which suits uneven widths and shares better but, on
    equal groups with more than ``2 G`` microbatches, fills the first group's flight with
    its first chunk and stalls the later ones (``4 x 16`` microbatches at ``V = 4``: 169
    steps for 134). :func:`rank_programs` keeps the shorter of the two plays.

    Returns the programs and the play's length in unit steps.
    """
    last_stage = len(plan.stages) - 1
    state = {}
    for group, stage in enumerate(plan.rank_groups):
        chunks = plan.stages_of_group(group)
        for rank, share in stage.microbatch_ranges().items():
            mine = [j for j in order if j in share]
            state[rank] = _RankPlay(chunks, mine, plan.num_groups, one_f_one_b_limit(plan, group), last_stage)
    channels: dict[tuple[int, int], deque[Message]] = {}
    left = 2 * sum(len(play.pending) for play in state.values())
    """Actions still to run: each forward pending, and its backward."""

    def choose(play: _RankPlay, relaxed: bool) -> Action | None:
        in_order = strict and not relaxed
        backward, forward = play.ready_backward(in_order), play.ready_forward(in_order)
        if forward is not None and (len(play.in_flight) < play.limit or (relaxed and backward is None)):
            return forward
        return backward

    steps = 0
    while left:
        steps += 1
        chosen = {rank: choose(play, relaxed=False) for rank, play in state.items()}
        if all(action is None for action in chosen.values()):
            chosen = {rank: choose(play, relaxed=True) for rank, play in state.items()}
        if all(action is None for action in chosen.values()):
            raise PlanningError("no 1F1B order exists for this plan; use schedule=gpipe")
        sends: list[Message] = []
        for rank, action in chosen.items():
            if action is not None:
                receives, out = messages_of(plan, rank, action)
                for message in receives:
                    channel = channels[(message.src, message.dst)]
                    channel.popleft()
                    if channel:
                        state[rank].arrive(channel[0])
                sends += out
                state[rank].run(action)
                left -= 1
        for message in sends:
            channel = channels.setdefault((message.src, message.dst), deque())
            channel.append(message)
            if len(channel) == 1:
                state[message.dst].arrive(message)
    programs = tuple(tuple(state[rank].program) if rank in state else () for rank in range(plan.world_size))  # idle: ()
    return programs, steps


@dataclass
class _RankPlay:
    """One rank's progress during :func:`_one_f_one_b_programs` (local to it).

    Which of its actions are ready is kept as the play goes (:attr:`arrived`, :attr:`backwardable`,
    fed by the heads of its channels): looking for a ready forward among every pending one, each step,
    made recording quadratic in the microbatches."""

    chunks: tuple[int, ...]
    """The rank's stages, in layer order."""
    microbatches: list[int]
    """The rank's share, in the order it walks it."""
    round_size: int
    """Microbatches per interleaving round (the number of groups)."""
    limit: int
    last_stage: int
    """The plan's last stage, whose backwards need no gradient."""
    pending: list[Action] = field(init=False)
    """Forwards left, in preference order."""
    _position: dict[int, int] = field(init=False, repr=False)
    """Each microbatch's place in :attr:`microbatches` (the preference key is asked for often)."""
    _chunk: dict[int, int] = field(init=False, repr=False)
    _first_stage: list[Action] = field(init=False, repr=False)
    """The forwards of the plan's first stage (none unless the rank runs it), in preference order: they
    run in that order (they need no input, so only the first of them is ever offered)."""
    arrived: set[Action] = field(default_factory=set)
    """Forwards whose activation heads its channel."""
    backwardable: set[Action] = field(default_factory=set)
    """Forwards in flight whose backward may run: of the last stage, or their gradient heads its channel."""
    in_flight: list[Action] = field(default_factory=list)
    program: list[Action] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._position = {j: k for k, j in enumerate(self.microbatches)}
        self._chunk = {s: c for c, s in enumerate(self.chunks)}
        self.pending = sorted(
            (Action(s, ActionKind.FORWARD, j) for s in self.chunks for j in self.microbatches), key=self._forward_key
        )
        self._first_stage = [action for action in reversed(self.pending) if action.stage == 0]

    def _key(self, action: Action, chunk: int) -> tuple[int, int, int]:
        position = self._position[action.microbatch]
        return position // self.round_size, chunk, position % self.round_size

    def _forward_key(self, action: Action) -> tuple[int, int, int]:
        return self._key(action, self._chunk[action.stage])

    def _backward_key(self, forward: Action) -> tuple[int, int, int]:
        """Backwards (of the forwards in flight) prefer the last chunk first."""
        return self._key(forward, len(self.chunks) - 1 - self._chunk[forward.stage])

    def arrive(self, message: Message) -> None:
        """``message`` heads its channel: the action it feeds may run."""
        if message.kind is ActionKind.FORWARD:
            self.arrived.add(Action(message.boundary + 1, ActionKind.FORWARD, message.microbatch))
        else:
            self.backwardable.add(Action(message.boundary, ActionKind.FORWARD, message.microbatch))

    def ready_forward(self, in_order: bool) -> Action | None:
        """The first forward in preference order whose input has arrived (the first stage's only in
        microbatch order; later stages take what has arrived: their shares come from several senders);
        ``in_order``: the first forward left, if ready."""
        if in_order:
            first = self.pending[0] if self.pending else None
            return first if first is not None and (first.stage == 0 or first in self.arrived) else None
        return min([*self.arrived, *self._first_stage[-1:]], key=self._forward_key, default=None)

    def ready_backward(self, in_order: bool) -> Action | None:
        """The first backward of the forwards in flight, in preference order, whose gradient has arrived;
        ``in_order``: the first of them, if ready."""
        if in_order:
            first = min(self.in_flight, key=self._backward_key, default=None)
            forward = first if first in self.backwardable else None
        else:
            forward = min(self.backwardable, key=self._backward_key, default=None)
        return forward and Action(forward.stage, ActionKind.BACKWARD, forward.microbatch)

    def run(self, action: Action) -> None:
        self.program.append(action)
        forward = Action(action.stage, ActionKind.FORWARD, action.microbatch)
        if action.kind is ActionKind.FORWARD:
            self.arrived.discard(action)
            self.pending.remove(forward)
            self.in_flight.append(forward)
            if action.stage == 0:
                self._first_stage.pop()
            if action.stage == self.last_stage:
                self.backwardable.add(forward)
        else:
            self.in_flight.remove(forward)
            self.backwardable.discard(forward)


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
            raise PlanningError(f"schedule deadlocks: {_stuck_description(plan, programs, cursor, channels)}")
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


def _stuck_description(plan, programs, cursor, channels) -> str:
    waiting = []
    for rank, program in enumerate(programs):
        if cursor[rank] < len(program):
            receives, _ = messages_of(plan, rank, program[cursor[rank]])
            waiting.append(f"rank {rank} at {program[cursor[rank]]} waits for {[str(m) for m in receives]}")
    return "; ".join(waiting)


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
    programs = rank_programs(plan, forward_only)
    check_coverage(plan, programs, forward_only)
    return programs, play_in_steps(plan, programs)


def build_schedule(plan: Plan, forward_only: bool = False) -> PipelineSchedule:
    """The validated schedule of ``plan`` (forward-only for evaluation and prediction): covered, deadlock-free
    with unbounded buffers (the unit-step play) and under NCCL's rules (its batches' and collectives'
    rendezvous play)."""
    programs, grid = played_programs(plan, forward_only)
    batches = rank_batches(plan, programs, grid)
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


def one_f_one_b_warmup(stage_widths: tuple[int, ...], stage_index: int) -> int:
    """Forwards a rank of stage ``stage_index`` runs before its first backward under 1F1B.

    Equal single-rank stages need one per later stage (``S - 1 - i``): the
    classic warm-up. A later stage of ``w_j`` ranks fed by ``w_i`` ranks needs
    ``ceil(w_j / w_i)`` from each feeder to give every one of its ranks a
    microbatch; with only one, a narrow stage feeding a wide one kept a single
    microbatch per later stage in flight and the wide stage's ranks took turns
    (measured: 4.45 s a step against 1.5 s of compute, 1 rank feeding 3).
    The engine's schedule (``schedule/programs.py``) and this memory model use
    this one count.
    """
    mine = stage_widths[stage_index]
    return sum(-(-width // mine) for width in stage_widths[stage_index + 1 :])

"""1F1B programs: each rank's forwards and backwards in one-forward-one-backward order, and how many
forwards a rank keeps in flight.

Apart from :mod:`.programs` (every schedule's programs, checked and played) because 1F1B's order is not
written rank by rank but recorded from a step-by-step play of the whole pipeline
(:func:`one_f_one_b_programs`), and because the planner's memory model counts the same forwards in flight
(:func:`one_f_one_b_warmup`) that the recorded programs keep to.

Pure Python: no torch.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field

from zorse_lightning.errors import PlanningError
from zorse_lightning.schedule.actions import Action, ActionKind, Message, balanced_durations, messages_of
from zorse_lightning.schedule.plan import Plan


def one_f_one_b_warmup(stage_widths: tuple[int, ...], stage_index: int) -> int:
    """Forwards a rank of stage ``stage_index`` runs before its first backward under 1F1B.

    A rank keeps busy while the microbatches it has in flight cover one round trip: its own microbatch and
    the time each spends downstream, from the next stage's forward to its backward. A rank of the next stage
    keeps ``L`` in flight (counting the one it works on) and, in a balanced plan, spends ``w_j / w_i`` of this
    rank's time on each (it takes a ``w_i / w_j`` share of the microbatches), so a microbatch stays there
    ``L w_j / w_i`` of this rank's microbatches: ``L_i = 1 + ceil(L_j w_j / w_i)``, ``L = 1`` on the last
    stage, and the warm-up is ``L_i - 1``. Equal stages give the classic ``S - 1 - i``; a narrow stage
    feeding a wide one keeps each of its ranks busy (one warm-up for a single later stage's ranks, as
    measured: 4.45 s a step against 1.5 s of compute with one in flight, 1 rank feeding 3). Counting each
    later stage's ``ceil(w_j / w_i)`` instead (the rule until 2026-11-29) left a narrow stage feeding a wide
    one that feeds a narrow one short: its ranks waited for the wide stage's backwards, one H100 feeding 2,
    3 or 4 that feed one played 206, 262 and 245 ms where this count plays 171, 201 and 177 (their closed
    forms 172, 204 and 178: ``tests/planner/test_schedule.py``). The engine's schedule
    (:func:`one_f_one_b_limit`) and the planner's memory model use this one count.
    """
    in_flight = 1
    for downstream in range(len(stage_widths) - 1, stage_index, -1):
        in_flight = 1 + -(-in_flight * stage_widths[downstream] // stage_widths[downstream - 1])
    return in_flight - 1


def one_f_one_b_limit(plan: Plan, group: int, round_size: int | None = None) -> int:
    """Forwards a rank of ``group`` may have in flight (not yet backwarded) under 1F1B.

    Without interleaving: the warm-up of :func:`one_f_one_b_warmup` (the planner's
    memory model) and the one whose backward comes next. Interleaved, Megatron's
    warm-up, ``2 (G - g - 1) + (V - 1) G`` chunk-forwards for ``G`` equal groups,
    with each later group counted ``ceil(w_h / w_g)`` times where widths differ
    (a narrow group feeding a wide one must give each of its ranks work), and each
    round at least the rank's round (:func:`interleaving_rounds`; ``round_size``, by
    default the group's largest): a narrow group's rank fed by a wider one runs its
    longer round before its first chunk's backward. Counting the groups alone left
    it short: widths 2, 1 at 3 chunks (H100s, 48 microbatches) played 1.30x the
    closed form, 1.04x with it.
    """
    widths = tuple(len(stage.replicas) for stage in plan.rank_groups)
    if plan.interleave == 1:
        return one_f_one_b_warmup(widths, group) + 1
    feeds = [-(-width // widths[group]) for width in widths]
    if round_size is None:
        round_size = group_round(plan, group, interleaving_rounds(plan))
    return 2 * sum(feeds[group + 1 :]) + (plan.interleave - 1) * max(sum(feeds), round_size) + 1


def group_round(plan: Plan, group: int, rounds: dict[int, int]) -> int:
    """The longest round (``rounds``: :func:`interleaving_rounds`) of a rank of ``group``: what the planner's
    closed form counts its ranks as keeping in flight."""
    return max((rounds[rank] for rank in plan.rank_groups[group].ranks if rank in rounds), default=1)


def action_counts(plan: Plan) -> dict[int, int]:
    """Each working rank's forwards and backwards under 1F1B (or GPipe): two per microbatch of its share and chunk."""
    return {
        rank: 2 * len(plan.stages_of_group(group)) * n
        for group, stage in enumerate(plan.rank_groups)
        for rank, n in zip(stage.ranks, stage.microbatches_per_rank)
        if n > 0
    }


def interleaving_rounds(plan: Plan) -> dict[int, int]:
    """Each working rank's round in the interleaved order: how many of its microbatches it runs through one
    chunk before the same go through the next (:func:`one_f_one_b_programs`).

    A round must cover a round trip of the pipeline, so that a microbatch is back for the rank's next chunk
    when the rank reaches it: ``G`` microbatches (Megatron's round) for ranks that pass their microbatches
    to one rank of each other group, as many as the rank holds. A rank that takes the microbatches of
    several ranks of another group (a narrow group after a wide one) sees each of those ranks' rounds in turn,
    so its round is ``G`` times its share over the least share of any rank holding its microbatches: rounds
    then align across groups. Rounds of ``G`` for every rank misaligned wherever widths differ (a group of two
    took six microbatches a round from a single-GPU one that took three: widths 2, 1, 1 at 2 chunks played
    1.83x the closed form, now 0.97x); one round of all ranks' microbatches broke the ranks of uneven shares
    in equal groups (sixteen groups of 8 A100s taking 45 microbatches and 8 V100s taking 19, x2: 2092.7 ms
    became 4094.7), whose ranks form lanes of their own."""
    groups = plan.rank_groups
    if plan.interleave == 1:
        return {rank: len(groups) for group in groups for rank in group.ranks}
    shares = [list(group.microbatch_ranges().values()) for group in groups]
    starts = [[share.start for share in group_shares] for group_shares in shares]
    rounds = {}
    for group in groups:
        for rank, share in group.microbatch_ranges().items():
            if not share:
                continue
            least = len(share)
            for other_starts, other in zip(starts, shares):  # the shares of each group that overlap this one
                first = bisect_right(other_starts, share.start) - 1
                for held in other[max(first, 0) :]:
                    if held.start >= share.stop:
                        break
                    if held and held.stop > share.start:
                        least = min(least, len(held))
            rounds[rank] = -(-len(groups) * len(share) // least)
    return rounds


def one_f_one_b_programs(
    plan: Plan, order: tuple[int, ...], strict: bool, within: int | None = None
) -> tuple[tuple[tuple[Action, ...], ...], int] | None:
    """1F1B programs recorded from a play of the whole pipeline in balanced time.

    Writing each rank's program on its own (warm-up forwards, then alternate)
    deadlocks once stages differ in width and shares are uneven: a rank waits for
    a gradient whose forward is queued behind a rank that waits in turn. So the
    programs are recorded from a play with FIFO channels: whenever a rank is free
    it runs one action whose inputs are at the head of their channels: a forward
    while fewer than the limit (:func:`one_f_one_b_limit`) are in flight, else a
    ready backward: the classic warm-up, then one forward, one backward. Only when
    no rank runs and none can start within the limits do ranks exceed them, so the
    play, and the engine, cannot deadlock.

    Each rank's actions last the iteration over their count (:func:`~.actions.balanced_durations`),
    as in a balanced plan, whose ranks are all busy about as long: where every rank
    runs as many actions these are unit steps. Unit steps for all made a wide
    group's ranks, which take a fraction of the microbatches each, as quick per
    microbatch as the narrow group feeding them, so the recorded order expected
    inputs sooner than they come: interleaved x3 over groups of widths 1, 2, 1 (H100s,
    48 microbatches) the engine's play took 1.44x the closed form, 1.15x in balanced
    time (0.96x with the rounds below).

    Interleaved, a rank prefers its chunk-forwards and chunk-backwards in Megatron's
    order: a round of its microbatches (:func:`interleaving_rounds`, ``G`` for ``G``
    equal groups) through one chunk, then the same through the next (backwards
    from the last chunk), then the next round. ``strict``: it
    keeps to that order (waits for its next action's input), which for equal groups
    gives Megatron's ``2 M V + 2 (G - 1)`` chunk-steps exactly; else a ready action runs
    ahead of one still waiting, which suits uneven widths and shares better but, on
    equal groups with more than ``2 G`` microbatches, fills the first group's flight with
    its first chunk and stalls the later ones (``4 x 16`` microbatches at ``V = 4``: 169
    steps for 134). :func:`~.programs.rank_programs` keeps the shorter of the two plays.

    Returns the programs and the play's length, in the units of :func:`~.actions.balanced_durations`; None
    once the play reaches ``within`` units with actions left: it cannot be shorter than a play that long, so
    :func:`~.programs.rank_programs` plays the second play no further than the first one's length (a
    512-GPU plan's relaxed play stopped at 5355 units of its 11302).
    """
    last_stage = len(plan.stages) - 1
    durations = balanced_durations(action_counts(plan))
    rounds = interleaving_rounds(plan)
    state = {}
    for group, stage in enumerate(plan.rank_groups):
        chunks = plan.stages_of_group(group)
        for rank, share in stage.microbatch_ranges().items():
            mine = [j for j in order if j in share]
            if mine:
                limit = one_f_one_b_limit(plan, group, rounds[rank])
                state[rank] = _RankPlay(chunks, mine, rounds[rank], limit, last_stage)
    channels: dict[tuple[int, int], deque[Message]] = {}
    running: list[tuple[int, int, list[Message]]] = []
    """Actions running, as (end, rank, sends), a heap."""
    free = sorted(state)
    now = 0

    def choose(play: _RankPlay, relaxed: bool) -> Action | None:
        in_order = strict and not relaxed
        backward, forward = play.ready_backward(in_order), play.ready_forward(in_order)
        if forward is not None and (len(play.in_flight) < play.limit or (relaxed and backward is None)):
            return forward
        return backward

    while free or running:
        if within is not None and now >= within:
            return None
        chosen = {rank: choose(state[rank], relaxed=False) for rank in free}
        if not running and all(action is None for action in chosen.values()):
            chosen = {rank: choose(state[rank], relaxed=True) for rank in free}
            if all(action is None for action in chosen.values()):
                raise PlanningError("no 1F1B order exists for this plan; use schedule=gpipe")
        for rank, action in chosen.items():
            if action is None:
                continue
            receives, sends = messages_of(plan, rank, action)
            for message in receives:
                channel = channels[(message.src, message.dst)]
                channel.popleft()
                if channel:
                    state[rank].arrive(channel[0])
            state[rank].run(action)
            heapq.heappush(running, (now + durations[rank], rank, sends))
        now = running[0][0]
        ended = []
        while running and running[0][0] == now:
            ended.append(heapq.heappop(running))
        for _, rank, sends in ended:
            for message in sends:
                channel = channels.setdefault((message.src, message.dst), deque())
                channel.append(message)
                if len(channel) == 1:
                    state[message.dst].arrive(message)
        waiting = [rank for rank, action in chosen.items() if action is None]
        free = sorted(rank for rank in waiting + [rank for _, rank, _ in ended] if state[rank].left)
    programs = tuple(tuple(state[rank].program) if rank in state else () for rank in range(plan.world_size))  # idle: ()
    return programs, now


@dataclass
class _RankPlay:
    """One rank's progress during :func:`one_f_one_b_programs` (local to it).

    Which of its actions are ready is kept as the play goes (:attr:`arrived`, :attr:`backwardable`,
    fed by the heads of its channels): looking for a ready forward among every pending one, each step,
    made recording quadratic in the microbatches; so did the least backward of the forwards in flight, asked for
    every step (a fifth of planning at 1024 GPUs): heaps keep them by preference (:meth:`ready_backward`)."""

    chunks: tuple[int, ...]
    """The rank's stages, in layer order."""
    microbatches: list[int]
    """The rank's share, in the order it walks it."""
    round_size: int
    """Its microbatches per interleaving round (:func:`interleaving_rounds`)."""
    limit: int
    last_stage: int
    """The plan's last stage, whose backwards need no gradient."""
    pending: list[Action] = field(init=False)
    """Its forwards in preference order; those before :attr:`_next` have run, and those run out of order are
    in :attr:`in_flight` or backwarded (:meth:`_first_left`)."""
    _next: int = field(default=0, repr=False)
    _ran: set[Action] = field(default_factory=set, repr=False)
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
    in_flight: set[Action] = field(default_factory=set)
    program: list[Action] = field(default_factory=list)
    _flight_order: list[tuple[tuple[int, int, int], Action]] = field(default_factory=list, repr=False)
    """:attr:`in_flight` as a heap by backward preference, with forwards since backwarded left in until they
    come first."""
    _backwardable_order: list[tuple[tuple[int, int, int], Action]] = field(default_factory=list, repr=False)
    """:attr:`backwardable` likewise."""

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
            self._may_backward(Action(message.boundary, ActionKind.FORWARD, message.microbatch))

    def _may_backward(self, forward: Action) -> None:
        if forward not in self.backwardable:
            self.backwardable.add(forward)
            heapq.heappush(self._backwardable_order, (self._backward_key(forward), forward))

    def ready_forward(self, in_order: bool) -> Action | None:
        """The first forward in preference order whose input has arrived (the first stage's only in
        microbatch order; later stages take what has arrived: their shares come from several senders);
        ``in_order``: the first forward left, if ready."""
        if in_order:
            first = self._first_left()
            return first if first is not None and (first.stage == 0 or first in self.arrived) else None
        return min([*self.arrived, *self._first_stage[-1:]], key=self._forward_key, default=None)

    def _first_left(self) -> Action | None:
        """The first forward in preference order not run yet."""
        while self._next < len(self.pending) and self.pending[self._next] in self._ran:
            self._next += 1
        return self.pending[self._next] if self._next < len(self.pending) else None

    def ready_backward(self, in_order: bool) -> Action | None:
        """The first backward of the forwards in flight, in preference order, whose gradient has arrived;
        ``in_order``: the first of them, if ready."""
        order, live = (self._flight_order, self.in_flight) if in_order else (self._backwardable_order, self.backwardable)
        while order and order[0][1] not in live:
            heapq.heappop(order)
        forward = order[0][1] if order else None
        if forward is None or forward not in self.backwardable:
            return None
        return Action(forward.stage, ActionKind.BACKWARD, forward.microbatch)

    @property
    def left(self) -> bool:
        """The rank has actions left to run: forwards not run, or backwards of those in flight."""
        return self._first_left() is not None or bool(self.in_flight)

    def run(self, action: Action) -> None:
        self.program.append(action)
        forward = Action(action.stage, ActionKind.FORWARD, action.microbatch)
        if action.kind is ActionKind.FORWARD:
            self.arrived.discard(action)
            self._ran.add(forward)
            self.in_flight.add(forward)
            heapq.heappush(self._flight_order, (self._backward_key(forward), forward))
            if action.stage == 0:
                self._first_stage.pop()
            if action.stage == self.last_stage:
                self._may_backward(forward)
        else:
            self.in_flight.discard(forward)
            self.backwardable.discard(forward)


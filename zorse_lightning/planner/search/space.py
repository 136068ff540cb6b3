"""The search's inputs and its candidates: every choice a plan makes before its split, each with a lower
bound on the iteration time of any plan it can give.

A :class:`Search` holds what every step of the search reads (the cost context, the options, the batch,
the speeds, the layouts and microbatch sizes to try), checked once and frozen. A :class:`Candidate` is one
point of the candidate space, of one :class:`Kind`; :func:`first_candidates` proposes the space's starting
points and :func:`follow_ups` what a plan found opens (other orders of its groups, its interleavings, the
integer program's split of its layout). The loop (:mod:`.loop`) takes them in order of their bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from itertools import permutations

from zorse_lightning import capabilities
from zorse_lightning.capabilities import Schedule
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.tensor_parallel import tensor_parallel_degrees
from zorse_lightning.planner.interleaving import degrees
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.planner.search.bound import any_layout_lower_bound_ms, lower_bound_ms
from zorse_lightning.planner.search.choice import handicap, margin
from zorse_lightning.planner.search.heuristic import HEURISTIC, speed_by_type
from zorse_lightning.planner.search.layouts import Layout, candidate_layouts, fastest_type_subsets
from zorse_lightning.planner.search.problem import WindowCosts, stage_groups
from zorse_lightning.profiling.profile import ModelProfile
from zorse_lightning.schedule.plan import Plan

WORK_PER_GPU = 2**15
"""Work (:func:`.choice.work_of`: ``2 V M R`` and a fixed cost per play) the search may spend recording
programs and simulating plans, per GPU of the cluster: beyond it plans keep their closed form (but the one
returned, :meth:`.choice.Choice._answer`). Per GPU
because the planning-time goals grow with the cluster (2 s at 32 GPUs, 60 s at 1024). At ``2^13`` the loop
lost the peers' structures on four machines of four types (Llama 7B: 9258 against 9149 ms; Llama 3B: 4993
against 4765 ms); at ``2^15`` it finds them (``bench/plan_scaling.py``: 8 GPUs 6.2 s, 32 GPUs 2.3 s,
1024 GPUs 60 s of CPU)."""
MOST_ORDERED_GROUPS = 4
"""Stage groups up to which every order of a leading plan's groups is a candidate (24 orders at four, 120 at
five: each priced at every microbatch size). Where the links between groups are alike the best order is
set by where the embedding and head land and the activations each group holds in flight, which the
orders of :func:`.layouts.stage_orders` do not weigh (Llama tiny on four machines of four types: 0.7 %)."""


class Kind(Enum):
    SPLIT = "a layout's heuristic split"
    PROGRAM = "a layout split by the integer program"
    GATHERED = "every parameter gathered per microbatch, microbatches split evenly"
    INTERLEAVED = "a plan's groups each holding several layer chunks"
    BASELINE = "a baseline the planner prints"
    SIMULATED = "a plan simulated"


@dataclass(frozen=True)
class Candidate:
    """One point of the candidate space. ``plan``: the plan it starts from (the heuristic split a program
    starts from, the plain plan an interleaving cuts, the plan to simulate); ``baseline``: what builds a
    baseline's plan."""  # noqa: D205

    bound_ms: float
    kind: Kind
    layout: Layout = ()
    microbatch_size: int = 0
    interleave: int = 1
    plan: Plan | None = None
    baseline: Callable[[], Plan | None] | None = None
    draft: Plan | None = None
    """Its plan built and priced in the closed form, not yet made to fit (gathered and interleaved plans are
    drafted first: fitting them costs more)."""
    estimate_ms: float | None = None
    """With its draft, the least closed form it can give: the draft's (a split's, or its interleavings' at best:
    :func:`.fit.interleaved_best_case_ms`). Its key is this times the floor (:meth:`.loop._Loop._refined`)."""
    tensor_parallel: tuple[int, ...] = ()
    """Each stage's TP degree, its ranks listed replica by replica (:meth:`Search.split_over`); empty: none."""
    planned: bool = False
    """A baseline the planner plans on its ranks (the fastest type alone): the search's own candidates on those
    ranks are the ones it would propose, so what the search learns of them bounds it (:meth:`.loop._Loop._refined`)."""

    def handicap(self, world_size: int) -> float:
        """The handicap of every plan it can give (:func:`.choice.handicap`)."""
        if self.kind is Kind.SIMULATED:
            return handicap(self.plan)
        return margin(sum(map(len, self.layout)) < world_size, self.interleave > 1, bool(self.tensor_parallel))

    @cached_property
    def plain_layout(self) -> Layout:
        """Its layout without TP, each stage's ranks in order (:meth:`Search.split_over` lists a TP stage's ranks
        replica by replica): the layout its TP variants' keys are drafted for (:meth:`.loop._Loop._refined`)."""
        return tuple(tuple(sorted(ranks)) for ranks in self.layout)

    @property
    def key(self) -> tuple | None:
        """What makes two candidates the same (the loop queues one); None for a candidate made from a plan,
        a draft or a baseline, which is made once."""
        if self.plan is not None or self.draft is not None or self.baseline is not None:
            return None
        return self.kind, self.layout, self.microbatch_size, self.interleave, self.tensor_parallel


@dataclass(frozen=True)
class Search:
    """What every step of one planning call reads; frozen, so no step changes what another sees."""

    ctx: CostContext
    windows: WindowCosts
    options: PlannerOptions
    global_batch_size: int
    speeds: dict[str, float]
    sizes: tuple[int, ...]
    layouts: tuple[Layout, ...]
    schedule: Schedule
    notes: tuple[str, ...]
    plan_cluster: Callable[[ClusterInventory], Plan]
    """Plans a sub-cluster (the fastest type alone) with the same options: the planner itself, passed in."""

    @classmethod
    def build(
        cls, inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions,
        plan_cluster: Callable[[ClusterInventory], Plan],
    ) -> Search:
        _check_inputs(inventory, profile, global_batch_size, options)
        ctx = CostContext.build(inventory, profile, options.memory_reserve_gib, options.p2p_rules)
        speeds = speed_by_type(ctx)
        return cls(
            ctx, WindowCosts(ctx), options, global_batch_size, speeds,
            tuple(microbatch_sizes(global_batch_size, options, profile)), tuple(_layouts(ctx, options, speeds)),
            options.schedule or Schedule.ONE_F_ONE_B,
            () if options.allow_pipeline else (f"data parallel only: {options.no_pipeline_reason}",), plan_cluster,
        )

    @property
    def pinned(self) -> bool:
        """Some part of the plan pinned: the baselines are then no candidates."""
        o = self.options
        return any(pin is not None for pin in (o.stage_layout, o.layer_counts, o.microbatch_size, o.schedule))

    def bound_ms(self, layout: Layout, degrees: tuple[int, ...], m: int, interleave: int = 1) -> float:
        """:func:`.bound.lower_bound_ms` of ``layout`` with each stage at TP degree ``degrees`` (empty: none), once
        per arguments (a layout's candidate is bounded by its TP variants' bounds, which queue them again)."""
        return self.ctx.memo(
            ("bound", layout, degrees, m, interleave),
            lambda: lower_bound_ms(self.ctx, layout, m, self.global_batch_size, interleave, degrees or None),
        )

    @property
    def tensor_parallel_degrees(self) -> tuple[int, ...]:
        """The TP degrees the search tries: those the model's blocks admit, up to ``max_tp``; none where the
        layer counts are pinned (the integer program that splits them does not model TP)."""
        if self.options.layer_counts is not None:
            return ()
        return tuple(t for t in self.ctx.profile.tensor_parallel.degrees if 1 < t <= self.options.max_tp)

    def split_over(self, layout: Layout, degree: int) -> tuple[Layout, tuple[int, ...]] | None:
        """``layout`` with its blocks split over TP groups of ``degree`` GPUs in every stage that admits it
        (:func:`~.tensor_parallel.tensor_parallel_degrees`; its ranks then listed replica by replica), and each
        stage's degree; None where no stage admits it."""
        stages, degrees = [], []
        for ranks in layout:
            split = self.ctx.memo(("split over", ranks, degree), lambda: self._split_stage(ranks, degree))
            stages.append(split or ranks)
            degrees.append(degree if split else 1)
        return (tuple(stages), tuple(degrees)) if degree in degrees else None

    def _split_stage(self, ranks: tuple[int, ...], degree: int) -> tuple[int, ...] | None:
        """A stage's ranks replica by replica where it admits TP ``degree``, else None (:meth:`split_over`)."""
        gpus = self.ctx.inventory.gpus
        ordered = tuple(sorted(ranks, key=lambda r: (gpus[r].machine, gpus[r].gpu_type.name, r)))
        return ordered if degree in tensor_parallel_degrees(self.ctx, ordered, degree) else None

    def gpu_type(self, rank: int) -> str:
        return self.ctx.inventory.gpus[rank].gpu_type.name


def structure(plan: Plan) -> tuple:
    """What makes two plans the same pipeline: microbatch size, and each stage's ranks, layers and TP degree."""
    return plan.microbatch_size, tuple((s.ranks, s.layers, s.tensor_parallel) for s in plan.stages)


def first_candidates(search: Search, baselines: Iterable[tuple[tuple[int, ...], Callable[[], Plan | None], bool]]) -> Iterator[Candidate]:
    """Every layout at every microbatch size (split by the heuristic, or by the program where layer counts
    are pinned), the one-stage layouts gathered per microbatch too (pipelines are where their split needs
    a remedy to fit: :func:`follow_ups`), each layout with its stages split over TP groups at each degree some
    stage admits (keyed, until drafted, by the draft of the layout without TP too:
    :meth:`.loop._Loop._refined`), and the ``baselines``: each with the ranks it may use and whether
    the planner plans it (the fastest type alone), bounded by any layout of those ranks or, where the
    planner plans it, by the search's own layouts of exactly those ranks (a sub-cluster's planner proposes
    the same) and then by what the search learns of them (:attr:`Candidate.planned`)."""
    kind = Kind.PROGRAM if search.options.layer_counts is not None else Kind.SPLIT
    for layout in search.layouts:
        for m in search.sizes:
            bound = search.bound_ms(layout, (), m)
            yield Candidate(bound, kind, layout, m)
            if len(layout) == 1 and len(layout[0]) > 1:
                yield Candidate(bound, Kind.GATHERED, layout, m)
            for split in filter(None, (search.split_over(layout, t) for t in search.tensor_parallel_degrees)):
                yield Candidate(search.bound_ms(*split, m), Kind.SPLIT, split[0], m, tensor_parallel=split[1])
    for ranks, build, searched in baselines:
        bound = min(any_layout_lower_bound_ms(search.ctx, ranks, m, search.global_batch_size) for m in search.sizes)
        same = [search.bound_ms(l, (), m) for l in search.layouts if searched and sorted(r for s in l for r in s) == sorted(ranks) for m in search.sizes]
        yield Candidate(max(bound, min(same, default=bound)), Kind.BASELINE, (ranks,), baseline=build, planned=searched)


def follow_ups(search: Search, found: Candidate, plan: Plan | None, programs_left: bool) -> Iterator[Candidate]:
    """What a plain ``plan`` of candidate ``found`` opens (None: only a plan offloading activations fits, or
    nothing): where None, the layout gathered per microbatch (the other remedy); its layout split by the integer
    program (where it has something to choose and programs are left), and each interleaving degree it admits. A
    plan with TP opens only its interleavings: the engine gathers no TP stage, and the program does not model TP."""
    layout, m, split = found.layout, found.microbatch_size, found.tensor_parallel
    if plan is None and not split and len(layout) > 1 and capabilities.SUPPORTS_GATHER_PER_MICROBATCH_IN_PIPELINES and sum(map(len, layout)) > len(layout):
        yield Candidate(found.bound_ms, Kind.GATHERED, layout, m)
    if plan is None:
        return
    if found.kind is Kind.SPLIT and programs_left and not split and _has_choice(search, layout):
        yield Candidate(found.bound_ms, Kind.PROGRAM, layout, m, plan=plan)
    if plan.interleave == 1 and capabilities.SUPPORTS_INTERLEAVING and not any(s.gather_per_microbatch for s in plan.stages):
        thick = min(s.num_layers for s in plan.stages)
        for degree in degrees(plan, search.options.max_interleave)[1:]:
            if search.options.layer_counts is None or thick >= degree:
                stages = tuple(s.ranks for s in plan.stages)
                yield Candidate(
                    search.bound_ms(stages, split, plan.microbatch_size, degree), Kind.INTERLEAVED, stages, plan.microbatch_size, degree, plan,
                    tensor_parallel=split,
                )


def held_program(search: Search, held: Plan) -> Candidate | None:
    """The integer program of the layout of ``held`` (the plan the search holds at its stop) at its size, where
    its split is the heuristic's and the program has something to choose: programs go to the layouts of least
    bound first, up to ``max_programs``, and the plan held's may be past them (a100x4_v100x4 Llama 7B: its
    program moves a layer to the A100s, 6860.3 to 6818.8 ms; without a limit the search came to it only at its
    49th program). None where programs are off, where the plan has TP or gathers (the program models neither),
    and where it is interleaved: at 32 synthetic GPUs its plain layout's program cost 3 programs and 15 plays
    more, for the same plan."""
    layout = tuple(s.ranks for s in held.rank_groups)
    if held.solver.name != HEURISTIC.name or not search.options.max_programs or not _has_choice(search, layout):
        return None
    if held.interleave > 1 or any(s.tensor_parallel > 1 or s.gather_per_microbatch for s in held.stages):
        return None
    return Candidate(search.bound_ms(layout, (), held.microbatch_size), Kind.PROGRAM, layout, held.microbatch_size)


def _has_choice(search: Search, layout: Layout) -> bool:
    """Whether the integer program has a split to choose: more than one stage, or one stage of several groups."""
    return not (len(layout) == 1 and len(stage_groups(search.ctx, layout[0])) == 1)


def other_orders(search: Search, chosen: Plan) -> Iterator[Candidate]:
    """Every order of the groups of the plan the search holds (simulated), at every size, where it has 2 to
    :data:`MOST_ORDERED_GROUPS` groups, is plain and not gathered, and neither layout nor layers are pinned."""
    pinned = search.options.stage_layout is not None or search.options.layer_counts is not None
    if pinned or not 2 <= len(chosen.stages) <= MOST_ORDERED_GROUPS or chosen.interleave > 1 or any(s.gather_per_microbatch for s in chosen.stages):
        return
    for order in permutations(tuple((s.ranks, s.tensor_parallel) for s in chosen.stages)):
        layout, degrees = tuple(ranks for ranks, _ in order), tuple(t for _, t in order)
        degrees = degrees if any(t > 1 for t in degrees) else ()
        for size in search.sizes:
            yield Candidate(search.bound_ms(layout, degrees, size), Kind.SPLIT, layout, size, tensor_parallel=degrees)


def _check_inputs(inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions) -> None:
    if not (isinstance(global_batch_size, int) and not isinstance(global_batch_size, bool) and global_batch_size >= 1):
        raise PlanningError(f"global_batch_size={global_batch_size!r} must be a positive integer (samples per iteration)")
    missing = [t.name for t in inventory.gpu_types if t.name not in profile.devices]
    if missing:
        raise PlanningError(
            f"profile of {profile.model!r} has no times for GPU type(s) {missing} of cluster {inventory.name!r} "
            f"(has: {sorted(profile.devices)}); profile on those GPUs or use an estimated profile"
        )
    if options.layer_counts is not None and sum(options.layer_counts) != profile.num_layers:
        raise PlanningError(
            f"pinned layer_counts {list(options.layer_counts)} sum to {sum(options.layer_counts)}, "
            f"but {profile.model!r} has {profile.num_layers} layers; make them add up"
        )
    if options.stage_layout is not None:
        seen = sorted(r for s in options.stage_layout for r in s)
        if seen != list(range(inventory.world_size)) or any(not s for s in options.stage_layout):
            raise PlanningError(
                f"pinned stage_layout uses ranks {seen}; it must use every rank 0..{inventory.world_size - 1} "
                f"of cluster {inventory.name!r} exactly once, in non-empty stages"
            )


def microbatch_sizes(global_batch_size: int, options: PlannerOptions, profile: ModelProfile) -> list[int]:
    """The candidate sizes that divide the global batch and, on a measured profile, were measured: a size
    beyond the measured ones would be priced on a line through two points, which the planner never does."""
    sizes = [options.microbatch_size] if options.microbatch_size is not None else list(options.microbatch_sizes)
    measured = profile.measured_sizes
    if measured is not None:
        unmeasured = [m for m in sizes if m not in measured]
        sizes = [m for m in sizes if m in measured]
        if not sizes:
            raise PlanningError(
                f"microbatch sizes {unmeasured} were not measured (the profile holds sizes {list(measured)}); the "
                f"planner prices measured sizes only: give one of {list(measured)}, or profile the larger sizes"
            )
    usable = [m for m in sizes if global_batch_size % m == 0]
    if not usable:
        raise PlanningError(
            f"no microbatch size in {sizes} divides global_batch_size={global_batch_size}; "
            f"pick a global batch that is a multiple of one of them, or add a divisor to the sizes"
        )
    return usable


def _layouts(ctx: CostContext, options: PlannerOptions, speeds: dict[str, float]) -> list[Layout]:
    num_layers = ctx.profile.num_layers
    if options.stage_layout is not None:
        layouts = [tuple(tuple(sorted(s)) for s in options.stage_layout)]
    else:
        subsets = fastest_type_subsets(ctx.inventory, speeds) if options.allow_idle_ranks else [tuple(range(ctx.inventory.world_size))]
        if options.allow_pipeline:
            max_stages = min(options.max_stages, num_layers)
            layouts = [l for ranks in subsets for l in candidate_layouts(ctx.inventory, ctx.links, speeds, max_stages, ranks)]
        else:
            layouts = [(ranks,) for ranks in subsets]
    if options.layer_counts is not None:
        layouts = [l for l in layouts if len(l) == len(options.layer_counts)]
    if not layouts or any(len(l) > num_layers for l in layouts):
        raise PlanningError(
            f"no stage layout matches the pins: {num_layers} layers, pinned layer_counts "
            f"{options.layer_counts and list(options.layer_counts)}, pinned stage_layout "
            f"{options.stage_layout and [list(s) for s in options.stage_layout]}; give as many layer counts as "
            f"stages, and no more stages than layers"
        )
    if not options.allow_pipeline and len(layouts[0]) > 1:
        raise PlanningError("allow_pipeline=False allows only one stage, but the pinned stage_layout has more")
    return layouts

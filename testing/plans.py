"""Plans built by hand for tests and benches: explicit stages, no planner run."""

from __future__ import annotations

from zorse_lightning.capabilities import Schedule, Sharding
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.planner.interleaving import interleave
from zorse_lightning.schedule.actions import ActionKind, messages_of
from zorse_lightning.schedule.p2p_batches import HostCollective, P2PBatch
from zorse_lightning.schedule.plan import Plan, StagePlan
from zorse_lightning.schedule.step_collectives import step_collectives


def hand_plan(
    stages: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, int]]],
    microbatch_size: int = 1,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    sharding: Sharding = Sharding.NONE,
    shard_fractions: dict[int, tuple[float, ...]] | None = None,
    recompute: bool = False,
    inventory: ClusterInventory | None = None,
    idle_ranks: tuple[int, ...] = (),
    gather_per_microbatch: bool = False,
    interleave: int = 1,
    offload_stages: tuple[int, ...] = (),
) -> Plan:
    """A plan from (ranks, microbatches per rank, layer range) per stage (GPU types from ``inventory``),
    ``idle_ranks`` in no stage; ``interleave`` > 1: the stages are virtual ones, the groups' chunks in
    layer order (``shard_fractions`` then by group); ``offload_stages``: the groups that offload activations."""
    groups = len(stages) // interleave
    built = []
    for index, (ranks, counts, layers) in enumerate(stages):
        built.append(
            StagePlan(
                ranks=ranks,
                gpu_types=tuple(inventory.gpus[r].gpu_type.name for r in ranks) if inventory else ("cpu",) * len(ranks),
                machines=tuple(inventory.gpus[r].machine for r in ranks) if inventory else ("localhost",) * len(ranks),
                layers=layers,
                microbatches_per_rank=counts,
                sharding=sharding,
                shard_fractions=(shard_fractions or {}).get(index % groups, ()),
                recompute=recompute,
                offload_activations=index % groups in offload_stages,
                gather_per_microbatch=gather_per_microbatch,
            )
        )
    num_microbatches = sum(stages[0][1])
    return Plan(
        model="test",
        cluster="test",
        num_layers=stages[-1][2][1],
        world_size=sum(len(s[0]) for s in stages[:groups]) + len(idle_ranks),
        global_batch_size=num_microbatches * microbatch_size,
        microbatch_size=microbatch_size,
        schedule=schedule,
        stages=tuple(built),
        idle_ranks=idle_ranks,
        interleave=interleave,
    )


def per_message_batches(plan: Plan, programs) -> list[tuple[P2PBatch, ...]]:
    """How the engine posted before it kept NCCL's rules: each message alone, a receive just before the
    action that needs it, a send just after the action that made it (tests show it hangs 1F1B)."""
    batches = []
    for rank, program in enumerate(programs):
        mine = []
        for index, action in enumerate(program):
            receives, sends = messages_of(plan, rank, action)
            mine += [P2PBatch(index, (), (m,)) for m in receives]
            mine += [P2PBatch(index + 1, (m,), ()) for m in sends]
        batches.append(tuple(mine))
    return batches


def random_layout(
    rng, max_world: int, max_cuts: int, max_microbatches: int, layers_per_stage: int = 1, with_idle: bool = False
) -> tuple[list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, int]]], tuple[int, ...]]:
    """Random stages for :func:`hand_plan` and the idle ranks beside them: 2 to ``max_world`` ranks in random
    order (one left idle at random where ``with_idle`` and more than two), cut into up to ``max_cuts + 1``
    groups, each group's ranks sharing 1 to ``max_microbatches`` microbatches unevenly (some none)."""
    world = rng.randint(2, max_world)
    ranks = rng.sample(range(world), world)
    idle = tuple(ranks[: rng.randint(0, 1)]) if with_idle and world > 2 else ()
    working = ranks[len(idle) :]
    cuts = sorted(rng.sample(range(1, len(working)), rng.randint(0, min(max_cuts, len(working) - 1))))
    groups = [working[a:b] for a, b in zip([0, *cuts], [*cuts, len(working)])]
    microbatches = rng.randint(1, max_microbatches)
    stages = []
    for index, group in enumerate(groups):
        counts = [0] * len(group)
        for _ in range(microbatches):
            counts[rng.randrange(len(group))] += 1
        stages.append((tuple(group), tuple(counts), (index * layers_per_stage, (index + 1) * layers_per_stage)))
    return stages, idle


def random_plan(rng) -> Plan:
    """A random plan of :func:`random_layout`: widths 1-4, uneven shares (some ranks without any), idle ranks,
    1-5 stages, GPipe or 1F1B, interleaving 1-4."""
    stages, idle = random_layout(rng, max_world=10, max_cuts=4, max_microbatches=16, layers_per_stage=4, with_idle=True)
    schedule = rng.choice([Schedule.ONE_F_ONE_B, Schedule.ONE_F_ONE_B, Schedule.GPIPE])
    plan = hand_plan(stages, schedule=schedule, idle_ranks=idle)
    degree = rng.choice([1, 2, 3, 4])
    return interleave(plan, degree) if degree > 1 and len(stages) > 1 else plan


def in_backward_collectives(plan: Plan, programs, batches) -> list[tuple[HostCollective, ...]]:
    """Where the engine issued its stage reductions before they were placed (tests show it hangs): during each
    stage's last backward, before the batch carrying that backward's gradient is posted; the step's end as
    :func:`zorse_lightning.schedule.step_collectives.step_collectives` has it."""
    collectives = []
    for rank, (program, ends) in enumerate(zip(programs, step_collectives(plan, programs, batches))):
        mine = []
        if rank not in plan.idle_ranks and len(plan.rank_groups[plan.stage_of_rank(rank)].ranks) > 1:
            group = plan.stage_of_rank(rank)
            last_backward = {a.stage: i for i, a in enumerate(program) if a.kind is ActionKind.BACKWARD}
            for stage in sorted(plan.stages_of_group(group), reverse=True):
                what = f"stage {stage}'s gradient reduction"
                ranks = plan.rank_groups[group].ranks
                if stage in last_backward:
                    point = last_backward[stage]
                    posted = sum(1 for batch in batches[rank] if batch.before <= point)
                    mine.append(HostCollective(ranks, what, point + 1, posted, reduces=(stage,)))
                else:
                    mine.append(HostCollective(ranks, what, len(program), len(batches[rank]), reduces=(stage,)))
        collectives.append((*mine, *(c for c in ends if c.at_end)))
    return collectives

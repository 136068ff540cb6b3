"""What a plan may hold: the rules every :class:`~.plan.Plan` is checked against as it is made, and what
reading a plan refuses (another format version, a key the format does not have).

Apart from the format itself (:mod:`.plan`: what a plan says, its views, how it is written), so that the
rules read as one list. Each rule yields a problem that gives the values, the rule and what to change;
:meth:`Plan.validate` raises them together, so a hand-written plan's every mistake shows in one error.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from zorse_lightning.capabilities import SUPPORTED_SCHEDULES, SUPPORTED_SHARDING, Sharding
from zorse_lightning.errors import PlanningError

if TYPE_CHECKING:
    from zorse_lightning.schedule.plan import Plan, StagePlan

PLAN_FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
"""Versions :meth:`Plan.from_dict` reads: each added fields with defaults that keep older plans' meaning."""


def plan_problems(plan: Plan) -> Iterator[str]:
    """Structural problems of ``plan``; memory against a cluster is checked by the planner's cost model."""
    if plan.schedule not in SUPPORTED_SCHEDULES:
        yield f"schedule {plan.schedule.value!r} is not supported (supported: {[s.value for s in SUPPORTED_SCHEDULES]})"
    if plan.microbatch_size < 1 or plan.global_batch_size % plan.microbatch_size:
        yield (
            f"global_batch_size={plan.global_batch_size} is not a multiple of microbatch_size="
            f"{plan.microbatch_size}; choose a microbatch size that divides the global batch"
        )
    if not plan.stages:
        yield "a plan needs at least one stage"
        return
    if isinstance(plan.interleave, bool) or not isinstance(plan.interleave, int) or plan.interleave < 1:
        yield f"interleave={plan.interleave!r} must be a whole number >= 1 (1: no interleaving)"
        return
    if plan.interleave > 1:
        yield from _interleave_problems(plan)
    seen = sorted([r for s in plan.rank_groups for r in s.ranks] + list(plan.idle_ranks))
    if seen != list(range(plan.world_size)):
        yield f"every rank 0..{plan.world_size - 1} must be used exactly once (in a stage or idle), got ranks {seen}"
    expected_start = 0
    for index, stage in enumerate(plan.stages):
        where = f"stage {index}"
        yield from _tensor_parallel_problems(where, stage)
        if not _whole_degree(stage):
            expected_start = stage.layers[1]
            continue
        if not (len(stage.ranks) == len(stage.gpu_types) == len(stage.machines) == len(stage.microbatches_per_rank)):
            yield f"{where}: ranks, gpu_types, machines and microbatches_per_rank differ in length"
        if stage.layers[0] != expected_start or stage.layers[1] <= stage.layers[0]:
            yield f"{where}: layers {list(stage.layers)} must start at {expected_start} and be non-empty"
        expected_start = stage.layers[1]
        if stage.num_microbatches * plan.microbatch_size != plan.global_batch_size:
            yield (
                f"{where}: microbatches {list(stage.microbatches_per_rank)} x microbatch_size "
                f"{plan.microbatch_size} != global_batch_size {plan.global_batch_size}"
            )
        if any(c < 0 for c in stage.microbatches_per_rank):
            yield f"{where}: negative microbatch count {list(stage.microbatches_per_rank)}"
        if stage.sharding not in SUPPORTED_SHARDING:
            yield f"{where}: sharding {stage.sharding.value!r} is not supported yet (supported: {[s.value for s in SUPPORTED_SHARDING]})"
        if stage.shard_fractions and (
            len(stage.shard_fractions) != len(stage.ranks)
            or abs(sum(stage.shard_fractions[:: stage.tensor_parallel]) - 1) > 1e-6
        ):
            yield (
                f"{where}: shard_fractions {list(stage.shard_fractions)} must give one share per rank, summing to 1 "
                f"over the replicas (each TP rank repeats its replica's share)"
            )
        if stage.gather_per_microbatch and stage.sharding is not Sharding.FULL:
            yield f"{where}: gather_per_microbatch needs sharding 'full' (it has {stage.sharding.value!r}); set it false"
        if stage.gather_per_microbatch and plan.interleave > 1:
            yield (
                f"{where}: gather_per_microbatch does not run in an interleaved plan (interleave={plan.interleave}): "
                f"a group's rounds of gathers would follow the chunks of several stages; use interleave=1 or "
                f"gather once per step (gather_per_microbatch false)"
            )
    if expected_start != plan.num_layers:
        yield f"layers cover [0, {expected_start}) but the model has {plan.num_layers}"


def _interleave_problems(plan: Plan) -> Iterator[str]:
    count, degree = len(plan.stages), plan.interleave
    if count % degree or count // degree < 2:
        yield (
            f"interleave={degree} needs a multiple of {degree} stages (the chunks of at least 2 groups of ranks), "
            f"got {count}; use interleave=1 or list each group's {degree} chunks"
        )
        return
    groups = count // degree
    but_layers = attrgetter(*(f.name for f in fields(plan.stages[0]) if f.name != "layers"))  # one tuple per stage
    for index in range(groups, count):
        mine, group = plan.stages[index], plan.stages[index % groups]
        if but_layers(mine) == but_layers(group):
            continue
        differing = [
            f.name for f in fields(mine) if f.name != "layers" and getattr(mine, f.name) != getattr(group, f.name)
        ]
        if differing:
            yield (
                f"stage {index} is chunk {index // groups} of group {index % groups} (interleave={degree}) but differs "
                f"from stage {index % groups} in {differing}; chunks of a group differ only in their layers"
            )


def _whole_degree(stage: StagePlan) -> bool:
    """Whether the stage's TP degree is a whole number >= 1 dividing its ranks (else nothing else can be read)."""
    t = stage.tensor_parallel
    return not isinstance(t, bool) and isinstance(t, int) and t >= 1 and len(stage.ranks) % t == 0


def _tensor_parallel_problems(where: str, stage: StagePlan):
    """A stage's TP groups: a whole degree dividing its ranks, each group on one machine, of one GPU type, its
    ranks running the same microbatches (and holding the same share of sharded state)."""
    t = stage.tensor_parallel
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        yield f"{where}: tensor_parallel={t!r} must be a whole number >= 1 (1: no tensor parallelism)"
        return
    if len(stage.ranks) % t:
        yield (
            f"{where}: tensor_parallel={t} does not divide its {len(stage.ranks)} ranks {list(stage.ranks)}; list "
            f"whole TP groups of {t} ranks, replica after replica, or choose a degree dividing {len(stage.ranks)}"
        )
        return
    if t == 1 or len({len(stage.ranks), len(stage.machines), len(stage.gpu_types), len(stage.microbatches_per_rank)}) > 1:
        return
    per_rank = ("machines", stage.machines), ("gpu_types", stage.gpu_types), ("microbatches_per_rank", stage.microbatches_per_rank)
    rules = {
        "machines": "a TP group exchanges every block's activations, so it lives on one machine",
        "gpu_types": "a TP group's ranks wait for each other at every block, so they are of one GPU type",
        "microbatches_per_rank": "the ranks of a TP group run their replica's microbatches together",
    }
    if stage.shard_fractions and len(stage.shard_fractions) == len(stage.ranks):
        per_rank += (("shard_fractions", stage.shard_fractions),)
        rules["shard_fractions"] = "the ranks of a TP group hold the same share of their replica's sharded state"
    for start in range(0, len(stage.ranks), t):
        group = list(stage.ranks[start : start + t])
        for name, values in per_rank:
            mine = values[start : start + t]
            if len(set(mine)) > 1:
                yield (
                    f"{where}: TP group {group} (tensor_parallel={t}) has {name} {list(mine)}: {rules[name]}; list ranks "
                    f"replica by replica so that each run of {t} ranks shares its {name}, or lower tensor_parallel"
                )



def check_format_version(version: Any, source: str) -> None:
    """Refuse a plan of a format version this code does not read; ``source`` names it in the error."""
    if version not in READABLE_FORMAT_VERSIONS:
        raise PlanningError(
            f"{source} has format_version={version!r}, which this zorse_lightning does not read (it reads "
            f"{list(READABLE_FORMAT_VERSIONS)}, writes {PLAN_FORMAT_VERSION}); re-run the planner, or upgrade "
            f"zorse_lightning if the plan comes from a newer one"
        )


def check_known_keys(kind: type, data: dict[str, Any], source: str, version: int, prefix: str) -> None:
    """Refuse a key ``kind`` does not have (a plan from a newer version, or a typo) by name: a plan read with a
    field dropped would run something other than what it says."""
    unknown = sorted(set(data) - set(kind.__dataclass_fields__))
    if unknown:
        raise PlanningError(
            f"{source} (format_version={version}) has {', '.join(prefix + k for k in unknown)}, which plan format "
            f"{PLAN_FORMAT_VERSION} does not know (its {kind.__name__} has {sorted(kind.__dataclass_fields__)}); "
            f"correct the key, or upgrade zorse_lightning if the plan comes from a newer one"
        )

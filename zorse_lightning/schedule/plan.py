"""The plan: who does what, frozen, validated and serialisable.

Ranks are global ranks of the inventory (:attr:`ClusterInventory.gpus`). Layers
index the model's block list; the first stage also holds the embedding and the
last the head.

Interleaving (``Plan.interleave`` = V > 1): ``stages`` lists *virtual* stages,
contiguous layer chunks in layer order, and the ranks repeat: stage ``s`` runs on
the group of ranks of stage ``s % G`` (``G`` = ``len(stages) / V`` groups), so each
group holds V non-adjacent chunks (Megatron's interleaved 1F1B; Zorse chooses V per
plan). All chunks of a group agree in everything but their layers. Each stage processes every microbatch of the iteration once,
spread over its ranks by ``microbatches_per_rank`` (uneven, by speed); microbatch
``j`` goes to the rank whose contiguous share contains ``j`` (see
:meth:`StagePlan.rank_of_microbatch`).

Tensor parallelism (``StagePlan.tensor_parallel`` = t > 1): the stage's ``ranks``
are listed replica by replica, each run of t consecutive ranks one TP group (on
one machine, of one GPU type) that holds one copy of the stage's layers, each
block split over its t ranks. The ranks of a TP group run the same microbatches
(``microbatches_per_rank`` repeats the replica's count for each of them), so a
stage's microbatches are counted once per replica, and TP rank i of a replica
exchanges activations with TP rank i of the next stage's replica
(:meth:`StagePlan.peer_of_microbatch`).

Format versions: 2 added ``tensor_parallel``; a version-1 file reads as a plan
without tensor parallelism. The rules a plan must keep and what reading one refuses
are :mod:`.plan_validation`.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from zorse_lightning.capabilities import Schedule, Sharding
from zorse_lightning.errors import PlanningError
from zorse_lightning.schedule.plan_validation import (
    PLAN_FORMAT_VERSION,
    check_format_version,
    check_known_keys,
    plan_problems,
)


@dataclass(frozen=True)
class StagePlan:
    ranks: tuple[int, ...]
    gpu_types: tuple[str, ...]
    machines: tuple[str, ...]
    layers: tuple[int, int]
    """Half-open range [start, end) of the block list."""
    microbatches_per_rank: tuple[int, ...]
    sharding: Sharding = Sharding.NONE
    shard_fractions: tuple[float, ...] = ()
    """Share of the stage's sharded state each rank holds (sums to 1); empty: even shares."""
    recompute: bool = False
    gather_per_microbatch: bool = False
    """``full`` sharding only: each block's parameters are gathered for each microbatch's forward and
    backward and freed after them (least memory, most traffic); otherwise all of the stage's parameters
    are gathered once before its first microbatch of a step and kept for all of them."""
    offload_activations: bool = False
    """Keep what backward needs of the stage's blocks in host memory between a microbatch's forward and its
    backward (copied out as the forward saves it, brought back one block ahead of the backward): a small GPU
    then holds one microbatch's activations at a time instead of every microbatch in flight, at the price
    of the copies over its host link (:meth:`~zorse_lightning.planner.cost.context.CostContext.offload_copy_ms`). With
    ``recompute``, what recomputation keeps (each block's input) goes to host memory: the least device memory
    of all, at the price of both."""
    tensor_parallel: int = 1
    """Ranks of each TP group (1: no tensor parallelism): ``ranks`` lists the replicas one after the other,
    each run of this many consecutive ranks one group that splits every block of the stage over its ranks."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharding", Sharding(self.sharding))
        for name in ("ranks", "gpu_types", "machines", "microbatches_per_rank", "shard_fractions", "layers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def num_microbatches(self) -> int:
        """Microbatches of the stage: each replica's once (its TP ranks repeat its count)."""
        return sum(self.microbatches_per_rank[:: self.tensor_parallel])

    @cached_property
    def replicas(self) -> tuple[tuple[int, ...], ...]:
        """The stage's TP groups in order (one rank each without tensor parallelism); computed once, as the
        planner asks for it for every stage it prices."""
        t = self.tensor_parallel
        return tuple(self.ranks[i : i + t] for i in range(0, len(self.ranks), t))

    @cached_property
    def rank_index(self) -> dict[int, int]:
        """Each rank's place in ``ranks``."""
        return {rank: index for index, rank in enumerate(self.ranks)}

    def tensor_index(self, rank: int) -> int:
        """``rank``'s place in its TP group (0 without tensor parallelism)."""
        return self.rank_index[rank] % self.tensor_parallel

    def tensor_group(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s TP group (itself alone without tensor parallelism)."""
        start = self.rank_index[rank] // self.tensor_parallel * self.tensor_parallel
        return self.ranks[start : start + self.tensor_parallel]

    def data_ranks(self, tensor_index: int) -> tuple[int, ...]:
        """The ranks of TP index ``tensor_index`` in every replica: they hold the same shard of every weight,
        so its gradients are summed over them (all of the stage's ranks without tensor parallelism)."""
        return self.ranks[tensor_index :: self.tensor_parallel]

    def peer_of_microbatch(self, microbatch: int, tensor_index: int) -> int:
        """The rank of TP index ``tensor_index`` in the replica that runs ``microbatch``."""
        owner = self.rank_of_microbatch(microbatch)
        return owner if tensor_index == 0 else self.ranks[self.rank_index[owner] + tensor_index]

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def microbatch_ranges(self) -> dict[int, range]:
        """Microbatch indices each rank of the stage processes (contiguous shares in replica order; the ranks
        of a TP group share their replica's)."""
        return dict(self._ranges)

    @cached_property
    def _ranges(self) -> dict[int, range]:
        """Computed once per stage: schedules ask for every microbatch's rank (most of the recording time
        of a 1024-GPU plan's programs when rebuilt per call)."""
        ranges, start = {}, 0
        for index, (rank, count) in enumerate(zip(self.ranks, self.microbatches_per_rank)):
            if index % self.tensor_parallel == 0:
                share, start = range(start, start + count), start + count
            ranges[rank] = share
        return ranges

    @cached_property
    def _rank_of(self) -> dict[int, int]:
        """Microbatch -> the first rank of the replica that runs it."""
        return {j: replica[0] for replica in self.replicas for j in self._ranges[replica[0]]}

    def rank_of_microbatch(self, microbatch: int) -> int:
        if microbatch not in self._rank_of:
            raise IndexError(f"microbatch {microbatch} is outside the stage's {self.num_microbatches}")
        return self._rank_of[microbatch]

    def effective_shard_fractions(self) -> tuple[float, ...]:
        """Each rank's share of the state sharded over its data-parallel group (its replicas' ranks of its TP
        index): the fractions of one TP index's ranks sum to 1."""
        if self.shard_fractions:
            return self.shard_fractions
        share = 1.0 / len(self.replicas)
        return tuple(share for _ in self.ranks)

    @property
    def activations_label(self) -> str:
        """What the stage does with its activations between forward and backward, as reports print it."""
        if self.offload_activations:
            return "offload"
        return "recompute" if self.recompute else "keep"

    @property
    def sharding_label(self) -> str:
        """The sharding level as reports print it: ``full/microbatch`` when gathered block by block
        per microbatch (``full`` alone: gathered once per step)."""
        return f"{self.sharding.value}/microbatch" if self.gather_per_microbatch else self.sharding.value


@dataclass(frozen=True)
class Prediction:
    iteration_ms: float
    samples_per_s: float
    memory_gib: tuple[float, ...]
    """Predicted peak per global rank."""
    profile_source: dict[str, str]
    """GPU type -> where its times came from (measured, reference, estimated...)."""
    host_memory_gib: tuple[float, ...] = ()
    """Pinned host memory per global rank (activation offload's copies); empty: the plan offloads nothing."""
    closed_form_ms: float | None = None
    """The cost model's closed form, which the search ranks candidates by, where ``iteration_ms`` is the
    simulation of the engine's programs (:func:`~zorse_lightning.planner.cost.simulate.with_simulated_prediction`);
    None: ``iteration_ms`` is the closed form's."""


@dataclass(frozen=True)
class SolverRecord:
    name: str = "none"
    status: str = "not run"
    objective_ms: float | None = None


@dataclass(frozen=True)
class Plan:
    model: str
    cluster: str
    num_layers: int
    world_size: int
    global_batch_size: int
    microbatch_size: int
    schedule: Schedule
    stages: tuple[StagePlan, ...]
    predicted: Prediction | None = None
    planner_seconds: float = 0.0
    solver: SolverRecord = field(default_factory=SolverRecord)
    notes: tuple[str, ...] = ()
    """Why the plan looks as it does (for example: no cuts because the module has no block list)."""
    idle_ranks: tuple[int, ...] = ()
    """Ranks that take no part in training (the plan is faster without them, for example
    behind a slow link): in no stage, no collective, no data."""
    interleave: int = 1
    """Layer chunks (virtual stages) each group of ranks holds: 1 is a plain pipeline; V > 1
    makes ``stages`` V rounds of the same groups (see the module docstring)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "idle_ranks", tuple(self.idle_ranks))
        self.validate()

    # -- invariants ---------------------------------------------------------------------

    def validate(self) -> None:
        """Every structural problem at once (:func:`~.plan_validation.plan_problems`); memory against a cluster is
        checked by the planner's cost model."""
        problems = list(plan_problems(self))
        if problems:
            raise PlanningError("invalid plan: " + "; ".join(problems))

    def with_prediction(self, predicted: Prediction | None) -> Plan:
        """This plan predicted at ``predicted``. Its structure is the one already validated, so it is not checked
        again: the search reprices a plan thousands of times (5 % of its time was validating the same plans)."""
        out = copy.copy(self)
        object.__setattr__(out, "predicted", predicted)
        return out

    def predicted_at(self, iteration_ms: float, closed_form_ms: float | None) -> Plan:
        """This plan with its prediction at ``iteration_ms`` (samples per second to match) and ``closed_form_ms`` the
        closed form's figure beside it: a simulation's, a twin's or a calibration's time put on a plan priced."""
        return self.with_prediction(replace(
            self.predicted, iteration_ms=iteration_ms, samples_per_s=self.global_batch_size / iteration_ms * 1000.0,
            closed_form_ms=closed_form_ms,
        ))

    # -- views --------------------------------------------------------------------------

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.microbatch_size

    @property
    def num_groups(self) -> int:
        """Groups of ranks: as many as stages unless interleaved."""
        return len(self.stages) // self.interleave

    @property
    def rank_groups(self) -> tuple[StagePlan, ...]:
        """One stage per group of ranks (its first chunk): each working rank is in exactly one."""
        return self.stages[: self.num_groups]

    def group_of_stage(self, index: int) -> int:
        return index % self.num_groups

    def stages_of_group(self, group: int) -> tuple[int, ...]:
        """The stages (chunks, in layer order) that group ``group`` runs."""
        return tuple(range(group, len(self.stages), self.num_groups))

    def stage_of_rank(self, rank: int) -> int:
        """The rank's group of ranks, which is also the index of its first stage."""
        for index, stage in enumerate(self.rank_groups):
            if rank in stage.ranks:
                return index
        raise IndexError(f"rank {rank} is in no stage of this plan (world size {self.world_size})")

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """Every stage the rank runs (one unless interleaved)."""
        return self.stages_of_group(self.stage_of_rank(rank))

    # -- JSON ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["format_version"] = PLAN_FORMAT_VERSION
        return json.loads(json.dumps(data, default=lambda v: v.value))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "the plan") -> Plan:
        """A plan of any readable format version; ``source`` names where it came from (a file) in errors."""
        data = dict(data)
        version = data.pop("format_version", PLAN_FORMAT_VERSION)
        check_format_version(version, source)
        check_known_keys(cls, data, source, version, "")
        for index, stage in enumerate(data["stages"]):
            check_known_keys(StagePlan, stage, source, version, f"stages[{index}].")
        data["stages"] = tuple(StagePlan(**s) for s in data["stages"])
        if data.get("predicted") is not None:
            predicted = dict(data["predicted"])
            check_known_keys(Prediction, predicted, source, version, "predicted.")
            predicted["memory_gib"] = tuple(predicted["memory_gib"])
            predicted["host_memory_gib"] = tuple(predicted.get("host_memory_gib", ()))
            data["predicted"] = Prediction(**predicted)
        check_known_keys(SolverRecord, data.get("solver", {}), source, version, "solver.")
        data["solver"] = SolverRecord(**data.get("solver", {}))
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str, source: str = "the plan") -> Plan:
        return cls.from_dict(json.loads(text), source)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(Path(path).read_text(), source=f"plan file {str(path)!r}")

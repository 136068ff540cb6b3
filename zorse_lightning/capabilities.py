"""What the engine can execute; the planner offers only these choices.

One list read by both sides (issue 3: "offer a choice only once the engine
supports it"). Pure data: no torch import.
"""

from __future__ import annotations

from enum import Enum


class Schedule(str, Enum):
    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"


class Sharding(str, Enum):
    """How much training state a stage shards across its GPUs (ZeRO stages 0-3)."""

    NONE = "none"
    OPTIMIZER = "optimizer"
    OPTIMIZER_GRADIENTS = "optimizer_gradients"
    FULL = "full"


class P2PRules(str, Enum):
    """The rules a run's point-to-point messages keep, which the planner's simulation plays
    (:mod:`zorse_lightning.planner.cost.simulate`).

    * ``gloo``: gloo's own, on a run of CPU ranks: a send is posted and left, and a message moves once
      its receiver waits for it;
    * ``nccl``: NCCL's, on every run on GPUs, and on a gloo run under ``ZORSE_P2P_RULES=nccl``
      (:mod:`zorse_lightning.engine.p2p_rules`): a rank's batches of messages run one at a time, in posting
      order, on one stream, and a send completes only together with the peer's matching receive.
    """

    GLOO = "gloo"
    NCCL = "nccl"


SUPPORTED_SCHEDULES: tuple[Schedule, ...] = (Schedule.ONE_F_ONE_B, Schedule.GPIPE)
SUPPORTED_SHARDING: tuple[Sharding, ...] = (
    Sharding.NONE,
    Sharding.OPTIMIZER,
    Sharding.OPTIMIZER_GRADIENTS,
    Sharding.FULL,
)
SUPPORTS_GATHER_PER_MICROBATCH_IN_PIPELINES = True
"""``full`` sharding with parameters gathered block by block for each microbatch
(``StagePlan.gather_per_microbatch``) runs in any stage of a plan that is not interleaved. Every rank of
the stage makes the same gathers in the same order, in rounds (:mod:`zorse_lightning.schedule.gathering_rounds`);
inside a pipeline a round also waits on other stages, and whether rounds and messages can wait on each
other in a cycle is the rendezvous play's to decide for each plan (``schedule.programs.build_schedule``
refuses one that would hang)."""
TENSOR_PARALLEL_SHARDING: tuple[Sharding, ...] = (Sharding.NONE, Sharding.OPTIMIZER)
"""Sharding levels a stage with tensor parallelism runs: the shards of one TP index's ranks hold local
slices; the levels that move whole parameters between owners do not run with TP yet, nor does offloading
activations or gathering per microbatch (``engine.tensor_parallel.check_stage`` refuses them)."""
SUPPORTS_RECOMPUTATION = True
SUPPORTS_INTERLEAVING = True
"""Plans may give each group of ranks several non-adjacent layer chunks (``Plan.interleave``): the
engine runs each rank's chunks by the interleaved schedule and the planner chooses the degree."""
SUPPORTS_IDLE_RANKS = True
"""Plans may leave ranks out of every stage (``Plan.idle_ranks``): the engine keeps such
ranks out of its process groups and frees their copy of the model, and the strategy runs
their Lightning loop on batches without samples, joining only world-wide collectives."""

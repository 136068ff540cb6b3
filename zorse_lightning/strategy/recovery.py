"""The strategy's side of fault handling: one watchdog per run, named after the plan's stages."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.engine.faults import FaultPolicy, Watchdog, _exit_with
from zorse_lightning.strategy.checkpoint_io import all_gather
from zorse_lightning.planner.plan import Plan


def rank_describer(plan: Plan, inventory: ClusterInventory | None):
    """``describe(rank)`` for messages: the rank, its stage, and its GPU and machine when known."""

    def describe(rank: int) -> str:
        if rank in plan.idle_ranks:
            return f"rank {rank} (idle)"
        stages = plan.stages_of_rank(rank)
        label = f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"  # interleaved
        where = ""
        if inventory is not None and rank < inventory.world_size:
            gpu = inventory.gpus[rank]
            where = f", {gpu.gpu_type.name} on {gpu.machine}"
        return f"rank {rank} ({label}{where})"

    return describe


def start_watchdog(environment: Any, plan: Plan, inventory: ClusterInventory | None, rank: int,
                   policy: FaultPolicy, on_lost: Callable[[], None] | None = None) -> Watchdog:
    """Start this rank's watchdog for a run (collective: the ranks agree on the run's key prefix).

    ``on_lost`` runs before the watchdog ends a rank stuck in a wait (survivors keep their state there)."""
    token = all_gather(uuid.uuid4().hex if rank == 0 else None)[0]

    def exit_process(message: str) -> None:
        try:
            if on_lost is not None:
                on_lost()
        finally:  # the stuck rank must end even if keeping its state failed, or it would hang
            _exit_with(message)

    watchdog = Watchdog.connect(
        environment.main_address, environment.main_port, token, rank=rank, world_size=plan.world_size,
        describe=rank_describer(plan, inventory), policy=policy, exit_process=exit_process,
    )
    return watchdog.start()

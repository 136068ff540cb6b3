"""Where the strategy's plan comes from: a given plan checked against the cluster, or one made at start.

Planning at start: each distinct GPU type's first rank times the model's
blocks on its own device (an emulated rank through its emulation, so it is
never told its speed factor), the measurements are gathered, and rank 0 runs
the planner; every rank receives rank 0's plan. Each machine's ranks also time
an all-reduce of the model's gradient bytes (startup/link_probe.py): the planner
prices synchronisation at the measured rate where it is below the configured one. A module that cannot be cut,
or that optimises by hand (strategy/manual_optimization.py), gets a data-parallel
plan, and the plan's notes say why.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.module.blocks import BlockList, CutError, find_block_list
from zorse_lightning.emulation.emulator import ComputeEmulator, emulation_spec_for_rank, named_emulated_modules
from zorse_lightning.emulation.calibration import calibrate_in_turn
from zorse_lightning.errors import PlanningError
from zorse_lightning.startup.link_probe import probe_bytes, probe_machines, with_measured_rates
from zorse_lightning.strategy.log_capture import LogCapture, capturing_logs
from zorse_lightning.startup.step_costs import measure_rank_step_costs
from zorse_lightning.strategy.manual_optimization import MANUAL_OPTIMIZATION_REASON
from zorse_lightning.strategy.validation import check_predicted_memory
from zorse_lightning.capabilities import Schedule, Sharding
from zorse_lightning.planner.plan import Plan, StagePlan
from zorse_lightning.profiling.profile import BlockShape

PROFILE_OPTIONS = dict(max_microbatch_size=2, warmup=1, repeats=3)
"""Short: profiling runs at every start; the planner needs the slope per sample more than precision."""


def resolve_plan(source: Plan | str | Path, inventory: ClusterInventory | None, world_size: int) -> Plan:
    plan = source if isinstance(source, Plan) else Plan.load(source)
    if plan.world_size != world_size:
        raise PlanningError(
            f"the plan is for {plan.world_size} ranks but {world_size} processes were launched "
            f"({'more' if world_size > plan.world_size else 'fewer'} than the plan has); launch {plan.world_size} "
            f"(Trainer(devices=..., num_nodes=...), torchrun --nproc-per-node) or re-plan for this cluster"
        )
    return plan


def check_plan_against(plan: Plan, inventory: ClusterInventory) -> None:
    """The plan's ranks must have the GPU types the cluster lists at those ranks."""
    if plan.world_size != inventory.world_size:
        raise PlanningError(
            f"the plan is for {plan.world_size} ranks but cluster {inventory.name!r} has {inventory.world_size}; "
            f"re-plan for this cluster"
        )
    for index, stage in enumerate(plan.stages):
        for rank, gpu_type in zip(stage.ranks, stage.gpu_types):
            actual = inventory.gpus[rank].gpu_type.name
            if gpu_type != actual:
                raise PlanningError(
                    f"stage {index} of the plan puts a {gpu_type} at rank {rank}, but cluster {inventory.name!r} "
                    f"has a {actual} there; the plan was made for another cluster: re-plan for this one"
                )
    check_predicted_memory(plan, inventory)


def _one_sample_step(strategy: Any, batch: Any) -> None:
    """The user's training step on the first sample of ``batch``, logs discarded, no gradients."""
    from zorse_lightning.module.microbatch import microbatch_slice

    with capturing_logs(strategy.lightning_module, LogCapture(1)), torch.no_grad():
        strategy.lightning_module.training_step(microbatch_slice(batch, 0, 1), 0)


def _first_block_input(strategy: Any, blocks: BlockList, batch: Any) -> torch.Tensor:
    """What the first block receives for one sample of ``batch`` (the profile's example input)."""
    captured: list[torch.Tensor] = []

    class _Seen(Exception):
        pass

    def hook(module, args):
        captured.append(args[0].detach())
        raise _Seen

    handle = blocks.blocks[0].register_forward_pre_hook(hook)
    try:
        _one_sample_step(strategy, batch)
    except _Seen:
        pass
    finally:
        handle.remove()
    if not captured:
        raise PlanningError("the training step did not run the block list; name it with ZorseStrategy(block_path=...)")
    return captured[0]


def _block_names(blocks: BlockList) -> list[str]:
    return [f"{blocks.path}.{name}" for name, _ in blocks.container.named_children()]


def _measure_my_type(strategy: Any, blocks: BlockList, batch: Any, example: torch.Tensor, inventory: ClusterInventory):
    """This rank's profile if it is the first of its GPU type, else None: its blocks, then what the
    step spends outside them and the optimizer's rate (:mod:`.step_costs`).

    Emulated ranks time the blocks through an emulator on the costs calibrated
    once for the whole run (:func:`plan_at_start`): every type is timed on the
    same CPU cost, so the profile's ratios between types are exactly their
    speed ratios, and the run's emulation uses those same costs.
    """
    from zorse_lightning.profiling.measure import MeasureOptions, measure_blocks

    rank = strategy.global_rank
    my_type = inventory.gpus[rank].gpu_type.name
    if next(r for r, g in enumerate(inventory.gpus) if g.gpu_type.name == my_type) != rank:
        return None
    measured_blocks = copy.deepcopy(blocks.blocks)
    emulator = None
    if strategy.calibrated_costs is not None:
        spec = emulation_spec_for_rank(inventory, rank, strategy.emulation_slowdown)
        emulator = ComputeEmulator(spec, rank=rank, costs=strategy.calibrated_costs)
        emulator.instrument(measured_blocks, names=_block_names(blocks))
    try:
        measured = measure_blocks(
            measured_blocks, example, device=strategy.root_device, gpu_type=my_type,
            dtype=str(example.dtype).removeprefix("torch."),
            options=MeasureOptions(**PROFILE_OPTIONS), cache_dir=None,
        )
    finally:
        if emulator is not None:
            emulator.remove()
    edges, optimizer_rate = measure_rank_step_costs(strategy, blocks, batch)
    times = replace(measured.times, embedding=edges.embedding, head=edges.head,
                    optimizer_ms_per_million_parameters=optimizer_rate)
    return replace(measured, times=times)


def _edge_shapes(strategy: Any, blocks: BlockList, batch: Any, example: torch.Tensor) -> tuple[BlockShape, BlockShape, bool]:
    """(embedding, head, tied) sizes: the parameters of the modules that run before and after the blocks.

    The blocks' profile has no embedding or head; without their parameters the
    planner would count no memory for them and no all-reduce of a tied
    embedding/head weight between the first and last stage. Their times are
    measured apart (:mod:`.step_costs`).
    """
    inside = {id(m) for b in blocks.blocks for m in b.modules()}
    seen_block, before, after = [False], set(), set()

    def hook(module, args):
        if id(module) in inside:
            seen_block[0] = True
        else:
            (after if seen_block[0] else before).update(id(p) for p in module.parameters(recurse=False))

    root = strategy.lightning_module
    handles = [m.register_forward_pre_hook(hook) for m in root.modules()]
    try:
        _one_sample_step(strategy, batch)
    finally:
        for handle in handles:
            handle.remove()
    sizes = {id(p): p.numel() for p in root.parameters()}
    embedding = BlockShape("embedding", sum(sizes[i] for i in before), 0, example.numel() * example.element_size(), 0.0)
    head = BlockShape("head", sum(sizes[i] for i in after), 0, 0, 0.0)
    return embedding, head, bool(before & after)


def plan_at_start(strategy: Any, loader: DataLoader) -> Plan:
    """Profile, plan on rank 0, broadcast (collective: every rank calls it)."""
    inventory = strategy.inventory
    if inventory is None:
        raise PlanningError("ZorseStrategy needs a cluster (cluster='cpu_sim4', a config path or an inventory) or a plan")
    if loader.batch_size is None:
        raise PlanningError("the training DataLoader has no batch_size; give one, or pass a plan")
    # On resume the checkpoint's global batch continues (same data order, same trajectory), whatever the
    # loader's batch size times this cluster's ranks.
    global_batch_size = strategy._checkpoint_global_batch_size or loader.batch_size * strategy.world_size
    from zorse_lightning.planner.search import PlannerOptions, make_plan
    from zorse_lightning.profiling.measure import assemble_profile

    if not strategy.lightning_module.automatic_optimization:
        return data_parallel_plan(inventory, global_batch_size, MANUAL_OPTIMIZATION_REASON, shard_optimizer=False)
    options = within_profiled_sizes(strategy._planner_options or PlannerOptions())
    try:
        blocks = find_block_list(strategy.lightning_module, strategy.block_path)
    except CutError as error:
        blocks, options = None, _without_pipeline(options, str(error))
    if blocks is None:
        return data_parallel_plan(inventory, global_batch_size, options.no_pipeline_reason)
    batch = next(iter(loader))
    example = _first_block_input(strategy, blocks, batch)
    if inventory.emulated and strategy.root_device.type == "cpu":
        strategy.calibrated_costs = calibrate_in_turn(
            named_emulated_modules(strategy.lightning_module), lambda: _one_sample_step(strategy, batch), batch_samples=1
        )
    measured = [None] * strategy.world_size
    dist.all_gather_object(measured, _measure_my_type(strategy, blocks, batch, example, inventory))
    probes = probe_machines(inventory, strategy.global_rank, strategy.root_device, probe_bytes(strategy.lightning_module))
    plan = None
    if strategy.global_rank == 0:
        embedding, head, tied = _edge_shapes(strategy, blocks, batch, example)
        profile = assemble_profile(
            [m for m in measured if m is not None], model=type(strategy.lightning_module).__name__, tied_embedding_head=tied
        )
        profile = replace(profile, embedding=embedding, head=head)
        planned_on = with_measured_rates(inventory, probes)
        plan = make_plan(planned_on, profile, global_batch_size, options)
        plan = replace(plan, notes=(*plan.notes, *(p.note() for p in probes if p.slower_than_configured)))
        strategy.start_up_profile, strategy.start_up_inventory = profile, planned_on  # for reports, on rank 0
    return strategy.broadcast(plan)


def _largest_remainder(total: int, weights: list[float]) -> list[int]:
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def data_parallel_plan(
    inventory: ClusterInventory, global_batch_size: int, reason: str, shard_optimizer: bool = True
) -> Plan:
    """One stage of every rank (Cephalo-style): microbatches by peak speed, optimizer state by memory
    (unless ``shard_optimizer`` is False: a module optimising by hand steps every weight on every rank).

    For modules that cannot be cut; no profile is needed, since one stage has no
    layer split to balance. Microbatches are as large as leaves each rank about
    four of them, so the speed split can be fine-grained.
    """
    world = inventory.world_size
    microbatch_size = max(d for d in range(1, global_batch_size + 1)
                          if global_batch_size % d == 0 and global_batch_size // d >= min(4 * world, global_batch_size))
    counts = _largest_remainder(global_batch_size // microbatch_size, [g.gpu_type.peak_tflops for g in inventory.gpus])
    memory = [g.memory_gib for g in inventory.gpus]
    sharded = shard_optimizer and world > 1
    stage = StagePlan(
        ranks=tuple(range(world)),
        gpu_types=tuple(g.gpu_type.name for g in inventory.gpus),
        machines=tuple(g.machine for g in inventory.gpus),
        layers=(0, 1),
        microbatches_per_rank=tuple(counts),
        sharding=Sharding.OPTIMIZER if sharded else Sharding.NONE,
        shard_fractions=tuple(m / sum(memory) for m in memory) if sharded else (),
    )
    return Plan(
        model="", cluster=inventory.name, num_layers=1, world_size=world, global_batch_size=global_batch_size,
        microbatch_size=microbatch_size, schedule=Schedule.ONE_F_ONE_B, stages=(stage,),
        notes=(f"data parallel only: {reason}",),
    )


def within_profiled_sizes(options: Any) -> Any:
    """Microbatch sizes up to the largest profiled, unless the user pins one.

    Beyond the measured sizes the planner extrapolates a line through two
    points, and a per-call overhead then reads as a per-sample saving that grows
    with the size (seen on cpu_sim4: a 32-sample microbatch given to the A100
    alone, the three other ranks idle, predicted faster than a balanced split).
    """
    if options.microbatch_size is not None:
        return options
    largest = PROFILE_OPTIONS["max_microbatch_size"]
    return replace(options, microbatch_sizes=tuple(m for m in options.microbatch_sizes if m <= largest) or (1,))


def _without_pipeline(options: Any, reason: str) -> Any:
    return replace(options, allow_pipeline=False, no_pipeline_reason=reason)

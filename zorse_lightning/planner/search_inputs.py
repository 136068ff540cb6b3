"""What the search is given, checked before it starts: the inputs, and the microbatch sizes it may use."""

from __future__ import annotations

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.profiling.profile import ModelProfile


def check_inputs(inventory: ClusterInventory, profile: ModelProfile, global_batch_size: int, options: PlannerOptions) -> None:
    if not (isinstance(global_batch_size, int) and global_batch_size >= 1):
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

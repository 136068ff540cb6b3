"""Draw one iteration of a plan: a row per GPU, bars for forward, backward, communication
and the optimizer step, from :func:`zorse_lightning.planner.cost.simulate`, which plays the
engine's own per-rank programs, so the picture shows the order the engine runs.

On an interleaved plan each row names its group's stages (chunks), and the forwards
and backwards of a rank's later chunks are hatched (:data:`CHUNK_HATCHES`: none for its
first chunk, ``//`` for the second...), so one sees which chunk runs when."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.schedule.plan import Plan
from zorse_lightning.planner.cost.simulate import simulate

COMPUTE_KINDS = ("forward", "backward", "optimizer")
"""Drawn full height; every other kind is communication."""

COLOURS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "send": "#55A868",
    "recv": "#8172B3",
    "allreduce": "#C44E52",
    "optimizer": "#937860",
}


CHUNK_HATCHES = ("", "//", "..", "xx", "\\\\", "++", "oo", "--")
"""Hatch of a compute bar by the rank's chunk it runs (0: its first), repeating past eight."""


class TimelineEvent(Protocol):
    rank: int
    kind: str
    start_ms: float
    end_ms: float


def draw_plan_timeline(plan: Plan, ctx: CostContext, path: str | Path) -> Path:
    """Play one iteration of ``plan``'s engine programs in the cost model's times and draw it."""
    timeline = simulate(ctx, plan)
    labels = [f"{rank} {ctx.inventory.gpus[rank].gpu_type.name} idle" for rank in range(plan.world_size)]
    for index, stage in enumerate(plan.rank_groups):
        stages = "+".join(f"s{s}" for s in plan.stages_of_group(index))
        for rank, gpu_type, count in zip(stage.ranks, stage.gpu_types, stage.microbatches_per_rank):
            labels[rank] = f"{rank} {gpu_type} {stages} ({count} mb)"
    interleaved = f", interleaved x{plan.interleave} (hatched: later chunks)" if plan.interleave > 1 else ""
    title = (
        f"{plan.model} on {plan.cluster}: {plan.schedule.value}{interleaved}, {plan.num_microbatches} x {plan.microbatch_size} "
        f"samples, predicted {timeline.predicted_iteration_ms:.1f} ms"
    )
    computing = ("forward", "backward")
    return draw_timeline(
        [
            _Plain(e.rank, e.kind.value, e.start_ms, e.end_ms, e.stage // plan.num_groups if e.kind.value in computing else 0)
            for e in timeline.events
        ],
        labels, path, title,
    )


@dataclass(frozen=True)
class _Plain:
    rank: int
    kind: str
    start_ms: float
    end_ms: float
    chunk: int = 0
    """Which of its rank's chunks a forward or backward runs (0 unless interleaved)."""


def draw_timeline(
    events: Sequence[TimelineEvent],
    row_labels: Sequence[str],
    path: str | Path,
    title: str = "",
) -> Path:
    """Write a PNG of ``events``; ``row_labels[rank]`` names each row (e.g. "0 a100x40 stage 0")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    height = max(2.5, 0.45 * len(row_labels) + 1.2)
    figure, axes = plt.subplots(figsize=(12, min(height, 40)))
    # Communication is drawn as a thin bar at the bottom of the row so it never hides compute.
    # One call per row and kind: a call per event costs matplotlib a rescale each (seconds at 32 GPUs).
    bars: dict[tuple[int, str, int], list[tuple[float, float]]] = defaultdict(list)
    for event in events:
        chunk = getattr(event, "chunk", 0)
        bars[(event.rank, event.kind, chunk)].append((event.start_ms, max(event.end_ms - event.start_ms, 1e-6)))
    for (rank, kind, chunk), spans in bars.items():
        communication = kind not in COMPUTE_KINDS
        axes.broken_barh(
            spans,
            (rank - 0.4, 0.25 if communication else 0.8),
            facecolors=COLOURS.get(kind, "#999999"),
            edgecolor="white" if not communication else None,
            hatch=CHUNK_HATCHES[chunk % len(CHUNK_HATCHES)] or None,
            linewidth=0.3,
        )
    axes.set_yticks(range(len(row_labels)))
    axes.set_yticklabels(row_labels, fontsize=8 if len(row_labels) < 40 else 5)
    axes.invert_yaxis()
    axes.set_xlabel("time in one iteration (ms)")
    axes.set_title(title)
    kinds = sorted({e.kind for e in events}, key=lambda k: list(COLOURS).index(k) if k in COLOURS else 99)
    axes.legend(
        handles=[Patch(color=COLOURS.get(k, "#999999"), label=k) for k in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        fontsize=8,
        ncols=len(kinds),
    )
    axes.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path

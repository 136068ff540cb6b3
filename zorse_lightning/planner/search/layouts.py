"""Candidate stage layouts: which GPUs form each stage, and in which order the stages run.

Pipeline stages exchange only activations (a few MB per microbatch), while the GPUs inside a stage synchronise
every gradient of the stage: so slow links should fall *between* stages. As the Zorse paper's min-k-cut, the
GPUs are grouped by agglomeration on link bandwidth (Kruskal's algorithm on the bandwidth graph, fastest links
first): every prefix of the merge order is a partition, one for each number of groups. The units merged are
*cells*: the GPUs of one type and memory on one machine. Big groups may be split further (more stages, less
memory per GPU). Cost: O(C^2 log C) for C cells (128 machines: 8128 pairs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.cost.comm import LinkTable

Layout = tuple[tuple[int, ...], ...]
"""Stages in pipeline order, each the sorted global ranks of its GPUs."""

SPLIT_FACTORS = (2, 4, 8)
"""Ways of splitting every group of a partition into equal parts (more, shorter stages)."""


@dataclass(frozen=True)
class Cell:
    ranks: tuple[int, ...]
    machine: str
    gpu_type: str


def cells(inventory: ClusterInventory, ranks: tuple[int, ...]) -> list[Cell]:
    found: dict[tuple[str, str, float], list[int]] = {}
    for rank in ranks:
        gpu = inventory.gpus[rank]
        found.setdefault((gpu.machine, gpu.gpu_type.name, gpu.memory_gib), []).append(rank)
    return [Cell(tuple(ranks), machine, gpu_type) for (machine, gpu_type, _), ranks in found.items()]


def stage_counts_to_try(num_cells: int, max_stages: int) -> list[int]:
    """Every count up to 16, then a geometric ladder (1024 GPUs need not try all 128)."""
    top = min(num_cells, max_stages)
    ladder = {k for k in range(1, min(top, 16) + 1)}
    k = 16
    while k < top:
        k = int(k * 1.5)
        ladder.add(min(k, top))
    return sorted(ladder)


def partitions(
    inventory: ClusterInventory, links: LinkTable, speed_by_type: dict[str, float], stage_counts: list[int],
    ranks: tuple[int, ...],
) -> list[list[tuple[int, ...]]]:
    """Agglomerate the cells of ``ranks`` by descending bandwidth; ties merge GPUs of similar speed first."""
    not_positive = {t: v for t, v in speed_by_type.items() if not v > 0}
    if not_positive:
        raise PlanningError(
            f"speeds {not_positive} must be positive (sample-layers per ms): the profile gives these types a "
            f"zero or negative cost per sample; re-profile them, or pass speeds from "
            f"heuristic.speed_by_type, which falls back to the one-sample time"
        )
    found = cells(inventory, ranks)
    parent = list(range(len(found)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def edge_key(edge: tuple[int, int]) -> tuple:
        """Bandwidth first, then the gap in speed (a log ratio), then the cells' order."""
        a, b = found[edge[0]], found[edge[1]]
        speed_gap = abs(math.log(speed_by_type[a.gpu_type] / speed_by_type[b.gpu_type]))
        return -links.bandwidth_gbps(a.ranks[0], b.ranks[0]), speed_gap, edge

    wanted, groups_left = set(stage_counts), len(found)
    out = [_snapshot(found, root)] if groups_left in wanted else []
    for a, b in sorted(combinations(range(len(found)), 2), key=edge_key):
        ra, rb = root(a), root(b)
        if ra == rb:
            continue
        parent[max(ra, rb)] = min(ra, rb)
        groups_left -= 1
        if groups_left in wanted:
            out.append(_snapshot(found, root))
        if groups_left == 1:
            break
    return out


def _snapshot(found: list[Cell], root) -> list[tuple[int, ...]]:
    groups: dict[int, list[int]] = {}
    for index, cell in enumerate(found):
        groups.setdefault(root(index), []).extend(cell.ranks)
    return [tuple(sorted(g)) for g in groups.values()]


def split_groups(groups: list[tuple[int, ...]], parts: int) -> list[tuple[int, ...]]:
    """Cut each group into ``parts`` contiguous runs of ranks (fewer if it is smaller)."""
    out = []
    for group in groups:
        pieces = min(parts, len(group))
        bounds = [round(i * len(group) / pieces) for i in range(pieces + 1)]
        out.extend(group[bounds[i] : bounds[i + 1]] for i in range(pieces))
    return out


def stage_orders(
    groups: list[tuple[int, ...]], inventory: ClusterInventory, links: LinkTable, speed_by_type: dict[str, float]
) -> list[Layout]:
    """Orders worth trying: the path with the fastest boundaries; fastest GPUs first; the same with the
    fastest group moved last (the last stage also computes the head); slowest first (the slow groups, holding
    few layers, first, where 1F1B's warm-up keeps the most activations); most memory first (the first stage
    holds the most microbatches in flight); most memory per unit of speed first (a group's layers follow its
    speed, so this is the room each of its layers has for activations in flight). Up to
    :data:`.space.MOST_ORDERED_GROUPS` groups the loop tries every order of the plan it holds as well."""
    if len(groups) == 1:
        return [tuple(groups)]
    machines = [sorted({inventory.gpus[r].machine for r in g}) for g in groups]
    first_rank: dict[str, int] = {}
    for rank, gpu in enumerate(inventory.gpus):
        first_rank.setdefault(gpu.machine, rank)

    def boundary_gbps(i: int, j: int) -> float:
        if i == j:
            return math.inf
        return min(links.bandwidth_gbps(first_rank[a], first_rank[b]) for a in machines[i] for b in machines[j])

    table = [[boundary_gbps(i, j) for j in range(len(groups))] for i in range(len(groups))]
    speed = [sum(speed_by_type[inventory.gpus[r].gpu_type.name] for r in g) / len(g) for g in groups]
    memory = [min(inventory.gpus[r].memory_gib for r in g) for g in groups]
    by_speed = sorted(range(len(groups)), key=lambda i: -speed[i])
    orders = [
        _best_path(table),
        by_speed,
        by_speed[1:] + by_speed[:1],
        by_speed[::-1],
        sorted(range(len(groups)), key=lambda i: -memory[i]),
        sorted(range(len(groups)), key=lambda i: -memory[i] / speed[i]),
    ]
    return list(dict.fromkeys(tuple(groups[i] for i in order) for order in orders))  # each once, in this order


def _best_path(table: list[list[float]]) -> list[int]:
    """Greedy path through the groups from every start, keeping the one whose slowest boundary is fastest
    (then the least total transfer time, 1 / bandwidth)."""
    best, best_key = None, None
    n = len(table)
    for start in range(n):
        path, left = [start], set(range(n)) - {start}
        while left:
            nxt = max(sorted(left), key=lambda j: table[path[-1]][j])
            path.append(nxt)
            left.remove(nxt)
        boundaries = [table[a][b] for a, b in zip(path, path[1:])]
        key = (-min(boundaries), sum(1 / b for b in boundaries))
        if best_key is None or key < best_key:
            best, best_key = path, key
    return best


def candidate_layouts(
    inventory: ClusterInventory, links: LinkTable, speed_by_type: dict[str, float], max_stages: int,
    ranks: tuple[int, ...] | None = None,
) -> list[Layout]:
    """Every partition of the agglomeration of ``ranks`` (default: all), and its splits, in every order worth
    trying."""
    ranks = tuple(range(inventory.world_size)) if ranks is None else ranks
    counts = stage_counts_to_try(len(cells(inventory, ranks)), max_stages)
    grouped: list[list[tuple[int, ...]]] = []
    for groups in partitions(inventory, links, speed_by_type, counts, ranks):
        for parts in (1, *SPLIT_FACTORS):
            split = split_groups(groups, parts) if parts > 1 else groups
            if len(split) <= max_stages and split not in grouped:
                grouped.append(split)
    return list(dict.fromkeys(layout for groups in grouped for layout in stage_orders(groups, inventory, links, speed_by_type)))


def fastest_type_subsets(inventory: ClusterInventory, speed_by_type: dict[str, float]) -> list[tuple[int, ...]]:
    """All ranks, then the ranks of the fastest types only: fastest one, fastest two, ... A plan may leave slow
    GPUs idle when they, or the links to them, would slow the rest down (GPUs in another datacenter behind a
    slow link)."""
    order = sorted(speed_by_type, key=lambda t: -speed_by_type[t])
    subsets = [tuple(range(inventory.world_size))]
    for count in range(len(order) - 1, 0, -1):
        kept = set(order[:count])
        subsets.append(tuple(r for r, g in enumerate(inventory.gpus) if g.gpu_type.name in kept))
    return subsets


def unused_ranks(world_size: int, layout: Layout) -> tuple[int, ...]:
    """Ranks in no stage of the layout: the plan's idle ranks."""
    used = {r for stage in layout for r in stage}
    return tuple(r for r in range(world_size) if r not in used)

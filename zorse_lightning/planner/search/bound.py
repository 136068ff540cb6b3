"""Lower bounds the search prunes by: no plan of a stage layout at a microbatch size is faster than
:func:`lower_bound_ms`, so a candidate whose bound is past the best plan so far is never priced.

The search walks its candidates in increasing order of this bound and stops at the first past the
best plan found, so a tighter bound is fewer candidates priced (and planning time): at 1024 GPUs
most of the search's time is spent pricing the heuristic splits of candidates that cannot win.
Every term must hold for whatever split, shares, sharding and recomputation the search may then
choose: ``tests/planner/test_planner_search_bounds.py`` prices every split of small layouts against it.
"""

from __future__ import annotations

from collections import Counter

from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.tensor_parallel import ALL_REDUCES_PER_PASS, split_factor
from zorse_lightning.planner.cost.update import update_lower_bound_ms, update_lower_bound_of_counts
from zorse_lightning.planner.search.layouts import Layout
from zorse_lightning.planner.search.problem import block_extras, round_trip_ms


def lower_bound_ms(
    ctx: CostContext, layout: Layout, m: int, global_batch_size: int, interleave: int = 1, degrees: tuple[int, ...] | None = None,
) -> float:
    """No plan of the layout at microbatch size ``m`` (its groups cut into ``interleave`` chunks each, each
    stage's blocks split over TP groups of ``degrees``, listed replica by replica) is faster than this.

    The busiest stage works at least as long as (a) the whole model's work spread
    over every GPU of the layout at its fastest layer time, and (b) any one stage
    passing every microbatch through one layer and the embedding or head it holds,
    spread over its own GPUs. Add one microbatch through each other stage (fill and
    drain: the largest such term is left out, it may be the busiest stage's) and
    through each boundary at its fastest link; or, where larger, the bound of
    :func:`bottleneck_bound_ms`, which counts every layer in the fill and drain and
    the microbatches a stage's busiest GPU must take. Then the optimizer step: the
    stages hold every parameter between them, and no split of them over stages and
    shards steps faster than all of them spread over every GPU of the layout by its
    speed (:func:`update_lower_bound_ms`). Interleaved, a microbatch still passes at least a layer of
    every other group in the fill and drain, and crosses every boundary, but no longer every layer of
    the others: :func:`bottleneck_bound_ms` holds for plain plans only. A TP group counts as one GPU
    whose layers take the one-GPU time over the degree at the type's efficiency plus the all-reduces of
    the smallest layer output of a forward and a backward on the fastest such group (:func:`_split_layer_ms`),
    its embedding and head whole: every term then holds as for a GPU.
    """
    num_m = global_batch_size // m
    last = len(layout) - 1
    degrees = degrees or (1,) * len(layout)
    types, units, update_ms = ctx.memo(("bound units", layout, degrees), lambda: _layout_units(ctx, layout, degrees))
    message_bytes = ctx.memo(("smallest layer output",), lambda: min(b.output_bytes_per_sample for b in ctx.profile.layers)) * m
    fastest_layer = _split_layer_ms(ctx, layout, degrees, types, m, message_bytes)
    extras = [{u: block_extras(ctx, u[0], m, s == 0, s == last)[0] for u in stage} for s, stage in enumerate(types)]
    whole_model = _whole_model_ms(ctx, units, fastest_layer, m, num_m)
    one_layer_per_stage = max(
        num_m / sum(n / (fastest_layer[t] + edge[t]) for t, n in stage.items()) for stage, edge in zip(types, extras)
    )
    fill = [min(fastest_layer[t] + edge[t] for t in stage) for stage, edge in zip(types, extras)]
    transfers = sum(
        ctx.memo(("round trip", a, b, message_bytes), lambda: round_trip_ms(ctx, a, b, message_bytes)[0]) for a, b in zip(layout, layout[1:])
    )
    compute = max(
        max(whole_model, one_layer_per_stage) + sum(fill) - max(fill),
        bottleneck_bound_ms(ctx.profile.num_layers, num_m, types, fastest_layer, extras) if interleave == 1 else 0.0,
    ) + transfers
    return compute + update_ms


def _layout_units(ctx: CostContext, layout: Layout, degrees: tuple[int, ...]) -> tuple[list[Counter[tuple[str, int]]], Counter, float]:
    """Per stage its :func:`_units`, the layout's together, and the optimizer step's bound of its GPUs: the same at
    every microbatch size (a layout is bounded at each)."""
    types = [_units(ctx, s, t) for s, t in zip(layout, degrees)]
    units: Counter[tuple[str, int]] = Counter()
    for stage in types:
        units.update(stage)
    gpus: Counter[str] = Counter()
    for (name, t), n in units.items():
        gpus[name] += n * t
    return types, units, update_lower_bound_of_counts(ctx, gpus)


def any_layout_lower_bound_ms(ctx: CostContext, ranks: tuple[int, ...], m: int, global_batch_size: int) -> float:
    """No plan on ``ranks`` or any subset of them, whatever its layout, at microbatch size ``m`` is faster:
    the whole model's work spread over all of them at their fastest layer time, then the optimizer step
    spread over them by speed (the terms of :func:`lower_bound_ms` that need no layout). Lets the search
    skip planning a sub-cluster (the fastest type alone) that cannot beat the plan it holds."""
    count = Counter(_unit(ctx, r, 1) for r in ranks)
    fastest_layer = {u: ctx.fastest_layer_ms(u[0], m) for u in count}
    return _whole_model_ms(ctx, count, fastest_layer, m, global_batch_size // m) + update_lower_bound_ms(ctx, list(ranks))


def _units(ctx: CostContext, ranks: tuple[int, ...], degree: int) -> Counter[tuple[str, int]]:
    """A stage's GPUs (or TP groups of ``degree``) counted by :func:`_unit`, once per stage: a stage recurs in
    many layouts, and at 1024 GPUs counting them again was most of a bound."""
    return ctx.memo(("units", ranks, degree), lambda: Counter(_unit(ctx, r, degree) for r in ranks[::degree]))


def _split_layer_ms(
    ctx: CostContext, layout: Layout, degrees: tuple[int, ...], types: list[Counter[tuple[str, int]]], m: int, message_bytes: float,
) -> dict[tuple[str, int], float]:
    """Per type and degree, the least time of one microbatch through a layer on one GPU or TP group of the layout
    (``types``: each stage's :func:`_units`)."""
    out: dict[tuple[str, int], float] = {}
    for ranks, t, units in zip(layout, degrees, types):
        if t == 1:
            out.update({u: ctx.fastest_layer_ms(u[0], m) for u in units})
            continue
        for unit, ms in ctx.memo(("split layers", ranks, t, m), lambda: _stage_split_layer_ms(ctx, ranks, t, m, message_bytes)).items():
            out[unit] = min(out.get(unit, ms), ms)
    return out


def _stage_split_layer_ms(ctx: CostContext, ranks: tuple[int, ...], t: int, m: int, message_bytes: float) -> dict[tuple[str, int], float]:
    """Per type and degree, the least time of one microbatch through a layer on a TP group of the stage."""
    out: dict[tuple[str, int], float] = {}
    for start in range(0, len(ranks), t):
        group = ranks[start : start + t]
        unit, ms = ctx.memo(("split layer", group, m), lambda: _group_layer_ms(ctx, group, m, message_bytes))
        out[unit] = min(out.get(unit, ms), ms)
    return out


def _group_layer_ms(ctx: CostContext, group: tuple[int, ...], m: int, message_bytes: float) -> tuple[tuple[str, int], float]:
    """A TP group's unit and the least time of one microbatch through a layer on it."""
    unit = _unit(ctx, group[0], len(group))
    collectives = 2 * ALL_REDUCES_PER_PASS * ctx.links.all_reduce_ms(tuple(sorted(group)), message_bytes)
    return unit, ctx.fastest_layer_ms(unit[0], m) * split_factor(ctx, *unit) + collectives


def _unit(ctx: CostContext, rank: int, degree: int) -> tuple[str, int]:
    """What the bound counts a GPU or TP group as: its type and degree."""
    return ctx.inventory.gpus[rank].gpu_type.name, degree


def _whole_model_ms(ctx: CostContext, count: Counter[tuple[str, int]], fastest_layer: dict, m: int, num_m: int) -> float:
    """Every microbatch through every layer and the cheapest embedding and head, spread over ``count``'s
    GPUs and TP groups (of each type and degree) at their fastest layer time: none of them is ever idle."""
    head_and_embedding = min(block_extras(ctx, u[0], m, True, True)[0] / fastest_layer[u] for u in count)
    capacity = sum(n / fastest_layer[t] for t, n in count.items())
    return num_m * (ctx.profile.num_layers + head_and_embedding) / capacity


def bottleneck_bound_ms(
    num_layers: int, num_m: int, types: list[Counter[str]], fastest_layer: dict[str, float],
    extras: list[dict[tuple[str, int], float]],
) -> float:
    """The pipeline (transfers left out) is no shorter than any stage ``b``'s busy time plus one
    microbatch through every other stage (the closed form's ``sum_e l_e + max_e (T_e - l_e)``).

    With ``k`` layers on ``b``: its busiest GPU takes at least ``ceil(M / width)`` microbatches of
    at least ``k`` fastest layers and its cheapest embedding or head each, and the stage's GPUs
    together pass ``M`` microbatches through ``k`` layers at their speeds; the other stages hold the
    other ``L - k`` layers, each at least the fastest layer of their GPUs, and their embedding or
    head. That is convex in ``k`` (a maximum of lines plus a line), so its least value over the
    splits lies at an end of ``1 .. L - S + 1`` or at the kink between; the bound holds for the
    actual split, whichever stage is busiest, so the largest over ``b`` of those least values is a
    bound. Tight where few microbatches meet many layers: the fill and drain of a deep pipeline,
    a data-parallel stage whose GPUs outnumber its microbatches. ``types``: per stage, its GPUs of
    each type.
    """
    stages = len(types)
    per_layer = [min(fastest_layer[t] for t in stage) for stage in types]
    edge = [min(stage_extras.values()) for stage_extras in extras]
    most_layers = num_layers - stages + 1
    bound = 0.0
    lowest = sorted(range(stages), key=per_layer.__getitem__)[:2]  # the least per-layer time of the stages but b's
    edges = sum(edge)
    for b, stage in enumerate(types):
        others_layer = per_layer[lowest[lowest[0] == b]] if stages > 1 else 0.0
        others_edge = edges - edge[b]
        busiest = -(-num_m // sum(stage.values()))
        capacity = sum(n / fastest_layer[t] for t, n in stage.items())
        layer_ms, edge_ms = per_layer[b], edge[b]
        slope_gap = num_m / capacity - busiest * layer_ms
        kink = busiest * edge_ms / slope_gap if slope_gap > 0 else 1.0
        ks = {1, most_layers, min(max(int(kink), 1), most_layers), min(max(int(kink) + 1, 1), most_layers)} if stages > 1 else (num_layers,)
        bound = max(bound, min(
            max(busiest * (k * layer_ms + edge_ms), num_m * k / capacity) + (num_layers - k) * others_layer + others_edge for k in ks
        ))
    return bound

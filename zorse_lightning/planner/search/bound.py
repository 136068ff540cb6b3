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
from typing import NamedTuple

from zorse_lightning.planner.cost.comm import least_stage_sync_ms
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.cost.memory import profile_state_bytes
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
    the microbatches a stage's busiest GPU must take. Then the first stage's synchronisation and
    optimizer step, which start at the last backward: of its embedding and one layer at least
    (:func:`_first_tail_ms`; every other stage's may hide in its drain, so the step of all the
    parameters spread over every GPU, once counted here, came 0.08 % over a plan of four stages). Or,
    where larger, :func:`tail_bound_ms`: a stage's work, synchronisation and step, balanced over the
    stages. Interleaved, a microbatch still passes at least a layer of
    every other group in the fill and drain, and crosses every boundary, but no longer every layer of
    the others: :func:`bottleneck_bound_ms` holds for plain plans only. A TP group counts as one GPU
    whose layers take the one-GPU time over the degree at the type's efficiency plus the all-reduces of
    the smallest layer output of a forward and a backward on the fastest such group of its stage (:func:`_stage_layer_ms`),
    its embedding and head whole: every term then holds as for a GPU.
    """
    num_m = global_batch_size // m
    last = len(layout) - 1
    degrees = degrees or (1,) * len(layout)
    stages = [
        ctx.memo(("stage bound", ranks, t, m, num_m, s == 0, s == last), lambda: _stage_bound(ctx, ranks, t, m, num_m, s == 0, s == last))
        for s, (ranks, t) in enumerate(zip(layout, degrees))
    ]
    whole_model = _whole_model_ms(ctx, stages, num_m)
    one_layer_per_stage = max(s.one_layer_ms for s in stages)
    fill = [s.fill_ms for s in stages]
    message_bytes = _smallest_output_bytes(ctx) * m
    transfers = sum(
        ctx.memo(("round trip", a, b, message_bytes), lambda: round_trip_ms(ctx, a, b, message_bytes)[0]) for a, b in zip(layout, layout[1:])
    )
    compute = max(
        max(whole_model, one_layer_per_stage) + sum(fill) - max(fill),
        bottleneck_bound_ms(ctx.profile.num_layers, num_m, [s.terms for s in stages]) if interleave == 1 else 0.0,
    ) + transfers
    first_tail_ms = ctx.memo(("first tail", layout[0], degrees[0]), lambda: _first_tail_ms(ctx, layout[0], degrees[0]))
    return max(compute + first_tail_ms, tail_bound_ms(ctx.profile.num_layers, [s.tail_lines for s in stages]))


class StageTerms(NamedTuple):
    """What the bounds count of a stage at a microbatch size: its least time of a microbatch through one layer
    and through its embedding or head, on its fastest GPU or TP group; the microbatches per ms it passes through a
    layer with every GPU busy; and the fewest microbatches its busiest GPU or TP group takes."""

    layer_ms: float
    edge_ms: float
    capacity: float
    busiest: int


class _StageBound(NamedTuple):
    """A stage's part of :func:`lower_bound_ms` at a microbatch size and position, made once: a stage recurs in
    many layouts (at 1024 GPUs counting its GPUs again was most of a bound). ``head_ratio``: its cheapest
    embedding and head in units of its layer time (:func:`_whole_model_ms`); ``one_layer_ms``: every microbatch
    through one layer and its own embedding or head over its GPUs; ``fill_ms``: one microbatch through them on
    its fastest; ``tail_lines``: :func:`tail_bound_ms`'s two lines in its layer count."""

    terms: StageTerms
    head_ratio: float
    one_layer_ms: float
    fill_ms: float
    tail_lines: tuple[tuple[float, float], tuple[float, float]]


def _stage_bound(ctx: CostContext, ranks: tuple[int, ...], degree: int, m: int, num_m: int, first: bool, last: bool) -> _StageBound:
    """:class:`_StageBound` of a stage on ``ranks`` (TP groups of ``degree``, listed replica by replica)."""
    units = _units(ctx, ranks, degree)
    layer = _stage_layer_ms(ctx, ranks, degree, m)
    edge = {u: block_extras(ctx, u[0], m, first, last)[0] for u in units}
    capacity = sum(n / layer[u] for u, n in units.items())
    terms = StageTerms(min(layer.values()), min(edge.values()), capacity, -(-num_m // sum(units.values())))
    tail_ms, tail_latency_ms = ctx.memo(("tail line", ranks, degree), lambda: _tail_line(ctx, ranks, degree))
    return _StageBound(
        terms,
        min(block_extras(ctx, u[0], m, True, True)[0] / layer[u] for u in units),
        num_m / sum(n / (layer[u] + edge[u]) for u, n in units.items()),
        min(layer[u] + edge[u] for u in units),
        ((num_m / capacity + tail_ms, tail_latency_ms), (terms.busiest * terms.layer_ms + tail_ms, terms.busiest * terms.edge_ms + tail_latency_ms)),
    )


def _smallest_output_bytes(ctx: CostContext) -> float:
    """The smallest layer output of a sample: the least any message between stages or any TP all-reduce moves."""
    return ctx.memo(("smallest layer output",), lambda: min(b.output_bytes_per_sample for b in ctx.profile.layers))


def any_layout_lower_bound_ms(ctx: CostContext, ranks: tuple[int, ...], m: int, global_batch_size: int) -> float:
    """No plan on ``ranks`` or any subset of them, whatever its layout, at microbatch size ``m`` is faster:
    the whole model's work spread over all of them at their fastest layer time, then the optimizer step
    spread over them by speed (the terms of :func:`lower_bound_ms` that need no layout). Lets the search
    skip planning a sub-cluster (the fastest type alone) that cannot beat the plan it holds."""
    num_m = global_batch_size // m
    return _whole_model_ms(ctx, [_stage_bound(ctx, ranks, 1, m, num_m, True, True)], num_m) + update_lower_bound_ms(ctx, list(ranks))


def _units(ctx: CostContext, ranks: tuple[int, ...], degree: int) -> Counter[tuple[str, int]]:
    """A stage's GPUs (or TP groups of ``degree``) counted by :func:`_unit`, once per stage: a stage recurs in
    many layouts, and at 1024 GPUs counting them again was most of a bound."""
    return ctx.memo(("units", ranks, degree), lambda: Counter(_unit(ctx, r, degree) for r in ranks[::degree]))


def _stage_layer_ms(ctx: CostContext, ranks: tuple[int, ...], degree: int, m: int) -> dict[tuple[str, int], float]:
    """Per :func:`_unit` of the stage, the least time of one microbatch through a layer on one of its GPUs or TP
    groups (a stage's layers run on its own groups only)."""
    if degree == 1:
        return {u: ctx.fastest_layer_ms(u[0], m) for u in _units(ctx, ranks, degree)}
    out: dict[tuple[str, int], float] = {}
    for start in range(0, len(ranks), degree):
        group = ranks[start : start + degree]
        unit, ms = ctx.memo(("split layer", group, m), lambda: _group_layer_ms(ctx, group, m, _smallest_output_bytes(ctx) * m))
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


def _whole_model_ms(ctx: CostContext, stages: list[_StageBound], num_m: int) -> float:
    """Every microbatch through every layer and the cheapest embedding and head, spread over the ``stages``'
    GPUs and TP groups at their fastest layer time: none of them is ever idle."""
    return num_m * (ctx.profile.num_layers + min(s.head_ratio for s in stages)) / sum(s.terms.capacity for s in stages)


def bottleneck_bound_ms(num_layers: int, num_m: int, stages: list[StageTerms]) -> float:
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
    a data-parallel stage whose GPUs outnumber its microbatches.
    """
    most_layers = num_layers - len(stages) + 1
    bound = 0.0
    lowest = sorted(range(len(stages)), key=lambda b: stages[b].layer_ms)[:2]  # the least per-layer time of the stages but b's
    edges = sum(stage.edge_ms for stage in stages)
    for b, (layer_ms, edge_ms, capacity, busiest) in enumerate(stages):
        others_layer = stages[lowest[lowest[0] == b]].layer_ms if len(stages) > 1 else 0.0
        others_edge = edges - edge_ms
        slope_gap = num_m / capacity - busiest * layer_ms
        kink = busiest * edge_ms / slope_gap if slope_gap > 0 else 1.0
        ks = {1, most_layers, min(max(int(kink), 1), most_layers), min(max(int(kink) + 1, 1), most_layers)} if len(stages) > 1 else (num_layers,)
        bound = max(bound, min(
            max(busiest * (k * layer_ms + edge_ms), num_m * k / capacity) + (num_layers - k) * others_layer + others_edge for k in ks
        ))
    return bound


def tail_bound_ms(num_layers: int, lines: list[tuple[tuple[float, float], tuple[float, float]]]) -> float:
    """No plan ends before any stage's busiest GPU has done its work, the stage has synchronised its layers and
    that GPU stepped its share of them, whatever the split, the interleaving or the sharding: with ``k`` layers, a
    stage's work is at least :func:`bottleneck_bound_ms`'s two lines in ``k`` and its synchronisation and step
    at least another (:func:`_tail_line`), each stage's two ``lines`` (:class:`_StageBound`); the largest of
    these over the stages is least, over real ``k`` summing to the layers, where every stage's is equal. Where
    the closed form's tail rules (a wide stage's reduction over a slow link), the search no longer drafts the
    layout to learn that."""
    return max(_least_largest(num_layers, [stage[i] for stage in lines]) for i in (0, 1))


def _tail_line(ctx: CostContext, ranks: tuple[int, ...], degree: int) -> tuple[float, float]:
    """(ms per layer, ms): no stage on ``ranks`` (TP groups of ``degree``) synchronises its ``k`` layers and steps its
    busiest GPU's share of them in less than ``k`` times the first plus the second (each layer at least the model's
    smallest, a TP rank's part of it over the degree): :func:`_stage_tail_ms` of one layer."""
    return _stage_tail_ms(ctx, ranks, degree, _smallest_layer(ctx) / degree)


def _first_tail_ms(ctx: CostContext, ranks: tuple[int, ...], degree: int) -> float:
    """The least the first stage (on ``ranks``, TP groups of ``degree``) takes to synchronise and step after its last
    backward, which ends the pipeline: its embedding and at least one layer."""
    return sum(_stage_tail_ms(ctx, ranks, degree, _smallest_layer(ctx) / degree + ctx.profile.embedding.parameters))


def _smallest_layer(ctx: CostContext) -> int:
    """The parameters of the model's smallest layer: every stage holds at least one."""
    return min(block.parameters for block in ctx.profile.layers)


def _stage_tail_ms(ctx: CostContext, ranks: tuple[int, ...], degree: int, parameters: float) -> tuple[float, float]:
    """(ms, ms of latencies) below a stage's synchronisation and step of ``parameters`` a rank: the synchronisation at
    :func:`~..cost.comm.least_stage_sync_ms`, the step at them spread over one TP index's GPUs by speed
    (:func:`~..cost.update.update_lower_bound_of_counts`)."""
    per = profile_state_bytes(ctx.profile)
    sync_ms, latency_ms = least_stage_sync_ms(ctx.links, ranks, parameters * per.weights, parameters * per.gradients, degree)
    stepping = Counter(ctx.inventory.gpus[r].gpu_type.name for r in ranks[::degree])
    return sync_ms + update_lower_bound_of_counts(ctx, stepping) * parameters / ctx.profile.total_parameters, latency_ms


def _least_largest(num_layers: int, lines: list[tuple[float, float]]) -> float:
    """The least over real ``k`` summing to ``num_layers`` of the largest ``slope * k_s + intercept`` of ``lines``
    (one per stage): where every line has the same value; 0 where a slope is not positive (free layers: a stage
    could take them all)."""
    if any(slope <= 0 for slope, _ in lines):
        return 0.0
    return (num_layers + sum(intercept / slope for slope, intercept in lines)) / sum(1 / slope for slope, _ in lines)

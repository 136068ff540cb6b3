"""The timeline picture shows the order the engine runs: the event simulation plays the
engine's per-rank programs (``build_schedule(plan)``, which ``PipelineEngine`` executes)
and ``timeline.png`` is drawn from that simulation.

The plans are those where an ordering rule of the simulation's own would differ from
the engine's: a narrow stage feeding a wide one with uneven shares (the engine walks
microbatches interleaved across the wide stage's ranks, not in index order), GPipe over
stages of different widths, 1F1B shares that need the engine's recorded play to avoid a
deadlock, and plans with idle ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from testing.plans import hand_plan

from zorse_lightning.capabilities import Schedule
from zorse_lightning.cluster import DEFAULT_CATALOG, ClusterInventory, Machine
from zorse_lightning.planner import CostContext, EventKind, Plan, simulate
from zorse_lightning.schedule.programs import ActionKind, build_schedule
from zorse_lightning.profiling.profile import (
    BlockShape,
    BlockTimes,
    DeviceTimes,
    ModelProfile,
    ProfileSource,
    TimeCurve,
)
from zorse_lightning.reporting import timeline as timeline_drawing

NUM_LAYERS = 6


def _inventory() -> ClusterInventory:
    """Four A100s and four T4s on two machines joined by 10 Gb/s, so transfers compete for links."""
    a100, t4 = DEFAULT_CATALOG.get("a100x40"), DEFAULT_CATALOG.get("t4")
    machines = (
        Machine("a", (a100,) * 4, intra_bandwidth_gbps=100.0),
        Machine("t", (t4,) * 4, intra_bandwidth_gbps=50.0),
    )
    return ClusterInventory("mixed", machines, inter_machine_bandwidth_gbps=10.0)


def _profile() -> ModelProfile:
    """Layers of 1 ms forward and 2 ms backward per sample on an A100, 2.5 times that on a T4,
    passing 2 MB on (a few ms across machines, as long as the compute)."""
    layer = BlockShape("layer", 1000, 1000, 2_000_000, 1.0)
    edge = BlockShape("edge", 0, 0, 2_000_000, 0.0)

    def device(name: str, slope: float) -> DeviceTimes:
        times = BlockTimes(TimeCurve(slope, 0.0), TimeCurve(2 * slope, 0.0))
        return DeviceTimes(name, ProfileSource.MEASURED, times, (times,) * NUM_LAYERS, times)

    devices = {"a100x40": device("a100x40", 1.0), "t4": device("t4", 2.5)}
    return ModelProfile("sim", 8, "float16", edge, (layer,) * NUM_LAYERS, edge, devices)


ONE_F_ONE_B, GPIPE = Schedule.ONE_F_ONE_B, Schedule.GPIPE
PLANS = {
    # ranks, microbatches per rank, layers per stage; ranks 0-3 are A100s, 4-7 T4s
    "1f1b narrow feeds wide, uneven": (
        ONE_F_ONE_B,
        [((0,), (8,), (0, 2)), ((4, 5, 6), (5, 2, 1), (2, 6))],
        (1, 2, 3, 7),
    ),
    "gpipe 2 feeds 3, uneven": (GPIPE, [((0, 1), (5, 3), (0, 3)), ((4, 5, 6), (2, 3, 3), (3, 6))], (2, 3, 7)),
    "1f1b 1-2-1, shares 2 and 6": (
        ONE_F_ONE_B,
        [((0,), (8,), (0, 2)), ((4, 5), (2, 6), (2, 4)), ((1,), (8,), (4, 6))],
        (2, 3, 6, 7),
    ),
    "1f1b 2-3-1-2, no idle rank": (
        ONE_F_ONE_B,
        [((0, 1), (3, 5), (0, 1)), ((4, 5, 6), (4, 1, 3), (1, 3)), ((2,), (8,), (3, 5)), ((7, 3), (6, 2), (5, 6))],
        (),
    ),
    "gpipe 1 feeds 3, idle ranks": (GPIPE, [((4,), (6,), (0, 3)), ((0, 1, 2), (1, 3, 2), (3, 6))], (3, 5, 6, 7)),
}


def _plan(name: str) -> Plan:
    schedule, stages, idle = PLANS[name]
    return hand_plan(stages, schedule=schedule, inventory=_inventory(), idle_ranks=idle)


def _context() -> CostContext:
    return CostContext.build(_inventory(), _profile())


@pytest.mark.parametrize("name", list(PLANS))
def test_each_rank_computes_in_the_order_of_its_engine_program(name: str) -> None:
    """Same kind, same microbatch, action by action (idle ranks: nothing at all)."""
    plan = _plan(name)
    timeline = simulate(_context(), plan)
    programs = build_schedule(plan).programs
    as_event = {ActionKind.FORWARD: EventKind.FORWARD, ActionKind.BACKWARD: EventKind.BACKWARD}
    for rank, program in enumerate(programs):
        compute = [e for e in timeline.of_rank(rank) if e.kind in (EventKind.FORWARD, EventKind.BACKWARD)]
        ran = [(e.kind, e.microbatch) for e in sorted(compute, key=lambda e: e.start_ms)]
        assert ran == [(as_event[a.kind], a.microbatch) for a in program], f"rank {rank}"


@pytest.mark.parametrize("name", list(PLANS))
def test_the_picture_is_drawn_from_that_timeline(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The PNG's bars are the simulation's events, none re-ordered or re-timed on the way."""
    plan, ctx = _plan(name), _context()
    drawn: list = []
    draw = timeline_drawing.draw_timeline

    def spy(events, row_labels, path, title=""):
        drawn.extend(events)
        return draw(events, row_labels, path, title)

    monkeypatch.setattr(timeline_drawing, "draw_timeline", spy)
    path = timeline_drawing.draw_plan_timeline(plan, ctx, tmp_path / "timeline.png")
    assert path.stat().st_size > 0
    expected = [(e.rank, e.kind.value, e.start_ms, e.end_ms) for e in simulate(ctx, plan).events]
    assert [(e.rank, e.kind, e.start_ms, e.end_ms) for e in drawn] == expected

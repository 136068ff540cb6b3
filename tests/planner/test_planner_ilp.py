"""The integer program against an exhaustive search on small random instances."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from zorse_lightning.planner.search import ilp
from zorse_lightning.planner.search.ilp import AssignmentProblem, GroupCosts, StageCosts, solve_assignment


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _fits(group: GroupCosts, k: int, busiest: int, max_in_flight: int | None) -> bool:
    flight = busiest if max_in_flight is None else min(busiest, max_in_flight)
    return group.fixed_bytes[k - 1] + group.activation_bytes[k - 1] * flight <= group.capacity_bytes + 1e-9


def _objective(problem: AssignmentProblem, counts, shares) -> float | None:
    """The documented objective, or None when some GPU's or stage's memory overflows.

    Sharded state must fit the stage's free memory with each group's in-flight
    microbatches: its busiest GPU's under GPipe; under 1F1B the most it could hold
    (min(limit, most allowed by memory)), a constant.
    """
    excess = -math.inf
    latency = 0.0
    tail = 0.0
    for stage, k, stage_shares in zip(problem.stages, counts, shares):
        free = 0.0
        for group, n in zip(stage.groups, stage_shares):
            busiest = math.ceil(n / group.count)
            if not _fits(group, k, busiest, stage.max_in_flight):
                return None
            if stage.max_in_flight is None:
                flight = busiest
            else:
                most = math.ceil(problem.num_microbatches / group.count)
                allowed = max(q for q in range(most + 1) if _fits(group, k, q, stage.max_in_flight))
                flight = min(stage.max_in_flight, allowed)
            free += group.count * (group.capacity_bytes - group.fixed_bytes[k - 1] - group.activation_bytes[k - 1] * flight)
            excess = max(excess, busiest * (group.microbatch_ms[k - 1] + group.receive_ms) - stage.latency_ms[k - 1])
        if free + 1e-9 < stage.sharded_bytes[k - 1]:
            return None
        latency += stage.latency_ms[k - 1]
        tail = max(tail, stage.tail_ms[k - 1])
    return problem.constant_ms + latency + excess + tail


def brute_force(problem: AssignmentProblem) -> float | None:
    best = None
    count_options = [problem.layer_counts] if problem.layer_counts else _compositions(problem.num_layers, len(problem.stages))
    for counts in count_options:
        per_stage = [
            [c for c in itertools.product(range(problem.num_microbatches + 1), repeat=len(s.groups)) if sum(c) == problem.num_microbatches]
            for s in problem.stages
        ]
        for shares in itertools.product(*per_stage):
            value = _objective(problem, counts, shares)
            if value is not None and (best is None or value < best):
                best = value
    return best


def random_problem(rng: random.Random, pin: bool = False) -> AssignmentProblem:
    num_layers = rng.randint(3, 6)
    num_stages = rng.randint(1, 3)
    num_m = rng.randint(2, 6)
    stages = []
    for s in range(num_stages):
        groups = []
        for _ in range(rng.randint(1, 2)):
            per_layer = rng.uniform(0.5, 3.0)
            extra = rng.uniform(0.0, 1.0)
            per_layer_bytes = rng.uniform(1.0, 3.0)
            groups.append(
                GroupCosts(
                    count=rng.randint(1, 2),
                    microbatch_ms=tuple(per_layer * k + extra for k in range(1, num_layers + 1)),
                    fixed_bytes=tuple(per_layer_bytes * k for k in range(1, num_layers + 1)),
                    activation_bytes=tuple(0.5 * k for k in range(1, num_layers + 1)),
                    capacity_bytes=rng.uniform(6.0, 14.0),
                    receive_ms=rng.choice([0.0, rng.uniform(0.0, 1.0)]),
                )
            )
        latency = tuple(max(g.microbatch_ms[k] for g in groups) for k in range(num_layers))
        sharded = rng.random() < 0.5
        stages.append(
            StageCosts(
                groups=tuple(groups),
                latency_ms=latency,
                tail_ms=tuple(rng.uniform(0.0, 0.3) * k for k in range(1, num_layers + 1)),
                sharded_bytes=tuple((2.0 * k if sharded else 0.0) for k in range(1, num_layers + 1)),
                max_in_flight=rng.choice([None, num_stages - s]),
            )
        )
    counts = None
    if pin:
        counts = next(_compositions(num_layers, num_stages))
    return AssignmentProblem(num_layers, num_m, tuple(stages), constant_ms=rng.uniform(0, 2), layer_counts=counts)


@pytest.mark.parametrize("seed", range(40))
def test_ilp_matches_brute_force(seed: int) -> None:
    problem = random_problem(random.Random(seed), pin=seed % 5 == 4)
    expected = brute_force(problem)
    solved = solve_assignment(problem, time_limit_s=20)
    if expected is None:
        assert solved is None
        return
    assert solved is not None
    assert solved.objective_ms == pytest.approx(expected, rel=1e-6, abs=1e-6)
    # the solution itself achieves the objective the solver reports
    assert _objective(problem, solved.layer_counts, solved.group_microbatches) == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert solved.record.status == "optimal"


def test_infeasible_instances_are_reported_as_none() -> None:
    group = GroupCosts(1, (1.0, 2.0), (10.0, 20.0), (1.0, 1.0), capacity_bytes=5.0)
    stage = StageCosts((group,), (1.0, 2.0), (0.0, 0.0), (0.0, 0.0), None)
    assert solve_assignment(AssignmentProblem(2, 2, (stage,)), time_limit_s=5) is None


@pytest.mark.parametrize("seed", range(40, 50))
def test_warm_start_does_not_change_the_optimum(seed: int) -> None:
    problem = random_problem(random.Random(seed))
    expected = brute_force(problem)
    counts = next(_compositions(problem.num_layers, len(problem.stages)))
    shares = tuple((problem.num_microbatches,) + (0,) * (len(s.groups) - 1) for s in problem.stages)
    solved = solve_assignment(problem, time_limit_s=20, start=(counts, shares))
    assert (solved is None) == (expected is None)
    if expected is not None:
        assert solved.objective_ms == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_a_program_stopped_by_its_node_limit_says_so_and_stops_the_same_way_each_time(monkeypatch) -> None:
    """The limit that ends a hard program counts nodes, not seconds: the same solution under any load."""
    rng = random.Random(7)
    problems = [random_problem(rng) for _ in range(40)]
    monkeypatch.setattr(ilp, "MAX_NODES", 1)
    stopped = 0
    for problem in problems:
        first = solve_assignment(problem, time_limit_s=20)
        if first is None or first.record.status == "optimal":
            continue
        stopped += 1
        assert first.record.status == "feasible (stopped at 1 nodes)"
        again = solve_assignment(problem, time_limit_s=20)
        assert (again.layer_counts, again.group_microbatches, again.objective_ms) == (
            first.layer_counts, first.group_microbatches, first.objective_ms
        )
    assert stopped >= 1


def test_cbc_runs_on_one_thread_with_fixed_seeds_and_the_clock_only_as_a_safety_stop() -> None:
    import pulp

    solver = ilp._cbc(pulp, time_limit_s=3.0)
    assert solver.optionsDict["threads"] == 1 and solver.timeLimit == 3.0
    assert {f"maxNodes {ilp.MAX_NODES}", f"randomSeed {ilp.SEED}", f"randomCbcSeed {ilp.SEED}"} <= set(solver.options)

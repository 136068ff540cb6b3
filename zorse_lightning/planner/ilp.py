"""Integer program for one stage layout: layers per stage and microbatches per GPU.

Works on plain cost arrays (:class:`AssignmentProblem`), built from the cost model
by :mod:`.problem`, so that it can be tested on random costs against a brute force.

Identical GPUs of a stage (same type and memory) form a *group* of ``c`` GPUs that
shares ``N`` microbatches as evenly as possible: the busiest holds
``q = ceil(N / c)``. With ``k_s`` layers on stage ``s`` the objective is::

    constant_ms + sum_s latency[s][k_s]
                + max_{s, g} (q_g * time[g][k_s] - latency[s][k_s])
                + max_s sync[s][k_s]

the pipeline formula of :mod:`.compute` with each stage's latency taken over all
its groups. Memory of every group: ``fixed[g][k] + activation[g][k] * f_g <=
capacity_g`` with ``f_g = min(q_g, max_in_flight)`` (1F1B) or ``q_g`` (GPipe);
when the stage shards optimizer state unevenly by free memory, the state must fit
the stage's total free memory: ``sum_g c_g (capacity - fixed - activation * f_g)
>= sharded[k]``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.plan import SolverRecord

SOLVER_NAME = "pulp-cbc"


@dataclass(frozen=True)
class GroupCosts:
    """Identical GPUs of a stage; arrays are indexed by layer count - 1."""

    count: int
    microbatch_ms: tuple[float, ...]
    """Forward plus backward of one microbatch through the stage's blocks."""
    fixed_bytes: tuple[float, ...]
    """Held whatever the microbatches: unsharded training state and the reserve."""
    activation_bytes: tuple[float, ...]
    """Per microbatch in flight."""
    capacity_bytes: float


@dataclass(frozen=True)
class StageCosts:
    groups: tuple[GroupCosts, ...]
    latency_ms: tuple[float, ...]
    sync_ms: tuple[float, ...]
    sharded_bytes: tuple[float, ...]
    """Optimizer state sharded across the stage by free memory (zeros: unsharded)."""
    max_in_flight: int | None
    """1F1B: stages after this one plus one; None for GPipe (every microbatch)."""


@dataclass(frozen=True)
class AssignmentProblem:
    num_layers: int
    num_microbatches: int
    stages: tuple[StageCosts, ...]
    constant_ms: float = 0.0
    """Terms no choice here changes (boundary transfers during fill and drain)."""
    layer_counts: tuple[int, ...] | None = None
    """Pinned layers per stage, or None to choose."""


@dataclass(frozen=True)
class Assignment:
    layer_counts: tuple[int, ...]
    group_microbatches: tuple[tuple[int, ...], ...]
    """Per stage, per group: microbatches the group shares."""
    objective_ms: float
    record: SolverRecord


def _pulp():
    try:
        import pulp
    except ImportError:  # pragma: no cover - pulp is a dependency
        raise PlanningError("the planner needs PuLP: `pip install pulp` (it bundles the CBC solver)") from None
    if not _cbc(pulp, time_limit_s=1.0).available():
        raise PlanningError(
            "PuLP's bundled CBC solver is not available on this machine; reinstall pulp "
            "(`pip install --force-reinstall pulp`) or install `cbc` on the PATH"
        )
    return pulp


def _cbc(pulp, time_limit_s: float):
    """PuLP's bundled CBC (PuLP 3 warns it moves to an extra in PuLP 4; the extra is
    not installed here, so keep the bundled binary and silence that notice)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s)


def _layer_options(problem: AssignmentProblem, stage: int) -> list[int]:
    """Layer counts the stage may take: at least one layer each (or the pin), and only
    counts whose training state fits every GPU of the stage without activations."""
    spec = problem.stages[stage]
    if problem.layer_counts is not None:
        options = [problem.layer_counts[stage]]
    else:
        options = list(range(1, problem.num_layers - len(problem.stages) + 2))
    return [k for k in options if all(g.fixed_bytes[k - 1] <= g.capacity_bytes for g in spec.groups)]


def solve_assignment(problem: AssignmentProblem, time_limit_s: float) -> Assignment | None:
    """Optimal layers per stage and microbatches per group, or None when nothing fits.

    Products of a layer-count choice and a microbatch count are disaggregated (one
    copy of the variable per layer count, zero unless that count is chosen), which
    keeps the linear relaxation tight and CBC fast.
    """
    pulp = _pulp()
    num_m = problem.num_microbatches
    options = [_layer_options(problem, s) for s in range(len(problem.stages))]
    if any(not o for o in options):
        return None
    prob = pulp.LpProblem("zorse_assignment", pulp.LpMinimize)

    # 1. Variables: one-hot layer count per stage; per group the microbatches it shares
    #    (n), its busiest GPU's count (q) and in-flight count (f), with their copies per
    #    layer count (wq, wf); the bottleneck excess D and the exposed synchronisation E.
    use, total, busiest, in_flight, copies = {}, {}, {}, {}, {}
    for s, stage in enumerate(problem.stages):
        for k in options[s]:
            use[s, k] = prob.add_variable(f"use_{s}_{k}", cat="Binary")
        for g in range(len(stage.groups)):
            total[s, g] = prob.add_variable(f"n_{s}_{g}", 0, num_m, cat="Integer")
            busiest[s, g] = prob.add_variable(f"q_{s}_{g}", 0, num_m, cat="Integer")
            in_flight[s, g] = prob.add_variable(f"f_{s}_{g}", 0, num_m)
            for k in options[s]:
                copies[s, g, k] = (prob.add_variable(f"wq_{s}_{g}_{k}", 0, num_m), prob.add_variable(f"wf_{s}_{g}_{k}", 0, num_m))
    bottleneck = prob.add_variable("bottleneck_ms", None, None)
    exposed_sync = prob.add_variable("sync_ms", 0, None)

    # 2. Objective: fill and drain latencies + bottleneck excess + exposed synchronisation.
    prob += (
        problem.constant_ms
        + pulp.lpSum(problem.stages[s].latency_ms[k - 1] * var for (s, k), var in use.items())
        + bottleneck
        + exposed_sync
    )

    # 3. Constraints.
    # 3.1 one layer count per stage; the counts cover the model.
    for s in range(len(problem.stages)):
        prob += pulp.lpSum(use[s, k] for k in options[s]) == 1
    prob += pulp.lpSum(k * var for (_, k), var in use.items()) == problem.num_layers
    for s, stage in enumerate(problem.stages):
        # 3.2 every microbatch passes every stage; a group's busiest GPU takes ceil(n / c).
        prob += pulp.lpSum(total[s, g] for g in range(len(stage.groups))) == num_m
        for g, group in enumerate(stage.groups):
            prob += total[s, g] <= group.count * busiest[s, g]
            _in_flight_constraints(pulp, prob, stage.max_in_flight, busiest[s, g], in_flight[s, g], num_m, f"{s}_{g}")
            # 3.3 the copies carry q and f under the chosen layer count only.
            prob += pulp.lpSum(copies[s, g, k][0] for k in options[s]) == busiest[s, g]
            prob += pulp.lpSum(copies[s, g, k][1] for k in options[s]) == in_flight[s, g]
            for k in options[s]:
                prob += copies[s, g, k][0] <= num_m * use[s, k]
                prob += copies[s, g, k][1] <= num_m * use[s, k]
                # 3.4 memory of each GPU against its own capacity.
                prob += (group.capacity_bytes - group.fixed_bytes[k - 1]) * use[s, k] >= group.activation_bytes[k - 1] * copies[s, g, k][1]
            # 3.5 bottleneck: the group's work beyond the stage latency.
            prob += bottleneck >= pulp.lpSum(
                group.microbatch_ms[k - 1] * copies[s, g, k][0] - stage.latency_ms[k - 1] * use[s, k] for k in options[s]
            )
        # 3.6 sharded state fits the stage's total free memory (uneven shards).
        for k in options[s]:
            sharded = stage.sharded_bytes[k - 1]
            if sharded > 0:
                free = sum(grp.count * (grp.capacity_bytes - grp.fixed_bytes[k - 1]) for grp in stage.groups)
                used = pulp.lpSum(
                    grp.count * grp.activation_bytes[k - 1] * copies[s, g, k][1] for g, grp in enumerate(stage.groups)
                )
                prob += (free - sharded) * use[s, k] >= used
        # 3.7 synchronisation after the last backward.
        prob += exposed_sync >= pulp.lpSum(stage.sync_ms[k - 1] * use[s, k] for k in options[s])

    prob.solve(_cbc(pulp, time_limit_s))
    status = pulp.LpStatus[prob.status]
    found = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if not found or status != "Optimal":
        return None
    counts = tuple(next(k for k in options[s] if use[s, k].value() > 0.5) for s in range(len(problem.stages)))
    microbatches = tuple(
        tuple(int(round(total[s, g].value())) for g in range(len(stage.groups))) for s, stage in enumerate(problem.stages)
    )
    objective = pulp.value(prob.objective)
    quality = "optimal" if prob.sol_status == pulp.LpSolutionOptimal else "feasible (time limit)"
    return Assignment(counts, microbatches, objective, SolverRecord(SOLVER_NAME, quality, objective))


def _in_flight_constraints(pulp, prob, limit: int | None, busiest, in_flight, num_m: int, tag: str) -> None:
    """``f >= min(q, limit)``: a binary picks which side of the min is active."""
    if limit is None:
        prob += in_flight >= busiest
        return
    above = prob.add_variable(f"above_{tag}", cat="Binary")
    prob += in_flight >= busiest - num_m * above
    prob += in_flight >= limit * above

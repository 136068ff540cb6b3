"""Integer program for one stage layout: layers per stage and microbatches per GPU.

Works on plain cost arrays (:class:`AssignmentProblem`), built from the cost model
by :mod:`.problem`, so that it can be tested on random costs against a brute force.

Identical GPUs of a stage (same type and memory) form a *group* of ``c`` GPUs that
shares ``N`` microbatches as evenly as possible: the busiest holds
``q = ceil(N / c)``. With ``k_s`` layers on stage ``s`` the objective is::

    constant_ms + sum_s latency[s][k_s]
                + max_{s, g} (q_g * (time[g][k_s] + receive_g) - latency[s][k_s])
                + max_s tail[s][k_s]

the pipeline formula of :mod:`.cost.compute` (``tail``: the stage's synchronisation
and optimizer step after its last backward; ``receive_g``: the transfers a GPU of the
group waits for per microbatch, which the engine's blocking receives add to its busy
time, :func:`.cost.compute.receiving_busy_ms`) with each stage's latency taken over all
its groups (the cost model takes only GPUs with microbatches, and adds the
boundaries' busy time and 1F1B's round-trip waits: it prices the solution after).
Memory of every group: ``fixed[g][k] + activation[g][k] * f_g <= capacity_g``
with ``f_g = min(q_g, max_in_flight)`` (1F1B) or ``q_g`` (GPipe). When the stage
shards optimizer state unevenly by free memory, the state must fit the stage's
total free memory, ``sum_g c_g (capacity - fixed - activation * f_g) >=
sharded[k]``, where under 1F1B ``f_g`` is taken at its largest allowed value (a
constant, which keeps the program linear; conservative).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

from zorse_lightning.errors import PlanningError
from zorse_lightning.schedule.plan import SolverRecord

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
    receive_ms: float = 0.0
    """Transfers a GPU of the group waits for per microbatch: busy time, but not the stage's latency
    (the fill and drain count each boundary's transfers apart, in ``constant_ms``)."""


@dataclass(frozen=True)
class StageCosts:
    groups: tuple[GroupCosts, ...]
    latency_ms: tuple[float, ...]
    tail_ms: tuple[float, ...]
    """Gradient synchronisation plus optimizer step after the stage's last backward."""
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


MAX_NODES = 20_000
"""Branch-and-bound nodes CBC may explore in one program: what ends a hard program, so that a plan is the
same on a busy machine and an idle one (a wall-clock limit returns whatever the solver reached by then).
The programs of the reference clusters and models end within 40 nodes (mix32 Llama 7B, a10g_l4_t4 GPT
1.3B, 2026-11-28); this leaves room for programs hundreds of times harder before the limit binds."""
SEED = 1
"""CBC's random seeds, fixed: its branching choices are the same in every run."""


def _cbc(pulp, time_limit_s: float, warm_start: bool = False):
    """PuLP's bundled CBC, deterministic: one thread, fixed seeds, stopped by :data:`MAX_NODES`; the
    wall-clock ``time_limit_s`` is only a safety stop, whose use the solver record reports (PuLP 3 warns
    it moves to an extra in PuLP 4; the extra is not installed here, so keep the bundled binary and
    silence that notice).

    Cut generation and CBC's heuristics are off: on these small, tight programs they
    cost ten times the branching they save (measured: 1.3 s against 0.1 s).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(
            msg=False, timeLimit=time_limit_s, warmStart=warm_start, threads=1,
            options=["cuts off", "heur off", f"maxNodes {MAX_NODES}", f"randomSeed {SEED}", f"randomCbcSeed {SEED}"],
        )


def group_limit(stage: StageCosts, group: int, k: int, num_m: int) -> int | None:
    """Most microbatches the group's busiest GPU may take with ``k`` layers, or None when
    its training state alone does not fit.

    GPipe holds every microbatch in flight (``q <= room``); 1F1B holds ``min(q, F)``,
    which caps ``q`` only when even ``F`` in flight do not fit.
    """
    spec = stage.groups[group]
    most = math.ceil(num_m / spec.count)
    free = spec.capacity_bytes - spec.fixed_bytes[k - 1]
    if free < 0:
        return None
    act = spec.activation_bytes[k - 1]
    room = most if act <= 0 else min(most, math.floor(free / act))
    if stage.max_in_flight is not None and room >= min(stage.max_in_flight, most):
        return most
    return room


def _fits_sharded(stage: StageCosts, k: int, limits: list[int]) -> bool:
    """1F1B: the sharded state must fit the stage's free memory with every group holding
    its most microbatches in flight (a constant, so the count is filtered up front)."""
    sharded = stage.sharded_bytes[k - 1]
    if sharded <= 0 or stage.max_in_flight is None:
        return True
    held = sum(
        g.count * (g.fixed_bytes[k - 1] + g.activation_bytes[k - 1] * min(stage.max_in_flight, limit) - g.capacity_bytes)
        for g, limit in zip(stage.groups, limits)
    )
    return -held >= sharded


def layer_options(problem: AssignmentProblem, stage: int) -> dict[int, list[int]]:
    """Layer counts the stage may take (at least one layer each, or the pin) that fit,
    with each group's microbatch limit."""
    spec = problem.stages[stage]
    if problem.layer_counts is not None:
        counts = [problem.layer_counts[stage]]
    else:
        counts = list(range(1, problem.num_layers - len(problem.stages) + 2))
    options = {}
    for k in counts:
        limits = [group_limit(spec, g, k, problem.num_microbatches) for g in range(len(spec.groups))]
        if None not in limits and _fits_sharded(spec, k, limits):
            options[k] = limits
    return options


def solve_assignment(
    problem: AssignmentProblem,
    time_limit_s: float,
    start: tuple[tuple[int, ...], tuple[tuple[int, ...], ...]] | None = None,
) -> Assignment | None:
    """Optimal layers per stage and microbatches per group, or None when nothing fits.

    The product of a layer-count choice and a microbatch count is disaggregated: one
    copy of the busiest count per layer count, bounded by that count's memory limit
    and zero unless it is chosen. This keeps the linear relaxation tight.
    ``start``: (layer counts, group microbatches) of a known solution for CBC to
    begin from (ignored when it does not satisfy the constraints), so that a solve
    cut short by the time limit is no worse than it.
    """
    pulp = _pulp()
    num_m = problem.num_microbatches
    options = [layer_options(problem, s) for s in range(len(problem.stages))]
    if any(not o for o in options):
        return None
    prob = pulp.LpProblem("zorse_assignment", pulp.LpMinimize)

    # 1. Variables: one-hot layer count per stage; per group the microbatches it shares
    #    (n), its busiest GPU's count (q), and copies of both per layer count (m, w);
    #    the bottleneck excess D and the exposed synchronisation and optimizer step E.
    use, total, busiest, copies, shares = {}, {}, {}, {}, {}
    for s, stage in enumerate(problem.stages):
        for k in options[s]:
            use[s, k] = prob.add_variable(f"use_{s}_{k}", cat="Binary")
        for g, group in enumerate(stage.groups):
            most = math.ceil(num_m / group.count)
            total[s, g] = prob.add_variable(f"n_{s}_{g}", 0, num_m, cat="Integer")
            busiest[s, g] = prob.add_variable(f"q_{s}_{g}", 0, most, cat="Integer")
            for k, limits in options[s].items():
                copies[s, g, k] = prob.add_variable(f"w_{s}_{g}_{k}", 0, limits[g])
                shares[s, g, k] = prob.add_variable(f"m_{s}_{g}_{k}", 0, num_m)
    bottleneck = prob.add_variable("bottleneck_ms", None, None)
    exposed_tail = prob.add_variable("tail_ms", 0, None)

    def _terms(pairs, constant: float = 0.0):
        """A linear expression of (variable, coefficient) pairs made at once, zero terms left out as PuLP's
        operators leave them: those build an expression per product and per sum, a third of a program's time."""
        return pulp.LpAffineExpression([(var, c) for var, c in pairs if c], constant)

    # 2. Objective: fill and drain latencies + bottleneck excess + exposed synchronisation and step.
    prob += _terms(
        [(var, problem.stages[s].latency_ms[k - 1]) for (s, k), var in use.items()] + [(bottleneck, 1), (exposed_tail, 1)],
        problem.constant_ms,
    )

    # 3. Constraints.
    # 3.1 one layer count per stage; the counts cover the model.
    for s in range(len(problem.stages)):
        prob += _terms([(use[s, k], 1) for k in options[s]]) == 1
    prob += _terms([(var, k) for (_, k), var in use.items()]) == problem.num_layers
    for s, stage in enumerate(problem.stages):
        # 3.2 every microbatch passes every stage; a group's busiest GPU takes ceil(n / c).
        #     The same holds for each layer count's copies, scaled by its choice variable.
        prob += _terms([(total[s, g], 1) for g in range(len(stage.groups))]) == num_m
        for k in options[s]:
            prob += _terms([(shares[s, g, k], 1) for g in range(len(stage.groups))] + [(use[s, k], -num_m)]) == 0
        for g, group in enumerate(stage.groups):
            prob += _terms([(total[s, g], 1), (busiest[s, g], -group.count)]) <= 0
            # 3.3 copies: only the chosen count's are non-zero; q's within its memory limit.
            prob += _terms([(copies[s, g, k], 1) for k in options[s]] + [(busiest[s, g], -1)]) == 0
            prob += _terms([(shares[s, g, k], 1) for k in options[s]] + [(total[s, g], -1)]) == 0
            for k, limits in options[s].items():
                prob += _terms([(copies[s, g, k], 1), (use[s, k], -limits[g])]) <= 0
                prob += _terms([(shares[s, g, k], 1), (copies[s, g, k], -group.count)]) <= 0
            # 3.4 bottleneck: the group's work beyond the stage latency.
            prob += _terms([(bottleneck, 1)] + [
                term for k in options[s]
                for term in ((copies[s, g, k], -(group.microbatch_ms[k - 1] + group.receive_ms)), (use[s, k], stage.latency_ms[k - 1]))
            ]) >= 0
        # 3.5 GPipe: sharded state fits the stage's free memory (uneven shards).
        if stage.max_in_flight is None:
            for k in options[s]:
                sharded = stage.sharded_bytes[k - 1]
                if sharded > 0:
                    room = sum(grp.count * (grp.capacity_bytes - grp.fixed_bytes[k - 1]) for grp in stage.groups) - sharded
                    per_microbatch = [grp.count * grp.activation_bytes[k - 1] for grp in stage.groups]
                    scale = max(abs(room), *per_microbatch) or 1.0  # rows near 1: bytes next to ms stall CBC
                    prob += _terms([(use[s, k], room / scale)] + [(copies[s, g, k], -a / scale) for g, a in enumerate(per_microbatch)]) >= 0
        # 3.6 synchronisation and optimizer step after the last backward.
        prob += _terms([(exposed_tail, 1)] + [(use[s, k], -stage.tail_ms[k - 1]) for k in options[s]]) >= 0

    warm = start is not None and _set_start(problem, options, start, use, total, busiest, copies, shares)
    began = time.perf_counter()
    prob.solve(_cbc(pulp, time_limit_s, warm_start=warm))
    stopped_by_clock = time.perf_counter() - began >= time_limit_s
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    counts = tuple(next(k for k in options[s] if use[s, k].value() > 0.5) for s in range(len(problem.stages)))
    microbatches = tuple(
        tuple(int(round(total[s, g].value())) for g in range(len(stage.groups))) for s, stage in enumerate(problem.stages)
    )
    objective = pulp.value(prob.objective)
    if prob.sol_status == pulp.LpSolutionOptimal:
        quality = "optimal"
    elif stopped_by_clock:
        quality = f"feasible (stopped by the {time_limit_s:g} s safety limit: plans may differ with the machine's load)"
    else:
        quality = f"feasible (stopped at {MAX_NODES} nodes)"
    return Assignment(counts, microbatches, objective, SolverRecord(SOLVER_NAME, quality, objective))


def _set_start(problem, options, start, use, total, busiest, copies, shares) -> bool:
    """Give CBC the start's values; False (and nothing set) when it breaks a bound."""
    counts, microbatches = start
    values = {}
    for s, stage in enumerate(problem.stages):
        if counts[s] not in options[s]:
            return False
        for k in options[s]:
            values[use[s, k]] = int(k == counts[s])
        for g, group in enumerate(stage.groups):
            n = microbatches[s][g]
            q = math.ceil(n / group.count)
            values[total[s, g]], values[busiest[s, g]] = n, q
            for k in options[s]:
                values[copies[s, g, k]] = q if k == counts[s] else 0
                values[shares[s, g, k]] = n if k == counts[s] else 0
    if any(v.upBound is not None and value > v.upBound for v, value in values.items()):
        return False
    for variable, value in values.items():
        variable.setInitialValue(value)
    return True

"""What ``ZorseStrategy`` is given: the public import line, schedule pins that re-plan, presets (one process)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from lightning.pytorch.strategies import StrategyRegistry

from testing.plans import hand_plan
from zorse_lightning import PlannerOptions, ZorseStrategy
from zorse_lightning.capabilities import Schedule
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.plan_check import check_schedule


@pytest.mark.multiprocess
def test_the_public_api_is_one_import_line():
    line = "from zorse_lightning import ZorseStrategy, PlannerOptions, FaultPolicy, RecoveryPolicy, EmulateCluster, Plan, load_cluster"
    subprocess.run([sys.executable, "-c", line], check=True)


@pytest.mark.multiprocess
def test_the_strategy_is_registered_whichever_is_imported_first():
    """The package loads lazily and registers when Lightning is imported: before it, after it, or by
    importing one of our modules that imports Lightning (the hook then runs inside that import)."""
    check = (
        "from lightning.pytorch.strategies import StrategyRegistry; "
        "from lightning.pytorch.accelerators import AcceleratorRegistry; "
        "assert {'zorse', 'zorse_gpipe', 'zorse_spawn'} <= set(StrategyRegistry), sorted(StrategyRegistry); "
        "assert 'zorse' in AcceleratorRegistry; "
        "assert type(StrategyRegistry.get('zorse_spawn')).__name__ == 'ZorseStrategy'; "
        "assert type(AcceleratorRegistry.get('zorse')).__name__ in ('ZorseCPUAccelerator', 'ZorseCUDAAccelerator'); "
        "assert AcceleratorRegistry['zorse']['accelerator'].is_available()"
    )
    orders = [
        "import zorse_lightning; import lightning",
        "import lightning.pytorch; import zorse_lightning",
        "from zorse_lightning import ZorseStrategy",
        "from zorse_lightning import EmulateCluster",
        "import zorse_lightning.strategy.zorse_strategy",
        "import zorse_lightning.emulation.callback",
        "from zorse_lightning.strategy.accelerator import cuda_index_for",  # a torchrun worker's first import
        "from zorse_lightning.strategy.environment import HeterogeneousEnvironment",
    ]
    # Each order needs an interpreter of its own (7 s here, most of it importing Lightning, on one core): they
    # run one per core at a time, each still alone in its process.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(
            lambda first: subprocess.run([sys.executable, "-c", f"{first}; {check}"], capture_output=True, text=True),
            orders,
        ))
    for first, result in zip(orders, results):
        assert result.returncode == 0, (first, result.stderr[-2000:])


def test_a_schedule_pin_reaches_the_planner_so_it_prices_what_runs():
    assert ZorseStrategy(cluster="cpu_sim2", schedule="gpipe")._planner_options.schedule is Schedule.GPIPE
    assert ZorseStrategy(cluster="cpu_sim2")._planner_options.schedule is None


def test_the_gpipe_preset_plans_with_gpipe():
    preset = StrategyRegistry["zorse_gpipe"]
    strategy = preset["strategy"](**preset["init_params"])
    assert strategy._planner_options.schedule is Schedule.GPIPE


def test_two_different_schedules_are_refused():
    with pytest.raises(PlanningError, match="contradicts planner_options.schedule='1f1b'"):
        ZorseStrategy(cluster="cpu_sim2", schedule="gpipe", planner_options=PlannerOptions(schedule="1f1b"))


def test_a_given_plan_is_never_run_with_another_schedule():
    plan = hand_plan([((0,), (2,), (0, 2)), ((1,), (2,), (2, 4))], inventory=load_cluster("cpu_sim2"))
    check_schedule(plan, PlannerOptions())  # no pin: runs as planned
    check_schedule(plan, PlannerOptions(schedule="1f1b"))
    with pytest.raises(PlanningError, match="made for schedule '1f1b' but schedule='gpipe'.*re-plan"):
        check_schedule(plan, PlannerOptions(schedule="gpipe"))


def test_unknown_arguments_are_refused_by_python_not_swallowed():
    with pytest.raises(TypeError):
        ZorseStrategy(cluster="cpu_sim2", environment=None)

"""What the engine does not run with tensor parallelism yet is refused before any collective, naming the value
and the fix: sharding that moves whole parameters, activation offload."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zorse_lightning.capabilities import Sharding
from zorse_lightning.engine.tensor_parallel import check_stage
from zorse_lightning.errors import PlanningError
from zorse_lightning.schedule.plan import Plan, StagePlan

STAGE = StagePlan(
    ranks=(0, 1), gpu_types=("cpu",) * 2, machines=("localhost",) * 2, layers=(0, 4), microbatches_per_rank=(2, 2),
    tensor_parallel=2,
)


def _plan(stage: StagePlan) -> Plan:
    return Plan("test", "test", 4, 2, 4, 2, "1f1b", (stage,))


@pytest.mark.parametrize("level", [Sharding.OPTIMIZER_GRADIENTS, Sharding.FULL])
def test_sharding_of_whole_parameters_is_refused(level):
    with pytest.raises(PlanningError, match=rf"sharding '{level.value}', which does not run with tensor parallelism.*'none', 'optimizer'"):
        check_stage(_plan(replace(STAGE, sharding=level)), 0)


def test_offload_is_refused():
    with pytest.raises(PlanningError, match="offloads activations.*set offload_activations false"):
        check_stage(_plan(replace(STAGE, offload_activations=True)), 0)


def test_levels_that_combine_pass():
    for level in (Sharding.NONE, Sharding.OPTIMIZER):
        check_stage(_plan(replace(STAGE, sharding=level, recompute=True)), 0)


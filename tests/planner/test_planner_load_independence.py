"""The same plan on a busy machine and an idle one (issue 37 item 4): the integer programs stop on limits
that do not depend on time (CBC's nodes, one thread, fixed seeds), so two CPUs busy with other work change
no plan, only how long planning takes. GPT 1.3B, the case that planned differently under a wall-clock
limit; Llama 7B passed the same test by hand (2026-11-28), left out to keep the suite short."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner import make_plan
from zorse_lightning.profiling import reference_profile

pytestmark = pytest.mark.multiprocess  # starts processes that keep both cores busy

CLUSTERS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "zorse_lightning" / "conf" / "cluster").glob("*.yaml"))
SAMPLES_PER_GPU = 8
"""Few microbatches a GPU: the regime where programs were hardest (a10g_l4_t4 GPT 1.3B planned differently
in two runs of the same code under a wall-clock limit)."""


def _plans(model: str) -> dict[str, object]:
    plans = {}
    for cluster in CLUSTERS:
        inventory = load_cluster(cluster)
        profile = reference_profile(model, [t.name for t in inventory.gpu_types], 512, "float16")
        try:
            plans[cluster] = replace(make_plan(inventory, profile, SAMPLES_PER_GPU * inventory.world_size), planner_seconds=0.0)
        except PlanningError as error:  # the model does not fit the cluster (the emulated ones are small)
            plans[cluster] = str(error)
    return plans


@pytest.mark.parametrize("model", ["gpt_1.3b"])
def test_every_cluster_gets_the_same_plan_with_both_cores_busy(model):
    quiet = _plans(model)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        busy = _plans(model)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert len(quiet) >= 10
    for cluster in CLUSTERS:
        assert busy[cluster] == quiet[cluster], cluster
    planned = [plan for plan in quiet.values() if not isinstance(plan, str)]
    assert len(planned) >= 5 and not any("safety limit" in plan.solver.status for plan in planned)

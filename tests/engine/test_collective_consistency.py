"""Pipelines under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: torch checks, before every collective, that all ranks of
the group call the same one with the same shapes in the same order (a fingerprint per collective, on gloo).

DETAIL makes every collective wait for its group at a barrier on the host, so a reduction started during a
backward (``reduce_in_backward``) blocks there until the stage's slower ranks arrive, while they may wait for
this rank's messages: the cases run with the reduction after the step (the order of collectives is the same
either way)."""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from test_engine_exactness import CASES, WORLD, _run_case
from testing.launch import spawn_ranks

pytestmark = pytest.mark.multiprocess

CHECKED = [
    replace(case, reduce_in_backward=False)
    for case in CASES
    if case.name
    in {
        "two_stages_1f1b_accumulate",
        "one_then_three_full_per_step_gpipe_recompute",
        "interleaved_two_groups_uneven_1f1b_accumulate_clip",
        "data_parallel_uneven_sharded",
    }
]


def _worker(rank: int, out_dir: Path) -> dict:
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        return {case.name: _run_case(rank, case) for case in CHECKED}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_worker, WORLD, tmp_path_factory.mktemp("detail"))


@pytest.mark.parametrize("case", [c.name for c in CHECKED])
def test_collectives_agree_and_training_stays_exact(results, case):
    for rank, per_rank in enumerate(results):
        assert per_rank[case]["max_param_diff"] < 1e-5, (rank, per_rank[case])
        assert per_rank[case]["loss_diff"] < 1e-5, (rank, per_rank[case])

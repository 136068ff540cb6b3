"""A profile that outlasts the process groups' timeout: start-up's other ranks wait for it and the run trains.

Two processes as torchrun starts them, every group's timeout 3 s; rank 0's start-up measurement is made to take
8 s longer (a first rank of its GPU type profiling a large model), while rank 1 has finished its own. Run as a
script, this file is one rank.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from testing.launch import start_script_ranks, torchrun_variables

WORLD = 2
TIMEOUT = timedelta(seconds=3)
PROFILING_S = 8.0
"""How much longer rank 0 measures: beyond the groups' timeout, far below the watchdog's."""


def _run_rank(rank: int, port: int, out: Path) -> None:
    import lightning.pytorch as pl
    import torch
    from testing.gpt_reference import tokens
    from torch.utils.data import DataLoader

    import zorse_lightning.startup.plan_at_start as plan_at_start
    from zorse_lightning.models.gpt import GPT
    from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

    measure = plan_at_start.measure_on_device

    def long_on_rank_0(*args, **kwargs):
        measured = measure(*args, **kwargs)
        if rank == 0:
            time.sleep(PROFILING_S)
        return measured

    plan_at_start.measure_on_device = long_on_rank_0
    torch.set_num_threads(1)
    os.environ.update(torchrun_variables(rank, WORLD, port))
    trainer = pl.Trainer(
        strategy=ZorseStrategy(cluster="cpu_sim2", emulate=False, timeout=TIMEOUT), accelerator="cpu", devices=WORLD,
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(GPT(vocab_size=40, seq_len=8, width=32, layers=4, heads=2), DataLoader(tokens(32), batch_size=8))
    (out / f"rank{rank}.txt").write_text(str(trainer.global_step))


@pytest.mark.multiprocess
def test_start_up_waits_for_a_profile_longer_than_the_groups_timeout(tmp_path):
    """Would catch start-up's ranks waiting in a collective while a rank profiles (at a8ab602 rank 1's gather
    timed out after 3 s and both ranks stopped)."""
    processes = start_script_ranks(__file__, WORLD, tmp_path)
    said = [p.communicate(timeout=240)[1] for p in processes]  # a guard against a hang, not a timing assertion
    for rank, process in enumerate(processes):
        assert process.returncode == 0, said[rank][-3000:]
        assert (tmp_path / f"rank{rank}.txt").read_text() == "2"


if __name__ == "__main__":
    _run_rank(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))

"""A rank that fails during start-up (out of memory at its first profiled size) ends every rank within the fault
timeout, each naming its error.

Two processes as torchrun starts them; rank 1's first training step (start-up's) raises and its process then
stays up, as a rank whose error leaves its communicator alive would: rank 0 sits in start-up's gather, which
under NCCL would wait out NCCL's timeout (gloo here, with the strategy's 30 minutes). Run as a script, this
file is one rank.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from testing.launch import start_script_ranks, torchrun_variables

WORLD = 2
STAYS_UP_S = 60.0
"""How long the failed rank's process lingers: far beyond the 3 s fault timeout."""


def _run_rank(rank: int, port: int, out: Path) -> None:
    import lightning.pytorch as pl
    import torch
    from testing.gpt_reference import tokens
    from torch.utils.data import DataLoader

    from zorse_lightning.engine.faults import FaultPolicy
    from zorse_lightning.models.gpt import GPT
    from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

    class FailsInStartup(GPT):
        def training_step(self, batch, batch_idx):
            if rank == 1:
                raise torch.OutOfMemoryError("out of memory at microbatch size 4, on purpose")
            return super().training_step(batch, batch_idx)

    torch.set_num_threads(1)
    os.environ.update(torchrun_variables(rank, WORLD, port))
    strategy = ZorseStrategy(cluster="cpu_sim2", emulate=False, faults=FaultPolicy(timeout_s=3.0, heartbeat_interval_s=0.25))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
    )
    try:
        trainer.fit(FailsInStartup(vocab_size=40, seq_len=8, width=32, layers=4, heads=2), DataLoader(tokens(32), batch_size=8))
    except BaseException as error:
        (out / f"rank{rank}.txt").write_text(f"{time.time()} {type(error).__name__}: {error}")
        if rank == 1:
            time.sleep(STAYS_UP_S)
        raise


@pytest.mark.multiprocess
def test_a_rank_failing_in_startup_ends_every_rank_with_its_error(tmp_path):
    """Would catch start-up without the watchdog: rank 0 would wait in the gather for the whole group timeout."""
    processes = start_script_ranks(__file__, WORLD, tmp_path)
    try:
        said = processes[0].communicate(timeout=STAYS_UP_S)[1]  # rank 0 ends while rank 1 still lingers
        ended = time.time()
        assert processes[1].poll() is None, "rank 1 ended first: the test proves nothing"
    finally:
        processes[1].kill()
        processes[1].wait()
    failed_at = float((tmp_path / "rank1.txt").read_text().split()[0])
    expected = ("rank 1 (v100x16 on localhost, in start-up) failed with OutOfMemoryError: out of memory at "
                "microbatch size 4, on purpose")
    assert processes[0].returncode != 0, said[-3000:]
    assert expected in said, said[-3000:]
    assert ended - failed_at < 3.0 + 10.0, (ended - failed_at, said[-3000:])  # the fault timeout, and slack


if __name__ == "__main__":
    _run_rank(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))

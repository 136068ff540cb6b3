"""A rank killed mid-step, or failing with an exception, stops every other rank with an error naming it.

Three processes (as torchrun starts them), a 2-stage plan with two ranks on the
second stage; the watchdog's timeout is 3 s. Each scenario launches its own
processes, since it ends them all. Run as a script, this file is one rank.
"""

from __future__ import annotations
from testing.gpt_reference import CPU_SIM3
from testing.launch import free_port, torchrun_variables

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

WORLD = 3
FAILING_STEP = 1


def _run_rank(rank: int, port: int, scenario: str, out_dir: Path) -> None:
    import lightning.pytorch as pl
    import torch
    from testing.plans import hand_plan
    from testing.gpt_reference import tokens
    from torch.utils.data import DataLoader

    from zorse_lightning.cluster.config import load_cluster
    from zorse_lightning.engine.faults import FaultPolicy
    from zorse_lightning.strategy.zorse_strategy import ZorseStrategy
    from zorse_lightning.models.gpt import GPT

    class Failing(GPT):
        def training_step(self, batch, batch_idx):
            if batch_idx == FAILING_STEP and scenario == "kill" and rank == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            if batch_idx == FAILING_STEP and scenario == "raise" and rank == 1:
                raise ValueError("a bad batch, on purpose")
            return super().training_step(batch, batch_idx)

    torch.set_num_threads(1)
    os.environ.update(torchrun_variables(rank, WORLD, port))
    inventory = load_cluster(CPU_SIM3)
    plan = hand_plan([((0,), (4,), (0, 2)), ((1, 2), (2, 2), (2, 4))], microbatch_size=2, inventory=inventory)
    strategy = ZorseStrategy(
        cluster=inventory, plan=plan, emulate=False, faults=FaultPolicy(timeout_s=3.0, heartbeat_interval_s=0.25)
    )
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out_dir,
    )
    model = Failing(vocab_size=40, seq_len=8, width=32, layers=4, heads=2)
    try:
        trainer.fit(model, DataLoader(tokens(8 * 3), batch_size=8))
    except BaseException as error:
        (out_dir / f"rank{rank}.txt").write_text(f"{type(error).__name__}: {error}")
        raise
    (out_dir / f"rank{rank}.txt").write_text("finished")


def _launch(scenario: str, out_dir: Path) -> list[tuple[int, str]]:
    """Each rank's exit status and what it said (its error, or the watchdog's message on stderr)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    processes = [
        subprocess.Popen([sys.executable, __file__, str(r), str(port), scenario, str(out_dir)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for r in range(WORLD)
    ]
    results = []
    for rank, process in enumerate(processes):
        _, stderr = process.communicate(timeout=300)  # a guard against a hang, not a timing assertion
        said = out_dir / f"rank{rank}.txt"
        results.append((process.returncode, (said.read_text() if said.exists() else "") + stderr))
    return results


@pytest.mark.parametrize("scenario", ["kill", "raise"])
def test_every_survivor_stops_naming_the_lost_rank(scenario, tmp_path):
    results = _launch(scenario, tmp_path)
    culprit = 2 if scenario == "kill" else 1
    if scenario == "kill":
        assert results[culprit][0] == -signal.SIGKILL
        expected = "rank 2 (stage 1, t4 on localhost) was lost: no heartbeat"
    else:
        assert results[culprit][0] != 0 and "ValueError: a bad batch, on purpose" in results[culprit][1]
        expected = "rank 1 (stage 1, v100x16 on localhost) failed with ValueError: a bad batch, on purpose"
    for rank, (status, said) in enumerate(results):
        if rank == culprit:
            continue
        assert status != 0, (rank, said)
        assert expected in said, (rank, said[-3000:])
        assert "relaunch and resume from the last checkpoint" in said


if __name__ == "__main__":
    _run_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))

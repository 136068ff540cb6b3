"""Under torchrun, a rank killed at step 3: the agent sends SIGTERM to the survivors within seconds, long before
the watchdog's verdict (its timeout here is 120 s); the survivors' newest snapshot (step 3) must be on disk.

One launch with ``python -m torch.distributed.run`` (3 ranks, snapshots every step); run as a script, this
file is one worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from testing.launch import free_port

KILLED_AT = 3


def _worker(out: Path) -> None:
    import lightning.pytorch as pl
    import torch
    from testing.gpt_reference import CPU_SIM3, gpt, tokens
    from testing.plans import hand_plan
    from torch.utils.data import DataLoader

    from zorse_lightning.cluster.config import load_cluster
    from zorse_lightning.engine.checkpoint.survivors import RecoveryPolicy
    from zorse_lightning.engine.faults import FaultPolicy
    from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    inventory = load_cluster(CPU_SIM3)
    plan = hand_plan([((0,), (4,), (0, 2)), ((1, 2), (2, 2), (2, 4))], microbatch_size=2, inventory=inventory)

    class Kill(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if rank == 2 and trainer.global_step == KILLED_AT:
                os.kill(os.getpid(), signal.SIGKILL)

    strategy = ZorseStrategy(cluster=inventory, plan=plan, emulate=False,
                             faults=FaultPolicy(timeout_s=120.0, heartbeat_interval_s=0.5),
                             recovery=RecoveryPolicy(directory=out / "kept", snapshot_every_steps=1))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=3, max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        callbacks=[Kill()],
    )
    trainer.fit(gpt(), DataLoader(tokens(8 * 6), batch_size=8))


@pytest.mark.multiprocess
def test_torchruns_sigterm_leaves_the_survivors_newest_snapshot_on_disk(tmp_path):
    """Would catch SIGTERM's default action (the process ends, nothing kept) or a handler that runs only when
    the main thread returns to Python (it may sit in a collective a lost peer never joins)."""
    from zorse_lightning.engine.checkpoint.files import open_file

    root = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    launch = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--max-restarts", "0",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), __file__, str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=100,  # far below the watchdog's 120 s: SIGTERM acted
    )
    said = launch.stdout + launch.stderr
    assert launch.returncode != 0, said[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} received SIGTERM" in said, said[-3000:]
        kept = tmp_path / "kept" / f"step-{KILLED_AT}" / f"rank-{rank}.pt"
        assert kept.is_file() and kept.with_suffix(".json").is_file(), said[-3000:]
        state = open_file(kept)  # weights_only, as the relaunch reads it
        assert state["step"] == KILLED_AT and state["state_dict"]
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == [f"step-{KILLED_AT}"]


_LIGHTNING_STOP = """
import os, signal, sys, time
from types import SimpleNamespace
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from zorse_lightning.engine.faults import SigtermKeeper

events = []
hang = sys.argv[1] == "hang"
SigtermKeeper.GRACEFUL_STOP_S = 1.0
keeper = SigtermKeeper(lambda: (time.sleep(0.2), events.append("kept")), "rank 0")
keeper.install()  # at the strategy's setup, before Lightning registers its handlers
trainer = SimpleNamespace(_accelerator_connector=SimpleNamespace(cluster_environment=LightningEnvironment()),
                          strategy=SimpleNamespace(launcher=None), local_rank=0, world_size=1)
connector = _SignalConnector(trainer)
connector.register_signal_handlers()  # Lightning's own, as the Trainer installs them
lightning_handler = signal.getsignal(signal.SIGTERM)

def stop(signum, frame):
    events.append("lightning")
    if hang:  # a stop that never ends (its broadcast on a group a lost peer broke, under NCCL)
        time.sleep(30)
    lightning_handler(signum, frame)

signal.signal(signal.SIGTERM, stop)
keeper.take_over()  # at on_train_start
os.kill(os.getpid(), signal.SIGTERM)
deadline = time.monotonic() + 10
while not connector.received_sigterm and time.monotonic() < deadline:  # Lightning's loop checks it per batch
    time.sleep(0.01)
keeper.remove()  # the strategy's teardown, on the way out of the stop
connector.teardown()
print(events, connector.received_sigterm)
"""


@pytest.fixture(scope="module")
def lightning_stops():
    """Both modes' processes, started together (7 s each, importing Lightning on one core): each test waits
    for its own, which runs alone in its process as before."""
    root = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    started = {mode: subprocess.Popen([sys.executable, "-c", _LIGHTNING_STOP, mode], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE) for mode in ("chain", "hang")}

    def stopped(mode: str) -> subprocess.CompletedProcess:
        process = started[mode]
        out, err = process.communicate(timeout=60)
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    try:
        yield stopped
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
                process.communicate()


@pytest.mark.multiprocess
def test_sigterm_keeps_the_snapshot_then_lightning_stops_the_run(lightning_stops):
    """Lightning's SIGTERM handler (its graceful stop: received_sigterm, then SIGTERMException at the next batch)
    runs after the snapshot is kept, not instead of it; the process then ends by that stop (status 0 here), not
    by the keeping thread. Would catch the keeper replacing Lightning's handler (received_sigterm never set, the
    process ended with status 143) or calling it before the snapshot is kept."""
    stopped = lightning_stops("chain")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert stopped.stdout.strip() == "['kept', 'lightning'] True", stopped.stdout
    assert "rank 0 received SIGTERM (its run was stopped); it kept its newest snapshot" in stopped.stderr


@pytest.mark.multiprocess
def test_a_stop_that_hangs_after_the_snapshot_is_ended(lightning_stops):
    """The handler chained to never returns (the main thread never reaches the teardown): the keeping thread
    ends the process GRACEFUL_STOP_S after keeping, with SIGTERM's status."""
    from zorse_lightning.engine.faults import SIGTERM_EXIT_STATUS

    stopped = lightning_stops("hang")
    assert stopped.returncode == SIGTERM_EXIT_STATUS, (stopped.returncode, stopped.stderr[-3000:])
    assert stopped.stdout == ""
    assert "rank 0 had not stopped 1 s after keeping its snapshot on SIGTERM: ended" in stopped.stderr


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))

"""Fast recovery: a rank is killed at step 3 of a run checkpointed at step 2; the two survivors keep their
state; the relaunch on two ranks (another plan) resumes at step 3 from what they kept, reading no shard of
the checkpoint, and goes on as an uninterrupted run would.

Three launches, each rank a process as torchrun starts them (run as a script, this file is one rank):
reference (2 ranks, 5 steps, a checkpoint every step), killed (3 ranks, a checkpoint every 2 steps, rank 2
SIGKILLed in its fourth step), resumed (2 ranks, ``ckpt_path=`` the step-2 checkpoint, to step 5), and apart
(as resumed, but each rank sees only its own survivor's file, as on two machines' local disks).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from zorse_lightning.engine.checkpoint import survivors as fast_recovery
from zorse_lightning.engine.checkpoint.relaunch import choose_step
from zorse_lightning.engine.checkpoint.survivors import KeptIndex, SurvivorKeeper
from zorse_lightning.module.materialize import holds_values
from testing.launch import free_port, torchrun_variables

KILLED_AT = 3
STEPS = 5


def _run_rank(rank: int, world: int, port: int, phase: str, out: Path) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from testing.gpt_reference import CPU_SIM3 as CLUSTER
    from testing.gpt_reference import gpt, tokens
    from torch.utils.data import DataLoader

    from zorse_lightning.cluster.config import load_cluster
    from zorse_lightning.engine.faults import FaultPolicy
    from zorse_lightning.engine.checkpoint.survivors import RecoveryPolicy
    from zorse_lightning.strategy.zorse_strategy import ZorseStrategy
    from testing.plans import hand_plan

    torch.set_num_threads(1)
    os.environ.update(torchrun_variables(rank, world, port))
    if world == 3:
        inventory = load_cluster(CLUSTER)
        plan = hand_plan([((0,), (4,), (0, 2)), ((1, 2), (2, 2), (2, 4))], microbatch_size=2, inventory=inventory)
    else:
        inventory = load_cluster("cpu_sim2")
        plan = hand_plan([((0,), (4,), (0, 2)), ((1,), (4,), (2, 4))], microbatch_size=2, inventory=inventory)

    class Probe(pl.Callback):
        def on_train_start(self, trainer, module):
            held = {n: p.detach().clone() for n, p in module.named_parameters() if holds_values(p)}
            torch.save({"step": trainer.global_step, "held": held}, out / f"{phase}-start-{rank}.pt")

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if phase == "killed" and rank == 2 and trainer.global_step == KILLED_AT:
                os.kill(os.getpid(), signal.SIGKILL)

    every = 1 if phase == "reference" else 2
    # Snapshots after every step (the chosen interval may be longer): the rank dies at a known step.
    kept_in = out / "apart" / f"machine-{rank}" if phase == "apart" else None
    strategy = ZorseStrategy(cluster=inventory, plan=plan, emulate=False,
                             faults=FaultPolicy(timeout_s=3.0, heartbeat_interval_s=0.25),
                             recovery=RecoveryPolicy(directory=kept_in, snapshot_every_steps=1))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=STEPS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        callbacks=[Probe(), ModelCheckpoint(dirpath=out / phase, filename="{step}", every_n_train_steps=every,
                                            save_top_k=-1)],
    )
    ckpt = out / "killed" / f"step={KILLED_AT - 1}.ckpt" if phase in ("resumed", "apart") else None
    trainer.fit(gpt(), DataLoader(tokens(8 * 6), batch_size=8, shuffle=True), ckpt_path=ckpt)
    if phase in ("resumed", "apart") and rank == 0:
        report = strategy.recovery_report
        (out / f"{phase}-report.json").write_text(json.dumps({
            "step": report.step, "checkpoint_step": report.checkpoint_step, "reason": report.reason,
            "survivor_files": [Path(f).name for f in report.survivor_files],
            "checkpoint_files": list(report.checkpoint_files),
        }))


def _launch(world: int, phase: str, out: Path) -> list[tuple[int, str]]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    processes = [
        subprocess.Popen([sys.executable, __file__, str(r), str(world), str(port), phase, str(out)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    said = [p.communicate(timeout=300)[1] for p in processes]  # a guard against a hang, not a timing assertion
    return [(p.returncode, stderr) for p, stderr in zip(processes, said)]


@pytest.fixture(scope="module")
def recovered(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("recovery")
    for world, phase in [(2, "reference"), (3, "killed"), (2, "resumed"), (2, "apart")]:
        if phase == "apart":  # each survivor's file on its own "machine" only
            for rank in range(2):
                machine = out / "apart" / f"machine-{rank}" / f"step-{KILLED_AT}"
                machine.mkdir(parents=True)
                for suffix in (".pt", ".json"):
                    shutil.copy(out / "killed" / ".survivors" / f"step-{KILLED_AT}" / f"rank-{rank}{suffix}", machine)
        results = _launch(world, phase, out)
        expect_failure = phase == "killed"
        for rank, (status, stderr) in enumerate(results):
            assert (status != 0) == expect_failure, (phase, rank, stderr[-3000:])
    return out


def _export(path: Path) -> dict:
    from zorse_lightning.apps.export_app import export_state_dict

    return export_state_dict(path)


@pytest.mark.multiprocess
def test_survivors_keep_their_state_of_the_last_completed_step(recovered):
    kept = sorted(p.name for p in (recovered / "killed" / ".survivors").rglob("*.pt"))
    assert kept == ["rank-0.pt", "rank-1.pt"]
    assert [p.name for p in (recovered / "killed" / ".survivors").iterdir()] == [f"step-{KILLED_AT}"]


@pytest.mark.multiprocess
def test_relaunch_resumes_from_the_survivors_step_reading_no_checkpoint_shard(recovered):
    import torch

    report = json.loads((recovered / "resumed-report.json").read_text())
    assert report["step"] == KILLED_AT and report["checkpoint_step"] == KILLED_AT - 1
    assert sorted(report["survivor_files"]) == ["rank-0.pt", "rank-1.pt"]
    assert report["checkpoint_files"] == []
    reference_at = _export(recovered / "reference" / f"step={KILLED_AT}.ckpt")
    checkpoint = _export(recovered / "reference" / f"step={KILLED_AT - 1}.ckpt")
    for rank in range(2):
        start = torch.load(recovered / f"resumed-start-{rank}.pt")
        assert start["step"] == KILLED_AT and start["held"]
        for name, value in start["held"].items():
            assert (value - reference_at[name]).abs().max().item() < 1e-5, name
        assert max((v - checkpoint[n]).abs().max().item() for n, v in start["held"].items()) > 1e-4


@pytest.mark.multiprocess
def test_survivors_files_on_other_machines_reach_the_ranks_that_need_them(recovered):
    """Would catch a relaunch that cannot read a survivor's file it does not see (another machine's local disk),
    or one that ships it through the default group: each rank received the other's file over gloo (both
    hold names outside the blocks, which the cut places) and starts at the survivors' step."""
    import torch

    report = json.loads((recovered / "apart-report.json").read_text())
    assert report["step"] == KILLED_AT and report["checkpoint_files"] == []
    for rank in range(2):
        other = 1 - rank
        received = recovered / "apart" / f"machine-{rank}" / ".received" / f"rank-{rank}" / f"step-{KILLED_AT}"
        assert [p.name for p in received.iterdir()] == [f"rank-{other}.pt"]
    reference_at = _export(recovered / "reference" / f"step={KILLED_AT}.ckpt")
    for rank in range(2):
        start = torch.load(recovered / f"apart-start-{rank}.pt")
        assert start["step"] == KILLED_AT
        assert max((v - reference_at[n]).abs().max().item() for n, v in start["held"].items()) < 1e-5


@pytest.mark.multiprocess
def test_recovered_run_continues_as_the_uninterrupted_one(recovered):
    final, reference = _export(recovered / "resumed" / f"step={STEPS - 1}.ckpt"), _export(
        recovered / "reference" / f"step={STEPS - 1}.ckpt")
    assert max((final[n] - reference[n]).abs().max().item() for n in reference) < 1e-5


def _kept(rank: int, step: int, entries: tuple[str, ...], stepped: tuple[str, ...]) -> KeptIndex:
    return KeptIndex(rank, step, entries, (stepped,), path=f"step-{step}/rank-{rank}.pt")


def test_newer_kept_state_missing_an_optimizer_shard_falls_back_to_the_checkpoint_step():
    entries, trainable = {"a", "b"}, {"a", "b"}
    sharded = [_kept(0, 5, ("a", "b"), ("a",)), _kept(1, 2, ("a", "b"), ("b",))]  # rank 1's newer state lost
    step, used, reason = choose_step(sharded, 2, entries, trainable)
    assert step == 2 and [k.rank for k in used] == [1]
    assert "step 5, but 1 entries (e.g. b) are only in the checkpoint of step 2" in reason
    whole = [_kept(0, 5, ("a",), ("a",)), _kept(1, 5, ("b",), ("b",)), _kept(0, 4, ("a", "b"), ("a", "b"))]
    assert choose_step(whole, 2, entries, trainable)[:2] == (5, whole[:2])
    assert choose_step(whole[2:], 4, entries, trainable)[0] == 4  # kept state as old as the checkpoint
    assert choose_step([_kept(0, 1, ("a", "b"), ("a", "b"))], 2, entries, trainable) == (
        2, [], "no survivor kept a step newer than the checkpoint's (2)")


def test_a_second_keep_returns_only_once_the_first_has_written(tmp_path, monkeypatch):
    """The watchdog's thread and the main thread may both keep; the main thread returning while the watchdog's
    daemon thread still writes would end the process mid-write and lose this rank's state."""
    import threading

    import torch

    module = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(module.parameters())
    module(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    keeper = SurvivorKeeper()
    keeper.snapshot(1, {"global_step": 1}, module, [optimizer])
    writing, release = threading.Event(), threading.Event()
    write = fast_recovery._write_atomically

    def held_up(path, content, mode):
        writing.set()
        release.wait()
        write(path, content, mode)

    monkeypatch.setattr(fast_recovery, "_write_atomically", held_up)
    watchdog = threading.Thread(target=keeper.keep, args=(tmp_path, 0, module, [optimizer]))
    watchdog.start()
    writing.wait()
    threading.Timer(0.3, release.set).start()  # the main thread keeps while the watchdog's thread writes
    assert keeper.keep(tmp_path, 0, module, [optimizer]) is None
    assert sorted(p.name for p in (tmp_path / "step-1").iterdir()) == ["rank-0.json", "rank-0.pt"]
    watchdog.join()
    kept = torch.load(tmp_path / "step-1" / "rank-0.pt", weights_only=False)
    assert kept["common"] == {"global_step": 1} and torch.equal(kept["state_dict"]["weight"], module.weight)


if __name__ == "__main__":
    _run_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5]))

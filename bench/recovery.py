"""Recovery time: relaunch to first completed step, reading survivors' state first vs a plain reload.

    .venv/bin/python bench/recovery.py [--width 256] [--layers 8]   # about 2 minutes on 2 CPU cores

A 3-rank run (stage 0 on rank 0, stage 1 on ranks 1 and 2) checkpoints at step
2; rank 2 is SIGKILLed in step 4; ranks 0 and 1 keep their state of step 3.
Then two relaunches on 2 ranks from the step-2 checkpoint, each timed by rank 0
from the start of ``fit`` to the end of its first step:

- ``recovery``: the default (survivors' files first; it resumes at step 3);
- ``plain``: ``RecoveryPolicy(enabled=False)`` (every shard of the checkpoint; step 2 again).

The ratio is plain over recovery. Both include process-group set-up and the
first step; the survivors' gain is the files not read and, on a real run, the
steps not redone (here one). The last line printed is one JSON object:
``{"recovery_s", "plain_reload_s", "ratio"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zorse_lightning.testing.launch import free_port

KILLED_AT = 3



def _rank(rank: int, world: int, port: int, phase: str, out: Path, width: int, layers: int) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from zorse_lightning.cluster.config import load_cluster
    from zorse_lightning.engine.faults import FaultPolicy
    from zorse_lightning.glue.fast_recovery import RecoveryPolicy
    from zorse_lightning.glue.strategy import ZorseStrategy
    from zorse_lightning.models.gpt import GPT

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_faults import CLUSTER as THREE_RANKS

    from zorse_lightning.testing.plans import hand_plan

    torch.set_num_threads(1)
    os.environ.update(
        TORCHELASTIC_RUN_ID="bench", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    half = layers // 2
    if world == 3:
        inventory = load_cluster(THREE_RANKS)
        stages = [((0,), (4,), (0, half)), ((1, 2), (2, 2), (half, layers))]
    else:
        inventory = load_cluster("cpu_sim2")
        stages = [((0,), (4,), (0, half)), ((1,), (4,), (half, layers))]
    plan = hand_plan(stages, microbatch_size=2, inventory=inventory)
    started = time.perf_counter()

    class Timer(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if phase == "killed" and rank == 2 and trainer.global_step == KILLED_AT:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_start(self, trainer, module):
            self.resumed_at = trainer.global_step

        def on_train_batch_end(self, trainer, *args):
            if phase != "killed" and rank == 0 and not (out / f"{phase}.json").exists():
                report = trainer.strategy.recovery_report
                (out / f"{phase}.json").write_text(json.dumps({
                    "seconds": time.perf_counter() - started, "resumed_at": self.resumed_at,
                    "survivor_files": len(report.survivor_files) if report else 0,
                }))

    strategy = ZorseStrategy(cluster=inventory, plan=plan, emulate=False, faults=FaultPolicy(timeout_s=3.0, heartbeat_interval_s=0.25),
                             recovery=RecoveryPolicy(enabled=phase != "plain"))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=KILLED_AT + 2 if phase == "killed" else
        KILLED_AT + 1, logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        callbacks=[Timer(), ModelCheckpoint(dirpath=out / "ckpt", filename="{step}", every_n_train_steps=2,
                                            save_top_k=-1)] if phase == "killed" else [Timer()],
        enable_checkpointing=phase == "killed",
    )
    torch.manual_seed(0)
    model = GPT(vocab_size=64, seq_len=16, width=width, layers=layers, heads=4)
    tokens = torch.randint(0, 64, (8 * 8, 17), generator=torch.Generator().manual_seed(2))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    ckpt = out / "ckpt" / f"step={KILLED_AT - 1}.ckpt" if phase != "killed" else None
    trainer.fit(model, loader, ckpt_path=ckpt)


def _launch(world: int, phase: str, out: Path, args: argparse.Namespace) -> None:
    port = free_port()
    processes = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world), "--port",
                                   str(port), "--phase", phase, "--out", str(out), "--width", str(args.width),
                                   "--layers", str(args.layers)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for r in range(world)]
    for process in processes:
        process.communicate(timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--phase")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.rank is not None:
        _rank(args.rank, args.world, args.port, args.phase, args.out, args.width, args.layers)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        _launch(3, "killed", out, args)
        _launch(2, "recovery", out, args)
        _launch(2, "plain", out, args)
        recovery, plain = (json.loads((out / f"{p}.json").read_text()) for p in ("recovery", "plain"))
    print(f"recovery (survivors first): {recovery['seconds']:.2f} s, resumed at step {recovery['resumed_at']}, "
          f"from {recovery['survivor_files']} survivors' files")
    print(f"plain reload: {plain['seconds']:.2f} s, resumed at step {plain['resumed_at']} from the checkpoint")
    print(f"ratio (plain / recovery): {plain['seconds'] / recovery['seconds']:.2f}")
    print(json.dumps({"recovery_s": round(recovery["seconds"], 3), "plain_reload_s": round(plain["seconds"], 3),
                      "ratio": round(plain["seconds"] / recovery["seconds"], 3)}))


if __name__ == "__main__":
    main()

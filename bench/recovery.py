"""Recovery time: a relaunch after a rank died, reading survivors' state first vs a plain reload.

    .venv/bin/python -m bench.recovery [--width 256] [--layers 8] [--repeats 3]   # about 1 minute on 2 cores

A 3-rank run (stage 0 on rank 0, stage 1 on ranks 1 and 2) checkpoints at step
2; rank 2 is SIGKILLed in step 4; ranks 0 and 1 keep their state of step 3.
Then the same relaunch, ``--repeats`` times each and alternating: 2 ranks
(cpu_sim2), the same plan, model and ``fit(ckpt_path=<the step-2 checkpoint>)``;
only the source of the state differs:

- ``recovery``: the default ``RecoveryPolicy`` (survivors' files first; it resumes at step 3);
- ``plain``: ``RecoveryPolicy(enabled=False)`` (every file of the checkpoint; step 2 again).

``recovery_s`` and ``plain_reload_s`` (medians) time the whole relaunch: from the
moment the processes are launched (interpreter start and imports included) until
rank 0 has finished the step the killed rank died in (step 4), so both end where
the run was lost; the plain reload redoes one more step to get there
(``steps_redone``). ``ratio`` is plain over recovery. ``phases_s`` splits them
on rank 0: ``start_and_import``, ``build`` (model, Trainer), ``process_group``
(joining it waits for the slowest rank's start), ``read_state``,
``strategy_setup`` (groups, watchdog), ``data``, ``first_step`` (the engine cuts
the model there) and ``steps_redone`` (the steps after the first, to step 4);
``from_process_group_s`` is the part from the joined process group on, where the
two differ most.
Left out: noticing the loss (the survivors wait out the watchdog's ``timeout_s``,
3 s here, then write their state, in the killed run before the relaunch), the
time a launcher or scheduler takes to start the new processes (here the bench
starts them itself), and their exit after the last step.
The bench stops with an error if the survivors kept nothing (then both
relaunches would read the checkpoint, and the ratio would mean nothing).

The last line printed is one JSON object: ``{"recovery_s", "plain_reload_s",
"ratio", "steps_redone", "from_process_group_s": {"recovery", "plain"}, "phases_s":
{"recovery": {phase: s}, "plain": {...}}, "files_read": {"recovery": {"survivor",
"checkpoint"}, "plain": {...}}, "repeats", "left_out"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testing.launch import free_port

KILLED_AT = 3
PHASES = (("process_group", "fit", "read_state_start"), ("read_state", "read_state_start", "read_state_end"),
          ("strategy_setup", "read_state_end", "fit_start"), ("data", "fit_start", "train_start"),
          ("first_step", "train_start", "first_step"), ("steps_redone", "first_step", "caught_up"))
"""(phase, rank 0's mark at its start, at its end): ``fit`` runs them in this order."""
LEFT_OUT = ["noticing the lost rank (the watchdog's timeout_s, 3 s here) and the survivors writing their state, "
            "both in the killed run", "a launcher's or scheduler's time to start the new processes",
            "the processes' exit after the last step"]
"""What the whole relaunch (``recovery_s``, ``plain_reload_s``) does not time."""


def _rank(rank: int, world: int, port: int, phase: str, out: Path, args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from zorse_lightning.cluster.config import load_cluster
    from zorse_lightning.engine.faults import FaultPolicy
    from zorse_lightning.engine.checkpoint.survivors import RecoveryPolicy
    from zorse_lightning.strategy.zorse_strategy import ZorseStrategy
    from zorse_lightning.models.gpt import GPT
    from testing.launch import torchrun_variables
    from testing.gpt_reference import CPU_SIM3 as THREE_RANKS
    from testing.plans import hand_plan

    marks = {"imported": time.time()}
    torch.set_num_threads(1)
    os.environ.update(torchrun_variables(rank, world, port))
    half = args.layers // 2
    if world == 3:
        inventory = load_cluster(THREE_RANKS)
        stages = [((0,), (4,), (0, half)), ((1, 2), (2, 2), (half, args.layers))]
    else:
        inventory = load_cluster("cpu_sim2")
        stages = [((0,), (4,), (0, half)), ((1,), (4,), (half, args.layers))]
    plan = hand_plan(stages, microbatch_size=2, inventory=inventory)
    relaunch = phase != "killed"

    class Timer(pl.Callback):
        def on_fit_start(self, trainer, module):
            marks["fit_start"] = time.time()

        def on_train_start(self, trainer, module):
            marks["train_start"] = time.time()
            self.resumed_at = trainer.global_step

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if phase == "killed" and rank == 2 and trainer.global_step == KILLED_AT:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, trainer, *rest):
            if not relaunch or rank != 0:
                return
            marks.setdefault("first_step", time.time())
            if trainer.global_step == KILLED_AT + 1:  # the step the killed rank died in is done: caught up
                marks["caught_up"] = time.time()
                report = trainer.strategy.recovery_report
                (out / f"{phase}.json").write_text(json.dumps({
                    "marks": marks, "resumed_at": self.resumed_at,
                    "survivor_files": len(report.survivor_files) if report else 0,
                    "checkpoint_files": len(report.checkpoint_files) if report else len(json.loads(
                        (out / "ckpt" / f"step={KILLED_AT - 1}.ckpt" / "manifest.json").read_text())["files"]),
                }))

    strategy = ZorseStrategy(cluster=inventory, plan=plan, emulate=False,
                             faults=FaultPolicy(timeout_s=3.0, heartbeat_interval_s=0.25),
                             recovery=RecoveryPolicy(enabled=phase != "plain"))
    load = strategy.load_checkpoint

    def timed_load(*load_args, **kwargs):
        marks["read_state_start"] = time.time()
        try:
            return load(*load_args, **kwargs)
        finally:
            marks["read_state_end"] = time.time()

    strategy.load_checkpoint = timed_load
    saving = [ModelCheckpoint(dirpath=out / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1)]
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=KILLED_AT + 1 if relaunch else KILLED_AT + 2,
        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        callbacks=[Timer(), *([] if relaunch else saving)], enable_checkpointing=not relaunch,
    )
    torch.manual_seed(0)
    model = GPT(vocab_size=64, seq_len=16, width=args.width, layers=args.layers, heads=4)
    tokens = torch.randint(0, 64, (8 * 8, 17), generator=torch.Generator().manual_seed(2))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    marks["launched"] = args.launched_at
    marks["fit"] = time.time()
    trainer.fit(model, loader, ckpt_path=out / "ckpt" / f"step={KILLED_AT - 1}.ckpt" if relaunch else None)


def _launch(world: int, phase: str, out: Path, args: argparse.Namespace) -> None:
    port, launched_at = free_port(), time.time()
    common = ["--world", str(world), "--port", str(port), "--phase", phase, "--out", str(out), "--width",
              str(args.width), "--layers", str(args.layers), "--launched-at", str(launched_at)]
    processes = [subprocess.Popen([sys.executable, "-m", "bench.recovery", "--rank", str(r), *common], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE) for r in range(world)]
    for process in processes:
        process.communicate(timeout=600)


def _phases(marks: dict[str, float]) -> dict[str, float]:
    phases = {"start_and_import": marks["imported"] - marks["launched"], "build": marks["fit"] - marks["imported"]}
    return {**phases, **{name: marks[end] - marks[start] for name, start, end in PHASES}}


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {name: round(statistics.median(run[name] for run in runs), 3) for name in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="relaunches of each kind (medians are reported)")
    for internal in ("--rank", "--world", "--port", "--launched-at"):
        parser.add_argument(internal, type=float if internal == "--launched-at" else int, help=argparse.SUPPRESS)
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        _rank(args.rank, args.world, args.port, args.phase, args.out, args)
        return
    runs: dict[str, list[dict]] = {"recovery": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        _launch(3, "killed", out, args)
        for _ in range(args.repeats):
            for kind, found in runs.items():
                _launch(2, kind, out, args)
                found.append(json.loads((out / f"{kind}.json").read_text()))
                (out / f"{kind}.json").unlink()
    if any(r["resumed_at"] <= runs["plain"][0]["resumed_at"] for r in runs["recovery"]):
        raise SystemExit("the recovery relaunch resumed from the checkpoint's step: the survivors of the killed run "
                         "kept nothing (see its stderr); no figure to report")
    phases = {kind: _median([_phases(r["marks"]) for r in found]) for kind, found in runs.items()}
    seconds = {kind: _median([{"relaunch": r["marks"]["caught_up"] - r["marks"]["launched"],
                               "from_process_group": r["marks"]["caught_up"] - r["marks"]["read_state_start"]}
                              for r in found])
               for kind, found in runs.items()}
    recovery, plain = runs["recovery"][0], runs["plain"][0]
    for kind, found in runs.items():
        print(f"{kind}: {seconds[kind]['relaunch']:.2f} s from launching the processes to step {KILLED_AT + 1} done "
              f"({seconds[kind]['from_process_group']:.2f} s of it from the joined process group; medians of "
              f"{args.repeats}), resumed at step {found[0]['resumed_at']}; phases: "
              + ", ".join(f"{k} {v:.2f}" for k, v in phases[kind].items()))
    ratio = seconds["plain"]["relaunch"] / seconds["recovery"]["relaunch"]
    print(f"ratio (plain / recovery): {ratio:.2f}; not timed: " + "; ".join(LEFT_OUT))
    print(json.dumps({
        "recovery_s": seconds["recovery"]["relaunch"], "plain_reload_s": seconds["plain"]["relaunch"],
        "ratio": round(ratio, 3), "steps_redone": recovery["resumed_at"] - plain["resumed_at"],
        "from_process_group_s": {kind: seconds[kind]["from_process_group"] for kind in runs}, "phases_s": phases,
        "files_read": {kind: {"survivor": r["survivor_files"], "checkpoint": r["checkpoint_files"]}
                       for kind, r in (("recovery", recovery), ("plain", plain))},
        "repeats": args.repeats, "left_out": LEFT_OUT,
    }))

if __name__ == "__main__":
    main()

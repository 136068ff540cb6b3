"""Resume at scale: each rank's peak host memory against its own stage's training state.

    .venv/bin/python -m bench.resume_memory                 # about 5 minutes on 2 cores, 8 GiB of memory
    .venv/bin/python -m bench.resume_memory --width 512 --layers 8   # a quick look

A GPT (``zorse_lightning.models.gpt``) built on the meta device
(``Trainer.init_module(empty_init=True)``) is trained one step and checkpointed
by 8 ranks (8 pipeline stages) and by 4 (4 stages); each checkpoint is then
resumed by 8 plain CPU ranks (gloo, no emulation) in 8 stages, for one more step.
For each resumed rank:

- ``peak_rss_gib``: the process's peak resident memory (``VmHWM``, reset through
  ``/proc/self/clear_refs`` when the checkpoint starts loading) from the load to
  the end of the first resumed step: reading the checkpoint, placing the stage,
  restoring its optimizer state, and that step (its gradients and activations);
- ``baseline_rss_gib``: resident memory just before the load (Python, torch,
  Lightning, the module on the meta device);
- ``stage_state_gib``: the bytes of the parameters and optimizer state the rank
  holds after the resume (weights and AdamW's two moments).

The goal: ``peak_rss_gib <= stage_state_gib + 1``. The model is sized so that
reading the whole checkpoint on a rank (``checkpoint_state_gib``, what every
rank read before) would break it. The last line printed is one JSON object:
``{"cases": [{"written_by_ranks", "checkpoint_state_gib", "ranks": [{"rank",
"peak_rss_gib", "baseline_rss_gib", "stage_state_gib"}]}], "goal_met"}``.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from testing.launch import spawn_ranks
from zorse_lightning.units import bytes_to_gib

RESUMING_RANKS = 8
WRITERS = (8, 4)
GOAL_MARGIN_GIB = 1.0
"""The issue's goal: a rank's peak at most its own stage's state plus this."""


@dataclass(frozen=True)
class BenchConfig:
    width: int = 1024
    layers: int = 16
    """Divisible by every writer count and by the resuming ranks: each stage holds layers / ranks blocks."""
    heads: int = 8
    vocab_size: int = 256
    seq_len: int = 16


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in KiB."""
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _held_bytes(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes of the parameters this rank holds values of, and of its optimizers' state tensors."""
    from zorse_lightning.module.materialize import holds_values

    held = {id(p): p for p in module.parameters() if holds_values(p)}
    total = sum(p.numel() * p.element_size() for p in held.values())
    for optimizer in optimizers:
        for state in optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
    return total


def _fit(rank: int, world: int, config: BenchConfig, root: Path, ckpt_path: Path | None, save_to: Path | None) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from testing.plans import hand_plan
    from zorse_lightning import RecoveryPolicy, ZorseStrategy
    from zorse_lightning.cluster.config import load_cluster
    from zorse_lightning.models.gpt import GPT

    inventory = load_cluster({
        "name": f"cpu{world}", "emulated": True,
        "machines": [{"name": "localhost", "intra_bandwidth_gbps": 10,
                      "gpus": [{"type": "a100x40", "count": world, "memory_gib": 40}]}],
    })
    per_stage = config.layers // world
    plan = hand_plan([((r,), (2,), (r * per_stage, (r + 1) * per_stage)) for r in range(world)], microbatch_size=1,
                     inventory=inventory)
    measured: dict[str, Any] = {}

    class Measured(ZorseStrategy):
        def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
            measured["baseline_kib"] = _status_kib("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # the peak counts from here
            return super().load_checkpoint(checkpoint_path, weights_only)

    class AfterFirstStep(pl.Callback):
        def on_train_batch_end(self, trainer, module, *args: Any) -> None:
            if "peak_kib" not in measured:
                measured["peak_kib"] = _status_kib("VmHWM")
                optimizers = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
                measured["stage_state_bytes"] = _held_bytes(module, optimizers)

    strategy = Measured(cluster=inventory, plan=plan, emulate=False,
                        recovery=RecoveryPolicy(enabled=ckpt_path is not None))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=2 if ckpt_path else 1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[AfterFirstStep()], default_root_dir=root,
    )
    with trainer.init_module(empty_init=True):
        model = GPT(vocab_size=config.vocab_size, seq_len=config.seq_len, width=config.width, layers=config.layers,
                    heads=config.heads)
    tokens = torch.randint(0, config.vocab_size, (8, config.seq_len + 1), generator=torch.Generator().manual_seed(0))
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return {
        "rank": rank,
        "peak_rss_gib": round(bytes_to_gib(measured.get("peak_kib", 0) * 1024), 3),
        "baseline_rss_gib": round(bytes_to_gib(measured.get("baseline_kib", 0) * 1024), 3),
        "stage_state_gib": round(bytes_to_gib(measured["stage_state_bytes"]), 3),
    }


def _write_worker(rank: int, out: Path, world: int, config: dict, checkpoint: str) -> dict:
    return _fit(rank, world, BenchConfig(**config), out, None, Path(checkpoint))


def _resume_worker(rank: int, out: Path, world: int, config: dict, checkpoint: str) -> dict:
    return _fit(rank, world, BenchConfig(**config), out, Path(checkpoint), None)


def _checkpoint_state_gib(checkpoint: Path) -> float:
    """The bytes of every shard: what each rank read before (the whole model and optimizer state)."""
    return round(bytes_to_gib(sum(p.stat().st_size for p in checkpoint.glob("shard-*.pt"))), 3)


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    cases = []
    for writers in WRITERS:
        checkpoint = root / f"written-by-{writers}.ckpt"
        written, resumed = root / f"write-{writers}", root / f"resume-{writers}"
        written.mkdir()
        resumed.mkdir()
        spawn_ranks(_write_worker, writers, written, writers, asdict(config), str(checkpoint))
        ranks = spawn_ranks(_resume_worker, RESUMING_RANKS, resumed, RESUMING_RANKS, asdict(config), str(checkpoint))
        case = {"written_by_ranks": writers, "checkpoint_state_gib": _checkpoint_state_gib(checkpoint), "ranks": ranks}
        print(json.dumps(case), flush=True)
        cases.append(case)
    met = all(r["peak_rss_gib"] <= r["stage_state_gib"] + GOAL_MARGIN_GIB for c in cases for r in c["ranks"])
    return {"config": asdict(config), "cases": cases, "goal_met": met}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = BenchConfig()
    parser.add_argument("--width", type=int, default=defaults.width)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    args = parser.parse_args(argv)
    if any(args.layers % ranks for ranks in (*WRITERS, RESUMING_RANKS)):
        parser.error(f"--layers {args.layers} must be divisible by {sorted({*WRITERS, RESUMING_RANKS})}: each stage "
                     f"holds an equal share of the blocks")
    config = BenchConfig(width=args.width, layers=args.layers, heads=args.heads)
    with tempfile.TemporaryDirectory(prefix="resume_memory-") as directory:
        print(json.dumps(run(config, Path(directory))))


if __name__ == "__main__":
    main()

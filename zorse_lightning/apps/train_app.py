"""The training app: compose a run, train it with ZorseStrategy, leave its outputs in the run directory.

Outputs: ``plan.json``, ``timeline.png``, metrics (CSV and TensorBoard) and checkpoints.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from omegaconf import DictConfig, OmegaConf, read_write

from zorse_lightning.apps.hydra_support import report_user_errors, run_app
from zorse_lightning.apps.planner_options import planner_options_from_config
from zorse_lightning.apps.throughput import SamplesPerSecond
from zorse_lightning.cluster.config import inventory_from_config
from zorse_lightning.strategy.zorse_strategy import ZorseStrategy
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.reporting.plan_table import plan_table
from zorse_lightning.reporting.timeline import draw_plan_timeline


MEASURE_AFTER_STEPS = 5
"""Steps left out of the measured rate: the first ones cut the model and calibrate the emulation."""

_LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _confine_children_to_this_job(output_dir: Path) -> None:
    """Under ``--multirun``, Lightning's subprocess launcher re-runs the command line, sweep included.

    It builds the children's command from ``sys.argv`` and ``hydra.run.dir``: point both at this job
    alone, so each child joins its own job and writes into this job's directory.
    """
    import os
    import sys

    import torch.distributed as dist

    # A previous job of the sweep ran in this process: its process group and the variables
    # Lightning's launcher exported (which would make this job believe it is a child) must go.
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for name in _LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    hydra_cfg = HydraConfig.get()
    sys.argv = [sys.argv[0], *hydra_cfg.overrides.task]
    with read_write(hydra_cfg):
        hydra_cfg.run.dir = str(output_dir)


@report_user_errors
def _run(cfg: DictConfig) -> None:
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        _confine_children_to_this_job(output_dir)
    pl.seed_everything(cfg.seed, workers=True)
    inventory = inventory_from_config(cfg.cluster)
    data = instantiate(cfg.data)
    options = planner_options_from_config(cfg.planner)
    strategy = ZorseStrategy(
        cluster=inventory, plan=cfg.plan, planner_options=options, block_path=cfg.block_path, seed=cfg.seed,
        weights=cfg.weights, weights_prefix=cfg.weights_prefix,
    )
    throughput = SamplesPerSecond()
    trainer = pl.Trainer(
        strategy=strategy,
        devices=_local_devices(inventory),
        num_nodes=1,
        default_root_dir=str(output_dir),
        logger=[CSVLogger(output_dir, name="metrics"), TensorBoardLogger(output_dir, name="tensorboard")],
        callbacks=[ModelCheckpoint(dirpath=output_dir / "checkpoints", save_last=True), throughput],
        **OmegaConf.to_container(cfg.trainer, resolve=True),
    )
    with trainer.init_module(empty_init=True) if cfg.empty_init else nullcontext():
        model = instantiate(cfg.model)
    trainer.fit(model, datamodule=data, ckpt_path=cfg.checkpoint)
    if trainer.is_global_zero:
        _write_plan_outputs(strategy, output_dir)
        print(_throughput_line(strategy, throughput))


def _local_devices(inventory) -> int:
    """Processes on this machine: all of an emulated cluster's ranks run here."""
    import os

    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return inventory.world_size if inventory.emulated else len(inventory.machines[0].gpu_types)


def _throughput_line(strategy: ZorseStrategy, throughput: SamplesPerSecond) -> str:
    """Predicted beside measured samples/s, saying what each counts, so a gap reads for what it is."""
    measured = throughput.median_after(MEASURE_AFTER_STEPS)
    predicted = strategy.plan.predicted
    parts = []
    if predicted is not None:
        parts.append(f"predicted {predicted.samples_per_s:.1f} samples/s (the cost model: the schedule's compute, "
                     f"transfers, synchronisation and optimizer step, from the start-up profile)")
    if measured is not None:
        parts.append(f"measured {measured:.1f} (median training step after {MEASURE_AFTER_STEPS}, wall clock: "
                     f"also Lightning's loop, logging and clipping, which the prediction leaves out)")
    if strategy.emulation is not None:
        parts.append("both in emulated GPU time: the ranks compute at their GPU type's speed, "
                     f"the fastest {strategy.emulation_slowdown:g}x slower than this CPU")
    return "throughput: " + "; ".join(parts)


def _write_plan_outputs(strategy: ZorseStrategy, output_dir: Path) -> None:
    from rich.console import Console

    plan = strategy.plan
    plan.save(output_dir / "plan.json")
    startup = strategy.startup
    if startup is not None and startup.profile is not None:
        ctx = CostContext.build(startup.inventory, startup.profile, p2p_rules=startup.p2p_rules)
        Console(width=160).print(plan_table(plan, ctx))
        draw_plan_timeline(plan, ctx, output_dir / "timeline.png")
    for note in plan.notes:  # why the plan looks as it does (no cuts for a module optimising by hand, ...)
        print(f"note: {note}")
    print(f"outputs in {output_dir}: plan.json, timeline.png, metrics/, tensorboard/, checkpoints/")


def main() -> None:
    run_app(_run, "train")

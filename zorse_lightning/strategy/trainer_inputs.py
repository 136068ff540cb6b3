"""What the strategy hands to the start-up pass (:mod:`zorse_lightning.startup.plan_at_start`)."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch
from torch.utils.data import DataLoader

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.emulation.rank import RankEmulation
from zorse_lightning.errors import PlanningError
from zorse_lightning.module.tensor_parallel import Style
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.profiling.measure import ForwardContext
from zorse_lightning.startup.plan_at_start import StartupInputs
from zorse_lightning.startup.step_costs import OptimizerFactory, optimizer_factory
from zorse_lightning.strategy.log_capture import LogCapture, capturing_logs


def rank_emulation(
    inventory: ClusterInventory | None, emulate: bool | None, device: torch.device, rank: int, slowdown: float
) -> RankEmulation | None:
    """This rank's emulation: on CPU ranks of an emulated cluster (or when ``emulate=True``), else None."""
    wanted = emulate if emulate is not None else bool(inventory and inventory.emulated)
    if not wanted or device.type != "cpu" or inventory is None:
        return None
    return RankEmulation(inventory, rank, slowdown)


def _strategy_of(module: Any) -> Any:
    """The strategy of the Trainer ``module`` is attached to (None: a bare module, as in tests)."""
    try:
        return module.trainer.strategy
    except RuntimeError:  # Lightning's "not attached to a Trainer"
        return None


def precision_forward_context(module: Any) -> ForwardContext:
    """The forward context of the precision plugin the run trains with (autocast under mixed precision):
    start-up times the step in it, as training runs it. A bare module trains in its own dtype."""
    strategy = _strategy_of(module)
    return nullcontext if strategy is None else strategy.precision_plugin.forward_context


def user_optimizer(module: Any) -> OptimizerFactory | None:
    """The optimizer the run steps (the first of ``configure_optimizers``), as a factory of the same class
    with the same settings (its first parameter group's), for start-up to time on sample parameters;
    None when the strategy has none yet."""
    strategy = _strategy_of(module)
    optimizers = [] if strategy is None else strategy.optimizers
    if not optimizers:
        return None
    return optimizer_factory(optimizers[0])


def strategy_tp_plan(module: Any) -> Mapping[str, Style] | None:
    """The ``tp_plan`` given to the strategy the module trains under (None: none given, or a bare module), so
    that start-up reads the TP degrees the blocks admit by the plan the engine will split them by."""
    strategy = _strategy_of(module)
    # ZorseStrategy keeps it as given (its constructor's tp_plan); another strategy has none
    plan = getattr(strategy, "_tp_plan", None)
    return plan if isinstance(plan, Mapping) else None


def quiet_training_step(module: Any, forward_context: ForwardContext | None = None):
    """``run_step(microbatch)``: the module's own training step inside ``forward_context`` (default: the
    precision plugin's), its ``self.log`` calls discarded; it returns what the step returns (the loss)."""
    context = forward_context or precision_forward_context(module)

    def run_step(micro: Any) -> Any:
        with capturing_logs(module, LogCapture(1)), context():
            return module.training_step(micro, 0)

    return run_step


def startup_inputs(
    module: Any, inventory: ClusterInventory | None, loader: DataLoader, rank: int, world_size: int,
    device: torch.device, resumed_global_batch_size: int | None, options: PlannerOptions, block_path: str | None,
    emulation: RankEmulation | None, init_seed: int = 0,
) -> StartupInputs:
    """The pass's inputs, checked: a cluster to plan on and a loader with a batch size.

    On resume the checkpoint's global batch continues (same data order, same
    trajectory), whatever the loader's batch size times this cluster's ranks.
    """
    if inventory is None:
        raise PlanningError("ZorseStrategy needs a cluster (cluster='cpu_sim4', a config path or an inventory) or a plan")
    if loader.batch_size is None:
        raise PlanningError("the training DataLoader has no batch_size; give one, or pass a plan")
    return StartupInputs(
        module=module, inventory=inventory, rank=rank, world_size=world_size, device=device,
        global_batch_size=resumed_global_batch_size or loader.batch_size * world_size,
        planner_options=options, block_path=block_path, emulation=emulation,
        automatic_optimization=module.automatic_optimization, init_seed=init_seed,
        forward_context=precision_forward_context(module), optimizer=user_optimizer(module),
        tp_plan=strategy_tp_plan(module),
    )


def training_loader(trainer: Any, fallback: DataLoader) -> DataLoader:
    """The loader ``fit`` will train on, made now (Lightning makes it again after the sanity check)."""
    train = trainer.fit_loop._data_source.dataloader()
    return train if isinstance(train, DataLoader) else fallback


"""Modules that optimise by hand (``automatic_optimization = False``) under ZorseStrategy.

Three processes (an A100, a V100 and a T4: the plan gives them 7, 3 and 2 of
each 12-sample global batch) train a module with two optimizers, a learning-rate
scheduler, ``toggle_optimizer`` and ``clip_gradients``, all called by hand; each
rank also trains the same module with Lightning on one device on the same
global batches, and compares. One process alone (world size 1) does the same.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zorse_lightning.capabilities import Sharding
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.unprofiled import unprofiled_data_parallel
from zorse_lightning.startup.plan_at_start import MANUAL_OPTIMIZATION_REASON
from zorse_lightning.strategy.manual_optimization import check_manual_plan
from zorse_lightning.strategy.precision import DynamicLossScale, ZorsePrecision
from zorse_lightning.strategy.zorse_strategy import ZorseStrategy
from testing.launch import spawn_ranks
from testing.plans import hand_plan

PER_RANK_BATCH = 4
STEPS = 4
FEATURES, CLASSES = 6, 3
CLIP = 0.05
"""Small enough that every step's body gradients are clipped."""
LOGGED = ("train_loss", "head_loss")


def _cluster(*types: str) -> dict:
    gpus = [{"type": t, "memory_gib": 0.4 if t == "a100x40" else 0.16} for t in types]
    return {"name": "mixed", "emulated": True, "machines": [{"name": "localhost", "intra_bandwidth_gbps": 10, "gpus": gpus}]}


THREE = _cluster("a100x40", "v100x16", "t4")
ONE = _cluster("a100x40")


class HandOptimized(pl.LightningModule):
    """A body and a head with an optimizer each: the body steps on the loss (clipped, lr scheduled), then the
    head alone on the loss of the updated body's features."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.body = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, CLASSES)

    def training_step(self, batch, batch_idx):
        body_opt, head_opt = self.optimizers()
        x, y = batch
        self.toggle_optimizer(body_opt)  # the head gets no gradient from this loss
        loss = F.cross_entropy(self.head(self.body(x)), y)
        body_opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(body_opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        body_opt.step()
        self.untoggle_optimizer(body_opt)
        head_loss = F.cross_entropy(self.head(self.body(x).detach()), y)
        head_opt.zero_grad()
        self.manual_backward(head_loss)
        head_opt.step()
        self.lr_schedulers().step()
        self.log("train_loss", loss)
        self.log("head_loss", head_loss)
        return loss

    def configure_optimizers(self):
        body = torch.optim.SGD(self.body.parameters(), lr=0.5, momentum=0.9)
        head = torch.optim.Adam(self.head.parameters(), lr=0.01)
        return [body, head], [torch.optim.lr_scheduler.StepLR(body, step_size=1, gamma=0.7)]


class Recorder(pl.Callback):
    """The logged values after each step, as the loggers and progress bar see them."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {name: [] for name in LOGGED}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for name in LOGGED:
            self.values[name].append(float(trainer.callback_metrics[name]))


def _data(global_batch: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(global_batch * STEPS, FEATURES, generator=generator)
    return TensorDataset(inputs, torch.randint(0, CLASSES, (global_batch * STEPS,), generator=generator))


def _module() -> HandOptimized:
    torch.manual_seed(0)
    return HandOptimized()


def _fit(strategy, devices: int, batch_size: int, global_batch: int, tmp: Path) -> tuple[pl.Trainer, HandOptimized, Recorder]:
    model, recorder = _module(), Recorder()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=2 * STEPS, logger=False,  # steps of 2 optimizers
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[recorder], default_root_dir=tmp,
    )
    trainer.fit(model, train_dataloaders=DataLoader(_data(global_batch), batch_size=batch_size, shuffle=False))
    return trainer, model, recorder


def _case(world: int, cluster: dict, tmp: Path) -> dict:
    """ZorseStrategy planning at start against Lightning on one device, on the same global batches."""
    global_batch = PER_RANK_BATCH * world
    trainer, model, recorder = _fit(ZorseStrategy(cluster=cluster, emulate=False), world, PER_RANK_BATCH, global_batch, tmp)
    _, reference, expected = _fit(SingleDeviceStrategy(torch.device("cpu")), 1, global_batch, global_batch, tmp)
    expected_params = dict(reference.named_parameters())
    plan = trainer.strategy.plan
    return {
        "param_diff": max((p.detach() - expected_params[n].detach()).abs().max().item() for n, p in model.named_parameters()),
        "loss_diff": max(abs(a - b) for name in LOGGED for a, b in zip(recorder.values[name], expected.values[name])),
        "steps_logged": len(recorder.values["train_loss"]),
        "global_step": trainer.global_step,
        "stages": len(plan.stages),
        "microbatches": list(plan.stages[0].microbatches_per_rank),
        "sharding": plan.stages[0].sharding.value,
        "notes": list(plan.notes),
    }


def _pipelined_plan_error(tmp: Path) -> str:
    inventory = load_cluster(THREE)
    plan = hand_plan([((0,), (6,), (0, 1)), ((1, 2), (4, 2), (1, 2))], inventory=inventory)
    try:
        _fit(ZorseStrategy(cluster=inventory, plan=plan, emulate=False), 3, PER_RANK_BATCH, 12, tmp)
    except PlanningError as error:
        return str(error)
    return "no error"


def _three_ranks(rank: int, tmp: Path) -> dict:
    return {"trained": _case(3, THREE, tmp), "pipelined_plan_error": _pipelined_plan_error(tmp)}


def _one_rank(rank: int, tmp: Path) -> dict:
    return _case(1, ONE, tmp)


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_three_ranks, 3, tmp_path_factory.mktemp("manual3"))


@pytest.mark.multiprocess
def test_three_uneven_ranks_train_as_one_process(three):
    for rank, result in enumerate(three):
        trained = result["trained"]
        assert trained["param_diff"] < 1e-5, (rank, trained)
        assert trained["loss_diff"] < 1e-5, (rank, trained)
        assert (trained["steps_logged"], trained["global_step"]) == (STEPS, 2 * STEPS)  # two optimizer steps a step


@pytest.mark.multiprocess
def test_plan_has_one_unsharded_stage_and_says_why(three):
    trained = three[0]["trained"]
    assert trained["stages"] == 1
    # 12 microbatches of 1 by peak speed, 312 : 125 : 65 TFLOPS -> 7.5, 3.0, 1.6 -> largest remainders.
    assert trained["microbatches"] == [7, 3, 2]
    assert trained["sharding"] == Sharding.NONE.value
    assert f"data parallel only: {MANUAL_OPTIMIZATION_REASON}" in trained["notes"]


@pytest.mark.multiprocess
def test_pipelined_plan_for_a_manual_module_is_refused(three):
    for result in three:
        message = result["pipelined_plan_error"]
        assert "cuts HandOptimized into 2 pipeline stages" in message
        assert "automatic_optimization=False" in message and "one-stage" in message


@pytest.mark.multiprocess
def test_one_process_trains_as_lightning_does(tmp_path):
    trained = spawn_ranks(_one_rank, 1, tmp_path)[0]
    assert trained["param_diff"] < 1e-5, trained
    assert trained["loss_diff"] < 1e-5, trained
    assert trained["stages"] == 1 and trained["sharding"] == Sharding.NONE.value


# -- plans checked without processes -------------------------------------------------------------


def test_sharded_or_idle_plans_and_loss_scaling_are_refused():
    inventory, module = load_cluster(THREE), _module()
    sharded = unprofiled_data_parallel(inventory, 12, "cannot be cut")
    with pytest.raises(PlanningError, match="shards the optimizer state .'optimizer'.*sharding 'none'"):
        check_manual_plan(sharded, module, ZorsePrecision(None, "cpu"))
    idle = hand_plan([((0, 1), (8, 4), (0, 1))], inventory=inventory)
    idle = type(idle).from_dict({**idle.to_dict(), "world_size": 3, "idle_ranks": [2]})
    with pytest.raises(PlanningError, match=r"leaves ranks \[2\] idle"):
        check_manual_plan(idle, module, ZorsePrecision(None, "cpu"))
    unsharded = unprofiled_data_parallel(inventory, 12, MANUAL_OPTIMIZATION_REASON, shard_optimizer=False)
    with pytest.raises(PlanningError, match="precision='32-true'"):
        check_manual_plan(unsharded, module, ZorsePrecision(torch.float16, "cpu", DynamicLossScale()))
    check_manual_plan(unsharded, module, ZorsePrecision(None, "cpu"))  # accepted
    module.automatic_optimization = True
    check_manual_plan(sharded, module, ZorsePrecision(None, "cpu"))  # not a manual module: not its business

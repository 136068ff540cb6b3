"""Emulated ranks pay for activation offload's copies at their GPU type's host link (issue 31, item 2).

A call that offloads ``n`` bytes lasts max(compute, n / host link) in its forward (the copies out) and the
same in its backward (the copies back), as the cost model's ``with_offload_copies`` prices a stage's
microbatch; per block here, which is the same for blocks alike. The one-process tests load fixed costs,
so the charged seconds (``emulated_compute_s``) are exact; the multi-process test runs the strategy with
an offloading pipeline stage and an offloading one-stage plan.
"""

from __future__ import annotations

import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.emulation.calibration import cost_key
from zorse_lightning.emulation.emulator import ComputeEmulator
from zorse_lightning.emulation.spec import EmulationSpec, emulation_spec_for_rank
from zorse_lightning.emulation.timing import CallCost
from zorse_lightning.engine.activation_offload import ActivationOffload
from zorse_lightning.errors import ZorseUserError
from zorse_lightning.units import gbps_to_bytes_per_s

WIDTH, SAMPLES, BLOCKS, STEPS = 64, 8, 3, 2
SLOWDOWN = 2.0
BLOCK_BYTES = 2 * SAMPLES * WIDTH * 4
"""What one block's forward offloads: the linear's input and the tanh's output, float32 (its weight stays)."""
FORWARD_S_PER_SAMPLE, BACKWARD_S_PER_SAMPLE = 5e-5, 1e-4
FORWARD_S, BACKWARD_S = SLOWDOWN * SAMPLES * FORWARD_S_PER_SAMPLE, SLOWDOWN * SAMPLES * BACKWARD_S_PER_SAMPLE
"""A block's emulated compute: 0.8 ms forward, 1.6 ms backward."""


def _link_gbps(copy_s: float) -> float:
    """The host link over which one block's copy lasts ``copy_s``."""
    return BLOCK_BYTES / copy_s / gbps_to_bytes_per_s(1.0)


def _offloading_blocks(
    host_link_gbps: float, costs: bool = True
) -> tuple[nn.ModuleList, nn.Linear, ComputeEmulator, ActivationOffload]:
    """Blocks offloading their saved tensors, and a head that does not, emulated at ``host_link_gbps``."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS))
    head = nn.Linear(WIDTH, 1)
    offload = ActivationOffload(torch.device("cpu"))
    for index, block in enumerate(blocks):
        block.forward = offload.wrap(index, block, block.forward)  # as the cut does: inside the module's hooks
    names = [f"blocks.{i}" for i in range(BLOCKS)] + ["head"]
    signature = f"({WIDTH},):torch.float32"
    fixed = {cost_key(n, signature): CallCost(FORWARD_S_PER_SAMPLE, BACKWARD_S_PER_SAMPLE) for n in names}
    emulator = ComputeEmulator(EmulationSpec("t4", SLOWDOWN, 1 << 30, host_link_gbps), costs=fixed if costs else None)
    emulator.instrument([*blocks, head], names=names)
    emulator.offloaded_bytes = lambda: offload.offloaded_bytes
    return blocks, head, emulator, offload


def _step(blocks: nn.ModuleList, head: nn.Linear) -> float:
    x = torch.randn(SAMPLES, WIDTH, requires_grad=True)
    start = time.perf_counter()
    for block in blocks:
        x = block(x)
    head(x).square().sum().backward()
    return time.perf_counter() - start


@pytest.mark.parametrize(
    "copy_s, forward_s, backward_s",
    [
        (4e-3, 4e-3, 4e-3),  # slower than both: each block takes the copy each way
        (1.2e-3, 1.2e-3, BACKWARD_S),  # between: the forward waits for its copy, the backward hides it
        (1e-6, FORWARD_S, BACKWARD_S),  # fast link: compute alone, as without offload
    ],
    ids=["copy_over_compute", "copy_between", "copy_hidden"],
)
def test_an_offloading_block_takes_the_longer_of_compute_and_copy(copy_s, forward_s, backward_s) -> None:
    blocks, head, emulator, offload = _offloading_blocks(_link_gbps(copy_s))
    walls = [_step(blocks, head) for _ in range(STEPS)]
    assert offload.offloaded_bytes == STEPS * BLOCKS * BLOCK_BYTES
    blocks_s = BLOCKS * (forward_s + backward_s)
    head_s = FORWARD_S + BACKWARD_S  # the head offloads nothing: never charged a copy
    assert emulator.emulated_compute_s == pytest.approx(STEPS * (blocks_s + head_s), rel=1e-9)
    assert emulator.copy_bound_s == pytest.approx(STEPS * (blocks_s - BLOCKS * (FORWARD_S + BACKWARD_S)), abs=1e-12)
    assert emulator.calls == STEPS * 2 * (BLOCKS + 1) and emulator.approximate_backwards == 0
    assert min(walls) >= blocks_s + head_s  # deadlines are absolute: the copies are waited for


def test_bytes_the_calibration_copies_are_not_charged() -> None:
    """A block calibrated at its first call runs its offloading forward outside the charged call."""
    copy_s = 4e-3
    blocks, head, emulator, offload = _offloading_blocks(_link_gbps(copy_s), costs=False)
    _step(blocks, head)
    assert offload.offloaded_bytes > BLOCKS * BLOCK_BYTES  # the calibration's runs copied too
    charged = [(SLOWDOWN * SAMPLES * c.forward_s_per_sample, SLOWDOWN * SAMPLES * c.backward_s_per_sample, k)
               for k, c in emulator.calibrated_costs.items()]
    expected = sum(f + b if k.startswith("head") else max(f, copy_s) + max(b, copy_s) for f, b, k in charged)
    assert emulator.emulated_compute_s == pytest.approx(expected, rel=1e-9)


def test_a_rank_without_offload_is_never_charged_a_copy() -> None:
    blocks, head, emulator, _ = _offloading_blocks(_link_gbps(4e-3))
    emulator.offloaded_bytes = None  # what StageEmulation leaves where the stage keeps its activations
    _step(blocks, head)
    assert emulator.emulated_compute_s == pytest.approx((BLOCKS + 1) * (FORWARD_S + BACKWARD_S), rel=1e-9)
    assert emulator.copy_bound_s == 0.0


def test_the_spec_takes_the_host_link_of_the_rank_s_type() -> None:
    inventory = load_cluster("cpu_sim4")  # a100x40 (PCIe 4), v100x16 and t4 (PCIe 3)
    links = [emulation_spec_for_rank(inventory, r).host_link_gbps for r in range(4)]
    assert links == [g.gpu_type.host_link_gbps for g in inventory.gpus]
    assert links[0] == 2 * links[1]
    custom = load_cluster({
        "name": "slow_host", "emulated": True,
        "gpu_types": [{"name": "slowhost", "memory_gib": 16, "fp16_tflops": 65, "host_link_gbps": 0.5}],
        "machines": [{"name": "localhost", "intra_bandwidth_gbps": 10, "gpus": [{"type": "slowhost", "memory_gib": 0.1}]}],
    })
    assert emulation_spec_for_rank(custom, 0).host_link_gbps == 0.5  # a cluster config's own type sets it too
    with pytest.raises(ZorseUserError, match="host_link_gbps=0 must be positive"):
        EmulationSpec("t4", 3.0, 1, host_link_gbps=0)


# -- the strategy: a pipeline stage's offload and a one-stage plan's ---------------------------------------


SLOW_LINK_GBPS = 0.0025
"""312 KB/s: a block's copy of the test GPT's microbatch (about 35 KB, 110 ms) outlasts its emulated compute
(a few ms) about thirty times over."""
SLOW_HOST = {
    "name": "slow_host2", "emulated": True,
    "gpu_types": [
        {"name": "fast_slowhost", "memory_gib": 40, "fp16_tflops": 312, "host_link_gbps": SLOW_LINK_GBPS},
        {"name": "slow_slowhost", "memory_gib": 16, "fp16_tflops": 125, "host_link_gbps": SLOW_LINK_GBPS},
    ],
    "machines": [{"name": "localhost", "intra_bandwidth_gbps": 10, "gpus": [
        {"type": "fast_slowhost", "memory_gib": 0.4}, {"type": "slow_slowhost", "memory_gib": 0.16},
    ]}],
}
STRATEGY_STEPS = 2


class _Charges(pl.Callback):
    """After each step: the rank's charged compute, its copy-bound part, its offload's bytes, and the number
    of modules the emulator charges a recomputed forward."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, float, int, int]] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        strategy = trainer.strategy
        emulator, offload = strategy.emulation.emulator, strategy.engine.offload
        self.rows.append((emulator.emulated_compute_s, emulator.copy_bound_s, offload.offloaded_bytes if offload else 0,
                          len(emulator.recomputed)))


def _strategy_worker(rank: int, out_dir: Path) -> dict:
    from testing.gpt_reference import gpt, tokens
    from testing.plans import hand_plan
    from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

    inventory = load_cluster(SLOW_HOST)
    plans = {
        "pipeline_offload_first": hand_plan([((0,), (4,), (0, 2)), ((1,), (4,), (2, 4))], microbatch_size=2,
                                            inventory=inventory, offload_stages=(0,)),
        "one_stage_offload": hand_plan([((0, 1), (2, 2), (0, 4))], microbatch_size=2, inventory=inventory,
                                       offload_stages=(0,)),
        "one_stage_recompute": hand_plan([((0, 1), (2, 2), (0, 4))], microbatch_size=2, inventory=inventory,
                                         recompute=True),
    }
    out = {}
    for name, plan in plans.items():
        charges = _Charges()
        trainer = pl.Trainer(
            strategy=ZorseStrategy(cluster=SLOW_HOST, plan=plan), accelerator="cpu", devices=2,
            max_steps=STRATEGY_STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, callbacks=[charges], default_root_dir=str(out_dir),
        )
        trainer.fit(gpt(), train_dataloaders=DataLoader(tokens(8 * STRATEGY_STEPS), batch_size=4))
        out[name] = charges.rows
    return out


@pytest.fixture(scope="module")
def strategy_charges(tmp_path_factory) -> list[dict]:
    from testing.launch import spawn_ranks

    return spawn_ranks(_strategy_worker, 2, tmp_path_factory.mktemp("offload_charges"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("case, offloading", [("pipeline_offload_first", {0}), ("one_stage_offload", {0, 1})])
def test_the_strategy_charges_the_copies_of_the_ranks_that_offload(strategy_charges, case, offloading) -> None:
    rate = gbps_to_bytes_per_s(SLOW_LINK_GBPS)
    for rank, charges in enumerate(strategy_charges):
        (emulated_0, bound_0, bytes_0, _), (emulated_n, bound_n, bytes_n, recomputed) = charges[case][0], charges[case][-1]
        assert recomputed == 0
        copied = bytes_n - bytes_0  # after the first step, whose calibrations copied outside charged calls
        if rank not in offloading:
            assert (bytes_n, bound_n) == (0, 0.0), rank
            continue
        assert copied > 0, rank
        copy_s = 2 * copied / rate  # out in the forwards, back in the backwards
        assert emulated_n - emulated_0 >= copy_s * (1 - 1e-9), rank
        assert bound_n - bound_0 >= 0.8 * copy_s, rank  # the link, not compute, set the blocks' time


@pytest.mark.multiprocess
def test_the_strategy_charges_the_recomputed_forward_of_a_one_stage_plan(strategy_charges) -> None:
    """The executor checkpoints every block of a one-stage plan that recomputes; the emulator charges them."""
    for charges in strategy_charges:
        *_, recomputed = charges["one_stage_recompute"][-1]
        assert recomputed == 4  # the test GPT's blocks

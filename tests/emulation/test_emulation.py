"""CPU ranks emulating GPU types: spec factors, deadlines, memory counting, the callback and the accelerator."""

from __future__ import annotations

import copy
import json
import socket
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.emulation.coverage import emulated_modules, named_emulated_modules
from zorse_lightning.emulation.emulator import ComputeEmulator, EmulatedOutOfMemoryError
from zorse_lightning.emulation.spec import EmulationSpec, cpu_cores_demanded, emulation_spec_for_rank
from zorse_lightning.emulation import emulator as emulator_module
from zorse_lightning.emulation.timing import CallCost
from zorse_lightning.errors import InventoryError, ZorseUserError
from zorse_lightning.strategy.accelerator import (
    ZorseCPUAccelerator,
    resolve_accelerator,
)
from zorse_lightning.emulation.callback import EmulateCluster
from zorse_lightning.strategy.registration import register_with_lightning
from zorse_lightning.units import BYTES_PER_GIB
from testing.launch import start_method
from testing.stateful import RecurrentLayer

FLOAT_BYTES = 4
ONE_T4 = {
    "name": "one_t4",
    "emulated": True,
    "machines": [{"name": "localhost", "intra_bandwidth_gbps": 10, "gpus": [{"type": "t4", "memory_gib": 0.16}]}],
}


# -- specs ---------------------------------------------------------------------------------


def test_cpu_sim4_specs_follow_catalog_peaks_and_budgets() -> None:
    inventory = load_cluster("cpu_sim4")  # a100x40 (312 TFLOPS), v100x16 (125), t4 (65) x2
    specs = [emulation_spec_for_rank(inventory, r) for r in range(4)]
    assert [s.gpu_type for s in specs] == ["a100x40", "v100x16", "t4", "t4"]
    assert [s.slowdown for s in specs] == pytest.approx([3.0, 3.0 * 312 / 125, 3.0 * 312 / 65, 3.0 * 312 / 65])
    assert [s.memory_budget_bytes for s in specs] == [int(0.4 * BYTES_PER_GIB)] + [int(0.16 * BYTES_PER_GIB)] * 3
    assert emulation_spec_for_rank(inventory, 1, fastest_slowdown=2.0).slowdown == pytest.approx(2.0 * 312 / 125)
    assert cpu_cores_demanded(inventory) == pytest.approx(1 / 3 + 125 / 936 + 2 * 65 / 936)
    with pytest.raises(InventoryError, match="rank 4 is outside cluster 'cpu_sim4'"):
        emulation_spec_for_rank(inventory, 4)
    with pytest.raises(ZorseUserError, match="slowdown=0.5 must be >= 1"):
        EmulationSpec("t4", 0.5, 1)


# -- compute -------------------------------------------------------------------------------


def _mlp(width: int = 256) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(4 * width, width))


def test_instrumented_module_takes_slowdown_times_calibrated_cost_and_keeps_the_math() -> None:
    torch.manual_seed(0)
    module = _mlp()
    reference = copy.deepcopy(module)
    slowdown, samples, steps = 3.0, 32, 3
    emulator = ComputeEmulator(EmulationSpec("t4", slowdown, 1 << 30))
    emulator.instrument([module])
    walls = []
    for step in range(steps):
        x = torch.randn(samples, 256, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        torch.manual_seed(step)
        start = time.perf_counter()
        module(x).square().sum().backward()
        walls.append(time.perf_counter() - start)
        torch.manual_seed(step)
        reference(x_ref).square().sum().backward()
        assert torch.equal(x.grad, x_ref.grad)  # identity markers, restored RNG: dropout masks unchanged
    for p, p_ref in zip(module.parameters(), reference.parameters()):
        assert torch.equal(p.grad, p_ref.grad)  # calibration took gradients without accumulating them
    (cost,) = emulator.calibrated_costs.values()
    per_step = slowdown * samples * (cost.forward_s_per_sample + cost.backward_s_per_sample)
    assert emulator.calls == 2 * steps and emulator.approximate_backwards == 0
    # (Whether every sleep was positive depends on the load of the machine, so it is reported by the
    # benchmarks through `overruns`, not asserted here.)
    assert emulator.emulated_compute_s == pytest.approx(steps * per_step, rel=0.01)
    assert min(walls) >= per_step  # deadlines are absolute: a step cannot be faster than emulated


def test_calibration_starts_each_run_from_a_layers_own_state_and_leaves_it_as_it_was() -> None:
    """Without :func:`own_state_kept` the second calibration run adds the first's state, whose graph that
    run's gradient freed: "backward through the graph a second time"; and the real call would start from
    the calibration's state instead of its own."""
    torch.manual_seed(0)
    module, reference = RecurrentLayer(), RecurrentLayer()
    reference.load_state_dict(module.state_dict())
    emulator = ComputeEmulator(EmulationSpec("t4", 2.0, 1 << 30))
    emulator.instrument([module])
    for step in range(2):
        start = torch.zeros(1, 8) if step else None  # a model's reset, then a state set before the call
        module.state, reference.state = start, start
        x = torch.randn(4, 8)
        module(x).sum().backward()
        reference(x).sum().backward()
        assert torch.equal(module.state, reference.state)
    for p, p_ref in zip(module.parameters(), reference.parameters()):
        assert torch.equal(p.grad, p_ref.grad)


def test_a_model_may_modify_an_emulated_modules_output_or_its_input_in_place() -> None:
    """As CTRL scales its embedding's output in place (``inputs_embeds *= sqrt(d)``): autograd forbids that
    on a view made inside a custom Function, which the markers' outputs were."""
    torch.manual_seed(0)
    embedding, block = nn.Embedding(16, 8), nn.Linear(8, 8)
    reference = copy.deepcopy(nn.ModuleList([embedding, block]))
    emulator = ComputeEmulator(EmulationSpec("t4", 2.0, 1 << 30))
    emulator.instrument([embedding, block], names=["embedding", "block"])
    tokens = torch.randint(0, 16, (4, 3))
    for modules in ([embedding, block], list(reference)):
        hidden = modules[0](tokens)
        hidden *= 2.0
        modules[1](hidden).square().sum().backward()
    for p, p_ref in zip([*embedding.parameters(), *block.parameters()], reference.parameters()):
        assert torch.equal(p.grad, p_ref.grad)


def test_costs_are_per_sample_and_shared_by_batch_sizes() -> None:
    module = _mlp(64)
    emulator = ComputeEmulator(EmulationSpec("t4", 2.0, 1 << 30))
    emulator.instrument([module])
    with torch.no_grad():  # a sanity-check style first call still calibrates the training backward
        module(torch.randn(8, 64))
    (cost,) = emulator.calibrated_costs.values()
    assert cost.backward_s_per_sample > 0
    module(torch.randn(3, 64, requires_grad=True)).sum().backward()
    assert list(emulator.calibrated_costs.values()) == [cost]  # same per-sample shape: no recalibration
    expected = 2.0 * (8 * cost.forward_s_per_sample + 3 * (cost.forward_s_per_sample + cost.backward_s_per_sample))
    assert emulator.emulated_compute_s == pytest.approx(expected, rel=0.01)
    emulator.agree_costs()  # no process group: a no-op
    assert list(emulator.calibrated_costs.values()) == [cost]


class _Positions(nn.Module):
    """GPT-style: tokens (batch, time) embedded, plus one position table row per time step (no batch)."""

    def __init__(self, time_steps: int = 16, width: int = 8) -> None:
        super().__init__()
        self.tokens = nn.Embedding(32, width)
        self.positions = nn.Embedding(time_steps, width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))


def test_a_call_without_the_batch_is_charged_once_whatever_the_batch() -> None:
    """Told the step's samples, the emulator charges the position lookup per call; per sample (the old
    reading of its 16 positions as 16 samples) it would cost as much as 16 samples' tokens."""
    model = _Positions()
    emulator = ComputeEmulator(EmulationSpec("t4", 2.0, 1 << 30))
    emulator.instrument([model.tokens, model.positions], names=["tokens", "positions"])
    charged = []
    for samples in (2, 8):
        emulator.batch_samples = samples
        before = emulator.emulated_compute_s
        with torch.no_grad():
            model(torch.randint(0, 32, (samples, 16)))
        charged.append(emulator.emulated_compute_s - before)
    costs = emulator.calibrated_costs
    assert sorted(costs) == ["positions|whole:(16,):torch.int64", "tokens|(16,):torch.int64"]
    token, table = costs["tokens|(16,):torch.int64"], costs["positions|whole:(16,):torch.int64"]
    assert charged == pytest.approx([2.0 * (s * token.forward_s_per_sample + table.forward_s_per_sample) for s in (2, 8)])
    emulator.batch_samples = None  # not told: the positions' dim 0 reads as 16 samples
    with torch.no_grad():
        model(torch.randint(0, 32, (2, 16)))
    assert "positions|():torch.int64" in emulator.calibrated_costs


def _checkpointed(module: nn.Module) -> nn.Module:
    """``module`` with its forward recomputed in backward, as the cut and a one-stage plan wrap a block's."""
    original = module.forward
    module.forward = lambda *args: torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False)
    return module


def test_a_recomputing_block_is_charged_its_forward_again_in_its_backward(monkeypatch) -> None:
    """The rerun calls the forward past the module's hooks: charged by the emulator, as the cost model prices
    it (``stage_microbatch_times``), not hidden under the backward's deadline."""
    torch.manual_seed(0)
    blocks = [_checkpointed(_mlp(64)) for _ in range(2)]
    key = lambda name: f"{name}|(64,):torch.float32"
    forward_s, backward_s, samples = 1e-4, 2e-4, 4
    emulator = ComputeEmulator(EmulationSpec("t4", 2.0, 1 << 30), costs={key(n): CallCost(forward_s, backward_s) for n in "ab"})
    emulator.instrument(blocks, names=["a", "b"])
    emulator.recomputed = frozenset({id(blocks[0])})
    x = torch.randn(samples, 64, requires_grad=True)
    blocks[1](blocks[0](x)).sum().backward()
    plain = 2.0 * samples * (forward_s + backward_s)
    assert emulator.emulated_compute_s == pytest.approx(2 * plain + 2.0 * samples * forward_s, rel=1e-9)
    # Calibrated at its first call through the checkpointed forward, the timed backward reran the forward:
    # the cost kept is the plain one (the rerun is charged as above), so the rerun is not counted twice.
    monkeypatch.setattr(emulator_module, "calibrate_call", lambda *args: CallCost(forward_s, backward_s + forward_s))
    fresh = ComputeEmulator(EmulationSpec("t4", 2.0, 1 << 30))
    fresh.instrument(blocks, names=["a", "b"])
    fresh.recomputed = frozenset({id(blocks[0])})
    blocks[1](blocks[0](x)).sum().backward()
    kept = {k: (c.forward_s_per_sample, c.backward_s_per_sample) for k, c in fresh.calibrated_costs.items()}
    assert kept == {key("a"): pytest.approx((forward_s, backward_s)), key("b"): pytest.approx((forward_s, backward_s + forward_s))}


def test_nested_modules_are_refused_and_the_cover_has_no_nesting() -> None:
    class Gpt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.body = nn.Module()
            self.body.blocks = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32) for _ in range(3))
            self.body.act = nn.GELU()
            self.norm = nn.LayerNorm(16)
            self.head = nn.Linear(16, 50)

    model = Gpt()
    assert emulated_modules(model) == [model.embed, *model.body.blocks, model.norm, model.head]
    with pytest.raises(ZorseUserError, match="must not contain one another"):
        ComputeEmulator(EmulationSpec("t4", 3.0, 1 << 30)).instrument([model.body, model.body.blocks[0]])


def test_blocks_are_those_the_cut_finds_and_an_encoder_decoder_is_emulated_whole() -> None:
    class EncoderDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.encoder = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
            self.decoder = nn.ModuleList(nn.LayerNorm(16) for _ in range(2))
            self.head = nn.Linear(16, 50)

    model = EncoderDecoder()
    # Two equally long lists of different classes: the cut refuses the model, so no part is a block.
    assert emulated_modules(model) == [model.embed, model.encoder, model.decoder, model.head]
    # Named by the user (ZorseStrategy(block_path=...)), the chain is the cut's and the stage's blocks are
    # emulated one by one, so each stage pays for its own.
    named = named_emulated_modules(model, "decoder")
    assert [m for _, m in named] == [model.embed, model.encoder, *model.decoder, model.head]
    assert [n for n, _ in named] == ["embed", "encoder", "decoder.0", "decoder.1", "head"]
    model.decoder.append(nn.LayerNorm(16))
    assert emulated_modules(model) == [model.embed, model.encoder, *model.decoder, model.head]


# -- memory --------------------------------------------------------------------------------


def _memory_case(budget_bytes: int) -> tuple[nn.Module, ComputeEmulator, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(32, 64), nn.ReLU())
    emulator = ComputeEmulator(EmulationSpec("t4", 3.0, budget_bytes), rank=2)
    emulator.instrument([module])
    optimizer = torch.optim.Adam(module.parameters())
    emulator.track_memory(module, [optimizer])
    module(torch.randn(10, 32, requires_grad=True)).sum().backward()
    optimizer.step()  # Adam state now exists; gradients are kept
    emulator.check_memory()
    return module, emulator, optimizer


PARAM_BYTES = (64 * 32 + 64) * FLOAT_BYTES
ADAM_BYTES = 2 * PARAM_BYTES + 2 * FLOAT_BYTES  # exp_avg, exp_avg_sq, and a float32 `step` per parameter
SAVED_BYTES = 10 * 32 * FLOAT_BYTES + 10 * 64 * FLOAT_BYTES  # Linear keeps its input, ReLU its output


def test_bytes_held_match_a_hand_count() -> None:
    module, emulator, _ = _memory_case(1 << 30)
    x = torch.randn(10, 32, requires_grad=True)
    out = module(x)
    held = emulator.memory_breakdown()
    assert (held.parameter_bytes, held.gradient_bytes) == (PARAM_BYTES, PARAM_BYTES)
    assert held.optimizer_state_bytes == ADAM_BYTES
    assert held.activation_bytes == SAVED_BYTES  # the weight Linear saves is a parameter: counted once
    assert emulator.memory_bytes_now() == 2 * PARAM_BYTES + ADAM_BYTES + SAVED_BYTES
    assert emulator.peak_memory_bytes == 2 * PARAM_BYTES + ADAM_BYTES + SAVED_BYTES
    out.sum().backward()
    assert emulator.memory_breakdown().activation_bytes == 0  # autograd freed what it saved


def test_the_checks_inside_calls_see_gradients_and_optimizer_state_come_and_go() -> None:
    """The per-call check reuses the last count of the training state only while it cannot have changed."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(32, 64), nn.ReLU())
    emulator = ComputeEmulator(EmulationSpec("t4", 3.0, 1 << 30))
    emulator.instrument([module])
    optimizer = torch.optim.Adam(module.parameters())
    emulator.track_memory(module, [optimizer])
    emulator.check_memory()
    module(torch.randn(10, 32, requires_grad=True)).sum().backward()  # its backward's check counts the gradients
    assert emulator.peak_memory_breakdown.gradient_bytes == PARAM_BYTES
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    held = emulator.check_memory(recount=False)
    assert (held.gradient_bytes, held.optimizer_state_bytes) == (0, ADAM_BYTES)
    assert held == emulator.check_memory()  # the same as a full count


def test_budget_exceeded_raises_a_clear_error() -> None:
    budget = 2 * PARAM_BYTES + ADAM_BYTES + SAVED_BYTES - 1  # the training state fits, one more forward does not
    module, emulator, _ = _memory_case(budget)
    with pytest.raises(EmulatedOutOfMemoryError) as raised:
        module(torch.randn(10, 32, requires_grad=True))
    message = str(raised.value)
    assert isinstance(raised.value, RuntimeError)
    assert "t4 (rank 2)" in message and f"budget is {budget} bytes" in message
    assert f"holds {budget + 1} bytes" in message and "smaller microbatch" in message
    assert "memory_gib" in message


# -- across ranks --------------------------------------------------------------------------


def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    module = _mlp(128)
    emulator = ComputeEmulator(EmulationSpec("x", (3.0, 6.0)[rank], 1 << 30), rank=rank)
    emulator.instrument([module])
    x = torch.randn(16, 128, requires_grad=True)
    module(x).sum().backward()  # calibrates
    emulator.agree_costs()
    dist.barrier()
    before, start = emulator.emulated_compute_s, time.perf_counter()
    for _ in range(5):
        module(x).sum().backward()
    wall = time.perf_counter() - start
    record = dict(
        costs={k: [c.forward_s_per_sample, c.backward_s_per_sample] for k, c in emulator.calibrated_costs.items()},
        emulated_s=emulator.emulated_compute_s - before, wall_s=wall, overruns=emulator.overruns,
    )
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def test_agreed_costs_make_emulated_time_proportional_to_slowdown(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_two_rank_worker, args=(port, str(tmp_path)), nprocs=2, start_method=start_method())
    fast, slow = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert fast["costs"] == slow["costs"]  # one cost, agreed: the ratio is the slowdowns' ratio exactly
    assert slow["emulated_s"] / fast["emulated_s"] == pytest.approx(2.0, rel=1e-9)
    print(f"measured wall ratio slow/fast: {slow['wall_s'] / fast['wall_s']:.4f}, overruns {fast['overruns']}, {slow['overruns']}")


# -- Lightning -----------------------------------------------------------------------------


class _TinyGpt(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(64, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.randint(0, 32, (24, 9), generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(data, batch_size=8)


class _MemoryLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, float] = {}

    name, version = "memory", 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.update(metrics)

    def log_hyperparams(self, params: object) -> None:
        pass


def _fit(callbacks: list, logger: Logger | bool = False) -> _TinyGpt:
    torch.manual_seed(0)
    model = _TinyGpt()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=logger, callbacks=callbacks,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model)
    return model


def test_callback_emulates_the_rank_under_a_one_process_trainer() -> None:
    callback, logger = EmulateCluster(ONE_T4), _MemoryLogger()
    model = _fit([callback], logger)
    reference = _fit([])
    for p, p_ref in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, p_ref)  # emulation changes time and accounting, never the math
    emulator = callback.emulator
    assert emulator.spec == EmulationSpec("t4", 3.0, int(0.16 * BYTES_PER_GIB))
    assert len(emulator.calibrated_costs) == 5  # embed, 3 blocks, head
    assert emulator.calls == 3 * 5 * 2  # 3 steps, 5 modules, forward and backward
    assert emulator.approximate_backwards == 3  # the embedding has no differentiable input
    params = sum(p.numel() for p in model.parameters()) * FLOAT_BYTES
    steps = len(list(model.parameters())) * FLOAT_BYTES  # Adam's float32 `step`, one per parameter tensor
    peak = emulator.peak_memory_breakdown
    assert (peak.parameter_bytes, peak.gradient_bytes, peak.optimizer_state_bytes) == (
        params, params, 2 * params + steps
    )
    assert logger.metrics == {"emulation/peak_memory_bytes/rank0": float(emulator.peak_memory_bytes)}
    assert all(m._forward_pre_hooks == {} for m in emulated_modules(model))  # removed at teardown


def test_callback_refuses_a_cluster_of_another_size() -> None:
    with pytest.raises(InventoryError, match="lists 4 GPUs but the Trainer runs 1"):
        _fit([EmulateCluster("cpu_sim4")])


# -- accelerator ---------------------------------------------------------------------------


class _ClusterStrategy(DDPStrategy):
    """What ZorseStrategy does: no accelerator of its own, and Lightning's final choice resolved."""

    def __init__(self, cluster: object) -> None:
        super().__init__()
        self.inventory = load_cluster(cluster)

    @property
    def accelerator(self):  # noqa: ANN201
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator) -> None:  # noqa: ANN001
        self._accelerator = resolve_accelerator(None, accelerator, self.inventory)


@pytest.mark.parametrize("flag", ["cpu", "auto", "zorse"])
def test_accelerator_is_picked_whatever_the_flag(flag: str) -> None:
    register_with_lightning()
    trainer = pl.Trainer(strategy=_ClusterStrategy(ONE_T4), accelerator=flag, devices=1, logger=False)
    accelerator = trainer.accelerator
    assert isinstance(accelerator, ZorseCPUAccelerator)
    rank = accelerator.describe_rank(global_rank=0, local_rank=0)
    assert (rank.device, rank.gpu_type.name) == (torch.device("cpu"), "t4")
    assert rank.emulation == EmulationSpec("t4", 3.0, int(0.16 * BYTES_PER_GIB))


def test_accelerator_describes_every_emulated_rank_and_refuses_cuda_for_emulated_clusters() -> None:
    inventory = load_cluster("cpu_sim4")
    accelerator = resolve_accelerator(None, "cpu", inventory)
    ranks = [accelerator.describe_rank(r, r) for r in range(4)]
    assert [r.gpu_type.name for r in ranks] == ["a100x40", "v100x16", "t4", "t4"]
    assert [r.emulation for r in ranks] == [emulation_spec_for_rank(inventory, r) for r in range(4)]
    assert resolve_accelerator(None, accelerator, inventory) is accelerator
    with pytest.raises(ZorseUserError, match="cluster 'cpu_sim4' is emulated"):
        resolve_accelerator(None, "gpu", inventory)
    with pytest.raises(ZorseUserError, match="accelerator='mps' is not supported"):
        resolve_accelerator(None, "mps", inventory)

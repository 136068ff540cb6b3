"""The parts of a step outside the block list, the user's optimizer and the engine's time per action, timed
at start-up (single process, a fake clock)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zorse_lightning.module.blocks import find_block_list
from zorse_lightning.profiling import timing
from zorse_lightning.startup import step_costs
from zorse_lightning.strategy.trainer_inputs import user_optimizer


class _Clock:
    """perf_counter in seconds, advanced only by the modules below: exact timings."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class _Advance(torch.autograd.Function):
    """Identity that advances the clock by its forward and backward cost per sample."""

    @staticmethod
    def forward(ctx, x, clock, forward_ms, backward_ms):
        clock.now_s += forward_ms * x.shape[0] / 1e3
        ctx.clock, ctx.cost_s = clock, backward_ms * x.shape[0] / 1e3
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.now_s += ctx.cost_s
        return grad, None, None, None


class _Costs(nn.Module):
    """Advances the clock by ``ms_per_sample`` per sample of its input forward, twice that backward."""

    def __init__(self, clock: _Clock, ms_per_sample: float) -> None:
        super().__init__()
        self.clock, self.ms_per_sample, self.scale = clock, ms_per_sample, nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Advance.apply(x * self.scale, self.clock, self.ms_per_sample, 2 * self.ms_per_sample)


class _Model(nn.Module):
    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self.embed = _Costs(clock, 3.0)
        self.blocks = nn.ModuleList([_Costs(clock, 100.0) for _ in range(3)])
        self.head = _Costs(clock, 5.0)
        self.clock = clock

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        x = self.embed(batch * 1.0)  # a tensor of the microbatch's own (a slice shares the batch's storage)
        for block in self.blocks:
            x = block(x)
        loss = self.head(x).sum()
        self.clock.now_s += 0.5e-3  # the loss and the step's own Python: once per call
        return loss


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(timing.time, "perf_counter", fake)
    return fake


def test_edges_are_timed_forward_and_backward_with_gradients_at_every_size(clock):
    model = _Model(clock)
    edges = step_costs.measure_step_edges(model.step, find_block_list(model), torch.ones(4, 2), torch.device("cpu"), (1, 2, 4))
    assert edges.sizes == (1, 2, 4)
    assert edges.embedding.forward.measured_ms == pytest.approx((3.0, 6.0, 12.0))
    assert edges.embedding.backward.measured_ms == pytest.approx((6.0, 12.0, 24.0))  # timed, not forward x 2 guessed
    assert edges.head.forward.measured_ms == pytest.approx((5.5, 10.5, 20.5))
    assert edges.head.backward.measured_ms == pytest.approx((10.0, 20.0, 40.0))
    assert edges.head.forward.at(4) == pytest.approx(20.5) and edges.head.forward.measured_sizes == (1, 2, 4)
    assert all(p.grad is None for p in model.parameters())  # put back


def test_what_the_first_block_does_at_the_end_of_its_backward_is_not_the_edges(clock):
    """An emulated block routes its input through a node whose backward sleeps to the block's deadline,
    after the gradient has passed the block: hooked before the step-edge probe, as the emulator is, that
    time once counted as the embedding's backward (+10 % on every emulated cluster's prediction)."""
    model = _Model(clock)

    def route_through_a_deadline(_module, args):
        return (_Advance.apply(args[0], clock, 0.0, 50.0),)

    model.blocks[0].register_forward_pre_hook(route_through_a_deadline)
    edges = step_costs.measure_step_edges(model.step, find_block_list(model), torch.ones(2, 2), torch.device("cpu"), (1, 2))
    assert edges.embedding.backward.measured_ms == pytest.approx((6.0, 12.0))


def test_edges_count_what_they_save_for_backward(clock):
    model = _Model(clock)
    edges = step_costs.measure_step_edges(model.step, find_block_list(model), torch.ones(4, 2), torch.device("cpu"), (1, 2))
    assert edges.embedding_activation_bytes[0] > 0 and edges.head_activation_bytes[0] > 0


def test_a_one_sample_batch_is_timed_at_one_sample_only(clock):
    model = _Model(clock)
    edges = step_costs.measure_step_edges(model.step, find_block_list(model), torch.ones(1, 2), torch.device("cpu"), (1,))
    assert edges.head.forward.measured_ms == pytest.approx((5.5,))


def test_the_action_overhead_is_the_step_with_every_block_passing_on(clock):
    model = _Model(clock)
    ms = step_costs.measure_action_overhead_ms(model.step, find_block_list(model), torch.ones(4, 2), torch.device("cpu"))
    assert ms == pytest.approx(3.0 + 5.0 + 0.5)  # no block's 100 ms: they pass their input on
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_the_optimizer_timed_is_the_users_own_class_and_settings():
    shapes = [nn.Parameter(torch.zeros(64, 32)), nn.Parameter(torch.zeros(32))]
    adamw = step_costs.measure_optimizer(lambda p: torch.optim.AdamW(p, lr=1e-3), shapes, torch.device("cpu"))
    sgd = step_costs.measure_optimizer(lambda p: torch.optim.SGD(p, lr=0.1), shapes, torch.device("cpu"))
    assert adamw.profile.name == "torch.optim.adamw.AdamW" and sgd.profile.name == "torch.optim.sgd.SGD"
    assert adamw.profile.state_bytes_per_parameter == pytest.approx(8.0)  # two float32 moments
    assert sgd.profile.state_bytes_per_parameter == 0.0
    assert adamw.ms_per_million_parameters > 0 and sgd.ms_per_million_parameters > 0
    foreach = step_costs.measure_optimizer(lambda p: torch.optim.AdamW(p, foreach=True), shapes, torch.device("cpu"))
    assert foreach.profile.step_bytes_per_parameter == pytest.approx(4.0)  # one float32 copy of the group


def test_the_factory_takes_the_strategy_optimizers_class_and_settings():
    params = [nn.Parameter(torch.zeros(3))]
    given = torch.optim.SGD(params, lr=0.25, momentum=0.5)
    module = SimpleNamespace(trainer=SimpleNamespace(strategy=SimpleNamespace(optimizers=[given])))
    made = user_optimizer(module)([nn.Parameter(torch.zeros(2))])
    assert type(made) is torch.optim.SGD
    assert made.param_groups[0]["lr"] == 0.25 and made.param_groups[0]["momentum"] == 0.5
    adamw = torch.optim.AdamW(params, lr=0.01, weight_decay=0.3, betas=(0.8, 0.9))
    module.trainer.strategy.optimizers = [adamw]
    made = user_optimizer(module)([nn.Parameter(torch.zeros(2))])
    assert type(made) is torch.optim.AdamW and made.param_groups[0]["weight_decay"] == 0.3
    assert made.param_groups[0]["betas"] == (0.8, 0.9)

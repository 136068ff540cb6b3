"""The parts of a step outside the block list, timed at start-up (single process, a fake clock)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zorse_lightning.module.blocks import find_block_list
from zorse_lightning.startup import step_costs


class _Clock:
    """perf_counter in seconds, advanced only by the modules below: exact timings."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class _Costs(nn.Module):
    """Advances the clock by ``ms_per_sample`` per sample of its input."""

    def __init__(self, clock: _Clock, ms_per_sample: float) -> None:
        super().__init__()
        self.clock, self.ms_per_sample, self.scale = clock, ms_per_sample, nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now_s += self.ms_per_sample * x.shape[0] / 1e3
        return x * self.scale


class _Model(nn.Module):
    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self.embed = _Costs(clock, 3.0)
        self.blocks = nn.ModuleList([_Costs(clock, 100.0) for _ in range(3)])
        self.head = _Costs(clock, 5.0)
        self.clock = clock

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        x = self.embed(batch)
        for block in self.blocks:
            x = block(x)
        loss = self.head(x).sum()
        self.clock.now_s += 0.5e-3  # the loss and the step's own Python: once per call
        return loss


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(step_costs.time, "perf_counter", fake)
    return fake


def test_edges_are_what_the_step_spends_before_the_first_block_and_after_the_last(clock):
    model = _Model(clock)
    edges = step_costs.measure_step_edges(model.step, find_block_list(model), torch.ones(4, 2), torch.device("cpu"))
    assert edges.embedding.forward.measured_ms == pytest.approx((3.0, 6.0))
    assert edges.head.forward.measured_ms == pytest.approx((5.5, 10.5))
    assert (edges.head.forward.slope_ms, edges.head.forward.intercept_ms) == pytest.approx((5.0, 0.5))
    assert edges.head.backward.measured_ms == pytest.approx((11.0, 21.0))  # BACKWARD_OVER_FORWARD x forward
    assert edges.embedding.backward.at(4) == pytest.approx(24.0)


def test_a_one_sample_batch_is_timed_at_one_sample_only(clock):
    model = _Model(clock)
    edges = step_costs.measure_step_edges(model.step, find_block_list(model), torch.ones(1, 2), torch.device("cpu"))
    assert edges.head.forward.measured_ms == pytest.approx((5.5,))


def test_the_optimizer_rate_is_per_million_parameters(clock, monkeypatch):
    steps = []

    def step(self, closure=None):
        steps.append(self)
        clock.now_s += 2e-3  # 2 ms for 2**20 parameters

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    rate = step_costs.measure_optimizer_ms_per_million_parameters(torch.device("cpu"))
    assert rate == pytest.approx(2.0 * 1e6 / 2**20)
    assert len(steps) == 4  # one warm-up, three timed

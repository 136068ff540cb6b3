"""One calibration for profile and run: fixed calibration size, names as keys, minimum over ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zorse_lightning.emulation.coverage import named_emulated_modules
from zorse_lightning.emulation.emulator import ComputeEmulator
from zorse_lightning.emulation.spec import EmulationSpec
from zorse_lightning.emulation.calibration import calibrate_in_turn, calibrate_modules, cost_key, min_costs
from zorse_lightning.emulation.timing import CALIBRATION_SAMPLES, CallCost, CALIBRATION_REPEATS
from zorse_lightning.models.gpt import GPT


class _Recorder(nn.Module):
    """A linear layer that records the batch size of every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.sizes.append(x.shape[0])
        return self.linear(x)


def test_calibration_runs_at_the_fixed_size_whatever_the_first_call() -> None:
    for first_call in (1, 3, 8, 11):
        module = _Recorder()
        costs = calibrate_modules([("layer", module)], lambda: module(torch.randn(first_call, 4)))
        calibration_sizes = module.sizes[:-1]  # the last forward is the real call
        assert calibration_sizes == [CALIBRATION_SAMPLES] * (CALIBRATION_REPEATS + 1)
        assert module.sizes[-1] == first_call
        assert list(costs) == [cost_key("layer", "(4,):torch.float32")]


class _BatchTimesHeads(nn.Module):
    """As Bloom's attention: a bias whose dim 0 folds the batch with the heads, so resizing dim 0 of the
    activation alone breaks the call."""

    HEADS = 3

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.sizes: list[int] = []

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        self.sizes.append(x.shape[0])
        per_head = self.linear(x).repeat_interleave(self.HEADS, dim=0)  # (batch x heads, 4)
        return (per_head + bias).reshape(x.shape[0], self.HEADS, 4).sum(1)


def test_a_call_that_breaks_when_resized_is_calibrated_as_it_came() -> None:
    module = _BatchTimesHeads()
    costs = calibrate_modules(
        [("layer", module)], lambda: module(torch.randn(1, 4), bias=torch.zeros(_BatchTimesHeads.HEADS, 4)),
        batch_samples=1,
    )
    assert module.sizes[-(CALIBRATION_REPEATS + 2):] == [1] * (CALIBRATION_REPEATS + 2)  # as it came, then real
    (cost,) = costs.values()
    assert cost.forward_s_per_sample > 0 and cost.backward_s_per_sample > 0


def test_preloaded_costs_are_used_without_recalibrating() -> None:
    module = _Recorder()
    key = cost_key("blocks.3", "(4,):torch.float32")
    emulator = ComputeEmulator(EmulationSpec("t4", 2.0, 1 << 30), costs={key: CallCost(1e-4, 2e-4)})
    emulator.instrument([module], names=["blocks.3"])
    module(torch.randn(5, 4, requires_grad=True)).sum().backward()
    assert module.sizes == [5]  # the real call only
    assert emulator.calibrated_costs == {key: CallCost(1e-4, 2e-4)}
    assert emulator.emulated_compute_s == pytest.approx(2.0 * 5 * 3e-4)
    emulator.remove()


def test_names_are_the_modules_names_in_the_whole_model() -> None:
    model = GPT(vocab_size=16, seq_len=8, width=16, layers=3, heads=2)
    named = named_emulated_modules(model)
    assert [n for n, _ in named] == ["tok_emb", "pos_emb", "blocks.0", "blocks.1", "blocks.2", "ln_f", "head"]
    assert all(model.get_submodule(n) is m for n, m in named)


def test_minimum_per_key_over_ranks_and_one_process_calibrates_alone() -> None:
    a = {"x|s": CallCost(1.0, 4.0), "y|s": CallCost(2.0, 2.0)}
    b = {"x|s": CallCost(3.0, 1.0)}
    assert min_costs([a, None, b]) == {"x|s": CallCost(1.0, 1.0), "y|s": CallCost(2.0, 2.0)}
    module = _Recorder()
    costs = calibrate_in_turn([("only", module)], lambda: module(torch.randn(2, 4)))  # no process group
    assert list(costs) == [cost_key("only", "(4,):torch.float32")]

"""The one timing harness (warm-up until the time settles, repeats, medians per phase), and profiles taken
in the precision that trains."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zorse_lightning.errors import PlanningError
from zorse_lightning.profiling import timing
from zorse_lightning.profiling.measure import MeasureOptions, measure_block_calls
from zorse_lightning.startup.device_profile import training_dtypes
from testing.stateful import RecurrentLayer


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(timing.time, "perf_counter", fake)
    return fake


def test_warm_up_lasts_until_the_time_settles_then_the_median_of_each_phase_is_kept(clock):
    durations = iter([50.0, 20.0, 9.0, 5.0, 5.1, 4.0, 6.0, 5.0])  # first-call costs fade, then noise
    runs = []

    def run(marks: timing.PhaseMarks) -> None:
        ms = next(durations)
        clock.now_s += ms / 2 / 1e3
        marks.mark()
        clock.now_s += ms / 2 / 1e3
        runs.append(ms)

    first, second = timing.time_phases(run, torch.device("cpu"), 2, timing.TimingOptions(repeats=3))
    assert runs[:5] == [50.0, 20.0, 9.0, 5.0, 5.1]  # warmed up until two runs agreed within 10 %
    assert len(runs) == 8
    assert (first, second) == pytest.approx((2.5, 2.5))  # medians of 4, 6, 5 halved


def test_warm_up_stops_at_its_cap_on_a_time_that_never_settles(clock):
    count = [0]

    def run(marks: timing.PhaseMarks) -> None:
        count[0] += 1
        clock.now_s += count[0] ** 2 / 1e3

    timing.time_ms(lambda: run(None), torch.device("cpu"), timing.TimingOptions(max_warmup=4, repeats=1))
    assert count[0] == 5


def test_a_run_that_marks_the_wrong_number_of_phases_is_refused(clock):
    with pytest.raises(PlanningError, match="marked 0 phase boundaries; it must mark 1"):
        timing.time_phases(lambda marks: None, torch.device("cpu"), 2, timing.TimingOptions(repeats=1))


def _bf16() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)


def _block_and_calls():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    calls = {b: ((torch.randn(b, 8, 64),), {}) for b in (1, 2, 4)}
    return block, calls


def test_a_profile_under_bf16_autocast_records_bf16_and_differs_from_the_fp32_one():
    block, calls = _block_and_calls()
    assert training_dtypes(_bf16, block, torch.device("cpu")) == ("bfloat16", "float32")
    options = MeasureOptions(warmup=1, repeats=1)
    computed, _ = training_dtypes(_bf16, block, torch.device("cpu"))
    mixed = measure_block_calls(block, calls, device=torch.device("cpu"), gpu_type="cpu", options=options,
                                forward_context=_bf16, dtype=computed)
    plain = measure_block_calls(block, calls, device=torch.device("cpu"), gpu_type="cpu", options=options)
    assert (mixed.dtype, plain.dtype) == ("bfloat16", "float32")
    # autocast keeps a bf16 copy of both weights for backward, once per microbatch: the intercept
    weights = sum(p.numel() for n, p in block.named_parameters() if n.endswith("weight"))
    assert mixed.layers[0].activation_bytes_per_microbatch >= 2 * weights
    assert plain.layers[0].activation_bytes_per_microbatch == 0
    assert mixed.layers[0].activation_bytes_per_sample != plain.layers[0].activation_bytes_per_sample
    assert mixed.times.layers[0].forward.measured_sizes == (1, 2, 4)


def test_profiling_runs_a_layer_from_its_own_state_and_leaves_it_as_it_was():
    """Each timed run starts from the state the layer holds, not the last run's (whose graph that run's
    backward freed), and the real call after profiling finds its own."""
    torch.manual_seed(0)
    block, held = RecurrentLayer(64), torch.zeros(1, 8, 64)
    block.state = held
    calls = {b: ((torch.randn(b, 8, 64),), {}) for b in (1, 2)}
    measure_block_calls(block, calls, device=torch.device("cpu"), gpu_type="cpu", options=MeasureOptions(warmup=1, repeats=2))
    assert block.state is held


class _ViewsItsWeight(nn.Module):
    """Passes a view of its weight to a submodule, as Mamba passes its convolution's to the kernel's fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.weight, self.inner = nn.Parameter(torch.randn(64, 64)), nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.inner(self.weight.view(64, 64))


def test_a_block_passing_a_view_of_its_weight_to_a_submodule_is_profiled_with_its_flops():
    calls = {b: ((torch.randn(b, 8, 64),), {}) for b in (1, 2)}
    measured = measure_block_calls(_ViewsItsWeight(), calls, device=torch.device("cpu"), gpu_type="cpu",
                                   options=MeasureOptions(warmup=1, repeats=1))
    assert measured.layers[0].forward_flops_per_sample == 2 * 8 * 64 * 64


def test_sizes_stop_at_the_first_that_does_not_fit():
    block, calls = _block_and_calls()
    original = block.forward

    def limited(x):
        if x.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (as a GPU would say)")
        return original(x)

    block.forward = limited
    measured = measure_block_calls(block, calls, device=torch.device("cpu"), gpu_type="cpu",
                                   options=MeasureOptions(warmup=1, repeats=1))
    assert measured.times.layers[0].forward.measured_sizes == (1, 2)
    block.forward = lambda x: (_ for _ in ()).throw(torch.OutOfMemoryError("no room"))
    with pytest.raises(PlanningError, match="a microbatch of 1 sample"):
        measure_block_calls(block, calls, device=torch.device("cpu"), gpu_type="cpu", options=MeasureOptions(1, 1))

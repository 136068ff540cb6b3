"""Choosing the precision of a plan, and loss scaling that leaves the update unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from zorse_lightning.cluster.catalog import DEFAULT_CATALOG
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.errors import ZorseUserError
from zorse_lightning.strategy.precision import (
    DynamicLossScale,
    PrecisionChoice,
    PrecisionMode,
    ZorsePrecision,
    choose_precision,
    resolve_precision,
)

CPU_SIM4 = [gpu.gpu_type for gpu in load_cluster("cpu_sim4").gpus]  # a100x40, v100x16, t4, t4
ALL_A100 = [DEFAULT_CATALOG.get("a100x40")] * 4


def test_choice_follows_what_every_gpu_supports() -> None:
    assert choose_precision(ALL_A100, "cuda").mode is PrecisionMode.BF16
    mixed = choose_precision(CPU_SIM4, "cuda")
    assert mixed.mode is PrecisionMode.FP16  # V100 and T4 lack bf16: fp16 with loss scaling for everyone
    assert "t4, v100x16 lack bf16" in mixed.reason
    assert mixed.note.startswith("precision 16-mixed: ")
    for types in (CPU_SIM4, ALL_A100):  # CPU ranks, emulated or not, stay float32
        assert choose_precision(types, "cpu").mode is PrecisionMode.FP32


def test_resolved_plugins_autocast_and_scale_as_chosen() -> None:
    plugin, choice = resolve_precision("auto", Precision(), CPU_SIM4, "cuda")
    assert (choice.mode, plugin.autocast_dtype, plugin.loss_scale_value) == (PrecisionMode.FP16, torch.float16, 2.0**16)
    plugin, choice = resolve_precision("auto", Precision(), ALL_A100, "cuda")
    assert (choice.mode, plugin.autocast_dtype, plugin.loss_scale) == (PrecisionMode.BF16, torch.bfloat16, None)
    plugin, choice = resolve_precision("auto", Precision(), CPU_SIM4, "cpu")
    assert (choice.mode, plugin.autocast_dtype, plugin.loss_scale_value) == (PrecisionMode.FP32, None, 1.0)
    with pytest.raises(ZorseUserError, match=r"GPU types \['t4', 'v100x16'\] of this cluster lack bf16"):
        resolve_precision("bf16-mixed", Precision(), CPU_SIM4, "cuda")
    with pytest.raises(ZorseUserError, match=r"precision='fp8'\) is not supported"):
        resolve_precision("fp8", Precision(), CPU_SIM4, "cpu")


LIGHTNING_PLUGINS = {
    "32-true": Precision(),
    "bf16-mixed": MixedPrecision("bf16-mixed", "cuda"),
    "16-mixed": MixedPrecision("16-mixed", "cuda", scaler=object()),  # its scaler is never used: the flag is read
    "bf16-true": HalfPrecision("bf16-true"),
    "16-true": HalfPrecision("16-true"),
    "64-true": DoublePrecision(),
}


@pytest.mark.parametrize("flag", sorted(LIGHTNING_PLUGINS))
def test_the_trainers_precision_is_what_trains(flag: str) -> None:
    """Would catch the strategy's own choice replacing the Trainer's flag (bf16 on an H100 where fp32 was
    asked for, or said nothing: Lightning's default is fp32), as before 2026-11-26."""
    plugin, choice = resolve_precision(None, LIGHTNING_PLUGINS[flag], ALL_A100, "cuda")
    assert choice.mode.value == flag and plugin.mode.value == flag
    assert choice.note == f"precision {flag}: the Trainer's precision"


def test_true_half_and_double_modes_cast_weights_inputs_and_new_tensors() -> None:
    plugin, _ = resolve_precision(None, HalfPrecision("bf16-true"), ALL_A100, "cpu")
    layer = plugin.convert_module(nn.Linear(4, 4))
    assert layer.weight.dtype == torch.bfloat16 and plugin.autocast_dtype is None
    assert plugin.convert_input(torch.ones(2)).dtype == torch.bfloat16
    assert plugin.convert_input(torch.ones(2, dtype=torch.int64)).dtype == torch.int64  # token ids stay
    with plugin.forward_context():
        assert torch.zeros(1).dtype == torch.bfloat16
    assert torch.zeros(1).dtype == torch.float32
    double, _ = resolve_precision(None, DoublePrecision(), ALL_A100, "cpu")
    assert double.convert_module(nn.Linear(2, 2)).weight.dtype == torch.float64


def test_a_mode_some_gpu_type_cannot_run_is_an_error_naming_it_never_a_silent_change() -> None:
    for flag in ("bf16-mixed", "bf16-true"):
        with pytest.raises(ZorseUserError, match=rf"precision='{flag}'.*\['t4', 'v100x16'\].*lack bf16"):
            resolve_precision(None, LIGHTNING_PLUGINS[flag], CPU_SIM4, "cuda")
    plugin, _ = resolve_precision(None, LIGHTNING_PLUGINS["16-mixed"], CPU_SIM4, "cuda")
    assert plugin.loss_scale is not None  # fp16 autocast scales the loss, agreed over the stages


def test_auto_and_explicit_modes_must_agree_with_a_trainer_flag() -> None:
    plugin, choice = resolve_precision("auto", LIGHTNING_PLUGINS["bf16-mixed"], ALL_A100, "cuda")
    assert choice.mode is PrecisionMode.BF16 and choice.reason.startswith("chosen")
    with pytest.raises(ZorseUserError, match=r"precision given twice: Trainer\(precision='bf16-mixed'\)"):
        resolve_precision("auto", LIGHTNING_PLUGINS["bf16-mixed"], CPU_SIM4, "cuda")  # auto picks 16-mixed
    with pytest.raises(ZorseUserError, match="precision given twice"):
        resolve_precision("32-true", LIGHTNING_PLUGINS["16-true"], ALL_A100, "cuda")
    plugin, choice = resolve_precision("32-true", Precision(), ALL_A100, "cuda")  # Lightning's default: no clash
    assert choice == PrecisionChoice(PrecisionMode.FP32, "asked for")


class _WeightCasts(TorchDispatchMode):
    """Counts casts of a (64, 64) tensor to bfloat16: autocast casting the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == (64, 64):
            self.casts += kwargs.get("dtype") == torch.bfloat16
        return func(*args, **kwargs)


def test_autocast_casts_weights_once_per_step_unless_gathered_per_microbatch() -> None:
    """Would catch ``cache_enabled=False`` where weights persist: every microbatch casting every weight again
    (Lightning's ``MixedPrecision`` casts once per step)."""
    layer = nn.Linear(64, 64)
    plugin = ZorsePrecision(torch.bfloat16, "cpu")
    casts = {}
    for cache in (True, False):
        plugin.cache_weights = cache
        with plugin.forward_context(), _WeightCasts() as counter:
            for _ in range(4):  # four microbatches of one step, backward included
                layer(torch.randn(2, 64)).float().sum().backward()
        casts[cache] = counter.casts
    assert casts == {True: 1, False: 4}


def test_autocast_runs_matmuls_in_the_chosen_dtype() -> None:
    layer = nn.Linear(4, 4)
    with ZorsePrecision(torch.bfloat16, "cpu").forward_context():
        assert layer(torch.randn(2, 4)).dtype == torch.bfloat16
    with ZorsePrecision(None, "cpu").forward_context():
        assert layer(torch.randn(2, 4)).dtype == torch.float32


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    x, y = torch.randn(5, 8, generator=generator), torch.randn(5, 1, generator=generator)
    return nn.functional.mse_loss(model(x), y)


def test_scaled_and_unscaled_training_take_the_same_steps() -> None:
    plain, scaled = _model(), _model()
    plain_opt, scaled_opt = torch.optim.AdamW(plain.parameters(), 1e-2), torch.optim.AdamW(scaled.parameters(), 1e-2)
    scale = DynamicLossScale(scale=2.0**12, growth_interval=2)
    for step in range(5):
        _loss(plain, step).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        (_loss(scaled, step) * scale.scale).backward()
        overflowed = scale.unscale_(list(scaled.parameters()), torch.device("cpu"))
        assert not overflowed
        scale.update(overflowed)
        scaled_opt.step()
        scaled_opt.zero_grad()
    for p, q in zip(plain.parameters(), scaled.parameters()):
        assert torch.equal(p, q)  # scaling by powers of two is exact in float32
    assert (scale.scale, scale.clean_steps) == (2.0**14, 1)  # doubled after every 2 clean steps


def test_overflow_skips_the_step_and_backs_off() -> None:
    model = _model()
    before = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plugin = ZorsePrecision(None, "cpu", DynamicLossScale(scale=2.0**10), parameters=lambda: list(model.parameters()))
    plugin._after_closure = lambda model, optimizer: None  # Lightning's hooks and clipping: not under test here

    def closure() -> torch.Tensor:
        loss = _loss(model, 0)
        (loss * plugin.loss_scale_value).backward()
        model[0].weight.grad[0, 0] = float("inf")
        return loss

    plugin.optimizer_step(optimizer, model, closure)
    assert plugin.skipped_steps == 1 and plugin.loss_scale_value == 2.0**9
    for p, q in zip(model.parameters(), before.parameters()):
        assert torch.equal(p, q)
    optimizer.zero_grad()

    def clean_closure() -> torch.Tensor:
        loss = _loss(model, 0)
        (loss * plugin.loss_scale_value).backward()
        return loss

    plugin.optimizer_step(optimizer, model, clean_closure)
    expected = _model()
    _loss(expected, 0).backward()
    torch.optim.SGD(expected.parameters(), lr=0.1).step()
    for p, q in zip(model.parameters(), expected.parameters()):
        assert torch.equal(p, q)
    assert plugin.state_dict() == {"scale": 2.0**9, "clean_steps": 1}

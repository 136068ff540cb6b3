"""Precision for a plan: one mode for every rank, and loss scaling that agrees across stages.

As in Lightning, the Trainer's flag decides (``Trainer(precision="bf16-mixed")``;
Lightning's default is ``"32-true"``). One mode holds for the whole cluster,
since activations cross stages and gradients are reduced between ranks of
different types; a mode some GPU type cannot run is an error naming it, never a
silent change. ``ZorseStrategy(precision="auto")`` asks for the cluster-wide
choice instead: bf16 autocast where every GPU supports bf16 (A100/H100 class);
fp16 autocast with dynamic loss scaling where any lacks it (V100, T4); float32
on CPU ranks, emulated clusters included (emulation is about speed, not numerics).

Why not Lightning's ``MixedPrecision`` with ``torch.amp.GradScaler``: the
scaler decides per optimizer and per process whether gradients overflowed, but
in a pipeline each rank holds one stage's gradients (and, sharded, steps only
its shard), so one stage would skip the step while another takes it. Here the
verdict is reduced over all ranks, every local gradient is unscaled (the global
clipping norm needs them all), and the whole step is skipped everywhere or
nowhere. The scale follows GradScaler's rule (defaults included).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

from zorse_lightning.cluster.gpu_type import GpuType
from zorse_lightning.errors import ZorseUserError


class PrecisionMode(str, Enum):
    """Lightning's spellings."""

    FP32 = "32-true"
    BF16 = "bf16-mixed"
    FP16 = "16-mixed"
    BF16_TRUE = "bf16-true"
    FP16_TRUE = "16-true"
    FP64 = "64-true"


_AUTOCAST_DTYPE: dict[PrecisionMode, torch.dtype | None] = {
    PrecisionMode.BF16: torch.bfloat16, PrecisionMode.FP16: torch.float16
}
_PARAMETER_DTYPE: dict[PrecisionMode, torch.dtype | None] = {
    PrecisionMode.BF16_TRUE: torch.bfloat16, PrecisionMode.FP16_TRUE: torch.float16, PrecisionMode.FP64: torch.float64
}
_NEEDS_BF16 = (PrecisionMode.BF16, PrecisionMode.BF16_TRUE)


@dataclass(frozen=True)
class PrecisionChoice:
    mode: PrecisionMode
    reason: str

    @property
    def note(self) -> str:
        """The line recorded in the plan's notes."""
        return f"precision {self.mode.value}: {self.reason}"


def choose_precision(gpu_types: Iterable[GpuType], device_type: str) -> PrecisionChoice:
    """``ZorseStrategy(precision="auto")``: the fastest mode every rank supports (``device_type``: ``"cuda"``
    or ``"cpu"``)."""
    if device_type != "cuda":
        return PrecisionChoice(PrecisionMode.FP32, "chosen for CPU ranks (emulated GPUs model speed, not numerics)")
    types = {t.name: t for t in gpu_types}
    lacking = sorted(name for name, t in types.items() if not t.supports_bf16)
    if not lacking:
        return PrecisionChoice(PrecisionMode.BF16, f"chosen: every GPU type ({', '.join(sorted(types))}) supports bf16")
    return PrecisionChoice(PrecisionMode.FP16, f"chosen: {', '.join(lacking)} lack bf16: fp16 with dynamic loss scaling")


def check_requested(mode: PrecisionMode, gpu_types: Iterable[GpuType], device_type: str) -> None:
    """A mode the user asked for must run on every rank."""
    lacking = sorted({t.name for t in gpu_types if not t.supports_bf16})
    if mode in _NEEDS_BF16 and device_type == "cuda" and lacking:
        half = "16-mixed" if mode is PrecisionMode.BF16 else "16-true"
        raise ZorseUserError(
            f"precision={mode.value!r} was asked for, but the GPU types {lacking} of this cluster lack bf16; "
            f"use precision={half!r} or ZorseStrategy(precision='auto'), which picks fp16 with loss scaling"
        )


@dataclass
class DynamicLossScale:
    """GradScaler's rule: halve on overflow, double after ``growth_interval`` clean steps."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    clean_steps: int = 0

    def unscale_(self, parameters: Sequence[torch.nn.Parameter], device: torch.device, group: Any = None) -> bool:
        """Divide gradients by the scale; True when any rank of ``group`` saw inf or NaN (collective).

        The verdict is a tensor on ``device``, the rank's own, even on a rank with no
        gradient (idle, or its stage holds none): NCCL refuses a host tensor.
        """
        grads = [p.grad for p in parameters if p.grad is not None]
        found = torch.zeros((), device=device)
        for grad in grads:
            found = torch.maximum(found, (~torch.isfinite(grad)).any().float())
            grad.mul_(1.0 / self.scale)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item())

    def update(self, overflowed: bool) -> None:
        if overflowed:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


class ZorsePrecision(Precision):
    """Autocast to ``autocast_dtype`` (None: none), weights in ``parameter_dtype`` (``"bf16-true"``,
    ``"16-true"``, ``"64-true"``, as Lightning's ``HalfPrecision``/``DoublePrecision``; None: as built) and,
    with ``loss_scale``, agreed dynamic loss scaling.

    ``parameters`` gives this rank's parameters (the engine's, once the model is
    cut). The strategy multiplies the backward of the schedule by
    :attr:`loss_scale_value`; :meth:`optimizer_step` unscales after the
    gradients are reduced and before clipping, then steps unless any rank overflowed.
    """

    def __init__(
        self,
        autocast_dtype: torch.dtype | None,
        device_type: str,
        loss_scale: DynamicLossScale | None = None,
        parameters: Callable[[], Sequence[torch.nn.Parameter]] | None = None,
        device: torch.device | None = None,
        parameter_dtype: torch.dtype | None = None,
    ) -> None:
        self.autocast_dtype = autocast_dtype
        self.parameter_dtype = parameter_dtype
        self.cache_weights = True
        """Autocast keeps each weight's low-precision copy for the whole step (one cast per step, as Lightning's
        ``MixedPrecision``); the strategy turns it off where weights are gathered anew for each microbatch."""
        self.device_type = device_type
        self.loss_scale = loss_scale
        self.parameters = parameters
        self.device = device
        """The rank's device, where the overflow verdict is reduced (the strategy sets it; None: ``device_type``)."""
        self.skipped_steps = 0

    @classmethod
    def for_mode(cls, mode: PrecisionMode, device_type: str) -> ZorsePrecision:
        scale = DynamicLossScale() if mode is PrecisionMode.FP16 else None
        return cls(_AUTOCAST_DTYPE.get(mode), device_type, scale, parameter_dtype=_PARAMETER_DTYPE.get(mode))

    @property
    def mode(self) -> PrecisionMode:
        if self.parameter_dtype is not None:
            return next(m for m, dtype in _PARAMETER_DTYPE.items() if dtype == self.parameter_dtype)
        return next((m for m, dtype in _AUTOCAST_DTYPE.items() if dtype == self.autocast_dtype), PrecisionMode.FP32)

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module if self.parameter_dtype is None else module.to(dtype=self.parameter_dtype)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return nullcontext() if self.parameter_dtype is None else _DtypeContextManager(self.parameter_dtype)

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    @override
    def convert_input(self, data: Any) -> Any:
        if self.parameter_dtype is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=self.parameter_dtype)

    @property
    def loss_scale_value(self) -> float:
        return 1.0 if self.loss_scale is None else self.loss_scale.scale

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.autocast_dtype is not None:
            with torch.autocast(self.device_type, dtype=self.autocast_dtype, cache_enabled=self.cache_weights):
                yield
        else:
            with self.tensor_init_context():  # true modes: tensors made in the step take the weights' dtype
                yield

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.loss_scale is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if self.parameters is None:
            raise RuntimeError("ZorsePrecision with loss scaling needs parameters=... (the strategy sets it)")
        overflowed = self.loss_scale.unscale_(self.parameters(), self.device or torch.device(self.device_type))
        self._after_closure(model, optimizer)
        self.loss_scale.update(overflowed)
        if overflowed:
            self.skipped_steps += 1
            return closure_result
        return optimizer.step(**kwargs)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.loss_scale.state_dict() if self.loss_scale is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loss_scale is not None and state_dict:
            self.loss_scale.load_state_dict(state_dict)


def _trainer_mode(plugin: Precision) -> PrecisionMode | None:
    """The mode Lightning's plugin stands for; None for Lightning's default (``"32-true"``: asked for or not,
    the two cannot be told apart)."""
    name = getattr(plugin, "precision", None)
    if type(plugin) is Precision or name == PrecisionMode.FP32.value:
        return None
    try:
        return PrecisionMode(name)
    except ValueError:
        raise ZorseUserError(
            f"the Trainer's precision plugin {type(plugin).__name__} ({name!r}) is not supported by zorse; use "
            f"Trainer(precision=...) with one of {', '.join(repr(m.value) for m in PrecisionMode)}"
        ) from None


def resolve_precision(
    requested: str | None, lightning_plugin: Precision, gpu_types: Sequence[GpuType], device_type: str
) -> tuple[ZorsePrecision, PrecisionChoice]:
    """The plugin for ``ZorseStrategy(precision=requested)`` given what Lightning's flag produced.

    As in Lightning, the Trainer's flag decides (``requested=None``, the default; Lightning's default is
    ``"32-true"``). ``requested="auto"`` chooses for the whole cluster (bf16 where every GPU type has it,
    else fp16 with loss scaling); a mode named here or on the Trainer is checked against every GPU type
    and never silently changed; the two may not disagree.
    """
    if isinstance(lightning_plugin, ZorsePrecision):
        return lightning_plugin, PrecisionChoice(lightning_plugin.mode, "given as a plugin")
    trainer_mode = _trainer_mode(lightning_plugin)
    if requested is None:
        mode = trainer_mode or PrecisionMode.FP32
        choice = PrecisionChoice(mode, "the Trainer's precision")
    else:
        if requested == "auto":
            choice = choose_precision(gpu_types, device_type)
        else:
            try:
                choice = PrecisionChoice(PrecisionMode(requested), "asked for")
            except ValueError:
                raise ZorseUserError(
                    f"ZorseStrategy(precision={requested!r}) is not supported; use None (the Trainer's precision, "
                    f"the default), 'auto' or one of {', '.join(repr(m.value) for m in PrecisionMode)}"
                ) from None
        if trainer_mode is not None and trainer_mode is not choice.mode:
            raise ZorseUserError(
                f"precision given twice: Trainer(precision={trainer_mode.value!r}) and "
                f"ZorseStrategy(precision={requested!r}) ({choice.mode.value}); give it in one place"
            )
    check_requested(choice.mode, gpu_types, device_type)
    return ZorsePrecision.for_mode(choice.mode, device_type), choice

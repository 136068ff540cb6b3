"""Mixed precision for a plan: one mode every rank supports, and loss scaling that agrees across stages.

The mode is chosen for the whole cluster, since activations cross stages and
gradients are reduced between ranks of different types: bf16 autocast where
every GPU supports bf16 (A100/H100 class); fp16 autocast with dynamic loss
scaling where any lacks it (V100, T4); float32 on CPU ranks, emulated clusters
included (emulation is about speed, not numerics).

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
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from typing_extensions import override

from zorse_lightning.cluster.gpu_type import GpuType
from zorse_lightning.errors import ZorseUserError


class PrecisionMode(str, Enum):
    """Lightning's spellings."""

    FP32 = "32-true"
    BF16 = "bf16-mixed"
    FP16 = "16-mixed"


_AUTOCAST_DTYPE: dict[PrecisionMode, torch.dtype | None] = {
    PrecisionMode.FP32: None, PrecisionMode.BF16: torch.bfloat16, PrecisionMode.FP16: torch.float16
}


@dataclass(frozen=True)
class PrecisionChoice:
    mode: PrecisionMode
    reason: str

    @property
    def note(self) -> str:
        """The line recorded in the plan's notes."""
        return f"precision {self.mode.value}: {self.reason}"


def choose_precision(gpu_types: Iterable[GpuType], device_type: str) -> PrecisionChoice:
    """The fastest mode every rank supports (``device_type``: ``"cuda"`` or ``"cpu"``)."""
    if device_type != "cuda":
        return PrecisionChoice(PrecisionMode.FP32, "CPU ranks (emulated GPUs model speed, not numerics)")
    types = {t.name: t for t in gpu_types}
    lacking = sorted(name for name, t in types.items() if not t.supports_bf16)
    if not lacking:
        return PrecisionChoice(PrecisionMode.BF16, f"every GPU type ({', '.join(sorted(types))}) supports bf16")
    return PrecisionChoice(PrecisionMode.FP16, f"{', '.join(lacking)} lack bf16: fp16 with dynamic loss scaling")


def check_requested(mode: PrecisionMode, gpu_types: Iterable[GpuType], device_type: str) -> None:
    """A mode the user asked for must run on every rank."""
    lacking = sorted({t.name for t in gpu_types if not t.supports_bf16})
    if mode is PrecisionMode.BF16 and device_type == "cuda" and lacking:
        raise ZorseUserError(
            f"precision='bf16-mixed' was asked for, but {lacking} of this cluster lack bf16; "
            f"use precision='16-mixed' (fp16 with loss scaling) or 'auto', which picks it"
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
    """Autocast to ``autocast_dtype`` (None: float32) and, with ``loss_scale``, agreed dynamic loss scaling.

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
    ) -> None:
        self.autocast_dtype = autocast_dtype
        self.device_type = device_type
        self.loss_scale = loss_scale
        self.parameters = parameters
        self.device = device
        """The rank's device, where the overflow verdict is reduced (the strategy sets it; None: ``device_type``)."""
        self.skipped_steps = 0

    @classmethod
    def for_mode(cls, mode: PrecisionMode, device_type: str) -> ZorsePrecision:
        return cls(_AUTOCAST_DTYPE[mode], device_type, DynamicLossScale() if mode is PrecisionMode.FP16 else None)

    @property
    def loss_scale_value(self) -> float:
        return 1.0 if self.loss_scale is None else self.loss_scale.scale

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.autocast_dtype is None:
            with nullcontext():
                yield
        else:
            with torch.autocast(self.device_type, dtype=self.autocast_dtype, cache_enabled=False):
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


def resolve_precision(
    requested: str, lightning_plugin: Precision, gpu_types: Sequence[GpuType], device_type: str
) -> tuple[ZorsePrecision, PrecisionChoice]:
    """The plugin for ``ZorseStrategy(precision=requested)`` given what Lightning's flag produced.

    ``"auto"`` keeps a mixed mode the user gave the Trainer (``precision="bf16-mixed"``)
    and otherwise chooses; an explicit mode is checked against the cluster.
    """
    if isinstance(lightning_plugin, ZorsePrecision):
        mode = next(m for m, dtype in _AUTOCAST_DTYPE.items() if dtype == lightning_plugin.autocast_dtype)
        return lightning_plugin, PrecisionChoice(mode, "given as a plugin")
    if requested == "auto" and isinstance(lightning_plugin, MixedPrecision):
        requested = lightning_plugin.precision
    if requested == "auto":
        choice = choose_precision(gpu_types, device_type)
    else:
        try:
            mode = PrecisionMode(requested)
        except ValueError:
            raise ZorseUserError(
                f"precision={requested!r} is not supported by zorse; use 'auto', "
                f"{', '.join(repr(m.value) for m in PrecisionMode)}"
            ) from None
        check_requested(mode, gpu_types, device_type)
        choice = PrecisionChoice(mode, "asked for")
    return ZorsePrecision.for_mode(choice.mode, device_type), choice

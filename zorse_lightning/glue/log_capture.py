"""``self.log`` calls made inside microbatch steps, captured and replayed once per step.

Ranks run different numbers of microbatches, and non-last stages stop before
the loss, so a collective per ``self.log(..., sync_dist=True)`` call would hang.
During the schedule, ``module.log`` only records values; afterwards one gather
per step merges every rank's records, and each rank logs the same value:
the mean over the samples of the microbatches that logged it (``reduce_fx="sum"``:
the sum).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class LoggedValue:
    total: float = 0.0
    """Sum of value x samples (``reduce_fx="sum"``: of values)."""
    samples: int = 0
    kwargs: dict[str, Any] = field(default_factory=dict)

    def merge(self, other: LoggedValue) -> None:
        self.total += other.total
        self.samples += other.samples

    @property
    def value(self) -> float:
        if self.kwargs.get("reduce_fx") in ("sum", torch.sum):
            return self.total
        return self.total / self.samples


class LogCapture:
    """Records of one step, by metric name, in the order first logged."""

    def __init__(self, samples_per_call: int) -> None:
        self.samples_per_call = samples_per_call
        self.records: dict[str, LoggedValue] = {}

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("pass self.log options by keyword inside a zorse-trained step (self.log(name, value, prog_bar=True))")
        number = float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else float(value)
        summed = kwargs.get("reduce_fx") in ("sum", torch.sum)
        weight = 1 if summed else self.samples_per_call
        record = self.records.setdefault(name, LoggedValue(kwargs={k: v for k, v in kwargs.items()}))
        record.merge(LoggedValue(number * weight, self.samples_per_call))

    def merged_over_ranks(self) -> dict[str, LoggedValue]:
        """Every rank's records merged (one collective); identical on every rank."""
        gathered: list[dict[str, LoggedValue] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.records)
        merged: dict[str, LoggedValue] = {}
        for records in gathered:
            for name, record in (records or {}).items():
                merged.setdefault(name, LoggedValue(kwargs=record.kwargs)).merge(record)
        return merged


@contextmanager
def capturing_logs(module: Any, capture: LogCapture) -> Iterator[LogCapture]:
    """Route ``module.log`` (and ``log_dict``, which calls it) into ``capture`` for the block."""
    module.log = capture.log
    try:
        yield capture
    finally:
        del module.log


def replay(module: Any, merged: dict[str, LoggedValue], batch_size: int) -> None:
    """Log each merged value once through Lightning, without a further collective."""
    for name, record in merged.items():
        kwargs = dict(record.kwargs, sync_dist=False, batch_size=batch_size)
        module.log(name, torch.tensor(record.value), **kwargs)

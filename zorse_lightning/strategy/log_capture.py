"""``self.log`` calls made inside microbatch steps, captured and replayed once per step.

Ranks run different numbers of microbatches, and non-last stages stop before
the loss, so a collective per ``self.log(..., sync_dist=True)`` call would hang.
During the schedule, ``module.log`` only records values, kept as tensors on the
device (reading one would make the host wait for the step); afterwards one merge
per step combines every rank's records (nothing on one rank; a small tensor
all-reduce while the names stay the same, see :class:`LogMerger`), and each rank
logs the same value: the mean over the samples of the microbatches that logged
it (``reduce_fx="sum"``: the sum).
"""

from __future__ import annotations

import warnings

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.warnings import PossibleUserWarning


Number = float | torch.Tensor
"""A logged total: a 0-dim tensor on the rank's device while values stay there (reading one back would
make the host wait for the step), or a float."""


@dataclass
class LoggedValue:
    total: Number = 0.0
    """Sum of value x samples (``reduce_fx="sum"``: of values)."""
    samples: Number = 0
    kwargs: dict[str, Any] = field(default_factory=dict)

    def merge(self, other: LoggedValue) -> None:
        self.total = self.total + other.total
        self.samples = self.samples + other.samples

    @property
    def value(self) -> Number:
        if self.kwargs.get("reduce_fx") in ("sum", torch.sum):
            return self.total
        return self.total / self.samples

    def on_host(self) -> LoggedValue:
        """With plain numbers (reads the device: only where the names are learned, not every step)."""
        return LoggedValue(float(self.total), int(self.samples), self.kwargs)


class LogCapture:
    """Records of one step, by metric name, in the order first logged. Tensor values stay on their device."""

    def __init__(self, samples_per_call: int) -> None:
        self.samples_per_call = samples_per_call
        self.records: dict[str, LoggedValue] = {}

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("pass self.log options by keyword inside a zorse-trained step (self.log(name, value, prog_bar=True))")
        number = value.detach().double().mean() if isinstance(value, torch.Tensor) else float(value)
        summed = kwargs.get("reduce_fx") in ("sum", torch.sum)
        weight = 1 if summed else self.samples_per_call
        record = self.records.setdefault(name, LoggedValue(kwargs={k: v for k, v in kwargs.items()}))
        record.merge(LoggedValue(number * weight, self.samples_per_call))

    def merged_over_ranks(self, merger: LogMerger | None = None) -> dict[str, LoggedValue]:
        """Every rank's records merged; identical on every rank. Without ``merger``: one object gather.
        With the owner's ``merger``: nothing on one rank, else one flag on the host and one tensor
        gather on the device (see :class:`LogMerger`)."""
        if merger is None:
            return _gathered(self.records)
        return merger.merge(self.records)


def _gathered(records: dict[str, LoggedValue]) -> dict[str, LoggedValue]:
    """Every rank's records merged in rank order: names by first appearance, options of the first rank
    that logged the name (pickles every record: the slow path)."""
    gathered: list[dict[str, LoggedValue] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {name: record.on_host() for name, record in records.items()})
    merged: dict[str, LoggedValue] = {}
    for rank_records in gathered:
        for name, record in (rank_records or {}).items():
            merged.setdefault(name, LoggedValue(kwargs=record.kwargs)).merge(record)
    return merged


@dataclass(frozen=True)
class _Layout:
    """What one object gather taught: this rank's names and options in logging order, the merged
    names and options, and where each of this rank's names sits among the merged ones."""

    own: tuple[tuple[str, dict[str, Any]], ...]
    merged: tuple[tuple[str, dict[str, Any]], ...]
    slots: tuple[int, ...]

    @classmethod
    def learned(cls, records: dict[str, LoggedValue], merged: dict[str, LoggedValue]) -> _Layout:
        order = {name: index for index, name in enumerate(merged)}
        return cls(
            own=tuple((name, dict(record.kwargs)) for name, record in records.items()),
            merged=tuple((name, dict(record.kwargs)) for name, record in merged.items()),
            slots=tuple(order[name] for name in records),
        )

    def fits(self, records: dict[str, LoggedValue]) -> bool:
        """The same names, in the same order, with the same options as when learned (so the merged layout,
        names and options of the first rank that logged each, is what an object gather would give)."""
        return len(records) == len(self.own) and all(
            name == own_name and record.kwargs == own_kwargs
            for (name, record), (own_name, own_kwargs) in zip(records.items(), self.own)
        )

    def row(self, records: dict[str, LoggedValue], device: torch.device) -> torch.Tensor:
        """[total_0, samples_0, total_1, samples_1, ...] over the merged names, built on ``device``
        (``torch.full`` is a fill kernel, where a host value copied in would make the host wait); zeros
        where this rank logged nothing."""
        cells = [torch.zeros((), dtype=torch.float64, device=device)] * (2 * len(self.merged))
        for slot, record in zip(self.slots, records.values()):
            for at, number in ((2 * slot, record.total), (2 * slot + 1, record.samples)):
                cells[at] = number if isinstance(number, torch.Tensor) else torch.full(
                    (), number, dtype=torch.float64, device=device
                )
        return torch.stack(cells).to(torch.float64)


@dataclass
class LogMerger:
    """Merges each step's records over ranks without the host waiting on the device.

    One rank has nothing to merge. Elsewhere ranks log the same names with the same options
    step after step, so an object gather (pickling every record, reading every device value)
    per step mostly re-sends what every rank already knows. The first merge, and any merge
    where some rank's names or options no longer fit the learned layout, gather objects and
    learn the layout; the others all-reduce a one-integer flag over ``host_group`` (on the
    host: no device value read) and gather one float64 row per rank over the default group (on
    the device: totals and samples per merged name), summed in rank order, so the merged values stay
    on the device.
    Every rank sees every flag, so all ranks take the same path. A step's ``LogCapture`` is
    new each step: the owner (the strategy) keeps one merger per hook for the run, and a new
    one when the process groups are rebuilt, on every rank alike.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the row is reduced: the rank's GPU under NCCL, the CPU under gloo."""
    host_group: Any = None
    """A gloo group over all ranks for the flag (None: the default group, which must then be gloo)."""
    object_gathers: int = 0
    """Merges that gathered objects: the first, and each where some rank's names or options changed."""
    _layout: _Layout | None = field(default=None, repr=False)

    def merge(self, records: dict[str, LoggedValue]) -> dict[str, LoggedValue]:
        """Every rank's ``records`` merged, as :meth:`LogCapture.merged_over_ranks` without a merger."""
        if dist.get_world_size() == 1:
            return records
        merged = None if self._layout is None else self._from_rows(records, self._layout)
        if merged is None:
            self.object_gathers += 1
            merged = _gathered(records)
            self._layout = _Layout.learned(records, merged)
        return merged

    def _from_rows(self, records: dict[str, LoggedValue], layout: _Layout) -> dict[str, LoggedValue] | None:
        """The merged records from every rank's row; None (on every rank) when some rank's names changed."""
        changed = torch.tensor([0 if layout.fits(records) else 1], dtype=torch.int64)
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self.host_group)
        if changed.item():  # a host tensor of a host collective: no device is waited for
            return None
        if not layout.merged:
            return {}
        row = layout.row(records, self.device)
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row)
        summed = torch.stack(rows).sum(0)  # in rank order, as the object gather sums
        return {
            name: LoggedValue(summed[2 * slot], summed[2 * slot + 1], dict(kwargs))
            for slot, (name, kwargs) in enumerate(layout.merged)
        }


@contextmanager
def capturing_logs(module: Any, capture: LogCapture) -> Iterator[LogCapture]:
    """Route ``module.log`` (and ``log_dict``, which calls it) into ``capture`` for the block."""
    module.log = capture.log
    try:
        yield capture
    finally:
        del module.log


def replay(module: Any, merged: dict[str, LoggedValue], batch_size: int) -> None:
    """Log each merged value once through Lightning, without a further collective; a value on the device
    stays there (Lightning reads it when it shows or writes it, as it would the user's own)."""
    for name, record in merged.items():
        kwargs = dict(record.kwargs, sync_dist=False, batch_size=batch_size)
        value = record.value
        module.log(name, value.float() if isinstance(value, torch.Tensor) else torch.tensor(value), **kwargs)


def quiet_merged_metric_advice() -> None:
    """Lightning advises ``sync_dist=True`` for epoch-level metrics of distributed runs. Under this strategy
    every logged value reaches Lightning already merged over the ranks (:func:`replay`), so the advice
    is wrong here, and following it would reduce the merged values a second time."""
    warnings.filterwarnings(
        "ignore", message=r"It is recommended to use `self\.log\(.*sync_dist=True\)`", category=PossibleUserWarning
    )


"""The one reader of the shipped reference data (``profiling/data/reference.json``).

The file is a compact copy of the measured GPU data of the Zorse and Cephalo
projects (MIT licence, see ``data/PROVENANCE.md``), written by
:mod:`tools.convert_reference`: only the models the alias
table of :mod:`zorse_lightning.profiling.reference` uses, GPU keys renamed to
catalog names, numbers rounded to 7 significant digits, entry shapes kept as
the source has them. This module is the only place that knows those shapes:

- ``[[fwd_slope, fwd_intercept], [bwd_slope, bwd_intercept]]`` (fits only);
- the same followed by ``[fwd_ms_at_b1, ...]`` and ``[bwd_ms_at_b1, ...]``
  (fits and measured times at microbatch sizes 1..n);
- ``[slope, intercept]``: one line for forward plus backward together (the
  ``gpt_*`` models and a few others), or a bare number: that slope alone (it
  matches the combined slope of the same GPU elsewhere: A10G, GPT-6.7B, 20.59
  against 20.63 ms). Both are split with the backward share of the same
  model's separate fits (median), or 2/3 when the model has none, since a
  backward pass costs about twice a forward one.

Negative intercepts are kept: :class:`TimeCurve` floors predicted times.
"""

from __future__ import annotations

import functools
import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType
from typing import Any

from zorse_lightning.profiling.profile import BlockTimes, TimeCurve

DATA_FILE = "reference.json"
DEFAULT_BACKWARD_SHARE = 2.0 / 3.0
"""Backward share of forward+backward when a model has no separate fits (backward ~ 2x forward)."""


@dataclass(frozen=True)
class ModelStats:
    """Shape of a reference model, from ``model_stats.json``."""

    hidden_size: int
    num_layers: int
    parameters_per_layer: int
    total_parameters: int


def _is_pair(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(x, (int, float)) for x in value)


def entry_kind(entry: Any) -> str:
    """``"fits"``, ``"fits+measured"``, ``"combined"`` or ``"slope"``; ValueError for anything else."""
    if isinstance(entry, (int, float)):
        return "slope"
    if _is_pair(entry):
        return "combined"
    if isinstance(entry, list) and len(entry) in (2, 4) and _is_pair(entry[0]) and _is_pair(entry[1]):
        return "fits" if len(entry) == 2 else "fits+measured"
    raise ValueError(f"unrecognised reference entry {str(entry)[:80]!r}: expected one of the shapes in {__name__}")


def _backward_share(model_entries: Mapping[str, Any]) -> float:
    """Median backward share of the slopes in a model's separate fits."""
    shares = [
        entry[1][0] / (entry[0][0] + entry[1][0])
        for by_seq in model_entries.values()
        for by_dtype in by_seq.values()
        for entry in by_dtype.values()
        if entry_kind(entry).startswith("fits") and entry[0][0] + entry[1][0] > 0
    ]
    return statistics.median(shares) if shares else DEFAULT_BACKWARD_SHARE


def parse_entry(entry: Any, backward_share: float = DEFAULT_BACKWARD_SHARE) -> BlockTimes:
    """One layer's forward and backward curves from a raw entry of any shape."""
    kind = entry_kind(entry)
    if kind in ("combined", "slope"):
        slope, intercept = entry if kind == "combined" else (entry, 0.0)
        return BlockTimes(
            TimeCurve(slope * (1 - backward_share), intercept * (1 - backward_share)),
            TimeCurve(slope * backward_share, intercept * backward_share),
        )
    measured = (tuple(entry[2]), tuple(entry[3])) if kind == "fits+measured" else ((), ())
    return BlockTimes(
        TimeCurve(entry[0][0], entry[0][1], measured[0]),
        TimeCurve(entry[1][0], entry[1][1], measured[1]),
    )


class ReferenceData:
    """Read-only view of the shipped data; build it with :func:`load_reference_data`."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self._latencies: Mapping[str, Any] = raw["layer_latencies"]
        self._stats: Mapping[str, Any] = raw["model_stats"]
        self._memory: Mapping[str, Any] = raw.get("model_memory", {})
        self._backward_share = {model: _backward_share(entries) for model, entries in self._latencies.items()}

    @property
    def model_keys(self) -> tuple[str, ...]:
        return tuple(self._latencies)

    def coverage(self, model_key: str) -> dict[str, dict[int, tuple[str, ...]]]:
        """GPU type -> sequence length -> dtypes that have an entry for this model."""
        return {
            gpu: {int(seq): tuple(by_dtype) for seq, by_dtype in by_seq.items()}
            for gpu, by_seq in self._latencies.get(model_key, {}).items()
        }

    def raw_entry(self, model_key: str, gpu_type: str, seq_len: int, dtype: str) -> Any | None:
        return self._latencies.get(model_key, {}).get(gpu_type, {}).get(str(seq_len), {}).get(dtype)

    def layer_times(self, model_key: str, gpu_type: str, seq_len: int, dtype: str) -> BlockTimes | None:
        """Times of one layer, or None where the data has no entry."""
        entry = self.raw_entry(model_key, gpu_type, seq_len, dtype)
        if entry is None:
            return None
        return parse_entry(entry, self._backward_share[model_key])

    def model_stats(self, stats_key: str) -> ModelStats:
        s = self._stats[stats_key]
        return ModelStats(s["hidden_size"], s["num_layers"], s["parameters_per_layer"], s["total_parameters"])

    def model_memory(self, cluster: str, model_key: str) -> Mapping[str, Any] | None:
        """Cephalo's fitted memory model (GB, float32 unless keyed otherwise), or None."""
        found = self._memory.get(cluster, {}).get(model_key)
        return None if found is None else MappingProxyType(found)


@functools.cache
def load_reference_data() -> ReferenceData:
    """The shipped data, parsed once per process (it is immutable package data)."""
    text = resources.files("zorse_lightning.profiling").joinpath("data").joinpath(DATA_FILE).read_text(encoding="utf-8")
    return ReferenceData(json.loads(text))

"""The on-disk cache of measured profiles: JSON keyed by model signature, GPU type, dtype, length and sizes.

A restart does not measure again what it measured before (see :mod:`.measure`).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zorse_lightning.profiling.profile import BlockShape, BlockTimes, DeviceTimes, ProfileSource, TimeCurve

if TYPE_CHECKING:
    from zorse_lightning.profiling.measure import MeasuredBlocks, MeasureOptions

DEFAULT_CACHE_DIR = Path("~/.cache/zorse_lightning/profiles")
CACHE_FORMAT = 1


def cache_path(
    cache_dir: Path, signature: str, gpu_type: str, dtype: str, seq_len: int, options: MeasureOptions
) -> Path:
    safe_gpu = "".join(c if c.isalnum() or c in "-_." else "_" for c in gpu_type)
    runs = f"b{options.max_microbatch_size}w{options.warmup}r{options.repeats}"
    return cache_dir.expanduser() / f"{signature}_{safe_gpu}_{dtype}_s{seq_len}_{runs}.json"


def curve_from(d: dict[str, Any]) -> TimeCurve:
    return TimeCurve(d["slope_ms"], d["intercept_ms"], tuple(d["measured_ms"]), tuple(d.get("measured_sizes", ())))


def to_json(m: MeasuredBlocks) -> dict[str, Any]:
    blocks = [m.embedding, *m.layers, m.head]
    times = [m.times.embedding, *m.times.layers, m.times.head]
    return {
        "format": CACHE_FORMAT,
        "signature": m.signature,
        "gpu_type": m.times.gpu_type,
        "seq_len": m.seq_len,
        "dtype": m.dtype,
        "optimizer_ms_per_million_parameters": m.times.optimizer_ms_per_million_parameters,
        "action_overhead_ms": m.times.action_overhead_ms,
        "blocks": [
            {"shape": asdict(s), "forward": asdict(t.forward), "backward": asdict(t.backward)}
            for s, t in zip(blocks, times)
        ],
    }


def from_json(d: dict[str, Any]) -> MeasuredBlocks:
    shapes = [BlockShape(**b["shape"]) for b in d["blocks"]]
    times = [BlockTimes(curve_from(b["forward"]), curve_from(b["backward"])) for b in d["blocks"]]
    device_times = DeviceTimes(
        d["gpu_type"], ProfileSource.MEASURED, times[0], tuple(times[1:-1]), times[-1],
        d.get("optimizer_ms_per_million_parameters"),  # absent from files written before it existed
        d.get("action_overhead_ms"),
    )
    from zorse_lightning.profiling.measure import MeasuredBlocks

    return MeasuredBlocks(
        d["signature"], d["seq_len"], d["dtype"], device_times, shapes[0], tuple(shapes[1:-1]), shapes[-1], True
    )

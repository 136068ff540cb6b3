"""Write the shipped compact copy of the reference data (run once; the output is committed).

    python -m tools.convert_reference PATH/TO/shared/reference

Keeps the models of the alias table (layer latencies, model_stats, and
Cephalo's model_memory entries), renames GPU keys to catalog names (``v100`` is
the V100-16GB, ``rtx_3090`` the RTX 3090), rounds numbers to 7 significant
digits and keeps every entry in its source shape (the reader parses them).
Also copies the licence next to the data.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from zorse_lightning.cluster.catalog import DEFAULT_CATALOG
from zorse_lightning.profiling.reference import REFERENCE_MODELS
from zorse_lightning.profiling.reference_data import DATA_FILE, entry_kind

DATA_DIR = Path(__file__).resolve().parents[1] / "zorse_lightning" / "profiling" / "data"
"""Where the shipped copy lives (inside the package: it is read at run time)."""
SIGNIFICANT_DIGITS = 7


def _round(value: Any) -> Any:
    if isinstance(value, list):
        return [_round(v) for v in value]
    if isinstance(value, float):
        return float(f"{value:.{SIGNIFICANT_DIGITS}g}")
    return value


def _convert_model(by_gpu: dict[str, Any], model: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for raw_gpu, by_seq in by_gpu.items():
        gpu = DEFAULT_CATALOG.get(raw_gpu).name
        if gpu in out:
            raise ValueError(f"{model}: GPU keys {raw_gpu!r} and another both mean {gpu!r}")
        for by_dtype in by_seq.values():
            for entry in by_dtype.values():
                entry_kind(entry)
        out[gpu] = _round(by_seq)
    return out


def convert(source_dir: Path) -> dict[str, Any]:
    latencies = json.loads((source_dir / "layer_latencies.json").read_text())
    stats = json.loads((source_dir / "model_stats.json").read_text())
    memory = json.loads((source_dir / "model_memory.json").read_text())
    latency_keys = sorted({k for m in REFERENCE_MODELS.values() for k in m.latency_keys})
    stats_keys = sorted({m.stats_key for m in REFERENCE_MODELS.values()})
    wanted = set(latency_keys) | set(stats_keys)
    return {
        "provenance": "Zorse and Cephalo measurements (Runsheng Benson Guo et al., MIT licence); see PROVENANCE.md",
        "layer_latencies": {k: _convert_model(latencies[k], k) for k in latency_keys},
        "model_stats": {k: stats[k] for k in stats_keys},
        "model_memory": {
            cluster: {k: _round(v) for k, v in models.items() if k in wanted}
            for cluster, models in memory.items()
            if wanted & set(models)
        },
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    source_dir = Path(argv[0])
    converted = convert(source_dir)
    DATA_DIR.mkdir(exist_ok=True)
    (DATA_DIR / DATA_FILE).write_text(json.dumps(converted, separators=(",", ":"), sort_keys=True) + "\n")
    shutil.copyfile(source_dir / "LICENSE-layer-data", DATA_DIR / "LICENSE-layer-data")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

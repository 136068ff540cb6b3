"""The training app end to end, as a user runs it: a subprocess, Lightning launching the ranks."""

from __future__ import annotations

import pytest

import csv
import json
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.multiprocess


def test_train_app_plans_trains_and_leaves_its_outputs(tmp_path: Path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable, "-m", "zorse_lightning.train", "cluster=cpu_sim2", "trainer.max_steps=12",
            "trainer.val_check_interval=6", "trainer.log_every_n_steps=1", "data.corpus_bytes=60000",
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["cluster"] == "cpu_sim2" and plan["global_batch_size"] == 16  # data.batch_size 8 x 2 ranks
    assert (run_dir / "timeline.png").stat().st_size > 10_000
    assert (run_dir / "checkpoints" / "last.ckpt" / "manifest.json").is_file()  # a sharded checkpoint directory
    assert list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    rows = list(csv.DictReader((run_dir / "metrics" / "version_0" / "metrics.csv").open()))
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert len(losses) >= 10
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.0  # bytes: ln(256) = 5.5 at the start, falling

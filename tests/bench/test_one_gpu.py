"""``bench/one_gpu.py --tiny`` runs end to end on this CPU, so the GPU bench is known to work before it meets a GPU.

The same code as on a GPU (plain Lightning against ``ZorseStrategy()``, each run
in its own process, the plan's predictions read back) on one non-emulated CPU
rank at small sizes; every case prints its line, and the host-overhead line
follows. Nothing here asserts a speed: the figures are the bench's to report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[2]
CASE_KEYS = {
    "model", "precision", "plain_samples_per_s", "zorse_samples_per_s", "ratio", "predicted_iteration_ms",
    "measured_iteration_ms", "predicted_peak_gib", "measured_peak_gib", "microbatch_size",
}
MODELS = {"gpt_86m", "gpt_1.2b", "llama_168m"}
PRECISIONS = {"bf16-mixed", "32-true"}


@pytest.fixture(scope="module")
def lines() -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.one_gpu", "--tiny", "--warmup", "1", "--steps", "2", "--rounds", "1",
         "--compare-steps", "4", "--overhead-warmup", "2", "--overhead-steps", "5"],  # the code paths, not figures: few steps
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def test_every_case_prints_its_line(lines):
    cases = [line for line in lines if "case" not in line]
    assert len(cases) == len(MODELS) * len(PRECISIONS), cases
    assert {(c["model"], c["precision"]) for c in cases} == {(m, p) for m in MODELS for p in PRECISIONS}
    for case in cases:
        assert CASE_KEYS <= case.keys(), (CASE_KEYS - case.keys(), case)
        assert "error" not in case, case["error"]
        assert case["plain_samples_per_s"] > 0 and case["zorse_samples_per_s"] > 0, case
        assert case["ratio"] > 0, case
        assert isinstance(case["microbatch_size"], int) and case["microbatch_size"] >= 1, case
        assert case["measured_iteration_ms"] > 0, case
        assert case["predicted_iteration_ms"] is None or case["predicted_iteration_ms"] > 0, case
        assert case["measured_peak_gib"] is None, case  # CPU: no CUDA allocator to ask
        assert case["sizes"]["tiny"] is True, case
        assert case["round"] == 1, case
    assert not [line for line in lines if line.get("case") == "summary"]  # one round: nothing to sum up


def test_host_overhead_line(lines):
    overhead = [line for line in lines if line.get("case") == "host_overhead"]
    assert len(overhead) == 1, lines
    (line,) = overhead
    assert "error" not in line, line["error"]
    assert line["plain_host_ms_per_step"] > 0 and line["zorse_host_ms_per_step"] > 0, line
    assert lines[-1] is line  # printed last


def test_both_strategies_train_the_same_parameters_from_the_same_start(lines):
    """Would catch zorse training other values than plain Lightning (another precision, a lost or doubled
    gradient, another data order): one CPU rank, fp32, the same weights and batches."""
    (line,) = [line for line in lines if line.get("case") == "parameters_after_steps"]
    assert "error" not in line, line["error"]
    assert line["same_names"] and line["compared"] > 0, line
    assert line["max_abs_diff"] <= 1e-5 * line["max_abs_weight"], line

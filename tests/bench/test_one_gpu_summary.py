"""``bench/one_gpu.py``'s summary over rounds: the median prediction error and ratio of each case, and their
spread, from its rounds' lines (failed rounds left out)."""

from __future__ import annotations

import pytest

from bench.one_gpu import prediction_error_pct, summary_lines


def _line(model: str, predicted: float, measured: float, ratio: float, microbatch: int = 8, **extra) -> dict:
    return {"model": model, "precision": "32-true", "predicted_iteration_ms": predicted,
            "measured_iteration_ms": measured, "ratio": ratio, "microbatch_size": microbatch,
            "plain_iteration_ms": measured * ratio, **extra}


def test_prediction_error_is_in_percent_of_the_measured_time():
    assert prediction_error_pct(_line("a", 115.0, 100.0, 1.0)) == pytest.approx(15.0, abs=1e-9)
    assert prediction_error_pct(_line("a", 80.0, 100.0, 1.0)) == pytest.approx(-20.0, abs=1e-9)
    assert prediction_error_pct({"predicted_iteration_ms": None, "measured_iteration_ms": 5.0}) is None


def test_each_case_is_summed_up_over_its_rounds_by_the_median():
    lines = [
        _line("gpt", 130.0, 100.0, 0.9), _line("llama", 50.0, 50.0, 1.0),
        _line("gpt", 100.0, 100.0, 1.1), _line("llama", 40.0, 50.0, 0.8, microbatch=4),
        _line("gpt", 90.0, 100.0, 1.3), _line("llama", 99.0, 1.0, 5.0, error="zorse run: exit 1"),
    ]
    gpt, llama = summary_lines(lines)
    assert gpt == {
        "case": "summary", "model": "gpt", "precision": "32-true", "rounds": 3,
        "prediction_error_pct_median": 0.0, "prediction_error_pct_min": -10.0, "prediction_error_pct_max": 30.0,
        "ratio_median": 1.1, "ratio_min": 0.9, "ratio_max": 1.3, "microbatch_sizes": [8],
        "plain_iteration_ms_min": 90.0, "plain_iteration_ms_max": 130.0,
    }
    assert llama["rounds"] == 2  # the failed round is no figure
    assert llama["prediction_error_pct_median"] == -10.0 and llama["ratio_median"] == 0.9
    assert llama["microbatch_sizes"] == [4, 8]

"""benchmarks.gpu_accuracy: its rows match the results files they cite, and the summary's
micro-batch-count signs (pricing the rows needs minutes of planning: the benchmark does it)."""

import json
import pathlib

import pytest

from benchmarks import gpu_accuracy

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_lent_series_rows_are_the_measured_steps_of_their_files():
    measured = {}
    for name in ("gpu-NVIDIA-H200-series.json", "gpu-NVIDIA-H200-series-125m.json"):
        for r in json.loads((RESULTS / name).read_text())["series"]:
            measured[(r["model"], r["batch"], r["micro_batches"])] = r["step_s"]
    rows = [r for r in gpu_accuracy.RUNS if r.source == "lent-gpu-series"]
    assert len(rows) == len(measured) == 8
    for run in rows:
        assert run.layout is not None and run.layout[:3] == (1, 1, 1)
        key = (run.model, run.batch, run.layout[3])
        assert run.measured_step_s == pytest.approx(measured[key], abs=1e-5), key
    assert len({r.series for r in rows}) == 2


def _row(series, micro, measured, predicted):
    return {"series": series, "micro": micro, "measured_step_s": measured,
            "predicted_step_s": predicted, "step_ratio": predicted / measured,
            "source": "s"}


def test_micro_signs_compare_every_step_of_a_series():
    rows = [_row("a", 4, 2.0, 2.2), _row("a", 1, 1.0, 1.1), _row("a", 2, 0.9, 1.15),
            _row("b", 1, 1.0, 1.0), _row("b", 2, 1.5, 1.2), _row("", 1, 1.0, 1.0)]
    signs = gpu_accuracy.micro_signs(rows)
    assert set(signs) == {"a", "b"}
    assert signs["a"] == {"micro": [1, 2, 4], "measured": [-1, 1], "predicted": [1, 1],
                          "right": False}
    assert signs["b"]["right"] is True
    s = gpu_accuracy.summary(rows)["all"]
    assert s["rows"] == 6 and s["within"] == 4   # 1.15/0.9 and 1.2/1.5 are off by > 15%

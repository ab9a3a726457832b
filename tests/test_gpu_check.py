"""benchmarks.gpu_check: its argument parsing and the report it renders from a saved run
(the measurements themselves need a GPU; the file read here is the committed H200 run)."""

import json
import pathlib

import pytest

from benchmarks import gpu_check

RESULT = pathlib.Path(gpu_check.RESULTS) / "gpu-NVIDIA-H200.json"


def test_models_parse_and_bad_items_are_named():
    assert gpu_check.parse_models("gpt-125m:8, wrn-250m:32") == [("gpt-125m", 8),
                                                                ("wrn-250m", 32)]
    for bad in ("gpt-125m", "gpt-125m:0", "gpt-9000b:8", "gpt-125m:x"):
        with pytest.raises(ValueError, match="--models item"):
            gpu_check.parse_models(bad)


def test_saved_run_renders_every_model_and_ratio(tmp_path):
    report = json.loads(RESULT.read_text())
    path = gpu_check.write(report, tmp_path)
    assert path.name == "gpu-NVIDIA-H200.md"
    text = path.read_text()
    for row in report["models"]:
        ratio = row["autopar_step_s"] / row["jit_step_s"]
        assert f"| {row['model']} | {row['batch']} |" in text
        assert f"{ratio:.3f}" in text
    assert json.loads((tmp_path / "gpu-NVIDIA-H200.json").read_text()) == report
    # A model that failed is a row with its error, not a crash of the report.
    report["models"].append({"model": "gpt-350m", "batch": 64, "error": "OOM: 150 GiB"})
    assert "| gpt-350m | 64 | error: OOM: 150 GiB |" in gpu_check.markdown(report)


def test_micro_batch_counts_must_divide_every_series_batch():
    assert gpu_check.parse_counts("1, 2,4", [8, 16]) == [1, 2, 4]
    with pytest.raises(ValueError, match=r"\[3\] do not divide the series batch 8"):
        gpu_check.parse_counts("1,3", [8])
    for bad in ("", "0", "2,x"):
        with pytest.raises(ValueError, match="--micro-batches"):
            gpu_check.parse_counts(bad, [8])


def test_series_rows_render_growth_over_the_first_count(tmp_path):
    row = {"model": "gpt-350m", "batch": 16, "loss_rel_diff": 0.0, "stages": 1}
    series = [{**row, "micro_batches": 1, "step_s": 0.200, "predicted_step_s_preset": 0.180,
               "predicted_step_s_profiled": 0.210},
              {**row, "micro_batches": 4, "step_s": 0.250, "predicted_step_s_preset": 0.189,
               "predicted_step_s_profiled": 0.252},
              {**row, "micro_batches": 16, "error": "OOM"}]
    report = json.loads(RESULT.read_text())
    report["series"] = series
    report["environment"]["tag"] = "t1"
    path = gpu_check.write(report, tmp_path)
    assert path.name == "gpu-NVIDIA-H200-t1.md"
    text = path.read_text()
    assert "| gpt-350m | 16 | 4 | 250.00 | 189.00 | 0.76 | 252.00 | 1.01 | 1.250 | 1.050 | " \
           "1.200 |" in text
    assert "| gpt-350m | 16 | 16 | error: OOM |" in text


def test_quick_run_on_cpu_writes_a_series_checked_against_jit(tmp_path):
    rc = gpu_check.main(["--quick", "--no-profile", "--models", "", "--series", "gpt-toy:4",
                         "--micro-batches", "2", "--steps", "1", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "gpu-cpu.json").read_text())
    assert [r["micro_batches"] for r in report["series"]] == [2]
    for r in report["series"]:
        assert r["stages"] == 1 and r["loss_rel_diff"] < 1e-5
        assert r["step_s"] > 0 and r["predicted_step_s_profiled"] > 0

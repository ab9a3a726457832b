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

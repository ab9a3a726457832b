"""examples/train_gpt.py run as a user runs it: every method, two processes, and resume.

One uninterrupted run (shard, 8 devices, 4 steps) is the reference.  A second run trains 2
steps as a pipeline; two processes (`autopar launch -n 2`, a 2-stage pipeline) resume it to
step 3; a 4-device run under "auto" resumes that to step 4.  Every resumed step must have the
reference's loss: the batches are a function of the step index and the checkpoint holds the
whole state, so only the reduction order differs between the plans (AdamW; rtol 1e-4, the
losses agree to ~1e-6 when measured).
"""

from __future__ import annotations

import csv
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from multihost import run_processes

ROOT = pathlib.Path(__file__).parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
COMMON = ("--model", "tiny", "--warmup", "1", "--lr", "1e-2", "--eval-every", "2",
          "--ckpt-every", "1", "--eval-batches", "2", "--batch", "16", "--time-limit", "5",
          "--quiet")
RTOL = 1e-4


def _run(*args: str, timeout_s: float = 300.0) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), *COMMON, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _rows(out: pathlib.Path) -> list[dict]:
    with (out / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def _losses(rows: list[dict]) -> dict[int, float]:
    return {int(r["step"]): float(r["train_loss"]) for r in rows}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[pathlib.Path, str]:
    out = tmp_path_factory.mktemp("reference")
    return out, _run("--method", "shard", "--steps", "4", "--out", str(out),
                     "--sample-chars", "40")


def test_trains_plots_and_samples(reference):
    out, stdout = reference
    rows = _rows(out)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    losses = [float(r["train_loss"]) for r in rows]
    assert losses[-1] < losses[0] - 0.3, losses          # it learns (lr 1e-2, 4 steps)
    val = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    assert len(val) == 2 and val[1] < val[0], val
    assert all(float(r["predicted_step_s"]) > 0 and r["method"] == "shard" for r in rows)
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "sample.txt").read_text().startswith("def ")
    assert "unigram baseline" in stdout and "sample:" in stdout


def test_resume_across_methods_devices_and_processes(reference, tmp_path):
    expected = _losses(_rows(reference[0]))
    _run("--method", "pipeshard", "--steps", "2", "--out", str(tmp_path), "--sample-chars", "0")
    run_processes(SCRIPT, *COMMON, "--method", "pipeshard", "--stages", "2", "--steps", "3",
                  "--out", str(tmp_path), "--sample-chars", "0", "--resume")
    stdout = _run("--method", "auto", "--devices", "4", "--steps", "4", "--out",
                  str(tmp_path), "--sample-chars", "0", "--resume")
    assert "resumed from the checkpoint of step 3" in stdout
    rows = _rows(tmp_path)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert [r["method"] for r in rows[:3]] == ["pipeshard"] * 3
    assert [int(r["devices"]) for r in rows] == [8, 8, 8, 4]
    got = _losses(rows)
    np.testing.assert_allclose([got[k] for k in range(1, 5)],
                               [expected[k] for k in range(1, 5)], rtol=RTOL)


def test_bad_arguments_are_named():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--steps", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--steps must be >= 1, got 0" in proc.stderr

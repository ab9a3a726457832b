"""benchmarks/cost_model_accuracy.py (issue 41, item 5): which plans count as one, the summary
computed from the rows, the scheduler flags, and one --quick run end to end."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from benchmarks import cost_model_accuracy as cma

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _row(model, plan, layout, signature, *, kind="single", mem=(1.0,), audit_mem=(1.0,),
         bytes_ratio=1.0, pred_s=1.0, audit_s=1.0, schedulers=("concurrency", "memory")):
    mem, audit_mem = list(mem), list(audit_mem)
    return {"model": model, "plan": plan, "kind": kind, "layout": layout,
            "signature": signature, "pred_memory_bytes": mem,
            "pred_memory_gpu_rules_bytes": mem, "audit_memory_bytes": audit_mem,
            "audit_memory_by_scheduler": {s: audit_mem for s in schedulers},
            "memory_ratio_by_scheduler": {s: cma.memory_ratio(mem, audit_mem)
                                          for s in schedulers},
            "bytes_ratio": bytes_ratio, "pred_step_s": pred_s, "audit_step_s": audit_s,
            "time_ratio": pred_s / audit_s, "replay_rel_diff": 0.0,
            "replay_memory_gpu_rules_bytes": mem, "involuntary_rematerializations": 0,
            "memory_what_if": {"per_value": audit_mem[0], "aliased": audit_mem[0],
                               "aliased_fused": audit_mem[0]}}


def test_one_layout_on_meshes_1x8_8x1_8_and_2x4_is_one_fingerprint():
    spec = lambda *axes: (tuple(axes), ())
    same = [cma._canonical_spec(spec("y"), (1, 8), ("x", "y")),
            cma._canonical_spec(spec("x"), (8, 1), ("x", "y")),
            cma._canonical_spec(spec("x"), (8,), ("x",)),
            cma._canonical_spec(spec("x", "y"), (2, 4), ("x", "y"))]
    assert all(s == (((8, 1),), ()) for s in same), same
    # Other layouts stay apart: 2 of 8 devices' worth (x of 2x4), the other order (y, x)
    # and a split of the other dim.
    other = [cma._canonical_spec(spec("x"), (2, 4), ("x", "y")),
             cma._canonical_spec(spec("y", "x"), (2, 4), ("x", "y")),
             cma._canonical_spec(((), ("x",)), (8,), ("x",))]
    assert len({*other, same[0]}) == 4


def test_dedupe_merges_same_layout_or_same_audit_transitively_within_a_model():
    rows = [_row("mlp", "dp", "L1", "S1"),
            _row("mlp", "auto 1x8", "L2", "S1"),     # same audit as dp
            _row("mlp", "tp 1x8", "L3", "S3"),
            _row("mlp", "tp 8x1", "L3", "S4"),       # same layout as tp 1x8
            _row("mlp", "auto", "L2", "S5"),         # same layout as auto 1x8 -> dp's group
            _row("gpt", "dp", "L1", "S1")]           # another model: never merged
    groups = cma.dedupe(rows)
    assert [g["cases"] for g in groups] == [["dp", "auto 1x8", "auto"], ["tp 1x8", "tp 8x1"],
                                           ["dp"]]
    assert [g["model"] for g in groups] == ["mlp", "mlp", "gpt"]
    assert groups[0]["why"] == {"auto 1x8": "audit", "auto": "via another case"}
    assert groups[1]["why"] == {"tp 8x1": "layout"}
    assert groups[0]["representative"] == "dp"


def test_memory_ratio_of_a_pipeline_is_its_stage_farthest_from_one():
    assert cma.memory_ratio([1.0, 0.5, 1.5], [1.0, 1.0, 1.0]) == 0.5   # |log 0.5| > |log 1.5|
    assert cma.memory_ratio([1.2], [1.0]) == pytest.approx(1.2)
    assert cma.memory_ratio([1.0], [0.0]) == math.inf


def test_summary_counts_distinct_plans_per_metric_and_scheduler():
    rows = [_row("mlp", "dp", "L1", "S1", mem=[100], audit_mem=[100], bytes_ratio=1.0,
                 pred_s=1.0, audit_s=1.1),
            _row("mlp", "auto", "L1", "S9", mem=[100], audit_mem=[300], bytes_ratio=9.0,
                 pred_s=5.0, audit_s=1.0),   # collapses into dp: its figures are not counted
            _row("mlp", "zero3", "L2", "S2", mem=[100], audit_mem=[125], bytes_ratio=0.5,
                 pred_s=2.0, audit_s=2.2),
            _row("mlp", "pipe", "L3", "S3", kind="pipeline", mem=[100, 100],
                 audit_mem=[105, 95], bytes_ratio=1.1, pred_s=3.0, audit_s=3.0),
            _row("gpt", "dp", "L1", "S1", mem=[100], audit_mem=[100], pred_s=1.0, audit_s=2.0),
            _row("gpt", "tp", "L4", "S4", mem=[100], audit_mem=[100], pred_s=2.0, audit_s=1.0)]
    # The memory scheduler's compile of the pipeline is missing (e.g. its subprocess timed out).
    for key in ("audit_memory_by_scheduler", "memory_ratio_by_scheduler"):
        del rows[3][key]["memory"]
    s = cma.summarize(rows, [], ["concurrency", "memory"])
    assert (s["cases"], s["distinct_plans"]) == (6, 5)
    assert s["distinct_by_model"] == {"mlp": 3, "gpt": 2}
    mem = s["memory"]["concurrency"]
    assert (mem["within"], mem["plans"]) == (4, 5)
    assert mem["worst"] == pytest.approx(0.8) and mem["worst_case"] == "mlp zero3"
    assert mem["median"] == pytest.approx(1.0)
    assert (s["memory"]["memory"]["within"], s["memory"]["memory"]["plans"]) == (3, 4)
    assert (s["bytes"]["within"], s["bytes"]["plans"]) == (4, 5)
    assert s["bytes"]["outside"] == ["mlp zero3 0.50"]
    assert (s["time"]["within"], s["time"]["plans"]) == (3, 5)
    ranks = {r["model"]: r for r in s["ranking_predicted_vs_audited"]}
    assert ranks["mlp"]["spearman"] == pytest.approx(1.0)          # dp < zero3 < pipe both ways
    assert ranks["gpt"]["spearman"] == pytest.approx(-1.0) and not ranks["gpt"]["same_best"]
    assert s["spearman_mean"] == pytest.approx(0.0)
    lines = "\n".join(cma.summary_lines(s, ["concurrency", "memory"]))
    assert "distinct plans measured: 5 of 6 cases" in lines
    assert "memory within ±10%, concurrency scheduler: 4/5" in lines
    assert "memory within ±10%, memory scheduler: 3/4" in lines


def test_scheduler_flags():
    assert cma.scheduler_of("--xla_force_host_platform_device_count=8") == "concurrency"
    assert cma.scheduler_of(f"--a=1 {cma.SCHEDULER_FLAG}") == "memory"
    assert cma.scheduler_of("--xla_cpu_enable_concurrency_optimized_scheduler=true") \
        == "concurrency"
    flags = f"--x=1 {cma.SCHEDULER_FLAG}"
    assert cma.flags_for("concurrency", flags) == "--x=1"
    assert cma.scheduler_of(cma.flags_for("memory", "--x=1")) == "memory"
    assert cma.flags_for("memory", flags).count("scheduler") == 1


def test_quick_run_writes_a_computed_summary_under_both_schedulers(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cost_model_accuracy", "--quick", "--models", "mlp",
         "--skip-measured", "--out-dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "cost_model_accuracy.json").read_text())
    s = data["summary"]
    assert data["config"]["other_scheduler"]["error"] is None
    assert set(s["memory"]) == {"concurrency", "memory"}
    # dp, tp 1x8, auto 1x8, auto and one budget: auto 1x8 and auto are dp's plan.
    labels = [r["plan"] for r in data["audit"]]
    assert labels[:4] == ["dp", "tp 1x8", "auto 1x8", "auto"]
    assert s["distinct_plans"] < s["cases"]
    assert any(g["cases"][:2] == ["dp", "auto 1x8"] for g in s["groups"])
    for r in data["audit"]:
        assert set(r["audit_memory_by_scheduler"]) == {"concurrency", "memory"}
    assert s["replay_max_rel_diff"] < 0.01
    md = (tmp_path / "cost_model_accuracy.md").read_text()
    assert f"distinct plans measured: {s['distinct_plans']} of {s['cases']} cases" in md
    assert "load average" in md
    assert (tmp_path / "cost_model_accuracy.png").stat().st_size > 0


def test_unaudited_transfer_seconds_include_the_receivers_gather():
    from types import SimpleNamespace

    from benchmarks.cost_model_accuracy import _copies_s

    plan = SimpleNamespace(stages=[None, None], solver={"transfers": [
        {"what": "activation", "from_stage": 0, "to_stage": 1, "copy_s": 2.0, "gather_s": 0.5},
        {"what": "cotangent", "from_stage": 1, "to_stage": 0, "copy_s": 1.0, "gather_s": 0.25},
        {"what": "cotangent", "from_stage": 1, "to_stage": 0, "copy_s": 4.0},  # older record
    ]})
    # Copies on the stage that receives the activation (and sends its cotangent back),
    # gathers where the value arrives.
    assert _copies_s(plan) == [0.25, 7.5]

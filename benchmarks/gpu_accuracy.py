"""The GPU step-time model against published and measured real runs it was not calibrated on.

    python -m benchmarks.gpu_accuracy [--only SOURCE ...]

Each row is one real training run: a zoo GPT (or the lent-GPU check's models) at the run's
batch, sequence length and precision, planned by autopar on the run's cluster preset with the
run's layout (`Manual3DParallel` at its data/tensor/pipeline degrees and micro-batch count;
`ShardParallel` on one device for the lent-GPU rows, a one-stage pipeline of k micro-batches
for the lent-GPU series), and the plan's predicted step time (and
memory, where the run published it) set against the measured one.  Nothing is compiled or
run: planning only, on CPU.

Calibration and validation are disjoint: ``cost_model/kernel_efficiency.json`` (the matmul
efficiency by size and the bandwidth fractions the presets use) holds the calibration
sources, and no row here comes from them:

* the V100's FP16 point: Megatron-LM's single-GPU run (Shoeybi et al. 2019, §5.1);
* the H100's points: the matmul and bandwidth *profile* rows of
  ``benchmarks/results/gpu-NVIDIA-H100-80GB-HBM3.md``, whose *train-step* rows are validated
  here;
* the H200's curve: the matmul sweep (*matmul-chain* rows) of
  ``benchmarks/results/gpu-NVIDIA-H200-series.md`` and the bandwidth rows of
  ``gpu-NVIDIA-H200.md``; the train steps of both (the micro-batch series and the zoo models)
  are validated here.

Validation sources (`RUNS`): Alpa's README sanity check (8 x V100-16GB), Alpa's published
benchmark log ``benchmark/alpa/11-10.txt`` (GPT on 1-4 V100-32GB), Megatron-LM's Table 1
(Narayanan et al. 2021, A100-80GB, the rows up to 39.1B parameters), the lent-GPU train
steps and the lent H200's micro-batch series (gpt-350m and gpt-125m at batch 32 in 1 to 16
micro-batches).  Writes ``benchmarks/results/gpu_accuracy.{md,json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import autopar
from autopar import models as zoo
from autopar.cost_model import ClusterSpec, efficiency
from benchmarks import alpa_plans, suite
from benchmarks.layouts import Pricer
from benchmarks.stamp import stamp, stamp_markdown

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
GIB = 2.0**30
TOLERANCE = 0.15  # issue 46: predicted step within 15% of measured

ALPA_GPT = {"param_dtype": "float16", "tied": False}  # Alpa's GPT benchmark: fp16 + master copy


@dataclasses.dataclass(frozen=True)
class Run:
    """One real run and how autopar plans it.

    Attributes:
      source: the validation source (one of `SOURCES`).
      label: the row's name in the results.
      model: zoo model whose config `overrides` adjust.
      batch: global batch (sequences or images).
      cluster: preset name, e.g. ``"8xV100-16GB"``.
      layout: ``(dp, tp, pp, micro-batches)`` for `Manual3DParallel`; None: `ShardParallel`
        (or `alpa` when set).
      measured_step_s: measured seconds per training step.
      measured_memory_bytes: measured peak bytes per device, None where not published.
      note: what the row assumes beyond its source.
      overrides: zoo config fields replaced for this run.
      alpa: Alpa's own plan for the run (stages, sub-meshes, logical meshes), priced as
        `benchmarks.suite` prices Alpa's published plans.
      series: rows that differ only in the micro-batch count share it (the sign of the
        micro-batch-count effect is compared along it).
    """

    source: str
    label: str
    model: str
    batch: int
    cluster: str
    layout: tuple[int, int, int, int] | None
    measured_step_s: float
    measured_memory_bytes: float | None
    note: str = ""
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    alpa: alpa_plans.AlpaPlan | None = None
    series: str = ""


SOURCES: dict[str, str] = {
    "alpa-readme": ("alpa-projects/alpa benchmark/alpa/README.md, 'Sanity Check' (AWS "
                    "p3.16xlarge, 2022-04-24): 'Mean Time: 2.425s', 'Peak Mem: 8.745G'"),
    "alpa-log": ("alpa-projects/alpa benchmark/alpa/11-10.txt: 'Mean Time (s)' and 'Peak Mem "
                 "(GB)' of each case; 32 GB devices (the grid logs beside it report "
                 "avail=28.031GB), read as V100-32GB"),
    "alpa-grid": ("alpa-projects/alpa benchmark/alpa/grid_log/grid_8.txt: GPT-2.6B, batch 1024, "
                  "one host of 8 x 32 GB devices (avail=28.031GB, read as V100-32GB), Alpa's "
                  "search at num_auto_layers=8 and 64, 128, 256 micro-batches: each case's "
                  "'Result forward_stage_layer_ids / mesh_shapes / logical_mesh_shapes / "
                  "autosharding_option_dicts' and its 'Mean Time (s)', 'Peak Mem (GB)'"),
    "megatron": ("Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on "
                 "GPU Clusters Using Megatron-LM' (arXiv 2104.04473), Table 1 (Selene, "
                 "80-GB A100s, seq 2048, vocab 51200); measured step = eq. (3) FLOPs / "
                 "(achieved teraFLOP/s per GPU x GPUs)"),
    "lent-gpu": ("benchmarks/results/gpu-NVIDIA-H100-80GB-HBM3.md and gpu-NVIDIA-H200.md "
                 "(python -m benchmarks.gpu_check, 2026-11-27): the 'autopar ms' train-step "
                 "column and the compiled memory"),
    "lent-gpu-series": ("benchmarks/results/gpu-NVIDIA-H200-series.md and "
                        "gpu-NVIDIA-H200-series-125m.md (python -m benchmarks.gpu_check "
                        "--series, lent H200, 2026-12-04): a zoo GPT at one batch as a one-stage "
                        "pipeline in k micro-batches, the 'measured ms' column"),
}


def megatron_step_s(batch: int, layers: int, hidden: int, tflops_per_gpu: float,
                    gpus: int, seq: int = 2048, vocab: int = 51200) -> float:
    """Seconds per step from Table 1: F = 96·B·s·l·h²·(1 + s/6h + V/16lh) (eq. 3) over the
    achieved FLOP/s of all GPUs."""
    flops = 96 * batch * seq * layers * hidden**2 * (
        1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return flops / (tflops_per_gpu * 1e12 * gpus)


def _megatron(params_b: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int,
              batch: int, tflops: float) -> Run:
    dp = gpus // (tp * pp)
    micro = batch // dp if pp > 1 else 1
    note = ("micro-batch size 1 assumed (Table 1 gives none)" if pp > 1 else
            "no gradient accumulation assumed (Table 1 gives no micro-batch size)")
    return Run("megatron", f"GPT-{params_b}B, {gpus} GPUs, tp{tp} pp{pp} dp{dp}", "gpt-1.3b",
               batch, f"{gpus // 8}x8xA100-80GB", (dp, tp, pp, micro),
               megatron_step_s(batch, layers, hidden, tflops, gpus), None,
               note + "; tied embedding, fp16 parameters with a float32 master copy",
               {"hidden": hidden, "layers": layers, "heads": heads, "seq": 2048,
                "param_dtype": "float16", "tied": True})


def _lent(kind: str, preset: str, model: str, batch: int, step_ms: float,
          compiled_gib: float) -> Run:
    return Run("lent-gpu", f"{model} batch {batch}, 1 x {kind}", model, batch, preset, None,
               step_ms / 1e3, compiled_gib * GIB, "zoo defaults (the check's own steps)")


def _lent_series(model: str, batch: int, micro: int, step_ms: float) -> Run:
    return Run("lent-gpu-series", f"{model} batch {batch}, 1 x H200-141GB, {micro} "
               "micro-batches", model, batch, "1xH200-141GB", (1, 1, 1, micro), step_ms / 1e3,
               None, "zoo defaults; Manual3DParallel(1, 1, 1, k), as the check ran it",
               series=f"{model} batch {batch} 1xH200-141GB one stage")


def _alpa_grid(micro: int, stage_layers: Sequence[Sequence[int]],
               submeshes: Sequence[tuple[int, int]], logical: Sequence[tuple[int, int]],
               force_dp: Sequence[bool], step_s: float, mem_gb: float) -> Run:
    plan = alpa_plans.AlpaPlan("gpt-2.6b", micro, 8, tuple(tuple(s) for s in stage_layers),
                               tuple(submeshes), tuple(logical), tuple(force_dp))
    return Run("alpa-grid", f"GPT-2.6B batch 1024, 8 GPUs, {micro} micro-batches, "
               f"{len(stage_layers)} stages (Alpa's plan)", "gpt-2.6b", 1024, "8xV100-32GB",
               None, step_s, mem_gb * GIB, "as alpa-readme; Alpa's 8 layers mapped onto "
               "autopar's (benchmarks/alpa_plans.py map_stages)", ALPA_GPT, plan,
               "gpt-2.6b 8xV100-32GB Alpa search")


RUNS: tuple[Run, ...] = (
    Run("alpa-readme", "GPT-2.6B batch 32, 2x2x2, 4 micro-batches", "gpt-2.6b", 32,
        "8xV100-16GB", (2, 2, 2, 4), 2.425, 8.745 * GIB,
        "fp16 parameters with a float32 master copy, untied embedding (Alpa's GPT benchmark)",
        ALPA_GPT),
    Run("alpa-log", "GPT-350M batch 1024, 1 GPU, 32 micro-batches", "gpt-350m", 1024,
        "1xV100-32GB", (1, 1, 1, 32), 75.251, 26.098 * GIB, "as alpa-readme", ALPA_GPT),
    Run("alpa-log", "GPT-760M batch 1024, 2 GPUs op=2, 32 micro-batches", "gpt-760m", 1024,
        "2xV100-32GB", (1, 2, 1, 32), 73.257, 19.061 * GIB, "as alpa-readme", ALPA_GPT),
    Run("alpa-log", "GPT-1.3B batch 1024, 4 GPUs dp=4, 32 micro-batches", "gpt-1.3b", 1024,
        "4xV100-32GB", (4, 1, 1, 32), 49.219, 13.137 * GIB, "as alpa-readme", ALPA_GPT),
    Run("alpa-log", "GPT-760M batch 1024, 2 stages of 1 GPU, 64 micro-batches", "gpt-760m",
        1024, "2xV100-32GB", (1, 1, 2, 64), 59.206, 14.489 * GIB, "as alpa-readme", ALPA_GPT),
    _alpa_grid(64, [[0, 1, 2, 3], [4, 5, 6, 7]], [(1, 4)] * 2, [(4, 1)] * 2, [True] * 2,
               44.997, 13.196),
    _alpa_grid(128, [[0], [1], [2], [3], [4, 5, 6, 7]], [(1, 1)] * 4 + [(1, 4)],
               [(1, 1)] * 4 + [(4, 1)], [True, False, True, True, True], 48.299, 13.032),
    _alpa_grid(256, [[k] for k in range(8)], [(1, 1)] * 8, [(1, 1)] * 8,
               [False] + [True] * 7, 67.063, 10.725),
    _megatron("1.7", 24, 2304, 24, 1, 1, 32, 512, 137),
    _megatron("3.6", 32, 3072, 30, 2, 1, 64, 512, 138),
    _megatron("7.5", 32, 4096, 36, 4, 1, 128, 512, 142),
    _megatron("18.4", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _megatron("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _lent("H100-80GB", "1xH100-80GB", "gpt-125m", 8, 44.87, 4.08),
    _lent("H100-80GB", "1xH100-80GB", "gpt-350m", 8, 116.08, 6.95),
    _lent("H100-80GB", "1xH100-80GB", "moe-380m", 8, 50.12, 6.47),
    _lent("H100-80GB", "1xH100-80GB", "wrn-250m", 32, 75.68, 6.00),
    _lent("H200-141GB", "1xH200-141GB", "gpt-125m", 8, 38.50, 4.08),
    _lent("H200-141GB", "1xH200-141GB", "gpt-350m", 8, 99.21, 6.95),
    _lent("H200-141GB", "1xH200-141GB", "moe-380m", 8, 43.54, 6.47),
    _lent("H200-141GB", "1xH200-141GB", "wrn-250m", 8, 31.48, 4.29),
    *(_lent_series("gpt-350m", 32, k, ms) for k, ms in
      ((1, 389.66), (2, 372.29), (4, 396.78), (8, 452.36), (16, 522.39))),
    *(_lent_series("gpt-125m", 32, k, ms) for k, ms in ((1, 142.72), (4, 152.04), (16, 211.98))),
)


def price(run: Run) -> dict[str, Any]:
    """Plans `run` on its preset and returns its row: predictions, measurements and their
    ratios."""
    t0 = time.perf_counter()
    cluster = ClusterSpec.preset(run.cluster)
    if run.alpa is not None:
        pricer = Pricer(run.model, run.batch, cluster, overrides=tuple(run.overrides.items()))
        layers = len(pricer.workload(run.alpa.micro).layers)
        predicted, _ = suite.price_alpa_plan(pricer, run.alpa, layers)
    else:
        step, args = zoo.train_step_and_args(run.model, run.batch,
                                             overrides=dict(run.overrides))
        if run.layout is None:
            method = autopar.ShardParallel(memory_budget_bytes=1e12)
        else:
            dp, tp, pp, micro = run.layout
            method = autopar.Manual3DParallel(dp=dp, tp=tp, pp=pp, num_micro_batches=micro,
                                              memory_budget_bytes=1e12)
        predicted = autopar.plan(step, *args, cluster=cluster, method=method).predicted
    mem = run.measured_memory_bytes
    return {
        "source": run.source, "label": run.label, "model": run.model, "batch": run.batch,
        "overrides": dict(run.overrides), "cluster": run.cluster,
        "layout": None if run.layout is None else dict(zip(("dp", "tp", "pp", "micro"),
                                                           run.layout)),
        "alpa_plan": None if run.alpa is None else alpa_plans.describe(
            run.alpa, alpa_plans.map_stages(run.alpa, layers)),
        "micro": run.alpa.micro if run.alpa else run.layout[3] if run.layout else 1,
        "series": run.series, "note": run.note,
        "measured_step_s": run.measured_step_s, "predicted_step_s": predicted.step_s,
        "step_ratio": predicted.step_s / run.measured_step_s,
        "measured_memory_bytes": mem, "predicted_memory_bytes": predicted.memory_bytes,
        "memory_ratio": None if mem is None else predicted.memory_bytes / mem,
        "plan_s": time.perf_counter() - t0,
    }


def summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Worst and median |log| step ratio, the count within `TOLERANCE`, per source and all."""
    def one(rs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        ratios = [r["step_ratio"] for r in rs]
        worst = max(ratios, key=lambda x: max(x, 1 / x))
        return {"rows": len(rs), "worst": worst, "median": statistics.median(ratios),
                "within": sum(abs(x - 1) <= TOLERANCE for x in ratios)}
    by_source = {s: one([r for r in rows if r["source"] == s])
                 for s in dict.fromkeys(r["source"] for r in rows)}
    return {"all": one(rows), "by_source": by_source, "micro_series": micro_signs(rows)}


def micro_signs(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per series (rows differing only in the micro-batch count), the sign of the step
    time's change from each micro-batch count to the next, measured and predicted."""
    def signs(rs: Sequence[Mapping[str, Any]], key: str) -> list[int]:
        return [(b[key] > a[key]) - (b[key] < a[key]) for a, b in zip(rs, rs[1:])]

    out = {}
    for name in dict.fromkeys(r["series"] for r in rows if r["series"]):
        rs = sorted((r for r in rows if r["series"] == name), key=lambda r: r["micro"])
        measured, predicted = signs(rs, "measured_step_s"), signs(rs, "predicted_step_s")
        out[name] = {"micro": [r["micro"] for r in rs], "measured": measured,
                     "predicted": predicted, "right": measured == predicted}
    return out


def markdown(report: Mapping[str, Any]) -> str:
    s = report["summary"]["all"]
    lines = [
        "# GPU step-time model against real runs", "", stamp_markdown(report["meta"]), "",
        f"{s['rows']} runs from {len(report['summary']['by_source'])} sources, none used for "
        f"calibration: predicted / measured step time worst {s['worst']:.2f}, median "
        f"{s['median']:.2f}; {s['within']} of {s['rows']} within {TOLERANCE:.0%}. Planning "
        "only (autopar.plan on the run's preset and layout, on CPU); no GPU ran here.", "",
        "## Calibration (cost_model/kernel_efficiency.json) and validation (this page)", "",
        "Calibration, not priced here: " + "; ".join(report["calibration"]) + ".", "",
        "| device kind | dtype | FLOPs per call | fraction of peak | source |",
        "|---|---|---:|---:|---|"]
    for kind, entry in report["table"].items():
        for dtype, points in entry["matmul"].items():
            lines += [f"| {kind} | {dtype} | {p['flops']:.3g} | {p['fraction']:.4g} | "
                      f"{p['source']} |" for p in points]
        bw = entry["bandwidth"]
        lines.append(f"| {kind} | memory bandwidth | — | {bw['fraction']:.4g} | "
                     f"{bw['source']} |")
    lines += ["", "Validation sources:", ""]
    lines += [f"- **{k}**: {v}" for k, v in SOURCES.items()
              if k in report["summary"]["by_source"]]
    lines += ["", "## Rows", "",
              "| source | run | preset | layout dp/tp/pp/micro | measured s | predicted s | "
              "predicted / measured | memory predicted / measured |",
              "|---|---|---|---|---:|---:|---:|---:|"]
    for r in report["rows"]:
        lay = r["layout"]
        layout = r["alpa_plan"] or ("ShardParallel" if lay is None else "/".join(
            str(lay[k]) for k in ("dp", "tp", "pp", "micro")))
        mem = "—" if r["memory_ratio"] is None else f"{r['memory_ratio']:.2f}"
        lines.append(f"| {r['source']} | {r['label']} | {r['cluster']} | {layout} | "
                     f"{r['measured_step_s']:.4g} | {r['predicted_step_s']:.4g} | "
                     f"{r['step_ratio']:.2f} | {mem} |")
    lines += ["", "| source | rows | worst | median | within 15% |", "|---|---:|---:|---:|---:|"]
    for k, v in report["summary"]["by_source"].items():
        lines.append(f"| {k} | {v['rows']} | {v['worst']:.2f} | {v['median']:.2f} | "
                     f"{v['within']} |")
    lines += ["", "Micro-batch-count effect (sign of the step time's change from one count to "
              "the next):", "", "| series | micro-batches | measured | predicted | sign right |",
              "|---|---|---|---|---|"]
    for name, m in report["summary"]["micro_series"].items():
        lines.append(f"| {name} | {', '.join(map(str, m['micro']))} | {m['measured']} | "
                     f"{m['predicted']} | {'yes' if m['right'] else 'no'} |")
    lines += ["", "## Assumptions", ""]
    lines += [f"- {r['label']}: {r['note']}" for r in report["rows"] if r["note"]]
    lines += [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


CALIBRATION = (
    "the V100's FP16 point, Megatron-LM's single-GPU run (Shoeybi et al. 2019, §5.1)",
    "the H100's matmul (4096³ and 8192³) and elementwise timings, the profile rows of "
    "benchmarks/results/gpu-NVIDIA-H100-80GB-HBM3.md (its train-step rows are validation rows "
    "here)",
    "the H200's matmul sweep (matmul-chain rows: transformer-shaped matmuls of 4.3 GFLOP to "
    "4.4 TFLOP inside one program) of benchmarks/results/gpu-NVIDIA-H200-series.md, and its "
    "elementwise timings of gpu-NVIDIA-H200.md (the train steps of both files are validation "
    "rows here)",
    "the rows of cost_model/kernel_efficiency.json, as this run read them",
)
NOTES = (
    "A100 has no row in kernel_efficiency.json (no calibration source outside the "
    "validation set): its matmuls are priced at the datasheet peak, float32 at TF32.",
    "Alpa's grid rows run Alpa's own plans: their layers (alpa_plans.map_stages), stage "
    "sub-meshes and logical meshes, each stage's layout solved by autopar's layer ILPs on "
    "Alpa's logical mesh (benchmarks.suite.price_alpa_plan), the faster of the optimizer "
    "state whole or split kept; Alpa searched each case's plan, so the series changes plan "
    "as well as micro-batch count.",
    "Convolutions are priced with the matmul curve of their dtype: no convolution "
    "measurement is a calibration source.",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(SOURCES),
                        help="price only these sources (results files are not written)")
    args = parser.parse_args(argv)
    runs = [r for r in RUNS if not args.only or r.source in args.only]
    rows = []
    for run in runs:
        row = price(run)
        rows.append(row)
        print(f"{run.source:12s} {run.label:55s} predicted/measured {row['step_ratio']:.2f} "
              f"({row['plan_s']:.0f} s)", flush=True)
    with open(efficiency.TABLE_PATH, encoding="utf-8") as f:
        table = json.load(f)["devices"]
    report = {"meta": stamp(), "summary": summary(rows), "rows": rows,
              "sources": SOURCES, "calibration": list(CALIBRATION), "table": table,
              "notes": list(NOTES)}
    s = report["summary"]["all"]
    print(f"worst {s['worst']:.2f}, median {s['median']:.2f}, {s['within']}/{s['rows']} "
          f"within {TOLERANCE:.0%}")
    if not args.only:
        (RESULTS / "gpu_accuracy.json").write_text(json.dumps(report, indent=1) + "\n")
        (RESULTS / "gpu_accuracy.md").write_text(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What cutting a stage into layers costs the plan, and how much of it the search wins back
by solving a chosen stage's layers as one program: on the generated family.

    python -m benchmarks.layering_gap [--seeds 0-11] [--scale 4] [--output-dir DIR]

The pipeline search solves each layer's ILP alone and prices a stage as the sum of its
layers plus the resharding between them (`autopar.pipeline_search`); its assembly then
also tries each chosen stage's layers as one program (one ILP that sees the values they
share: `StageCosts.joint_alternatives`) and keeps it where the step gets faster.  Per
model (runtime_overhead's: the MLP 4x512, gpt-toy and tests/generated.py's draws at
`--scale` times its sizes, 8 emulated CPU devices, cost model `cpu-local`, 4
micro-batches): ShardParallel's predicted step, and for 1 and 2 stages with
`layer_num="auto"` the predicted step of the plan of layer solutions (before the joint
solves: `Plan.solver["layered_step_s"]`) and of the plan the search returns, against
`layer_num` = the stage count (one layer per stage; with 2 stages that also fixes where
the cut lands).  Ratio > 1: the automatic layering predicts a slower step than one layer
per stage.  Predictions only: nothing runs.  Writes benchmarks/results/layering_gap.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

from benchmarks.runtime_overhead import SCALE, SEEDS, _gpt_case, _mlp_case, _seeds
from benchmarks.stamp import stamp, stamp_markdown

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MICRO = 4
TIME_LIMIT_S = 10.0
# Ratio above which a row counts as the automatic layering losing (a step 5% slower).
LOSS = 1.05


def _predict(step, state, batch, method) -> tuple[float | None, float | None, float, str]:
    """(predicted step seconds, the step of its layer solutions, planning seconds, why
    none); None seconds where the method refuses the model."""
    import autopar

    t0 = time.perf_counter()
    try:
        plan = autopar.parallelize(step, method=method).get_plan(state, batch)
    except ValueError as err:   # a refusal the method documents (too few layers)
        return None, None, time.perf_counter() - t0, str(err).splitlines()[0][:160]
    return (plan.predicted.step_s, autopar.pipeline_search.layered_step_s(plan),
            time.perf_counter() - t0, "")


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def measure(name: str, family: str, step, state, batch) -> dict:
    """One model's row: predicted seconds of ShardParallel and of 1 and 2 stages (layer
    solutions, the search's plan, one layer per stage), and each plan's search seconds."""
    import autopar

    row: dict = {"model": name, "family": family}
    shard = autopar.ShardParallel(num_micro_batches=MICRO, time_limit_s=TIME_LIMIT_S)
    row["shard_s"], _, row["shard_search_s"], _ = _predict(step, state, batch, shard)
    for stages in (1, 2):
        for label, layers in (("auto", "auto"), ("joint", stages)):
            method = autopar.PipeshardParallel(num_micro_batches=MICRO, num_stages=stages,
                                               layer_num=layers, time_limit_s=TIME_LIMIT_S)
            s, layered, secs, why = _predict(step, state, batch, method)
            row[f"{label}{stages}_s"] = s
            row[f"{label}{stages}_search_s"] = round(secs, 2)
            if label == "auto":
                row[f"layers{stages}_s"] = layered
            if why:
                row[f"{label}{stages}_skip"] = why
        joint = row[f"joint{stages}_s"]
        row[f"before{stages}"] = _ratio(row[f"layers{stages}_s"], joint)
        row[f"ratio{stages}"] = _ratio(row[f"auto{stages}_s"], joint)
    print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in row.items()
                                   if k.startswith(("ratio", "before"))),
          file=sys.stderr, flush=True)
    return row


def summary(rows: list[dict]) -> list[dict]:
    """Per stage count and plan (`layers`: the layer solutions; `search`: the plan the
    search returns): models compared, worst / median / best ratio to one layer per stage,
    and how many lose by more than `LOSS`."""
    out = []
    for stages in (1, 2):
        for plan, key in (("layers", f"before{stages}"), ("search", f"ratio{stages}")):
            ratios = [r[key] for r in rows if r.get(key)]
            if ratios:
                out.append({"stages": stages, "plan": plan, "models": len(ratios),
                            "worst": max(ratios),
                            "median": round(statistics.median(ratios), 3),
                            "best": min(ratios), "losing": sum(x > LOSS for x in ratios)})
    return out


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.2f}"


def markdown(rows: list[dict], meta: dict, scale: int) -> str:
    lines = ["# Layering gap: a stage cut into layers vs one ILP per stage", "",
             stamp_markdown(meta), "",
             f"Predicted step (ms, cost model `cpu-local`, 8 emulated CPU devices, {MICRO} "
             "micro-batches) of each pipeline with `layer_num=\"auto\"`: its plan of layer "
             "solutions (each layer's ILP alone, a stage the sum of its layers and the "
             "resharding between them) and the plan the search returns (a chosen stage's "
             "layers solved as one program where that is faster), against `layer_num` = the "
             "stage count (one ILP per stage; with 2 stages that also fixes the cut).  "
             "Ratio = that plan / one layer per stage (> 1: the automatic layering plans a "
             f"slower step; 'losing' counts ratios > {LOSS}).  Models: runtime_overhead's "
             f"(MLP 4x512, gpt-toy, tests/generated.py at {scale} x its sizes).", "",
             "| stages | plan | models | worst | median | best | losing |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {s['stages']} | {s['plan']} | {s['models']} | {s['worst']:.2f} | "
              f"{s['median']:.2f} | {s['best']:.2f} | {s['losing']} |" for s in summary(rows)]
    lines += ["", "| model | ShardParallel | 1 stage: layers | search | one ILP | ratios | "
              "2 stages: layers | search | one ILP per stage | ratios | search s (auto1 / "
              "joint1 / auto2 / joint2) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratios = ["/".join("—" if r.get(f"{k}{n}") is None else f"{r[f'{k}{n}']:.2f}"
                           for k in ("before", "ratio")) for n in (1, 2)]
        lines.append(
            f"| {r['model']} | {_ms(r['shard_s'])} | {_ms(r['layers1_s'])} | "
            f"{_ms(r['auto1_s'])} | {_ms(r['joint1_s'])} | {ratios[0]} | "
            f"{_ms(r['layers2_s'])} | {_ms(r['auto2_s'])} | {_ms(r['joint2_s'])} | "
            f"{ratios[1]} | {r['auto1_search_s']} / {r['joint1_search_s']} / "
            f"{r['auto2_search_s']} / {r['joint2_search_s']} |")
    skips = [(r["model"], k, r[k]) for r in rows for k in r if k.endswith("_skip")]
    if skips:
        lines += ["", "Not planned: " + "; ".join(f"{m} {k[:-5]}: {why}" for m, k, why in skips)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.layering_gap")
    ap.add_argument("--seeds", type=_seeds, default=SEEDS,
                    help="generated models' seeds, 'A-B' or 'A,B,...' (default 0-11)")
    ap.add_argument("--scale", type=int, default=SCALE,
                    help=f"generated models' sizes times this (default {SCALE})")
    ap.add_argument("--output-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.scale < 1:
        ap.error("--scale must be positive")
    from autopar import demo

    demo.use_cpu_devices()
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    import generated

    rows = [measure("mlp 4x512, batch 256", "mlp", *_mlp_case(256, 512, 4)),
            measure("gpt-toy, batch 64", "gpt", *_gpt_case())]
    for seed in args.seeds:
        case = generated.generate(seed, scale=args.scale)
        rows.append(measure(case.name, case.family, case.step, case.init(), case.batch(0)))
    meta = stamp()
    out = pathlib.Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, meta, args.scale)
    (out / "layering_gap.md").write_text(text)
    (out / "layering_gap.json").write_text(json.dumps(
        {"meta": meta, "seeds": list(args.seeds), "scale": args.scale, "micro_batches": MICRO,
         "rows": rows, "summary": summary(rows)}, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

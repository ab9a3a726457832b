"""The auto micro-batch search's premise, checked on generated models it was not tuned on.

`python -m benchmarks.bound_premise [--seeds 12] [--start 0] [--time-limit 5]`

`PipeshardParallel(num_micro_batches="auto")` leaves out a count when the stage costs of a
count already searched bound it above the best plan found (`autopar.micro_batches`).  The
bound holds if no layer range is faster per row on smaller micro-batches, a premise about
the stages the pipeline search assembles, not a theorem.  For each seeded model of
tests/generated.py (seed s is family s % 6: MLPs, attention blocks, conv + BatchNorm,
mixture-of-experts, tied embeddings, `nn.scan`) this plans every count of
`micro_batches.ladder(batch rows)` with `PipeshardParallel(num_micro_batches=count)` on 8
emulated CPU devices (cost model `cpu-local`; stage count and sub-meshes chosen by the
search), and checks every (table, count) pair: the bound one count's stage costs give a
count at or above it (`micro_batches.lower_bound_s`) against that count's searched plan of
layer solutions (before any stage was solved as one program, which only lowers it).
A violation is a bound above the plan: the auto search could have left out a count that
wins.  It also reports how tight the bound from every smaller count's table is (bound /
plan, 1.0 = exact), which is what lets the auto search leave counts out.

Writes benchmarks/results/bound_premise.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # before any JAX import: 8 emulated devices
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("AUTOPAR_CACHE_DIR", "")  # plan afresh, write nothing into $HOME

import jax

import autopar
from autopar import micro_batches, pipeline_search
from autopar.microbatch import MicroBatchError
from autopar.passes.inter_op import NoStageLayoutError
from benchmarks.intra_op_reference import median, page_head
from benchmarks.stamp import stamp

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests"))
import generated  # noqa: E402  (tests/generated.py: the seeded model generator)

DEVICES = 8
TOLERANCE = 1e-9   # relative: a bound this far above its plan is rounding, not a violation


def run_model(seed: int, time_limit_s: float) -> dict:
    """Every count's plan of generated model `seed` and every (table, count) pair's bound."""
    case = generated.generate(seed)
    state, batch = case.init(), case.batch(0)
    rows = jax.tree_util.tree_leaves(batch)[0].shape[0]
    plans, counts = {}, []
    with pipeline_search.recording():
        for count in micro_batches.ladder(rows):
            method = autopar.PipeshardParallel(num_micro_batches=count,
                                               time_limit_s=time_limit_s)
            t0 = time.perf_counter()
            try:
                plan = autopar.parallelize(case.step, method=method).get_plan(state, batch)
            except (autopar.MemoryBudgetError, NoStageLayoutError, MicroBatchError) as err:
                # no layout fits, or the batch does not split: as the auto search skips it
                counts.append({"count": count, "error": f"{type(err).__name__}: {err}"[:200]})
                continue
            plans[count] = plan
            counts.append({"count": count, "step_s": pipeline_search.layered_step_s(plan),
                           "returned_s": float(plan.predicted.step_s),
                           "stages": len(plan.stages),
                           "search_s": round(time.perf_counter() - t0, 2)})
    tables = {c: pipeline_search.StageCostTable.from_json(p.solver["stage_costs"])
              for c, p in plans.items()}
    pairs = []
    for b, table in tables.items():
        for c, plan in plans.items():
            bound = micro_batches.lower_bound_s([table], c)
            if bound is not None:
                layered = pipeline_search.layered_step_s(plan)
                pairs.append({"table": b, "count": c, "bound_s": float(bound),
                              "plan_s": layered,
                              "violation": bool(bound > layered * (1 + TOLERANCE))})
    for row in counts:   # the auto search's bound: every smaller count's table at once
        smaller = [t for b, t in tables.items() if b < row["count"]]
        if "step_s" in row and smaller:
            row["bound_over_plan"] = float(
                micro_batches.lower_bound_s(smaller, row["count"]) / row["step_s"])
    return {"name": case.name, "seed": seed, "rows": rows, "counts": counts, "pairs": pairs}


def markdown(models: list[dict], meta: dict, wall_s: float) -> str:
    pairs = [p for m in models for p in m["pairs"]]
    bad = [(m["name"], p) for m in models for p in m["pairs"] if p["violation"]]
    tight = [r["bound_over_plan"] for m in models for r in m["counts"]
             if "bound_over_plan" in r]
    errors = [(m["name"], r) for m in models for r in m["counts"] if "error" in r]
    lines = page_head("The auto micro-batch bound's premise on generated models", meta,
                      __doc__)
    lines += [
        "",
        f"**{len(bad)} violations in {len(pairs)} (table, count) pairs** over {len(models)} "
        f"models; bound from every smaller count / plan: median {median(tight):.3f}, "
        f"lowest {min(tight, default=float('nan')):.3f}, highest "
        f"{max(tight, default=float('nan')):.3f} (over 1 would be a violation); "
        f"{len(errors)} counts without a plan. {wall_s / 60:.1f} min in all.", "",
        "| model | rows | count | predicted step (ms) | stages | bound / plan | search s |",
        "|---|---|---|---|---|---|---|"]
    for m in models:
        for r in m["counts"]:
            if "error" in r:
                lines.append(f"| {m['name']} | {m['rows']} | {r['count']} | {r['error']} "
                             "| | | |")
                continue
            ratio = r.get("bound_over_plan")
            lines.append(f"| {m['name']} | {m['rows']} | {r['count']} | "
                         f"{r['step_s'] * 1e3:.4f} | {r['stages']} | "
                         f"{'-' if ratio is None else f'{ratio:.3f}'} | {r['search_s']} |")
    lines += ["", "## Violations", ""]
    lines += [f"- {name}: table of {p['table']} micro-batches bounds {p['count']} at "
              f"{p['bound_s'] * 1e3:.4f} ms, its plan {p['plan_s'] * 1e3:.4f} ms"
              for name, p in bad] or ["None."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=12, help="models: seeds start..")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=5.0,
                        help="seconds per layer ILP")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1 (got {args.seeds})")
    if len(jax.devices()) < DEVICES:
        parser.error(f"needs {DEVICES} devices, {len(jax.devices())} found")
    start, models = time.perf_counter(), []
    for seed in range(args.start, args.start + args.seeds):
        model = run_model(seed, args.time_limit)
        models.append(model)
        worst = max((p["bound_s"] / p["plan_s"] for p in model["pairs"]), default=0.0)
        print(f"{model['name']:16} rows {model['rows']:3}  pairs {len(model['pairs']):3}  "
              f"violations {sum(p['violation'] for p in model['pairs'])}  "
              f"highest bound/plan {worst:.3f}", flush=True)
    wall = time.perf_counter() - start
    meta = stamp()
    text = markdown(models, meta, wall)
    data = json.dumps({"meta": meta, "wall_s": wall, "models": models}, indent=1) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bound_premise.json").write_text(data)
    (args.out / "bound_premise.md").write_text(text)
    return 0 if not any(p["violation"] for m in models for p in m["pairs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

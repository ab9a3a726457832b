"""toulbar2 search settings on the penalty loop's first model of an IOPDDL instance.

    python -m benchmarks.solver_tb2_settings [--instance S] [--dir D] [--levels 2]

On a large instance the penalty loop (passes/solver/penalty.py) spends most of its time in
toulbar2 solves of the whole penalized, memory-free problem, each cut by a CPU-time
limit.  This benchmark builds the loop's first-round models exactly as solve() does
(reductions, memory prices for the first weights, `--levels` weight levels, no warm
start), then solves each level under every setting of SETTINGS at 13 s of CPU time, and
autopar's own setting at several limits, two solves at a time (one per worker, as in the
loop).  Per solve: the penalized cost toulbar2 reached, the real cost of its answer and
its largest memory overflow (bytes; negative: slack under the limit), both on the whole
instance (the reductions' constant cost included).  It answers two
questions: does a setting other than autopar's reach a lower penalized cost in the same
time, and how much does a longer solve buy (the trade between more rounds and longer
ones).  A second table starts each level again from the answer autopar's setting reached
in 13 s (toulbar2's first guess, its penalized cost the upper bound: what the loop's later
rounds do) under the settings of WARM_SETTINGS: a setting can win from a cold start and
lose from a warm one.

A lower penalized cost here does not make a better loop: the loop's answer depends on where
the answers overflow and on how the repair fares.  Whole solve() runs on S (240 s, 2
cores; autopar's setting: 1.031-1.042 of the best known cost in 5 runs, see toulbar2.py)
with a setting in every penalty solve: "no dead-end elimination" (best here from
a cold start) 1.106 and 1.110, its answers cheap but over the limit; preprocessing
elimination 1.017 and 1.043, and on A 1.0034 (autopar's: 1.0002; its rounds take longer);
DGVNS 1.017 and 1.038, and on M 1.044 (autopar's: 0.9999); every solve on the folded core
(fold.py) 1.062 and 1.088, against 1.022-1.034 without on the same day.  autopar keeps its
setting and its whole model.

Writes benchmarks/results/solver_tb2_settings.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

from autopar.passes.solver import load_iopddl
from autopar.passes.solver.local_search import LocalSearch, initial_strategies
from autopar.passes.solver.penalty import Penalty
from autopar.passes.solver.pool import Request, WorkerPool
from autopar.passes.solver.reduce import reduce_problem
from autopar.passes.solver.toulbar2 import PRICE_MAX_S, _price_weights
from benchmarks.solver_experiments import tb2_options
from benchmarks.solver_experiments.fold import LeafFold
from benchmarks.solver_iopddl import REPO, _fail, _load_average
from benchmarks.stamp import stamp, stamp_markdown

# name -> (LDS discrepancies, toulbar2 options beyond autopar's: tb2_options.TUNABLE_OPTIONS)
SETTINGS: dict[str, tuple[int, dict]] = {
    "autopar (HBFS, LDS 4, EDAC, DEE, elimination deg 3)": (4, {}),
    "LDS 1": (1, {}),
    "no LDS (HBFS only)": (0, {}),
    "no dead-end elimination": (4, {"DEE": 0}),
    "no variable elimination": (4, {"elimDegree": 0}),
    "FDAC instead of EDAC": (4, {"LcLevel": 3}),
    "AC instead of EDAC": (4, {"LcLevel": 1}),
    "depth-first B&B (no HBFS)": (4, {"hbfs": 0}),
    "DGVNS (decomposition-guided VNS, restart every 10,000 backtracks)":
        (4, {"searchMethod": 2, "restart": 10000}),
    "variable elimination of degree <= 2 in preprocessing": (4, {"elimDegree_preprocessing": 2}),
}
# autopar's setting on the core left by folding the model's leaves into their neighbours
# (solver_experiments/fold.py: the same optimum, a quarter of S's nodes).
FOLDED = "autopar's, on the core left by folding leaves (fold.py)"
# Settings solved again from the 13 s answer of autopar's (the first of SETTINGS).
WARM_SETTINGS = (FOLDED, "autopar (HBFS, LDS 4, EDAC, DEE, elimination deg 3)",
                 "DGVNS (decomposition-guided VNS, restart every 10,000 backtracks)",
                 "variable elimination of degree <= 2 in preprocessing")
SETTING_LIMIT_S = 13  # the loop's slice on S with 12 rounds (toulbar2.PENALTY_ROUNDS)
AUTOPAR_LIMITS_S = (6, 26, 40)  # autopar's setting, also at these CPU-time limits


def first_round_models(path: pathlib.Path, levels: int) -> tuple[Penalty, list, dict]:
    """The penalty loop's first-round penalized unaries (one per level) for the instance."""
    t0 = time.perf_counter()
    red, _ = reduce_problem(load_iopddl(path))
    ls = LocalSearch(red, 0)
    ls.reset(initial_strategies(red))
    w0, pstats = _price_weights(red, float(ls.cost), time.perf_counter() + PRICE_MAX_S)
    pen = Penalty(red, w0, levels)
    unaries = [pen.unary(pen.weights(j)) for j in range(levels)]
    info = {"reduced_nodes": red.num_nodes, "reduced_strategies": red.num_strategies(),
            "edges": len(red.edges), "checkpoints": len(red.cap),
            "setup_seconds": round(time.perf_counter() - t0, 1), **pstats}
    return pen, unaries, info


def run(path: pathlib.Path, levels: int) -> tuple[list[dict], dict]:
    pen, unaries, info = first_round_models(path, levels)
    fold = LeafFold(**pen.edge_arrays)
    info["core_nodes"] = len(fold.core)
    autopar, (lds0, opts0) = next(iter(SETTINGS.items()))
    jobs = [(name, lds, opts, SETTING_LIMIT_S, None) for name, (lds, opts) in SETTINGS.items()]
    jobs.insert(1, (FOLDED, lds0, opts0, SETTING_LIMIT_S, fold))
    jobs += [(autopar, lds0, opts0, t, None) for t in AUTOPAR_LIMITS_S]
    rows = []
    starts: list = [None] * levels  # per level: autopar's 13 s answer and its model cost
    with WorkerPool(2, grace_s=1.5, command=tb2_options.COMMAND) as pool:
        pool.warm_up()
        for name, lds, opts, limit, fld in jobs:
            answers = _solve(pool, pen, unaries, lds, opts, limit, None, fld)
            if name == autopar and limit == SETTING_LIMIT_S:
                starts = [None if a is None or "values" not in a.arrays
                          else (a.arrays["values"], a.meta["cost"]) for a in answers]
            rows += _rows(pen, unaries, answers, name, limit, "cold")
        if all(st is not None for st in starts):
            for name in WARM_SETTINGS:
                lds, opts, fld = lds0, opts0, fold
                if name != FOLDED:
                    (lds, opts), fld = SETTINGS[name], None
                answers = _solve(pool, pen, unaries, lds, opts, SETTING_LIMIT_S, starts, fld)
                rows += _rows(pen, unaries, answers, name, SETTING_LIMIT_S, "warm", starts)
    info["load_average"] = _load_average()
    return rows, info


def _solve(pool: WorkerPool, pen: Penalty, unaries: list, lds: int, opts: dict, limit: int,
           starts: list | None, fold: LeafFold | None = None) -> list:
    """One solve per level, two at a time; `starts`: per level (first guess, its model
    cost), the cost + 1 being the exclusive upper bound.  With `fold`, each level is
    solved on its core and the answers are expanded to the whole model (their costs are
    the same)."""
    reqs, folded = [], []
    for j, (u, _off) in enumerate(unaries):
        meta = {"time_limit_s": limit, "lds": lds, "seed": 1, "options": opts}
        if fold is None:
            arrays, base = {"unary": u}, pen.edge_arrays
        else:
            folded.append(fold.fold(u))
            arrays, base = {"unary": fold.core_unary(folded[j])}, fold.arrays
        if starts is not None:
            x0, cost = starts[j]
            if fold is not None:
                x0, cost = x0[fold.core], fold.core_cost(folded[j], x0)
            arrays["best"] = x0
            meta["ub"] = cost + 1.0
        key = "first-round" if fold is None else "first-round-core"
        reqs.append(Request(arrays, meta, base=key, base_arrays=base))
    answers = pool.run(reqs, time.perf_counter() + 2 * limit + 30)
    for ans, f in zip(answers, folded):
        if ans is not None and "values" in ans.arrays:
            ans.arrays["values"] = fold.expand(ans.arrays["values"], f)
    return answers


def _rows(pen: Penalty, unaries: list, answers: list, name: str, limit: int, start: str,
          starts: list | None = None) -> list[dict]:
    rows = []
    for j, (ans, (_u, off)) in enumerate(zip(answers, unaries)):
        def penalized(model_cost: float, off: float = off) -> float:
            """A model cost of this level on the whole instance (constant cost included)."""
            return model_cost / pen.scale + off + pen.red.offset

        row = {"setting": name, "level": j, "cpu_limit_s": limit, "start": start,
               "status": None if ans is None else ans.meta.get("status")}
        x = None
        if ans is not None and "values" in ans.arrays:
            x, model_cost = ans.arrays["values"], ans.meta["cost"]
        elif starts is not None and ans is not None and ans.meta.get("status") == "none":
            x, model_cost = starts[j]  # nothing below the warm start: it stands
        if x is not None:
            row["penalized_cost"] = penalized(model_cost)
            row["cost"] = pen.real_cost(x) + pen.red.offset
            row["overflow"] = float((pen.usage(x) - pen.red.cap).max())
        elif ans is not None and ans.meta.get("message"):
            row["message"] = ans.meta["message"]
        if starts is not None:
            row["start_penalized_cost"] = penalized(starts[j][1])
        rows.append(row)
        print(f"{name} | {start} | level {j} | {limit} s: {row.get('penalized_cost', '-')} "
              f"{row['status']}", flush=True)
    return rows


def markdown(rows: list[dict], info: dict, instance: str, meta: dict) -> str:
    cold = [r for r in rows if r["start"] == "cold"]
    warm = [r for r in rows if r["start"] == "warm"]
    best = {}
    for r in cold:
        if "penalized_cost" in r and r["cpu_limit_s"] == SETTING_LIMIT_S:
            best[r["level"]] = min(best.get(r["level"], np.inf), r["penalized_cost"])
    lines = [
        f"# toulbar2 settings on the first penalty round of IOPDDL {instance}",
        "",
        stamp_markdown(meta),
        "",
        "`python -m benchmarks.solver_tb2_settings` — the penalty loop's first-round "
        f"models ({info['reduced_nodes']:,} reduced nodes, {info['reduced_strategies']:,} "
        f"strategies, {info['edges']:,} edges, a core of {info['core_nodes']:,} nodes once "
        "leaves are folded; memory-price weights, no warm start), each "
        "weight level solved by one toulbar2 worker under a CPU-time limit, two solves at "
        "a time on 2 cores. penalized = cost + weight x usage (what toulbar2 minimises); "
        "vs best = penalized / the lowest penalized cost of that level at "
        f"{SETTING_LIMIT_S} s; overflow = largest usage over the limit (bytes; negative: "
        "slack).",
        "",
        "| setting | level | CPU limit s | status | penalized cost | vs best | real cost "
        "| overflow |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in cold:
        if "penalized_cost" in r:
            rel = r["penalized_cost"] / best[r["level"]] if r["level"] in best else np.nan
            lines.append(
                f"| {r['setting']} | {r['level']} | {r['cpu_limit_s']} | {r['status']} "
                f"| {r['penalized_cost']:,.0f} | {rel:.4f} | {r['cost']:,.0f} "
                f"| {r['overflow']:,.0f} |")
        else:
            lines.append(f"| {r['setting']} | {r['level']} | {r['cpu_limit_s']} "
                         f"| {r['status']} {r.get('message', '')} | – | – | – | – |")
    if warm:
        lines += [
            "", f"From a warm start: each level solved again for {SETTING_LIMIT_S} s from the "
            f"answer autopar's setting reached in {SETTING_LIMIT_S} s above (first guess; "
            "its penalized cost + 1 the upper bound; status none: nothing cheaper found, "
            "the start stands). vs start = penalized / the start's penalized cost.", "",
            "| setting | level | status | start penalized | penalized cost | vs start "
            "| real cost | overflow |",
            "|---|---|---|---|---|---|---|---|"]
        for r in warm:
            if "penalized_cost" in r:
                lines.append(
                    f"| {r['setting']} | {r['level']} | {r['status']} "
                    f"| {r['start_penalized_cost']:,.0f} | {r['penalized_cost']:,.0f} "
                    f"| {r['penalized_cost'] / r['start_penalized_cost']:.4f} "
                    f"| {r['cost']:,.0f} | {r['overflow']:,.0f} |")
            else:
                lines.append(f"| {r['setting']} | {r['level']} | {r['status']} "
                             f"{r.get('message', '')} | – | – | – | – | – |")
    load = info.get("load_average")
    if load:
        lines += ["", f"Load average (1 min, on 2 cores) at the end: {load[0]:.1f}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instance", default="S")
    ap.add_argument("--levels", type=int, default=2, help="weight levels (the loop: 2)")
    ap.add_argument("--dir", default=str(REPO.parent / "shared" / "iopddl"))
    args = ap.parse_args(argv)
    if args.levels < 1:
        _fail(f"--levels must be at least 1, got {args.levels}")
    path = pathlib.Path(args.dir) / f"asplos-2025-iopddl-{args.instance}.json.gz"
    if not path.is_file():
        _fail(f"instance file {path} does not exist (pass --dir or --instance)")
    rows, info = run(path, args.levels)
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    meta = stamp()
    text = markdown(rows, info, args.instance, meta)
    payload = json.dumps({"meta": meta, "instance": args.instance, "info": info, "rows": rows},
                         indent=1, default=str) + "\n"
    for suffix, body in (("json", payload), ("md", text)):
        tmp = out / f"solver_tb2_settings.{suffix}.tmp"
        tmp.write_text(body)
        tmp.replace(out / f"solver_tb2_settings.{suffix}")
    print(text)


if __name__ == "__main__":
    main()

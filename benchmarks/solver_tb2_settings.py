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
ones).

Writes benchmarks/results/solver_tb2_settings.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

from autopar.passes.solver import load_iopddl
from autopar.passes.solver.heuristic import LocalSearch, initial_strategies
from autopar.passes.solver.penalty import Penalty
from autopar.passes.solver.pool import Request, WorkerPool
from autopar.passes.solver.reduce import reduce_problem
from autopar.passes.solver.toulbar2 import PRICE_MAX_S, _price_weights
from benchmarks.solver_iopddl import REPO, _fail, _load_average

# name -> (LDS discrepancies, toulbar2 options beyond autopar's: tb2_worker.TUNABLE_OPTIONS)
SETTINGS: dict[str, tuple[int, dict]] = {
    "autopar (HBFS, LDS 4, EDAC, DEE, elimination deg 3)": (4, {}),
    "LDS 1": (1, {}),
    "no LDS (HBFS only)": (0, {}),
    "no dead-end elimination": (4, {"DEE": 0}),
    "no variable elimination": (4, {"elimDegree": 0}),
    "FDAC instead of EDAC": (4, {"LcLevel": 3}),
    "AC instead of EDAC": (4, {"LcLevel": 1}),
    "depth-first B&B (no HBFS)": (4, {"hbfs": 0}),
}
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
    jobs = [(name, lds, opts, SETTING_LIMIT_S) for name, (lds, opts) in SETTINGS.items()]
    autopar, (lds0, opts0) = next(iter(SETTINGS.items()))
    jobs += [(autopar, lds0, opts0, t) for t in AUTOPAR_LIMITS_S]
    rows = []
    with WorkerPool(2, grace_s=1.5) as pool:
        pool.warm_up()
        for name, lds, opts, limit in jobs:
            reqs = [Request({"unary": u}, {"time_limit_s": limit, "lds": lds, "seed": 1,
                                           "options": opts},
                            base="first-round", base_arrays=pen.edge_arrays)
                    for u, _off in unaries]
            t = time.perf_counter()
            answers = pool.run(reqs, t + 2 * limit + 30)
            wall = time.perf_counter() - t
            for j, (ans, (_u, off)) in enumerate(zip(answers, unaries)):
                row = {"setting": name, "level": j, "cpu_limit_s": limit,
                       "wall_seconds": round(wall, 1),
                       "status": None if ans is None else ans.meta.get("status")}
                if ans is not None and "values" in ans.arrays:
                    x = ans.arrays["values"]
                    row["penalized_cost"] = ans.meta["cost"] / pen.scale + off + pen.red.offset
                    row["cost"] = pen.real_cost(x) + pen.red.offset
                    row["overflow"] = float((pen.usage(x) - pen.red.cap).max())
                elif ans is not None and ans.meta.get("message"):
                    row["message"] = ans.meta["message"]
                rows.append(row)
                print(f"{name} | level {j} | {limit} s: {row.get('penalized_cost', '-')} "
                      f"{row['status']}", flush=True)
    info["load_average"] = _load_average()
    return rows, info


def markdown(rows: list[dict], info: dict, instance: str) -> str:
    best = {}
    for r in rows:
        if "penalized_cost" in r and r["cpu_limit_s"] == SETTING_LIMIT_S:
            best[r["level"]] = min(best.get(r["level"], np.inf), r["penalized_cost"])
    lines = [
        f"# toulbar2 settings on the first penalty round of IOPDDL {instance}",
        "",
        "`python -m benchmarks.solver_tb2_settings` — the penalty loop's first-round "
        f"models ({info['reduced_nodes']:,} reduced nodes, {info['reduced_strategies']:,} "
        f"strategies, {info['edges']:,} edges; memory-price weights, no warm start), each "
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
    for r in rows:
        if "penalized_cost" in r:
            rel = r["penalized_cost"] / best[r["level"]] if r["level"] in best else np.nan
            lines.append(
                f"| {r['setting']} | {r['level']} | {r['cpu_limit_s']} | {r['status']} "
                f"| {r['penalized_cost']:,.0f} | {rel:.4f} | {r['cost']:,.0f} "
                f"| {r['overflow']:,.0f} |")
        else:
            lines.append(f"| {r['setting']} | {r['level']} | {r['cpu_limit_s']} "
                         f"| {r['status']} {r.get('message', '')} | – | – | – | – |")
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
    text = markdown(rows, info, args.instance)
    payload = json.dumps({"instance": args.instance, "info": info, "rows": rows},
                         indent=1, default=str) + "\n"
    for suffix, body in (("json", payload), ("md", text)):
        tmp = out / f"solver_tb2_settings.{suffix}.tmp"
        tmp.write_text(body)
        tmp.replace(out / f"solver_tb2_settings.{suffix}")
    print(text)


if __name__ == "__main__":
    main()

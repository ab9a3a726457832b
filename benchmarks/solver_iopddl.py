"""Runs solve() on the IOPDDL contest instances with the contest time limits.

    python -m benchmarks.solver_iopddl [--instances G,A,M,S] [--time-scale 1.0] [--dir D]
        [--backend toulbar2 (default when installed)] [--bound-time-scale 1.0] [--merge]
        [--repeat 1] [--busy 0] [--out solver_iopddl]

Writes benchmarks/results/solver_iopddl.{md,json}: per instance the cost of solve()'s
answer within the contest limit, its ratio to the best known cost, and a proven lower
bound (solve()'s own when it proves optimality, else the Lagrangian bound of
benchmarks/solver_experiments/lagrange.py computed afterwards in its own budget) against
the best known lower bound.

Robustness under load: `--busy K` keeps K busy-looping processes running through every
solve (K = 2 on a 2-core machine leaves the solver half the CPU the contest limits assume),
`--repeat N` solves every instance N times, and `--out NAME` writes
benchmarks/results/NAME.{md,json} instead, with the worst ratio of each instance over its
runs.  `--render --out NAME` solves nothing: it rewrites NAME.md from NAME.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import shlex
import subprocess
import sys
import time

from autopar.passes.solver import BACKENDS, evaluate, load_iopddl, solve
from autopar.passes.solver.backend import backend_available
from benchmarks.stamp import stamp, stamp_markdown

REPO = pathlib.Path(__file__).resolve().parents[1]
TIME_LIMITS_S = {"G": 120.0, "A": 60.0, "M": 180.0, "S": 240.0}
_CONTEST = "asplos-contest/2025 misc/iopddl_final_results.csv"
_TI2 = "ti2-group/iopddl_experiments (Staudt & Blacher, post-contest)"
# Best known costs and lower bounds (../shared/iopddl/README.md, which cites the sources).
BEST_KNOWN = {
    "G": (217_039.0, f"optimal ({_CONTEST})"),
    "A": (6_548_641_531.0, f"{_CONTEST}, team02"),
    "M": (49_928_157_537.0, _TI2),
    "S": (1_521_949_307.0, _TI2),
}
KNOWN_BOUND = {
    "G": (216_931.0, _TI2),
    "A": (6_513_812_172.0, _TI2),
    "M": (49_407_421_919.0, _TI2),
    "S": (1_511_240_135.0, f"{_TI2}, Gurobi"),
}


def _fail(msg: str) -> None:
    print(f"solver_iopddl: {msg}", file=sys.stderr)
    raise SystemExit(2)


@contextlib.contextmanager
def busy(processes: int):
    """Keeps `processes` busy-looping Python processes running for the block's duration.

    They are terminated (killed after 5 s) when the block ends, also on an exception.
    """
    spinners: list[subprocess.Popen] = []
    try:
        # started inside the block: a failed start still stops the ones already running
        for _ in range(processes):
            spinners.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                             stdin=subprocess.DEVNULL))
        yield
    finally:
        for proc in spinners:
            proc.terminate()
        for proc in spinners:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)


def run_instance(path: pathlib.Path, name: str, limit: float, backend: str,
                 bound_limit: float) -> dict:
    t0 = time.perf_counter()
    prob = load_iopddl(path)
    load_s = time.perf_counter() - t0
    sol = solve(prob, time_limit_s=limit, backend=backend)
    solve_load = _load_average()  # the last minute of the solve, before the bound's
    cost, feasible = evaluate(prob, sol.strategies)  # re-checked independently
    lb, lb_s, lb_src = sol.lower_bound, 0.0, "solve"
    if sol.status != "optimal" and bound_limit > 0 and feasible:
        from benchmarks.solver_experiments.lagrange import lagrangian_bound  # noqa: PLC0415

        t1 = time.perf_counter()
        lb2, _ = lagrangian_bound(prob, time_limit_s=bound_limit, upper_bound=cost)
        lb_s = time.perf_counter() - t1
        if lb2 is not None and (lb is None or lb2 > lb):
            lb, lb_src = lb2, "lagrangian"
    best, best_src = BEST_KNOWN[name]
    known_lb, known_lb_src = KNOWN_BOUND[name]
    stats = {k: v for k, v in sol.stats.items() if k != "heuristic"}
    return {
        "instance": name, "nodes": prob.num_nodes, "edges": prob.num_edges,
        "time_limit_s": limit, "best_known": best, "best_known_source": best_src,
        "known_lower_bound": known_lb, "known_lower_bound_source": known_lb_src,
        "cost": cost, "feasible": feasible, "ratio_to_best": cost / best,
        "lower_bound": lb, "lower_bound_from": lb_src, "bound_seconds": round(lb_s, 1),
        "bound_vs_known": None if lb is None else lb / known_lb,
        "seconds": round(sol.seconds, 2), "load_seconds": round(load_s, 2),
        "status": sol.status, "backend": sol.stats.get("backend"), "stats": stats,
        "load_average_solve": solve_load,
    }


def worst_by_instance(rows: list[dict]) -> dict[str, float]:
    """The highest ratio to the best known cost of each instance over its runs."""
    worst: dict[str, float] = {}
    for r in rows:
        worst[r["instance"]] = max(worst.get(r["instance"], 0.0), r["ratio_to_best"])
    return worst


def markdown(rows: list[dict], args, meta: dict) -> str:
    runs = max(r.get("run", 1) for r in rows)
    lines = [
        "# autopar solver on the IOPDDL contest instances"
        + (f", {args.busy} busy processes beside it" if args.busy else ""),
        "",
        stamp_markdown(meta)
        + (" Rows of instances not run this time are kept from an earlier run (--merge)."
           if "merged_from" in meta else ""),
        "",
        f"`python -m benchmarks.solver_iopddl` — backend {args.backend}, time scale "
        f"{args.time_scale}, 2 cores (shared with other jobs: see the load note below). "
        "seconds = solve() wall clock, model building included, file "
        "loading excluded; limit = the contest's. ratio = our cost / best known cost. "
        + ("Lower bound: solve()'s proof when it proves optimality, else the Lagrangian bound "
           "(lagrange.py: memory prices, toulbar2's bound on each subproblem, or the pairwise "
           "LP's dual where toulbar2 bounds worse) computed after "
           "the solve in `bound s`; bound / known = our bound / the best known bound."
           if args.bound_time_scale > 0 else
           "Lower bound: solve()'s proof when it proves optimality; no Lagrangian bound was "
           "computed (`--bound-time-scale 0`), so `–` elsewhere.")
        + (f" Every solve ran beside {args.busy} busy-looping processes (`--busy "
           f"{args.busy}`)." if args.busy else "")
        + (f" Each instance was solved {runs} times (`--repeat {runs}`, column run)."
           if runs > 1 else ""),
        "",
        "| instance " + ("| run " if runs > 1 else "")
        + "| limit s | best known cost (source) | known lower bound (source) "
        "| our cost | ratio to best | our lower bound | bound / known | seconds | bound s "
        "| status | backend |",
        "|---" * (12 + (runs > 1)) + "|",
    ]
    for r in rows:
        lb = "–" if r["lower_bound"] is None else f"{r['lower_bound']:,.0f}"
        bk = "–" if r["bound_vs_known"] is None else f"{r['bound_vs_known']:.4f}"
        lines.append(
            f"| {r['instance']} " + (f"| {r.get('run', 1)} " if runs > 1 else "")
            + f"| {r['time_limit_s']:.0f} | {r['best_known']:,.0f} "
            f"({r['best_known_source']}) | {r['known_lower_bound']:,.0f} "
            f"({r['known_lower_bound_source']}) | {r['cost']:,.0f}"
            f"{'' if r['feasible'] else ' (infeasible)'} | {r['ratio_to_best']:.4f} | {lb} "
            f"| {bk} | {r['seconds']} | {r['bound_seconds']} | {r['status']} "
            f"| {r['backend']} |"
        )
    if runs > 1:
        lines += ["", "Worst ratio to the best known cost over the runs: " + ", ".join(
            f"{name} {ratio:.4f}" for name, ratio in worst_by_instance(rows).items()) + "."]
    loads = [f"{r['instance']}{'' if runs == 1 else ' run ' + str(r.get('run', 1))} "
             f"{r['load_average_solve'][0]:.1f}" for r in rows if r.get("load_average_solve")]
    if loads:
        lines += ["", "Load average (1 min, on 2 cores) when each solve finished: "
                  + ", ".join(loads) + ". Above 2, other jobs shared the cores: the solver "
                  "got less than the 2 cores the contest limits assume."]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", default="G,A,M,S")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--bound-time-scale", type=float, default=1.0,
                    help="budget of the Lagrangian bound, as a multiple of the limit (0: none)")
    ap.add_argument("--dir", default=str(REPO.parent / "shared" / "iopddl"))
    ap.add_argument("--backend", default="toulbar2" if backend_available("toulbar2") else "auto",
                    choices=list(BACKENDS))
    ap.add_argument("--merge", action="store_true",
                    help="keep the stored rows of the instances not run this time")
    ap.add_argument("--repeat", type=int, default=1, help="solves of each instance")
    ap.add_argument("--busy", type=int, default=0,
                    help="busy-looping processes kept running beside every solve")
    ap.add_argument("--out", default="solver_iopddl",
                    help="results name: benchmarks/results/OUT.{md,json}")
    ap.add_argument("--render", action="store_true",
                    help="solve nothing: rewrite OUT.md from OUT.json (its rows, its stamp and "
                    "the options of the command it records)")
    return ap


def _results_dir() -> pathlib.Path:
    """Where the pages are written (read at call time: tests point REPO elsewhere)."""
    return REPO / "benchmarks" / "results"


def render(out: str) -> str:
    """benchmarks/results/OUT.md written again from OUT.json: the page's text as this module
    words it now, the rows, stamp and command of the run that wrote the JSON."""
    json_path = _results_dir() / f"{out}.json"
    if not json_path.is_file():
        _fail(f"--render: {json_path} does not exist")
    data = json.loads(json_path.read_text())
    if not isinstance(data, dict) or "meta" not in data or "rows" not in data:
        _fail(f"--render: {json_path} holds no stamp (written before stamps): run it again")
    words = shlex.split(data["meta"].get("command", ""))
    if "benchmarks.solver_iopddl" not in words:
        _fail(f"--render: {json_path}'s stamp records no benchmarks.solver_iopddl command")
    recorded = _parser().parse_args(words[words.index("benchmarks.solver_iopddl") + 1:])
    text = markdown(data["rows"], recorded, data["meta"])
    (json_path.with_suffix(".md")).write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.repeat < 1 or args.busy < 0:
        _fail(f"--repeat must be >= 1 and --busy >= 0 (got {args.repeat}, {args.busy})")
    if not args.out or not all(c.isalnum() or c in "-_." for c in args.out) \
            or args.out.startswith("."):
        _fail(f"--out must be a file name of letters, digits, '-', '_' or '.' (it is written "
              f"as benchmarks/results/OUT.md and .json), got {args.out!r}")
    if args.render:
        print(render(args.out))
        return
    if args.merge and args.repeat > 1:
        _fail("--merge keeps one row per instance; it cannot be combined with --repeat")
    names = args.instances.split(",")
    for name in names:
        if name not in TIME_LIMITS_S:
            _fail(f"unknown instance {name!r}; valid: {','.join(TIME_LIMITS_S)}")
    folder = pathlib.Path(args.dir)
    if not folder.is_dir():
        _fail(f"instance directory {folder} does not exist (pass --dir)")
    paths = {n: folder / f"asplos-2025-iopddl-{n}.json.gz" for n in names}
    for path in paths.values():
        if not path.is_file():
            _fail(f"instance file {path} does not exist")
    rows = []
    for run, name in ((k, n) for k in range(1, args.repeat + 1) for n in names):
        limit = TIME_LIMITS_S[name] * args.time_scale
        with busy(args.busy):
            row = run_instance(paths[name], name, limit, args.backend,
                               TIME_LIMITS_S[name] * args.bound_time_scale)
        row["load_average"] = _load_average()
        row["run"], row["busy_processes"] = run, args.busy
        rows.append(row)
        print(f"{name} (run {run}): cost={row['cost']:,.0f} ratio={row['ratio_to_best']:.4f} "
              f"feasible={row['feasible']} lb={row['lower_bound']} status={row['status']} "
              f"seconds={row['seconds']} (limit {limit:.0f})", flush=True)
    out = _results_dir()
    out.mkdir(parents=True, exist_ok=True)
    meta = stamp()
    json_path, md_path = out / f"{args.out}.json", out / f"{args.out}.md"
    if args.merge and json_path.exists():
        new = {r["instance"]: r for r in rows}
        old = json.loads(json_path.read_text())
        old_rows = old["rows"] if isinstance(old, dict) else old   # a list before stamps
        rows = [new.pop(r["instance"], r) for r in old_rows] + list(new.values())
        # Rows kept from an earlier run carry that run's stamp; this run's is `meta`.
        meta["merged_from"] = old.get("meta") if isinstance(old, dict) else None
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    text = markdown(rows, args, meta)
    md_path.write_text(text)
    print(text)


def _load_average() -> list[float] | None:
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return None


if __name__ == "__main__":
    main()

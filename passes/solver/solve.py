"""solve(): exact reductions, then the heuristic (large-neighbourhood search with HiGHS
sub-MIPs when highspy is installed), then the ILP when it fits the time, else a dual
lower bound (bound.py) so that the answer's gap is known."""

from __future__ import annotations

import importlib.util
import time
from typing import Literal

import numpy as np

from autopar.passes.solver.bound import dual_bound
from autopar.passes.solver.evaluate import evaluate
from autopar.passes.solver.heuristic import heuristic
from autopar.passes.solver.ilp import SECONDS_PER_NONZERO, model_nonzeros, solve_ilp
from autopar.passes.solver.problem import ShardingProblem, Solution
from autopar.passes.solver.reduce import reduce_problem

Backend = Literal["cbc", "highs", "auto"]
BACKENDS: tuple[Backend, ...] = ("cbc", "highs", "auto")
"""The valid `backend` names; "auto" picks the best installed one."""
DEFAULT_BACKEND: Backend = "auto"
# Fraction of the remaining time the heuristic gets before the ILP when the ILP fits.
_HEURISTIC_SHARE = 0.1
_HEURISTIC_MAX_S = 5.0
# Fraction of the time left after reductions spent on the dual bound when the ILP does not fit.
_BOUND_SHARE = 0.12


def _resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"solve: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "highs" if importlib.util.find_spec("highspy") is not None else "cbc"
    if backend == "highs" and importlib.util.find_spec("highspy") is None:
        raise ValueError("solve: backend='highs' needs the highspy package (pip install highspy)")
    return backend


def solve(
    problem: ShardingProblem,
    time_limit_s: float = 60.0,
    backend: Backend = DEFAULT_BACKEND,
    *,
    threads: int = 2,
    verbose: bool = False,
) -> Solution:
    """Chooses one strategy per node minimising cost under the usage limit.

    Always returns a Solution: status "optimal" (proved by the ILP), "feasible" (ILP
    incumbent, not proved) or "fallback" (the heuristic's answer; the ILP was skipped or
    found nothing in time).  `feasible` is False only if no allowed choice was found.
    The wall-clock limit covers everything (reductions, model building, solving).
    Raises InfeasibleError if even the least-usage choice exceeds the usage limit.
    """
    t0 = time.perf_counter()
    if not time_limit_s > 0:
        raise ValueError(f"solve: time_limit_s must be positive, got {time_limit_s=}")
    backend = _resolve_backend(backend)
    deadline = t0 + 0.91 * time_limit_s - 0.05  # contest: loading counts, finish by 0.95x
    stats: dict = {"backend": backend}
    red, rstats = reduce_problem(problem)
    stats.update(rstats)
    t_red = time.perf_counter()
    stats["reduce_seconds"] = t_red - t0

    nz = model_nonzeros(red) if red.num_nodes else 0
    stats["ilp_nonzeros"] = nz
    remaining = deadline - t_red
    ilp_fits = red.num_nodes > 0 and nz * SECONDS_PER_NONZERO < 0.5 * remaining
    h_deadline = deadline
    if ilp_fits:
        h_deadline = t_red + min(_HEURISTIC_SHARE * remaining, _HEURISTIC_MAX_S)
    elif red.num_nodes > 1:
        h_deadline = deadline - _BOUND_SHARE * remaining  # the rest: a proven lower bound
    if red.num_nodes:
        stall = max(500, 20 * red.num_nodes) if ilp_fits else None
        s_h, hstats = heuristic(red, h_deadline, max_stall=stall)
    else:
        s_h, hstats = np.zeros(0, np.int64), {}
    stats["heuristic"] = hstats
    t_h = time.perf_counter()
    stats["heuristic_seconds"] = t_h - t_red

    best = red.expand(s_h)
    best_cost, best_ok = evaluate(problem, best)
    stats["heuristic_cost"] = best_cost
    status = "optimal" if red.num_nodes == 0 else "fallback"
    lower = best_cost if red.num_nodes == 0 else None
    if not ilp_fits and red.num_nodes > 1 and best_ok:
        lb, bstats = dual_bound(red, deadline, best_cost - red.offset)
        stats.update(bstats)
        if np.isfinite(lb):
            lower = min(lb + red.offset, best_cost)
    stats["ilp"] = "skipped (model too large for the time left)" if not ilp_fits else "run"
    if ilp_fits:
        res = solve_ilp(red, backend, deadline, s_h, threads, verbose)
        stats["ilp_build_seconds"] = res.get("build_seconds")
        stats["ilp_solve_seconds"] = res.get("solve_seconds")
        stats["ilp_status"] = res["status"]
        if res["strategies"] is not None:
            cand = red.expand(res["strategies"])
            c_cost, c_ok = evaluate(problem, cand)
            if c_ok and (not best_ok or c_cost <= best_cost):
                best, best_cost, best_ok = cand, c_cost, c_ok
            status = res["status"]
            if status == "optimal":
                lower = best_cost
        if status != "optimal" and res.get("bound") is not None:
            lower = res["bound"] + red.offset
    stats["ilp_seconds"] = time.perf_counter() - t_h
    total = time.perf_counter() - t0
    stats["total_seconds"] = total
    if verbose:
        print(f"solve {problem.name}: {status} cost={best_cost:.6g} feasible={best_ok} "
              f"in {total:.1f}s; {stats}")
    return Solution(
        strategies=tuple(int(x) for x in best), cost=best_cost, lower_bound=lower,
        status=status, seconds=total, feasible=best_ok, stats=stats,
    )

"""solve(): exact reductions, then the backend.

toulbar2 (toulbar2.py): exact cost-function-network model with memory knapsacks on small
and medium problems, penalty loop + toulbar2 LNS on large ones.  highs / cbc (PuLP, the
reference formulation): the heuristic (large-neighbourhood search with HiGHS sub-MIPs
when highspy is installed), then the ILP when it fits the time, else a dual lower bound
(bound.py) so that the answer's gap is known."""

from __future__ import annotations

import time

import numpy as np

from .backend import (
    DEFAULT_BACKEND,
    Backend,
    backend_available,
    resolve_backend,
)
from .bound import dual_bound
from .evaluate import evaluate, flat
from .heuristic import heuristic
from .ilp import SECONDS_PER_NONZERO, model_nonzeros, solve_ilp
from .problem import (
    COST_FLOOR,
    INFINITE_COST,
    ShardingProblem,
    Solution,
    scale_costs,
)
from .reduce import reduce_problem

# Fraction of the remaining time the heuristic gets before the ILP when the ILP fits.
_HEURISTIC_SHARE = 0.1
_HEURISTIC_MAX_S = 5.0
# Fraction of the time left after reductions spent on the dual bound when the ILP does not fit.
_BOUND_SHARE = 0.12
# Below this many seconds left after the reductions, toulbar2 (worker processes: start-up,
# interrupt grace) gives way to the in-process ILP path.
TOULBAR2_MIN_S = 3.0
# "auto" on a problem under AUTO_TOULBAR2_MIN_NODES: toulbar2 in process when the ILP would
# take longer than this (seconds; SECONDS_PER_NONZERO x its nonzeros): see _toulbar2_inline.
AUTO_ILP_MAX_S = 2.0


def solve(
    problem: ShardingProblem,
    time_limit_s: float = 60.0,
    backend: Backend = DEFAULT_BACKEND,
    *,
    threads: int = 2,
    verbose: bool = False,
) -> Solution:
    """Chooses one strategy per node minimising cost under the usage limit.

    backend: "auto" (toulbar2 when pytoulbar2 imports, else highs when highspy is
    installed, else cbc), "toulbar2", "highs" or "cbc"; the one used is in
    stats["backend"] (toulbar2 gives way to highs/cbc when less than TOULBAR2_MIN_S
    seconds are left after the reductions: stats["toulbar2_skipped"] says so).
    threads: solver processes/threads (toulbar2: worker processes).
    Always returns a Solution: status "optimal" (proved), "feasible" (the exact solver's
    answer, not proved) or "fallback" (the heuristic's answer; the exact solver was
    skipped or found nothing better in time).  `feasible` is False only if no allowed
    choice was found.  The wall-clock limit covers everything (reductions, model
    building, solving).  Raises InfeasibleError if even the least-usage choice exceeds
    the usage limit.
    """
    t0 = time.perf_counter()
    if not time_limit_s > 0:
        raise ValueError(f"solve: time_limit_s must be positive, got {time_limit_s=}")
    if threads < 1:
        raise ValueError(f"solve: threads must be >= 1, got {threads=}")
    requested, backend = backend, resolve_backend(backend, problem.num_nodes)
    deadline = t0 + 0.91 * time_limit_s - 0.05  # contest: loading counts, finish by 0.95x
    stats: dict = {"backend": backend}
    # The solvers see costs of a sane magnitude (problem.COST_FLOOR); answers are priced on
    # `problem` itself, bounds scaled back.
    k = cost_scale(problem)
    if k != 1.0:
        stats["cost_scale"] = k
    red, rstats = reduce_problem(scale_costs(problem, k))
    stats.update(rstats)
    t_red = time.perf_counter()
    stats["reduce_seconds"] = t_red - t0
    if backend == "toulbar2":
        if red.num_nodes == 0 or deadline - t_red >= TOULBAR2_MIN_S:
            return _solve_toulbar2(problem, red, k, deadline, threads, verbose, stats, t0)
        # Too short for worker processes: the ILP path (HiGHS when installed, else CBC).
        stats["toulbar2_skipped"] = (f"{deadline - t_red:.2f} s left after reductions, "
                                     f"toulbar2 needs {TOULBAR2_MIN_S} s")
        backend = stats["backend"] = "highs" if backend_available("highs") else "cbc"

    nz = model_nonzeros(red) if red.num_nodes else 0
    stats["ilp_nonzeros"] = nz
    remaining = deadline - t_red
    if requested == "auto" and backend != "toulbar2" and _toulbar2_inline(red, nz, remaining):
        stats["backend"] = "toulbar2"
        stats["auto"] = (f"ILP of {nz:,} nonzeros (~{nz * SECONDS_PER_NONZERO:.1f} s): "
                         "toulbar2 in process")
        return _solve_toulbar2(problem, red, k, deadline, 1, verbose, stats, t0, inline=True)
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
        lb, bstats = dual_bound(red, deadline, best_cost * k - red.offset)
        stats.update(bstats)
        if np.isfinite(lb):
            lower = min((lb + red.offset) / k, best_cost)
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
            lower = (res["bound"] + red.offset) / k
    stats["ilp_seconds"] = time.perf_counter() - t_h
    return _finish(problem, best, best_cost, best_ok, lower, status, stats, t0, verbose)


def cost_scale(p: ShardingProblem) -> float:
    """The power of two solve() multiplies `p`'s costs by (1.0 when the largest finite
    magnitude is already at least COST_FLOOR, or every cost is zero or forbidden).  Reads
    the flat cost tables `evaluate` prices the answer with (built once per problem)."""
    f = flat(p)
    costs = np.concatenate([f.cost, f.ecost])
    top = float(np.abs(costs[costs < INFINITE_COST]).max(initial=0.0))
    if top <= 0.0 or top >= COST_FLOOR:
        return 1.0
    return float(2.0 ** int(np.ceil(np.log2(COST_FLOOR / top))))


def _finish(problem: ShardingProblem, best, cost: float, ok: bool, lower: float | None,
            status: str, stats: dict, t0: float, verbose: bool) -> Solution:
    total = time.perf_counter() - t0
    stats["total_seconds"] = total
    if verbose:
        print(f"solve {problem.name}: {status} cost={cost:.6g} feasible={ok} "
              f"in {total:.1f}s; {stats}")
    return Solution(
        strategies=tuple(int(x) for x in best), cost=cost, lower_bound=lower,
        status=status, seconds=total, feasible=ok, stats=stats,
    )


def _toulbar2_inline(red, nonzeros: int, seconds_left: float) -> bool:
    """Whether "auto" hands a problem it would give the ILP path (under
    AUTO_TOULBAR2_MIN_NODES nodes) to toulbar2 in this process instead: when toulbar2 is
    installed, the exact knapsack model fits, and the ILP would take more than
    AUTO_ILP_MAX_S (or half the time left) to build and solve.  Dense pairwise costs (2-D
    meshes: ~2,500 strategies over 65 nodes, 0.55 M nonzeros) take HiGHS 12-13 s and
    toulbar2 0.2-0.6 s to the same optimum."""
    from .toulbar2 import exact_fits  # noqa: PLC0415

    return (red.num_nodes > 0 and backend_available("toulbar2")
            and nonzeros * SECONDS_PER_NONZERO > min(AUTO_ILP_MAX_S, 0.5 * seconds_left)
            and exact_fits(red))


def _solve_toulbar2(problem: ShardingProblem, red, k: float, deadline: float, threads: int,
                    verbose: bool, stats: dict, t0: float, seed: int = 0,
                    inline: bool = False) -> Solution:
    from .toulbar2 import solve_toulbar2  # noqa: PLC0415

    if red.num_nodes:
        s_red, lb, status, tstats = solve_toulbar2(red, deadline, seed, threads, verbose,
                                                   inline=inline)
        stats.update(tstats)
    else:
        s_red, lb, status = np.zeros(0, np.int64), 0.0, "optimal"
        stats.update(heuristic_seconds=0.0, toulbar2_seconds=0.0, mode="solved by reduction")
    best = red.expand(s_red)
    cost, ok = evaluate(problem, best)
    lower = None
    if status == "optimal" and ok:
        lower = cost
    elif lb is not None:
        lower = min((lb + red.offset) / k, cost)
        if ok and lower >= cost:
            # toulbar2 proved nothing cheaper than the local-search answer exists.
            status = "optimal"
    return _finish(problem, best, cost, ok, lower, status, stats, t0, verbose)

"""A proven lower bound: the Lagrangian dual of the memory limit, bounded by toulbar2.

For prices mu_k >= 0 on the checkpoints of the reduced problem (reduce.py),

    L(mu) = min_x  cost(x) + sum_k mu_k (usage_k(x) - cap_k)
          = min_x  cost(x) + sum_v M_v du_v(x_v)  -  mu . cap,   M_v = sum_{k live at v} mu_k

is a lower bound of the optimum (any x within the limit makes the price term <= 0).  The
inner minimum is the unconstrained pairwise problem with penalized node costs, which
toulbar2 bounds from below (its dual bound; exact when it proves optimality), so
LB_toulbar2(mu) - mu . cap is a proven bound for every mu.  The prices start at the
memory prices of the pairwise-LP dual (bound.py), then move by projected subgradient
steps (Polyak's step towards the best known cost); each round prices two step lengths
at once, one per worker.  Each subproblem starts from the cheapest answer known under its
prices, whose cost bounds the search; a round that toulbar2 does not prove is solved once
more at the same prices with the answers it just found (with such a bound toulbar2 often
proves in seconds what it could not bound in a whole slice without one).  Model costs are
rounded to integers: the bound gives back half a unit per cost function so that it stays
valid.

Where toulbar2 bounds the subproblems no better than the LP dual does (IOPDDL S: it proves
none of them in a slice, and its first two rounds at the LP's prices gave 1.197e9 and
1.198e9 against the LP's 1.213e9), the rest of the time goes back to the LP dual, resumed
where it stopped, with a deflected subgradient (bound.DualAscent).  IOPDDL S, 240 s, this
machine kind, bound / best known bound: 0.815 with toulbar2's rounds to the end (the best
known cost as upper bound); with the LP dual resumed, 0.937 (the same; the LP's old edge
loop, patience 30), 0.950 (our cost 1.033x the best as upper bound; the faster loop),
0.978 (patience 320: benchmarks/results/solver_iopddl.md).
"""

from __future__ import annotations

import time

import numpy as np

from autopar.passes.solver.bound import DualAscent
from autopar.passes.solver.penalty import Penalty
from autopar.passes.solver.pool import Request, WorkerPool
from autopar.passes.solver.problem import ShardingProblem
from autopar.passes.solver.reduce import reduce_problem

_LP_SHARE = 0.15  # of the time: the pairwise-LP prices to start from
# The LP dual's subgradient: deflection and patience (bound.DualAscent; measured on S).
_DEFLECTION, _PATIENCE = 0.95, 320


def lagrangian_bound(problem: ShardingProblem, time_limit_s: float,
                     upper_bound: float | None = None,
                     threads: int = 2) -> tuple[float | None, dict]:
    """A proven lower bound of `problem`'s optimum found within `time_limit_s` seconds.

    upper_bound: the cost of a known feasible answer (sets the subgradient steps).
    Returns (bound or None, stats).
    """
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    red, _ = reduce_problem(problem)
    stats: dict = {"lagrange_rounds": 0}
    if red.num_nodes == 0:
        return red.offset, stats
    ncp = len(red.cap)
    ub = None if upper_bound is None else upper_bound - red.offset
    lp_dual = DualAscent(red, ub if ub is not None else np.inf, deflection=_DEFLECTION,
                         patience=_PATIENCE)
    lp = lp_dual.run(t0 + _LP_SHARE * time_limit_s)
    mu = lp_dual.best_mu
    best = lp if np.isfinite(lp) else -np.inf
    tb2_best = -np.inf  # the best of toulbar2's bounds
    stats["lp_bound"] = lp + red.offset
    pen = Penalty(red, 1.0, 1)
    slack = 0.5 * (red.num_nodes + len(red.edges)) / pen.scale
    mu = mu if len(mu) == ncp else np.zeros(ncp)

    def weights(m: np.ndarray) -> np.ndarray:
        return np.where(pen.mem, red.live_sums(m), 0.0)

    center, center_val, center_g, warm = mu, -np.inf, None, None
    prev: list[np.ndarray] = []  # the last round's answers
    retry: list[np.ndarray] | None = None
    theta = 1.0
    slice_s = float(np.clip(time_limit_s / 6.0, 5.0, 12.0))
    with WorkerPool(threads) as pool:
        key = "lagrange"
        while time.perf_counter() < deadline - 1.0:
            retrying = retry is not None
            if retrying:
                cands, retry = retry, None
            elif center_g is None:  # the LP's prices are often low: try them scaled up too
                cands = [center * f for f in ((1.0, 8.0) if threads > 1 else (1.0,))]
            else:
                gg = float(center_g @ center_g)
                target = ub if ub is not None else center_val + abs(center_val) * 0.05
                t = theta * max(target - center_val, 1e-9 * abs(target)) / max(gg, 1e-300)
                cands = [np.maximum(0.0, center + f * t * center_g)
                         for f in ((1.0, 0.3) if threads > 1 else (1.0,))]
            reqs, offs = [], []
            starts = [x for x in (*prev, warm) if x is not None]
            for m in cands:
                unary, off = pen.unary(weights(m))
                arrays = {"unary": unary}
                meta = {"seed": 1, "time_limit_s": int(max(1, round(slice_s)))}  # CPU s
                # The cheapest known answer under these prices bounds the search.
                first, cut = pen.warm_start(unary, starts)
                if first is not None:
                    arrays["best"] = first
                if cut is not None:
                    meta["ub"] = cut
                reqs.append(Request(arrays, meta, base=key, base_arrays=pen.edge_arrays))
                offs.append(off)
            answers = pool.run(reqs, deadline - pool.grace_s)
            stats["lagrange_rounds"] += 1
            improved = False
            found = []
            for m, off, ans in zip(cands, offs, answers):
                if ans is None or ans.meta.get("lower_bound") is None:
                    continue
                val = ans.meta["lower_bound"] / pen.scale + off - float(m @ red.cap) - slack
                x = ans.arrays.get("values", warm)
                if "values" in ans.arrays:
                    found.append(ans.arrays["values"])
                best = max(best, val)
                tb2_best = max(tb2_best, val)
                if val > center_val and x is not None:
                    center, center_val, warm, improved = m, val, x, True
                    center_g = pen.usage(x) - red.cap
                    center_g = np.where((m <= 0) & (center_g < 0), 0.0, center_g)
            prev = found or prev
            unproven = any(a is None or a.meta.get("status") not in ("optimal", "infeasible")
                           for a in answers)
            if unproven and not retrying and found:
                # Solved again with the answers just found as upper bounds, toulbar2 often
                # proves in seconds what it could not bound in a whole slice without one.
                retry = cands
                continue
            if stats["lagrange_rounds"] <= 2 and tb2_best <= lp:
                # toulbar2 bounds these subproblems no better than the LP dual: the rest
                # of the time goes to the LP dual.
                stats["lagrange_lp_resumed"] = True
                best = max(best, lp_dual.run(deadline))
                break
            if not improved:
                theta *= 0.5
            if unproven:
                slice_s *= 1.25  # the subproblems need more time to bound well
    stats["lagrange_seconds"] = time.perf_counter() - t0
    stats["lp_seconds"], stats["lp_iterations"] = lp_dual.seconds, lp_dual.iterations
    if not np.isfinite(best):
        return None, stats
    return best + red.offset, stats

"""The toulbar2 backend: exact on small and medium problems, penalties + LNS on large ones.

On a reduced problem (reduce.py: forbidden and dominated strategies, separable edges,
leaves and chains already gone):
  small/medium problems (EXACT_MAX_*): a quick local-search answer (heuristic.py: the
     fallback, the warm start and the upper bound), then one cost function network with
     a knapsack per non-dominated live set (cfn.reduced_model), solved by toulbar2 on
     every worker at once with different seeds and search settings; the first proof of
     optimality stops the others;
  large problems: memory prices from the pairwise-LP dual (bound.py) for the first
     penalty weights, the penalty loop (penalty.py) for most of the time, the
     local-search answer computed here while the workers solve its first round (the
     fallback), with the loop's answers recombined by HiGHS after each round and once
     more at its end (merge.py, when highspy is installed), then large-neighbourhood
     search with toulbar2 sub-solves (tb2_lns.py) on the best answer for the last
     LNS_SHARE of the time.
Every toulbar2 solve runs in a worker process (pool.py) under a wall-clock guard.

Determinism: with the same seed the exact path returns the same answer whenever toulbar2
proves optimality (and the lowest-index worker's answer among equal costs); the large
path's penalty rounds use CPU-time slices and its LNS backtrack limits, so its answer
depends on the machine only through how many rounds and regions fit before the deadline
(and on toulbar2's own progress within a slice).
"""

from __future__ import annotations

import time

import numpy as np

from . import lns
from .bound import dual_prices
from .cfn import live_set_constraints, reduced_model
from .heuristic import heuristic
from .local_search import LocalSearch, initial_strategies
from .merge import merge
from .penalty import penalty_search
from .pool import Answer, InlinePool, Request, WorkerPool
from .reduce import Reduced
from .tb2_lns import tb2_lns

# The exact model is tried when the reduced problem is at most this large.
EXACT_MAX_NODES = 3000
EXACT_MAX_STRATEGIES = 60_000
EXACT_MAX_CONSTRAINTS = 3000
# Large problems: share of the time after the first answer left to the final LNS (the
# penalty rounds a larger share takes away are worth more than the longer LNS:
# benchmarks/solver_experiments/measurements.md, "LNS_SHARE").
LNS_SHARE = 0.3
# Penalty solves get the loop's time over this many rounds (PENALTY_SOLVE_S seconds of
# CPU time each at least and at most).  Fewer, longer solves: each spends ~6 s in
# preprocessing and its first dive before it improves on its warm start, and a longer one
# reaches a lower penalized cost (benchmarks/results/solver_tb2_settings.md; whole
# solves: benchmarks/solver_experiments/measurements.md, "PENALTY_ROUNDS").
PENALTY_ROUNDS = 6.0
PENALTY_SOLVE_S = (8.0, 20.0)
# The penalty loop's last round answers at its deadline, and those answers, the cheapest
# as a rule, were dropped unrepaired; they get this share of the loop's time past it
# (taken from the LNS; benchmarks/solver_experiments/measurements.md,
# "FINAL_POLISH_SHARE").
FINAL_POLISH_SHARE = 0.05
# Large problems (when highspy is installed): the penalty loop's answers are recombined
# (merge.py) after each round, while the workers solve the next one, and once more after
# the loop for at most this share of the time after the first answer, before the LNS.
# Whole solves with it: benchmarks/results/solver_iopddl.md (with and without it:
# benchmarks/solver_experiments/measurements.md, "MERGE_SHARE").
MERGE_SHARE = 0.1
# Large problems: the first penalty weights come from memory prices, the pairwise-LP
# dual's (bound.dual_prices), computed in PRICE_SHARE of the penalty loop's time (at most
# PRICE_MAX_S seconds): node v's weight is PRICE_FACTOR x the sum of the prices over its
# live checkpoints, at least PRICE_FLOOR x the largest such sum.
PRICE_SHARE = 0.1
PRICE_MAX_S = 15.0
PRICE_FACTOR = 2.5
PRICE_FLOOR = 0.02
# The local-search answer only needs to exist (toulbar2 improves on it at once).
_HEURISTIC_SHARE = 0.02
_HEURISTIC_MAX_S = 1.0
_MIN_TOULBAR2_S = 0.5  # below this, the local-search answer is returned as it is
_GRACE_S = 1.5  # between interrupting a worker and killing it


def _is_optimal(ans: Answer) -> bool:
    return ans.meta.get("status") == "optimal"


def _stop_if_optimal(ans: Answer) -> float | None:
    return time.perf_counter() if _is_optimal(ans) else None


def exact_fits(red: Reduced) -> bool:
    """Whether the exact knapsack model is worth trying on `red`."""
    return (red.num_nodes <= EXACT_MAX_NODES
            and red.num_strategies() <= EXACT_MAX_STRATEGIES
            and len(live_set_constraints(red)) <= EXACT_MAX_CONSTRAINTS)


def solve_exact(red: Reduced, ls: LocalSearch, pool: WorkerPool, deadline: float,
                seed: int, incumbent_ok: bool) -> tuple[np.ndarray | None, float | None,
                                                         bool, dict]:
    """toulbar2 on the exact model; returns (choice, lower bound, proved optimal, stats).

    ls holds the incumbent (the warm start; with incumbent_ok, also the upper bound).
    The bound and cost are of the reduced problem (offset excluded).  Worker i runs seed
    seed + i; odd workers start with limited-discrepancy dives (a different search).
    """
    model = reduced_model(red, memory=True, best=np.array(ls.s, np.int64))
    # The incumbent itself stays acceptable (toulbar2's bound is exclusive).
    ub = model.units(ls.cost) + 1.0 if incumbent_ok else None
    reqs = []
    for i in range(pool.size):
        left = deadline - time.perf_counter()
        meta = {"ub": ub, "seed": seed + i, "lds": 4 if i % 2 else 0,
                "time_limit_s": int(max(1, 2 * left))}
        reqs.append(Request(model.arrays, meta))
    answers = pool.run(reqs, deadline, stop_when=_stop_if_optimal)
    best, best_cost, optimal, lower = None, np.inf, False, None
    for ans in answers:
        if ans is None:
            continue
        lb = ans.meta.get("lower_bound")
        if lb is not None:
            lb = model.real(lb)
            lower = lb if lower is None else max(lower, lb)
        if "values" not in ans.arrays:
            continue
        x = ans.arrays["values"]
        ls.reset(x)
        ok = ls.nforb == 0 and bool(np.all(ls.use <= ls.cap))
        if ok and ls.cost < best_cost:
            best, best_cost = x, float(ls.cost)
            optimal = _is_optimal(ans)
        elif ok and ls.cost == best_cost:
            optimal |= _is_optimal(ans)
    stats = {"exact_answers": [None if a is None else a.meta.get("status") for a in answers],
             "exact_constraints": int(len(model.arrays.get("kn_cap", [])))}
    if best is not None and lower is not None:
        lower = min(lower, best_cost)
    return best, lower, optimal, stats


def solve_toulbar2(red: Reduced, deadline: float, seed: int = 0, threads: int = 2,
                   verbose: bool = False, inline: bool = False,
                   ) -> tuple[np.ndarray, float | None, str, dict]:
    """Best reduced-problem choice found by `deadline` (time.perf_counter()).

    inline: solve in this process, one seed (pool.InlinePool), for small exact models
    where worker start-up would cost more than the solve.

    Returns (choice, lower bound of the reduced problem or None, status, stats); status
    is "optimal" (proved by toulbar2), "feasible" (an answer from toulbar2) or
    "fallback" (the local-search answer: toulbar2 found nothing better).
    """
    t0 = time.perf_counter()
    stats: dict = {"threads": 1 if inline else threads, "in_process": inline}
    ls = LocalSearch(red, seed)
    # Workers are interrupted by `deadline` and killed _GRACE_S later if they ignore it.
    if not inline:
        deadline = deadline - _GRACE_S
    local: dict = {}

    def local_search(stop: float, max_stall: int = 200) -> None:
        t = time.perf_counter()
        local["s"], local["stats"] = heuristic(red, stop, seed=seed, max_stall=max_stall,
                                               use_lns=False)
        stats["heuristic_seconds"] = time.perf_counter() - t

    with InlinePool() if inline else WorkerPool(threads, grace_s=_GRACE_S) as pool:
        large = not exact_fits(red)
        if deadline - t0 > _MIN_TOULBAR2_S:
            pool.warm_up()  # worker start-up overlaps the local search
        if not large or deadline - t0 <= _MIN_TOULBAR2_S:
            local_search(t0 + min(_HEURISTIC_MAX_S, _HEURISTIC_SHARE * (deadline - t0)))
        best, best_cost, status, lower = None, np.inf, "fallback", None
        t1 = time.perf_counter()
        if deadline - t1 < _MIN_TOULBAR2_S:
            stats["mode"] = "local search only (no time left for toulbar2)"
        elif not large:
            stats["mode"] = "exact"
            ls.reset(local["s"])
            feasible_h = ls.nforb == 0 and bool(np.all(ls.use <= ls.cap))
            x, lower, optimal, estats = solve_exact(red, ls, pool, deadline, seed, feasible_h)
            stats.update(estats)
            if x is not None:
                best, status = x, "optimal" if optimal else "feasible"
        else:
            stats["mode"] = "penalty+lns"
            lns_start = deadline - LNS_SHARE * (deadline - t1)
            ls.reset(initial_strategies(red))
            w0, pstats0 = _price_weights(
                red, float(ls.cost), t1 + min(PRICE_MAX_S, PRICE_SHARE * (lns_start - t1)))
            stats.update(pstats0)
            solve_s = float(np.clip((lns_start - t1) / PENALTY_ROUNDS, *PENALTY_SOLVE_S))
            answers: list = []
            x, cost, pstats = penalty_search(red, ls, pool, lns_start, w0, solve_s, seed,
                                             hard_deadline=deadline,
                                             final_polish_s=FINAL_POLISH_SHARE * (lns_start - t1),
                                             on_first_round=lambda stop: local_search(stop, 0),
                                             answers=answers,
                                             recombine=merge if lns.available() else None)
            stats.update(pstats, penalty_cost=cost)
            if x is not None:
                best, status = x, "feasible"
                ls.reset(best)
                if answers and lns.available():
                    answers.sort(key=lambda a: a[0])
                    stop = min(deadline, time.perf_counter() + MERGE_SHARE * (deadline - t1))
                    stats.update(merge(ls, [a[1] for a in answers], stop),
                                 merge_cost=float(ls.cost))
                lstats = tb2_lns(ls, pool, deadline, seed=seed)
                stats.update(lstats)
                best = np.array(ls.s, np.int64)
        stats["workers_killed"] = pool.killed
    # The local-search answer when toulbar2 has nothing better (or nothing feasible).
    if best is None and "s" not in local:
        local_search(time.perf_counter())  # one full descent pass, however late
    if best is not None:
        ls.reset(best)
        best_cost = float(ls.cost) if ls.nforb == 0 and np.all(ls.use <= ls.cap) else np.inf
    if "s" in local:
        stats["heuristic"] = local["stats"]
        ls.reset(local["s"])
        ok = ls.nforb == 0 and bool(np.all(ls.use <= ls.cap))
        if best is None or (ok and ls.cost < best_cost):
            best, status = np.array(local["s"], np.int64), "fallback"
    stats["toulbar2_seconds"] = time.perf_counter() - t0
    return best, lower, status, stats


def _initial_weight(red: Reduced, cost: float) -> float:
    """A uniform penalty weight (cost per unit of usage): the least-usage choice's cost
    (a rough scale of the answer's) spread over 4x the largest capacity."""
    cap = float(np.max(red.cap)) if len(red.cap) else 0.0
    if cap <= 0 or not cost > 0:
        return 1.0
    return cost / (4.0 * cap)


def _price_weights(red: Reduced, cost: float, stop: float) -> tuple[np.ndarray | float, dict]:
    """First penalty weights per node from the memory prices of the pairwise-LP dual
    (bound.dual_prices, run until `stop`): a node live where memory is tight gets a
    weight near the price of its bytes there, the others a small floor.  Falls back to
    one uniform weight (_initial_weight) when the prices are all zero.

    `cost`: a known answer's cost (the least-usage choice's), the dual's step scale.
    (Against a uniform weight: benchmarks/solver_experiments/measurements.md, "First
    penalty weights".)
    """
    t = time.perf_counter()
    lp, mu, _ = dual_prices(red, stop, cost)
    stats = {"price_seconds": time.perf_counter() - t, "price_lp_bound": lp + red.offset}
    if not len(mu) or not np.all(np.isfinite(mu)) or mu.max() <= 0:
        stats["initial_weight"] = w = _initial_weight(red, cost)
        return w, stats
    live = red.live_sums(mu)
    w = PRICE_FACTOR * np.maximum(live, PRICE_FLOOR * live.max())
    stats["initial_weight"] = float(np.median(w))
    return w, stats

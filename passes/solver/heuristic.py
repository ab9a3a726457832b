"""The fallback answer and ILP warm start of a reduced problem: a descent and repair by
`local_search.LocalSearch`, then large-neighbourhood search (`lns`, with HiGHS) or
iterated local search: perturb a small connected region at random, descend from it,
keep the result if it is better, else undo it.
"""

from __future__ import annotations

import time

import numpy as np

from . import lns
from .local_search import LocalSearch, initial_strategies, repair
from .reduce import Reduced


def heuristic(red: Reduced, deadline: float, seed: int = 0,
              max_stall: int | None = None, use_lns: bool = True) -> tuple[np.ndarray, dict]:
    """Best reduced-problem choice found before `deadline` (time.perf_counter()).

    After a descent and repair, improves by large-neighbourhood search with HiGHS when
    highspy is installed (lns.py), else by iterated local search, which stops early
    after `max_stall` consecutive perturbations without improvement.
    """
    t0 = time.perf_counter()
    ls = LocalSearch(red, seed)
    ls.reset(initial_strategies(red))
    start_key = ls.key()
    ls.full_descent(deadline, first_pass_complete=True)
    repaired = repair(ls, deadline)
    ls.full_descent(deadline)
    descent_key = ls.key()
    iters = accepted = stall = 0
    lstats: dict = {}
    if use_lns and ls.n > 1 and lns.available():
        lstats = lns.lns(ls, deadline)
    if ls.n > 1 and (not lstats or lstats["lns_broken"]):
        while max_stall is None or stall < max_stall:
            if iters % 64 == 0 and time.perf_counter() >= deadline:
                break
            size = 2 + int(ls.rand.integers(6))
            ok = ls.perturb_once(size)
            accepted += ok
            stall = 0 if ok else stall + 1
            iters += 1
            if iters % 20000 == 0:
                ls.full_descent(deadline)
                if ls.nforb:
                    repair(ls, deadline)
    stats = {
        "start_forbidden": start_key[0], "start_cost": start_key[1],
        "descent_forbidden": descent_key[0], "descent_cost": descent_key[1],
        "repair_chains_kept": repaired, "ils_iterations": iters, "ils_accepted": accepted,
        **lstats, "final_forbidden": ls.nforb, "final_cost": ls.cost,
        "seconds": time.perf_counter() - t0,
    }
    return np.array(ls.s, np.int64), stats

"""Optimal recombination: the best answer built from the strategies of several answers.

The penalty loop (penalty.py) leaves a dozen answers behind: cheap ones over the memory
limit, dearer ones within it.  They agree on about half of the nodes (S: 12,000 of
25,872 differ), and each differing node has only the few strategies the answers gave
it.  Over those nodes and those strategies alone (every other node fixed at the
incumbent's), the memory-constrained problem is a small MIP that HiGHS solves to
optimality in seconds (lns.solve_region with domains), and the recombined answer can be
far cheaper than any repair of one answer: it takes the cheap answers' choices wherever
memory allows.

The penalty loop recombines after every round (penalty.py), and later rounds start from
the result; whole solves: benchmarks/results/solver_iopddl.md (the runs that chose this:
benchmarks/solver_experiments/measurements.md, "Recombination").
(The idea is the "optimized crossover" of genetic algorithms; this is our own take.)
"""

from __future__ import annotations

import time

import numpy as np

from . import lns
from .local_search import LocalSearch

# At most this many strategies (beyond the incumbent's) over the merged nodes: the answers
# are added cheapest first until one would pass it.  S's 14 answers add ~15,000.
MAX_EXTRA_STRATEGIES = 200_000


def merge(ls: LocalSearch, answers: list[np.ndarray], deadline: float,
          max_extra: int = MAX_EXTRA_STRATEGIES) -> dict:
    """Recombines the answer in `ls` (feasible: the incumbent) with `answers` (reduced
    choices, cheapest first; feasible or not) and keeps the result in `ls` when it is
    strictly better and within the limit.  Needs highspy (lns.available()).

    Each node may take its incumbent strategy or one of those the answers give it; HiGHS
    solves the memory-constrained problem over the nodes with more than one such
    strategy, warm-started from the incumbent, until `deadline` (time.perf_counter()).
    Returns counters (merge_* keys): answers used, nodes and extra strategies in the
    MIP, nodes changed, whether HiGHS proved the recombination optimal, seconds.
    """
    t0 = time.perf_counter()
    base = np.asarray(ls.s, np.int64)
    extra: dict[int, set[int]] = {}
    used = count = 0
    for x in answers:
        diff = np.flatnonzero(np.asarray(x, np.int64) != base)
        new = [(int(v), int(x[v])) for v in diff.tolist() if int(x[v]) not in extra.get(v, ())]
        if count + len(new) > max_extra:
            break
        for v, j in new:
            extra.setdefault(v, set()).add(j)
        count += len(new)
        used += 1
    stats = {"merge_answers": used, "merge_nodes": len(extra), "merge_strategies": count,
             "merge_changed": 0, "merge_optimal": False}
    left = deadline - time.perf_counter()
    if extra and left > 0:
        region = np.array(sorted(extra), np.int64)
        domains = []
        for v in region.tolist():
            m = np.zeros(ls.cf[v].size, bool)
            m[base[v]] = True
            m[list(extra[v])] = True
            domains.append(m)
        changed, optimal = lns.solve_region(ls, region, left, domains)
        stats.update(merge_changed=changed, merge_optimal=optimal)
    stats["merge_seconds"] = time.perf_counter() - t0
    return stats

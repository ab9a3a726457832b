"""Large-neighbourhood search with toulbar2: re-solve regions of the answer exactly.

Every node outside a region keeps its strategy.  A region's nodes see their outside
neighbours as unary costs, and the memory left by the outside nodes as the capacity of
one knapsack per non-dominated live set of the region (cfn.nondominated_points over the
segments between the region's interval end points).  toulbar2 gets the current answer as
its first guess and the region's current cost as an exclusive upper bound, so an answer
is always strictly better; it is checked again on the whole problem before it is kept.

Two regions are solved at once (one per worker) from the same answer, the second one
disjoint from the first, and applied in order; each sub-solve is bounded by a backtrack
limit (deterministic) and a wall-clock guard.  Regions: breadth-first balls around
expensive nodes and windows of the timeline (lns.bfs_region / lns.window_region).
"""

from __future__ import annotations

import time

import numpy as np

from .cfn import build_model, nondominated_points
from .lns import WINDOW_EVERY, bfs_region, pick_seed, window_region
from .local_search import LocalSearch
from .pool import Request, WorkerPool
from .problem import INFINITE_COST


def region_model(ls: LocalSearch, region: np.ndarray):
    """(Model, current region cost in model units) of `region` given the rest of ls."""
    nodes = region.tolist()
    pos = {v: i for i, v in enumerate(nodes)}
    s = ls.s
    unary = []
    for v in nodes:
        t = ls.tot[v].copy()
        fb = ls.forb[v].copy()
        for w, f, b in ls.adj[v]:
            if w in pos:
                t -= f[:, s[w]]
                fb -= b[:, s[w]]
        unary.append(np.where(fb > 0, INFINITE_COST, t))
    edges = []
    for i, v in enumerate(nodes):
        for w, f, b in ls.adj[v]:
            k = pos.get(w)
            if k is not None and k > i:
                edges.append((i, k, np.where(b > 0, INFINITE_COST, f)))
    knaps = []
    memn = np.array([ls.mem[v] for v in nodes], bool)
    if memn.any():
        idx = np.flatnonzero(memn)
        a = np.array([ls.a[nodes[j]] for j in idx], np.int64)
        b = np.array([ls.b[nodes[j]] for j in idx], np.int64)
        pts = np.unique(np.concatenate([a, b]))
        lo, hi = int(pts[0]), int(pts[-1])
        cur = np.array([ls.du[nodes[j]][s[nodes[j]]] for j in idx])
        contrib = np.zeros(hi - lo + 1)
        np.add.at(contrib, a - lo, cur)
        np.add.at(contrib, b - lo, -cur)
        resid = ls.cap[lo:hi] - ls.use[lo:hi] + np.cumsum(contrib)[:-1]
        seg_cap = np.minimum.reduceat(resid, pts[:-1] - lo)
        ga = np.searchsorted(pts, a)
        gb = np.searchsorted(pts, b)
        dmax = np.array([ls.du[nodes[j]].max() for j in idx])
        for g in nondominated_points(ga, gb, seg_cap):
            live = (ga <= g) & (gb > g)
            if float(dmax[live].sum()) <= seg_cap[g]:
                continue  # cannot overflow
            js = idx[live]
            knaps.append((js, [ls.du[nodes[j]] for j in js.tolist()], float(seg_cap[g])))
    best = np.array([s[v] for v in nodes], np.int64)
    model = build_model(unary, edges, knaps, best)
    cur_cost = sum(float(unary[i][best[i]]) for i in range(len(nodes)))
    cur_cost += sum(float(r[best[i], best[k]]) for i, k, r in edges)
    return model, model.units(cur_cost)


def apply_answer(ls: LocalSearch, region: np.ndarray, values: np.ndarray) -> int:
    """Applies a region's new strategies if the whole answer gets strictly better and
    stays feasible; returns the number of nodes changed (0 when undone)."""
    before = ls.key()
    log = []
    for v, j in zip(region.tolist(), values.tolist()):
        if j != ls.s[v]:
            log.append((v, ls.s[v]))
            ls.apply(v, int(j))
    if log and ls.key() < before and bool(np.all(ls.use <= ls.cap)):
        return len(log)
    for v, j in reversed(log):
        ls.apply(v, j)
    return 0


def tb2_lns(ls: LocalSearch, pool: WorkerPool, deadline: float, max_cols: int = 6000,
            backtracks: int = 3000, sub_limit_s: float = 3.0, seed: int = 0) -> dict:
    """Pairs of region re-solves until `deadline`; ls holds the (feasible) answer."""
    windows = bool(len(ls.cap)) and bool(ls.mem_arr.any())
    tried = improved = changed = 0
    it = 0
    cols = max_cols
    while time.perf_counter() < deadline - 0.2:
        regions = []
        taken: set[int] = set()
        for _ in range(pool.size):
            it += 1
            if windows and WINDOW_EVERY and it % WINDOW_EVERY == 0:
                region = window_region(ls, cols, ls.rand)
            else:
                region = bfs_region(ls, pick_seed(ls), cols, ls.rand)
            region = np.array([v for v in region.tolist() if v not in taken], np.int64)
            if len(region) >= 2:
                regions.append(region)
                taken.update(region.tolist())
        if not regions:
            continue
        reqs = []
        for region in regions:
            model, cur = region_model(ls, region)
            meta = {"ub": cur, "backtrack_limit": backtracks, "seed": seed + it,
                    "time_limit_s": int(max(1, 2 * sub_limit_s))}
            reqs.append(Request(model.arrays, meta))
        if time.perf_counter() >= deadline - 0.2:
            break  # building the regions took the time left: no solve can finish
        stop = min(deadline, time.perf_counter() + sub_limit_s)
        answers = pool.run(reqs, stop)
        hit_limit = 0
        for region, ans in zip(regions, answers):
            tried += 1
            if ans is None:
                hit_limit += 1
                continue
            if ans.meta.get("status") not in ("optimal", "infeasible"):
                hit_limit += 1
            if "values" in ans.arrays:
                k = apply_answer(ls, region, ans.arrays["values"])
                improved += k > 0
                changed += k
        # Region size follows the sub-solves: grow while they finish, shrink when not.
        cols = int(cols * (0.7 if hit_limit else 1.15))
        cols = min(max(cols, 500), 20 * max_cols)
    return {"lns_regions": tried, "lns_improved": improved, "lns_changed": changed,
            "lns_final_cols": cols}

"""Cost-function-network models for toulbar2, built from a reduced problem or a region.

toulbar2 works with integer costs (64-bit, at most ~5e17).  Costs are scaled by a power of
two so that the largest possible total (the sum of every function's finite range) is at
most 2**50: integer problems (the contest's) keep their exact costs when they fit, and
float problems (autopar's, in seconds) keep ~15 significant digits, so the ranking of
assignments is preserved.  Each function is shifted so that its smallest finite cost is
0 (the shifts are a constant, `offset`).  Forbidden entries (>= INFINITE_COST) are never
numbers: a forbidden value of a variable leaves its domain, a forbidden pair becomes
+inf (toulbar2's hard cost).  Memory: usages are scaled by a power of two so that the
largest capacity is at most 2**40, rounded up (capacities down), so a knapsack-feasible
answer is feasible.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from .problem import INFINITE_COST
from .reduce import Reduced

_COST_TOTAL = 2.0**50
_USAGE_MAX = 2.0**40


def pow2_scale(total: float, target: float, integral: bool) -> float:
    """A power of two s with total * s <= target (s = 1 for integral totals that fit)."""
    if not np.isfinite(total) or total <= 0:
        return 1.0
    if integral and total <= target:
        return 1.0
    return float(2.0 ** np.floor(np.log2(target / total)))


@dataclasses.dataclass(frozen=True)
class Model:
    """A toulbar2 model (tb2_handler's arrays) and the map back to real costs.

    real cost of an assignment = model cost / cost_scale + offset.
    """

    arrays: dict
    cost_scale: float
    offset: float
    usage_scale: float = 1.0

    def real(self, model_cost: float) -> float:
        return model_cost / self.cost_scale + self.offset

    def units(self, real_cost: float) -> float:
        """Model units of a real cost (the inverse of `real`, rounded)."""
        return float(np.round((real_cost - self.offset) * self.cost_scale))


def _finite(x: np.ndarray) -> np.ndarray:
    return x < INFINITE_COST


def shifted_tables(tables: list[np.ndarray]) -> tuple[list[np.ndarray], float, float, bool]:
    """Each table minus its smallest finite entry (forbidden entries become +inf), the sum
    of those minima, the sum of the shifted tables' largest finite entries, and whether
    every finite entry is an integer."""
    out, offset, span, integral = [], 0.0, 0.0, True
    for t in tables:
        fin = _finite(t)
        m = float(t[fin].min()) if fin.any() else 0.0
        offset += m
        s = np.where(fin, t - m, np.inf)
        out.append(s)
        if fin.any():
            span += float(s[fin].max())
            integral &= bool(np.all(np.mod(t[fin], 1.0) == 0))
    return out, offset, span, integral


def build_model(unary: list[np.ndarray], edges: list[tuple[int, int, np.ndarray]],
                knapsacks: list[tuple[np.ndarray, list[np.ndarray], float]] | None = None,
                best: np.ndarray | None = None) -> Model:
    """The integer model of  min sum_v unary_v(x_v) + sum_(u,v,R) R[x_u, x_v]  subject to
    each knapsack (vars, usage vectors, capacity): sum_i usage_i[x_vars[i]] <= capacity.

    Entries >= INFINITE_COST are forbidden.  Unary/edge costs may be negative or float.
    """
    n = len(unary)
    sizes = np.array([u.size for u in unary], np.int64)
    shifted_u, off_u, span_u, int_u = shifted_tables(unary)
    shifted_e, off_e, span_e, int_e = shifted_tables([r for _a, _b, r in edges])
    offset, span, integral = off_u + off_e, span_u + span_e, int_u and int_e
    scale = pow2_scale(span, _COST_TOTAL, integral)
    arrays: dict = {"sizes": sizes}
    arrays["unary"] = (np.round(np.concatenate(shifted_u) * scale) if n
                       else np.zeros(0))
    arrays["edges"] = np.array([(a, b) for a, b, _ in edges], np.int64).reshape(-1, 2)
    arrays["costs"] = (np.round(np.concatenate([s.ravel() for s in shifted_e]) * scale)
                       if edges else np.zeros(0))
    uscale = 1.0
    if knapsacks:
        caps = np.array([max(float(c), 0.0) for _v, _u, c in knapsacks])
        uscale = pow2_scale(float(caps.max()) if len(caps) else 0.0, _USAGE_MAX, True)
        arrays.update(_knapsack_arrays(knapsacks, uscale))
    if best is not None:
        arrays["best"] = np.asarray(best, np.int64)
    return Model(arrays=arrays, cost_scale=scale, offset=offset, usage_scale=uscale)


def table_offsets(sizes: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each node's values start in a model's flat `unary` and each edge's table in its
    flat `costs` (each with one more entry: the end)."""
    sizes = np.asarray(sizes, np.int64)
    edges = np.asarray(edges, np.int64).reshape(-1, 2)
    uoff = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    eoff = np.concatenate([[0], np.cumsum(sizes[edges[:, 0]] * sizes[edges[:, 1]])])
    return uoff, eoff.astype(np.int64)


def assignment_cost(unary: np.ndarray, arrays: dict, offsets: tuple[np.ndarray, np.ndarray],
                    x: np.ndarray) -> float:
    """Cost in model units of assignment x: its entry of the flat `unary` at every node
    and of every edge table of `arrays` (sizes, edges, costs; `offsets`: table_offsets)."""
    uoff, eoff = offsets
    c = float(unary[uoff[:-1] + x].sum())
    e = arrays["edges"]
    if len(e):
        c += float(arrays["costs"][eoff[:-1] + x[e[:, 0]] * arrays["sizes"][e[:, 1]]
                                   + x[e[:, 1]]].sum())
    return c


def _knapsack_arrays(knapsacks: list[tuple[np.ndarray, list[np.ndarray], float]],
                     uscale: float) -> dict:
    """tb2_handler's knapsack arrays (CSR: kn_ptr over the terms kn_var/kn_val/kn_coef,
    kn_cap) with usages scaled by `uscale`.  A variable's usage vector is usually shared
    by many knapsacks (every live set it belongs to): its nonzero terms are computed once
    per (variable, vector) and gathered, so the cost is linear in the terms."""
    piece: dict[tuple[int, int], int] = {}
    p_val: list[np.ndarray] = []
    p_coef: list[np.ndarray] = []
    p_var: list[int] = []
    pid: list[int] = []
    n_of: list[int] = []
    for vars_, usages, _c in knapsacks:
        n_of.append(len(usages))
        for x, use in zip(vars_.tolist(), usages):
            key = (x, id(use))
            k = piece.get(key)
            if k is None:
                k = piece[key] = len(p_val)
                nz = np.flatnonzero(use > 0)
                p_val.append(nz.astype(np.int64))
                p_coef.append(np.ceil(use[nz] * uscale).astype(np.int64))
                p_var.append(x)
            pid.append(k)
    lens = np.array([len(v) for v in p_val], np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)])[:-1]
    ids = np.array(pid, np.int64)
    cnt = lens[ids]
    total = int(cnt.sum())
    # Term t of piece ids[i] sits at starts[ids[i]] + (t - first term of i).
    first = np.concatenate([[0], np.cumsum(cnt)])[:-1]
    at = np.repeat(starts[ids] - first, cnt) + np.arange(total)
    flat_val = np.concatenate(p_val) if p_val else np.zeros(0, np.int64)
    flat_coef = np.concatenate(p_coef) if p_coef else np.zeros(0, np.int64)
    knap_of = np.repeat(np.arange(len(knapsacks)), n_of)
    per_knap = np.bincount(knap_of, weights=cnt, minlength=len(knapsacks)).astype(np.int64)
    return {
        "kn_ptr": np.concatenate([[0], np.cumsum(per_knap)]),
        "kn_var": np.repeat(np.array(p_var, np.int64)[ids], cnt),
        "kn_val": flat_val[at],
        "kn_coef": flat_coef[at],
        "kn_cap": np.array([int(np.floor(c * uscale)) for _v, _u, c in knapsacks], np.int64),
    }


def nondominated_points(a: np.ndarray, b: np.ndarray, cap: np.ndarray) -> list[int]:
    """Points k (0 <= k < len(cap)) whose constraint  sum_{v: a_v <= k < b_v} use_v <= cap_k
    is not implied by another point's.

    The live set of k is a subset of the live set of k' exactly when
    max_a(k) <= k' < min_b(k) (live ranges are intervals); k is dropped when such a k'
    has a capacity no larger (ties: the lower index stays).  Points where nothing is live
    are dropped.
    """
    npt = len(cap)
    max_a = np.full(npt, -1, np.int64)
    min_b = np.full(npt, npt, np.int64)
    order = np.argsort(a, kind="stable")
    by_b: list[tuple[int, int]] = []  # heap of (b, a) of the live nodes
    by_a: list[tuple[int, int]] = []  # heap of (-a, b), cleaned lazily
    j = 0
    for k in range(npt):
        while j < len(order) and a[order[j]] <= k:
            v = order[j]
            heapq.heappush(by_b, (int(b[v]), int(a[v])))
            heapq.heappush(by_a, (-int(a[v]), int(b[v])))
            j += 1
        while by_b and by_b[0][0] <= k:
            heapq.heappop(by_b)
        while by_a and by_a[0][1] <= k:
            heapq.heappop(by_a)
        if by_b:
            min_b[k] = by_b[0][0]
            max_a[k] = -by_a[0][0]
    keep = []
    for k in range(npt):
        if max_a[k] < 0:
            continue
        lo, hi = int(max_a[k]), int(min_b[k])
        win = cap[lo:hi]
        idx = np.arange(lo, hi)
        dom = (idx != k) & ((win < cap[k]) | ((win == cap[k]) & (idx < k)))
        if not dom.any():
            keep.append(k)
    return keep


def memory_nodes(red: Reduced) -> np.ndarray:
    """Boolean [n]: nodes live at a checkpoint with a non-constant usage."""
    n = red.num_nodes
    return (red.rng[:, 1] > red.rng[:, 0]) & np.array(
        [d.max() > 0 for d in red.du] + [False])[:n]


def live_set_constraints(red: Reduced) -> list[int]:
    """Checkpoints of `red` whose memory constraint is not implied by another's."""
    if not len(red.cap):
        return []
    memo = memory_nodes(red)
    return nondominated_points(red.rng[memo, 0], red.rng[memo, 1], red.cap)


def reduced_model(red: Reduced, extra: np.ndarray | None = None, memory: bool = False,
                  best: np.ndarray | None = None) -> Model:
    """The whole reduced problem: node costs (+ `extra`, flat per strategy) and edges,
    with one knapsack per non-dominated live set when `memory`."""
    unary = list(red.costs)
    if extra is not None:
        off = np.concatenate([[0], np.cumsum([c.size for c in red.costs])])
        unary = [np.where(c < INFINITE_COST, c + extra[off[v]:off[v + 1]], c)
                 for v, c in enumerate(red.costs)]
    knaps = None
    if memory and len(red.cap):
        a, b = red.rng[:, 0], red.rng[:, 1]
        knaps = []
        for k in live_set_constraints(red):
            vs = np.flatnonzero((a <= k) & (b > k))
            vs = np.array([v for v in vs.tolist() if red.du[v].max() > 0], np.int64)
            knaps.append((vs, [red.du[v] for v in vs.tolist()], float(red.cap[k])))
    return build_model(unary, red.edges, knaps, best)

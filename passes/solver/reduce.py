"""Exact reductions of a ShardingProblem before search, and mapping solutions back.

The memory constraint is first rewritten on "checkpoints": the start times after which
the live set is maximal (no other start before the next end) and where the largest
possible usage exceeds the limit.  Each node's usage is split into its minimum (a
constant, summed into `base`) and the excess `du` over it; a node not live at any
checkpoint, or whose excess is zero, is "memory-free" and can be eliminated exactly
like in the unconstrained problem.  Reductions (all exact):
  - drop forbidden strategies (node cost >= INFINITE_COST, or a full forbidden edge row);
  - drop dominated strategies (no worse cost, excess usage and incident edge rows);
  - remove separable edges R[i, j] = a[i] + b[j] (moved into node costs), merge parallel
    edges;
  - fold single-strategy nodes into neighbours; eliminate memory-free isolated nodes,
    leaves, and degree-2 chain nodes (a new edge between the two neighbours).
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from .problem import INFINITE_COST, ShardingProblem

_BIG = 1e30  # stands for "forbidden" after sums of INFINITE_COST entries
_CHAIN_MAX_ENTRIES = 2_000_000  # S_u * S_v * S_w bound for chain elimination
_DOMINANCE_MAX_ENTRIES = 20_000_000  # S^2 * features bound for the dominance check
_DOMINANCE_MAX_DEGREE = 64


class InfeasibleError(ValueError):
    """No choice of strategies satisfies the usage limit."""

    def __init__(self, smallest_peak_usage: float, usage_limit: float, name: str = "") -> None:
        self.smallest_peak_usage = smallest_peak_usage
        self.usage_limit = usage_limit
        super().__init__(
            f"problem {name!r}: usage limit {usage_limit:g} cannot be met; the smallest peak "
            f"usage found is {smallest_peak_usage:g} (every node at its least-usage strategy)"
        )


@dataclasses.dataclass
class Reduced:
    """The reduced problem plus what is needed to map its solutions back.

    costs/du: per reduced node, cost and excess usage (over the node's minimum) vectors.
    rng: int64 [n, 2], the node's live checkpoints are rng[v, 0] <= k < rng[v, 1].
    cap: float64 [K], usage limit minus the constant usage at each checkpoint.
    edges: list of (u, v, R) with R of shape [S_u, S_v] (reduced node indices).
    offset: constant cost of the eliminated part (added to the reduced objective).
    """

    costs: list
    du: list
    rng: np.ndarray
    cap: np.ndarray
    edges: list
    offset: float
    kept: np.ndarray
    kept_idx: list
    records: list
    num_orig: int

    @property
    def num_nodes(self) -> int:
        return len(self.costs)

    def num_strategies(self) -> int:
        return int(sum(c.size for c in self.costs))

    def live_sums(self, per_checkpoint: np.ndarray) -> np.ndarray:
        """Per node: the sum of `per_checkpoint` (one value per checkpoint, e.g. memory
        prices) over the node's live checkpoints; 0 where the node is live nowhere."""
        cm = np.concatenate([[0.0], np.cumsum(per_checkpoint)])
        return cm[self.rng[:, 1]] - cm[self.rng[:, 0]]

    def expand(self, s_red) -> np.ndarray:
        """Maps a reduced-problem choice (local indices) to original strategy indices."""
        s = np.full(self.num_orig, -1, np.int64)
        for i, v in enumerate(self.kept):
            s[v] = self.kept_idx[i][int(s_red[i])]
        for rec in reversed(self.records):
            kind = rec[0]
            if kind == "fixed":
                s[rec[1]] = rec[2]
            elif kind == "leaf":
                _, v, u, ou, choice = rec
                s[v] = choice[np.searchsorted(ou, s[u])]
            else:
                _, v, u, w, ou, ow, table = rec
                s[v] = table[np.searchsorted(ou, s[u]), np.searchsorted(ow, s[w])]
        return s


def checkpoints(p: ShardingProblem) -> np.ndarray:
    """Sorted start times after which the live set is maximal (candidate peak times)."""
    iv = p.intervals[p.intervals[:, 0] < p.intervals[:, 1]]
    if not len(iv):
        return np.zeros(0, np.int64)
    starts = np.unique(iv[:, 0])
    ends = np.unique(iv[:, 1])
    nxt_start = np.append(starts[1:], np.iinfo(np.int64).max)
    nxt_end = ends[np.minimum(np.searchsorted(ends, starts, "right"), len(ends) - 1)]
    return starts[nxt_end <= nxt_start]


class _Graph:
    def __init__(self, p: ShardingProblem) -> None:
        n = p.num_nodes
        self.n = n
        self.cost = [np.minimum(c.astype(np.float64), _BIG) for c in p.node_costs]
        self.use = [u.astype(np.float64) for u in p.node_usages]
        self.idx = [np.arange(c.size) for c in p.node_costs]
        self.alive = np.ones(n, bool)
        self.adj: list[dict[int, int]] = [{} for _ in range(n)]
        self.edges: dict[int, list] = {}
        self.offset = 0.0
        self.records: list = []
        self.next_eid = 0
        for (u, v), r in zip(p.edges, p.edge_costs):
            self.add_edge(int(u), int(v), np.minimum(r.astype(np.float64), _BIG))

    def add_edge(self, u: int, v: int, r: np.ndarray) -> None:
        if u == v:  # self-loop: only the diagonal is ever paid
            self.cost[u] = np.minimum(self.cost[u] + np.diag(r), _BIG)
            return
        eid = self.adj[u].get(v)
        if eid is not None:
            e = self.edges[eid]
            e[2] = np.minimum(e[2] + (r if e[0] == u else r.T), _BIG)
            e[3] = None
            return
        eid = self.next_eid
        self.next_eid += 1
        self.edges[eid] = [u, v, r, None]  # last: cached row checks
        self.adj[u][v] = eid
        self.adj[v][u] = eid

    def remove_edge(self, u: int, v: int) -> None:
        eid = self.adj[u].pop(v)
        del self.adj[v][u]
        del self.edges[eid]

    def oriented(self, v: int, w: int) -> np.ndarray:
        """The matrix of edge v-w with v's strategies as rows."""
        a, _, r, _ = self.edges[self.adj[v][w]]
        return r if a == v else r.T

    def edge_info(self, v: int, w: int) -> tuple[np.ndarray, bool]:
        """(rows of v with an allowed entry, whether the edge is separable), cached."""
        e = self.edges[self.adj[v][w]]
        if e[3] is None:
            r = e[2]
            finite = r < INFINITE_COST
            sep = bool(finite.all())
            if sep:
                sep = np.array_equal(r, r[:, :1] + (r[0, :] - r[0, 0])[None, :])
            e[3] = (finite.any(axis=1), finite.any(axis=0), sep)
        rows_u, rows_v, sep = e[3]
        return (rows_u if e[0] == v else rows_v), sep

    def keep(self, v: int, mask: np.ndarray) -> None:
        self.cost[v] = self.cost[v][mask]
        self.use[v] = self.use[v][mask]
        self.idx[v] = self.idx[v][mask]
        for eid in self.adj[v].values():
            e = self.edges[eid]
            e[2] = e[2][mask] if e[0] == v else e[2][:, mask]
            e[3] = None


class _Queue:
    """FIFO work list without duplicates."""

    def __init__(self, items) -> None:
        self.q = deque(items)
        self.inq = set(self.q)

    def __bool__(self) -> bool:
        return bool(self.q)

    def append(self, v: int) -> None:
        if v not in self.inq:
            self.inq.add(v)
            self.q.append(v)

    def extend(self, vs) -> None:
        for v in vs:
            self.append(v)

    def pop(self) -> int:
        v = self.q.popleft()
        self.inq.discard(v)
        return v


def _dominated(feat: np.ndarray) -> np.ndarray:
    """Boolean mask of rows dominated (<= everywhere) by another row (ties: lower index wins)."""
    s = feat.shape[0]
    le = np.all(feat[:, None, :] <= feat[None, :, :], axis=2)  # le[b, a]: b <= a
    np.fill_diagonal(le, False)
    eq = le & le.T
    strict = le & ~le.T
    tie_lower = eq & (np.arange(s)[:, None] < np.arange(s)[None, :])
    return np.any(strict | tie_lower, axis=0)


class _Reducer:
    """One problem's reduction: its graph, which nodes the memory constraint still concerns
    (`mem_rel`), their checkpoint ranges (`rng`) and the checkpoints' free bytes (`cap`)."""

    def __init__(self, p: ShardingProblem) -> None:
        self.p = p
        self.g = g = _Graph(p)
        n = p.num_nodes
        # Forbidden node strategies first: they must not count as the node's minimum usage.
        for v in range(n):
            ok = g.cost[v] < INFINITE_COST
            if ok.any() and not ok.all():
                g.keep(v, ok)
        self.mem_rel = np.zeros(n, bool)
        self.rng = np.zeros((n, 2), np.int64)
        self.cap = np.zeros(0)
        self.setup_memory()

    def setup_memory(self) -> None:
        """Re-derives the binding checkpoints and the memory-relevant nodes from the live
        strategies (bytes); InfeasibleError when the minimum usage alone is over the limit."""
        p, g, limit, iv = self.p, self.g, self.p.usage_limit, self.p.intervals
        self.mem_rel[:] = False
        if limit is None:
            self.cap = np.zeros(0)
            return
        n = p.num_nodes
        alive = np.flatnonzero(g.alive)
        t = checkpoints(p)
        a = np.searchsorted(t, iv[:, 0], "left")
        b = np.maximum(a, np.searchsorted(t, iv[:, 1], "left"))
        umin = np.array([g.use[v].min() for v in range(n)])
        umax = np.array([g.use[v].max() for v in range(n)])
        base = np.zeros(len(t) + 1)
        np.add.at(base, a, umin)
        np.add.at(base, b, -umin)
        base = np.cumsum(base)[:-1]
        if len(t) and base.max() > limit:
            raise InfeasibleError(float(base.max()), float(limit), p.name)
        extra = np.zeros(len(t) + 1)
        np.add.at(extra, a[alive], umax[alive] - umin[alive])
        np.add.at(extra, b[alive], -(umax[alive] - umin[alive]))
        binding = base + np.cumsum(extra)[:-1] > limit
        t = t[binding]
        self.cap = limit - base[binding]
        self.rng[:, 0] = np.searchsorted(t, iv[:, 0], "left")
        self.rng[:, 1] = np.maximum(self.rng[:, 0], np.searchsorted(t, iv[:, 1], "left"))
        self.mem_rel[:] = (self.rng[:, 1] > self.rng[:, 0]) & (umax > umin) & g.alive

    def process(self, v: int, queue: _Queue) -> None:
        """Applies every rule to node `v`; queues the neighbours whose problem changed."""
        if not self.g.alive[v]:
            return
        changed = self._edge_rules(v, queue)
        changed = self._drop_dominated(v) or changed
        nbrs = list(self.g.adj[v])
        if self._eliminate(v, nbrs) or changed:
            queue.extend(nbrs)

    def _edge_rules(self, v: int, queue: _Queue) -> bool:
        """Drops `v`'s strategies every incident edge forbids and moves separable edges into
        the node costs; whether anything changed."""
        g = self.g
        changed = False
        ok = g.cost[v] < INFINITE_COST
        separable = []
        for w in g.adj[v]:
            rows, sep = g.edge_info(v, w)
            ok &= rows
            if sep:
                separable.append(w)
        if ok.any() and not ok.all():
            g.keep(v, ok)
            changed = True
        for w in separable:
            r = g.oriented(v, w)
            a, b = r[:, 0], r[0, :] - r[0, 0]
            if np.array_equal(r, a[:, None] + b[None, :]):
                g.cost[v] = g.cost[v] + a
                g.cost[w] = g.cost[w] + b
                g.remove_edge(v, w)
                queue.append(w)
                changed = True
        return changed

    def _drop_dominated(self, v: int) -> bool:
        """Drops the strategies of `v` another one dominates (cost, excess usage where memory
        matters, every incident edge row); whether any was dropped."""
        g = self.g
        sv = g.cost[v].size
        if sv <= 1 or len(g.adj[v]) > _DOMINANCE_MAX_DEGREE:
            return False
        cols = [g.cost[v][:, None]]
        if self.mem_rel[v]:
            cols.append(g.use[v][:, None])
        cols += [g.oriented(v, w) for w in g.adj[v]]
        if sv * sv * sum(c.shape[1] for c in cols) > _DOMINANCE_MAX_ENTRIES:
            return False
        dom = _dominated(np.concatenate(cols, axis=1))
        if not dom.any():
            return False
        g.keep(v, ~dom)
        if self.mem_rel[v] and g.use[v].max() == g.use[v].min():
            self.mem_rel[v] = False
        return True

    def _fix(self, v: int, j: int) -> None:
        """Removes `v` with its strategy at position `j` (no incident edge left)."""
        g = self.g
        g.offset += float(g.cost[v][j])
        g.records.append(("fixed", v, int(g.idx[v][j])))
        g.alive[v] = False
        self.mem_rel[v] = False

    def _eliminate(self, v: int, nbrs: list[int]) -> bool:
        """Eliminates `v` if a rule applies (one strategy; memory-free and isolated, a leaf
        or a small degree-2 chain node); whether it did."""
        g = self.g
        if g.cost[v].size == 1:
            for w in nbrs:
                g.cost[w] = np.minimum(g.cost[w] + g.oriented(w, v)[:, 0], _BIG)
                g.remove_edge(v, w)
            self._fix(v, 0)
        elif self.mem_rel[v]:
            return False
        elif not nbrs:
            self._fix(v, int(np.argmin(g.cost[v])))
        elif len(nbrs) == 1:
            (u,) = nbrs
            tot = g.oriented(u, v) + g.cost[v][None, :]
            j = np.argmin(tot, axis=1)
            g.cost[u] = np.minimum(g.cost[u] + tot[np.arange(len(j)), j], _BIG)
            g.records.append(("leaf", v, u, g.idx[u].copy(), g.idx[v][j]))
            g.remove_edge(u, v)
            g.alive[v] = False
        elif len(nbrs) == 2 and (g.cost[nbrs[0]].size * g.cost[nbrs[1]].size * g.cost[v].size
                                 <= _CHAIN_MAX_ENTRIES):
            u, w = nbrs
            tot = (g.oriented(u, v)[:, :, None] + g.cost[v][None, :, None]
                   + g.oriented(v, w)[None, :, :])
            j = np.argmin(tot, axis=1)
            best = np.take_along_axis(tot, j[:, None, :], axis=1)[:, 0, :]
            g.records.append(("chain", v, u, w, g.idx[u].copy(), g.idx[w].copy(), g.idx[v][j]))
            g.remove_edge(u, v)
            g.remove_edge(v, w)
            g.add_edge(u, w, np.minimum(best, _BIG))
            g.alive[v] = False
        else:
            return False
        return True

    def result(self) -> Reduced:
        """The problem of the nodes left, as `Reduced`."""
        g, mem_rel = self.g, self.mem_rel
        kept = np.flatnonzero(g.alive)
        pos = np.full(self.p.num_nodes, -1, np.int64)
        pos[kept] = np.arange(len(kept))
        edges = [(int(pos[u]), int(pos[v]), r) for u, v, r, _ in g.edges.values()]
        du = [g.use[v] - g.use[v].min() if mem_rel[v] else np.zeros(g.use[v].size)
              for v in kept]
        return Reduced(
            costs=[g.cost[v] for v in kept], du=du,
            rng=np.where(mem_rel[kept, None], self.rng[kept], 0), cap=self.cap, edges=edges,
            offset=g.offset, kept=kept, kept_idx=[g.idx[v] for v in kept], records=g.records,
            num_orig=self.p.num_nodes)


def reduce_problem(p: ShardingProblem) -> tuple[Reduced, dict]:
    """Applies the exact reductions; returns the reduced problem and size statistics."""
    r = _Reducer(p)
    stats = {"nodes_before": p.num_nodes, "edges_before": p.num_edges,
             "strategies_before": int(p.num_strategies().sum())}
    for _round in range(4):
        queue = _Queue(range(p.num_nodes))
        while queue:
            r.process(queue.pop(), queue)
        before = int(r.mem_rel.sum())
        r.setup_memory()
        if int(r.mem_rel.sum()) == before:
            break
    red = r.result()
    stats.update(nodes_after=len(red.kept), edges_after=len(red.edges),
                 strategies_after=red.num_strategies(), checkpoints=len(red.cap),
                 memory_nodes_after=int(r.mem_rel[red.kept].sum()))
    return red, stats

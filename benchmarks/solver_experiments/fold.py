"""Leaves of a penalized model folded into their neighbours: the same problem, smaller.

Once the memory limit is a penalty (penalty.py, lagrange.py) the problem is pairwise and
unconstrained, so a node with one neighbour (a leaf: most of a reduced XLA graph's memory
nodes are) can be decided after its neighbour: its neighbour's strategy i costs, in
addition, min_j (leaf_j + edge[i, j]).  Folding every leaf, and the leaves that leaves
leave behind, is exact: the folded model (the core) has the same optimum, the cost of a
core answer is the cost of its expansion (each folded node at its best strategy given its
neighbour), and a lower bound of the core is one of the whole model.  The reduction
(reduce.py) cannot fold these nodes, because with the limit a memory node's best strategy
depends on more than its neighbour.

Measured on IOPDDL S (benchmarks/solver_tb2_settings.py): 25,872 reduced nodes fold to a
core of 6,539, on which toulbar2 reaches a penalized cost about 4% lower from a cold start
in the same CPU time (13 s), and about the same from a warm start.
The penalty loop does not use it: with every penalty solve on the core, whole solve() runs
on S (240 s, 2 cores) ended at 1.062 and 1.088 of the best known cost (1.022-1.034 the
same day without): the cheaper penalized answers overflow more widely at low weights, where
the repair fails, and cost more at high ones.  With the loop's weights also falling 4x per
round (not 16x) while a node fits and widening 2x (not 1.35x) while it does not, S ended at
1.017, 1.022 and 1.074 (A 1.0003, M 0.9999): no better on average, and less steady.
The Lagrangian bound on S did not move (0.807 of the known bound with it, 0.809
without): toulbar2's gap on each subproblem stays.  Folding the nodes of two neighbours
as well (a core of 3,345) made toulbar2's answers worse (merged tables slow its
propagation).

Model arrays are autopar.passes.solver.tb2_handler's: sizes, edges [E, 2], costs (each
edge's [S_a, S_b] table flattened row-major), unary (flat, +inf forbidden); costs are
toulbar2's integer units.
"""

from __future__ import annotations

import numpy as np

from autopar.passes.solver.cfn import assignment_cost, table_offsets


class LeafFold:
    """The fold of one model's topology (its edge tables fixed, its unary costs free)."""

    def __init__(self, sizes: np.ndarray, edges: np.ndarray, costs: np.ndarray) -> None:
        sizes = np.asarray(sizes, np.int64)
        edges = np.asarray(edges, np.int64).reshape(-1, 2)
        n = len(sizes)
        self.sizes = sizes
        self.off, eoff = table_offsets(sizes, edges)
        incident: list[list[int]] = [[] for _ in range(n)]
        for k, (a, b) in enumerate(edges.tolist()):
            incident[a].append(k)
            incident[b].append(k)
        deg = np.array([len(x) for x in incident], np.int64)
        gone = np.zeros(len(edges), bool)
        folded = np.zeros(n, bool)
        # (leaf, its neighbour, table [S_neighbour, S_leaf]) in folding order.
        self.order: list[tuple[int, int, np.ndarray]] = []
        stack = np.flatnonzero(deg == 1).tolist()[::-1]
        while stack:
            v = stack.pop()
            if deg[v] != 1:
                continue  # its neighbour was folded into it: v is a root now
            k = next(e for e in incident[v] if not gone[e])
            a, b = int(edges[k, 0]), int(edges[k, 1])
            tab = costs[eoff[k]:eoff[k + 1]].reshape(sizes[a], sizes[b])
            u, table = (a, tab) if b == v else (b, tab.T)
            self.order.append((v, u, np.ascontiguousarray(table)))
            gone[k] = True
            folded[v] = True
            deg[v] = 0
            deg[u] -= 1
            if deg[u] == 1:
                stack.append(u)
        self.core = np.flatnonzero(~folded)
        new_id = np.full(n, -1, np.int64)
        new_id[self.core] = np.arange(len(self.core))
        keep = np.flatnonzero(~gone)
        core_sizes = sizes[self.core]
        self.arrays = {
            "sizes": core_sizes,
            "edges": new_id[edges[keep]].reshape(-1, 2),
            "costs": (np.concatenate([costs[eoff[k]:eoff[k + 1]] for k in keep.tolist()])
                      if len(keep) else np.zeros(0)),
        }
        # Positions of the core's values in the whole model's flat unary.
        self._core_pos = (np.concatenate([np.arange(self.off[v], self.off[v + 1])
                                          for v in self.core.tolist()])
                          if len(self.core) else np.zeros(0, np.int64))
        self._core_offsets = table_offsets(core_sizes, self.arrays["edges"])

    @property
    def num_folded(self) -> int:
        return len(self.order)

    def fold(self, unary: np.ndarray) -> np.ndarray:
        """The whole model's flat `unary` with every leaf's best cost added to its
        neighbour, in folding order (a folded node's own entries then hold its cost at
        the time it was folded).  core_unary and expand read this array."""
        u = np.array(unary, np.float64)
        off = self.off
        for v, w, table in self.order:
            u[off[w]:off[w + 1]] += (table + u[off[v]:off[v + 1]][None, :]).min(axis=1)
        return u

    def core_unary(self, folded: np.ndarray) -> np.ndarray:
        """The core's flat unary costs (`folded`: fold's answer)."""
        return folded[self._core_pos]

    def expand(self, core_x: np.ndarray, folded: np.ndarray) -> np.ndarray:
        """The whole model's answer from a core answer: each folded node at its best
        strategy given its neighbour's (the first one among equal costs)."""
        x = np.zeros(len(self.sizes), np.int64)
        x[self.core] = np.asarray(core_x, np.int64)
        off = self.off
        for v, w, table in reversed(self.order):
            x[v] = int(np.argmin(table[x[w]] + folded[off[v]:off[v + 1]]))
        return x

    def core_cost(self, folded: np.ndarray, x: np.ndarray) -> float:
        """Cost in model units of the whole model's answer `x` restricted to the core
        (at most the cost of x itself, whose folded nodes may not be at their best)."""
        return assignment_cost(self.core_unary(folded), self.arrays, self._core_offsets,
                               np.asarray(x, np.int64)[self.core])

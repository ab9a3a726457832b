"""The sharding-strategy selection problem every solver in autopar solves.

It has the shape of the ASPLOS'25 IOPDDL contest instances: nodes with a half-open
liveness interval and, per strategy, a cost and a memory usage; directed edges with a
|S_u| x |S_v| cost matrix; and a usage limit that the chosen strategies of all nodes
live at any time t must respect.  The intra-op pass builds one from a jaxpr (costs in
seconds, usages in bytes per device); `load_iopddl` builds one from a contest file
(costs and usages in the contest's own units).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

SolveStatus = Literal["optimal", "feasible", "fallback"]

# Costs at or above this are forbidden choices (XLA's "infinity" in the contest files).
INFINITE_COST = 1e18
# solve() scales costs whose largest finite magnitude is below this up by a power of two
# into [COST_FLOOR, 2 x COST_FLOOR) (`solve.cost_scale`): autopar's own problems are priced
# in seconds (1e-10 to 1e-7 per choice on a gpt-toy layer), below the MIP solvers' absolute
# tolerances (HiGHS: mip_abs_gap 1e-6, primal and dual feasibility 1e-7), which then stop
# at "optimal" answers several percent off the optimum (4.2% on that layer).
COST_FLOOR = 2.0 ** 20


@dataclasses.dataclass(frozen=True, eq=False)
class ShardingProblem:
    """A strategy-selection problem.

    Attributes:
      node_costs: per node, float64 array [S_v] of costs (seconds for autopar's own
        problems; contest units for IOPDDL ones).  Entries >= INFINITE_COST are forbidden.
      node_usages: per node, float64 array [S_v] of memory usage (bytes per device).
      intervals: int64 array [N, 2], half-open liveness interval [start, end) of each node.
        A node with start >= end is never live (uses no memory).
      edges: int64 array [E, 2] of (u, v) node pairs.
      edge_costs: per edge, float64 array [S_u, S_v]; entry [i, j] is paid when u picks
        strategy i and v picks strategy j.
      usage_limit: memory limit at every time t (same unit as node_usages), or None.
      node_names: optional human-readable name per node (for errors and reports).
      name: name of the problem (file name or program name).
    """

    node_costs: tuple[np.ndarray, ...]
    node_usages: tuple[np.ndarray, ...]
    intervals: np.ndarray
    edges: np.ndarray
    edge_costs: tuple[np.ndarray, ...]
    usage_limit: float | None = None
    node_names: tuple[str, ...] | None = None
    name: str = "problem"

    def __post_init__(self) -> None:
        n = len(self.node_costs)
        if len(self.node_usages) != n:
            raise ValueError(
                f"ShardingProblem {self.name!r}: {n} node cost vectors but "
                f"{len(self.node_usages)} usage vectors"
            )
        if self.intervals.shape != (n, 2):
            raise ValueError(
                f"ShardingProblem {self.name!r}: intervals has shape {self.intervals.shape}, "
                f"expected ({n}, 2)"
            )
        if len(self.edge_costs) != len(self.edges):
            raise ValueError(
                f"ShardingProblem {self.name!r}: {len(self.edges)} edges but "
                f"{len(self.edge_costs)} edge cost matrices"
            )
        for v, (c, m) in enumerate(zip(self.node_costs, self.node_usages)):
            if c.shape != m.shape or c.ndim != 1 or c.size == 0:
                raise ValueError(
                    f"ShardingProblem {self.name!r}: node {v} has cost shape {c.shape} and "
                    f"usage shape {m.shape}; both must be the same non-empty vector"
                )
        for e, ((u, v), r) in enumerate(zip(self.edges, self.edge_costs)):
            want = (self.node_costs[u].size, self.node_costs[v].size)
            if r.shape != want:
                raise ValueError(
                    f"ShardingProblem {self.name!r}: edge {e} ({u}->{v}) has cost matrix "
                    f"shape {r.shape}, expected {want}"
                )

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    @property
    def num_edges(self) -> int:
        return len(self.edges)

    def num_strategies(self) -> np.ndarray:
        """int64 array [N]: the number of strategies of each node."""
        return np.array([c.size for c in self.node_costs], dtype=np.int64)


def scale_costs(p: ShardingProblem, k: float) -> ShardingProblem:
    """`p` with every allowed cost multiplied by `k` (forbidden ones stay forbidden)."""
    if k == 1.0:
        return p

    def mul(c: np.ndarray) -> np.ndarray:
        return np.where(c < INFINITE_COST, c * k, c)

    return dataclasses.replace(p, node_costs=tuple(mul(c) for c in p.node_costs),
                               edge_costs=tuple(mul(r) for r in p.edge_costs))


@dataclasses.dataclass(frozen=True)
class Solution:
    """What a solver returns.

    Attributes:
      strategies: the chosen strategy index of every node.
      cost: objective value of `strategies` (sum of node costs and edge costs).
      lower_bound: a proven lower bound on the optimum, or None when unknown.
      status: "optimal" (proved), "feasible" (found by the exact solver, not proved
        optimal), or "fallback" (from the heuristic, the exact solver found nothing in time).
      seconds: wall-clock time spent in `solve`, model building included.
      feasible: whether `strategies` respects the usage limit and avoids forbidden costs.
      stats: diagnostics (sizes before/after reduction, backend, per-phase seconds, ...).
    """

    strategies: tuple[int, ...]
    cost: float
    lower_bound: float | None
    status: SolveStatus
    seconds: float
    feasible: bool = True
    stats: dict = dataclasses.field(default_factory=dict)

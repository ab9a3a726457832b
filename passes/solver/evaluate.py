"""Vectorised objective and feasibility check by the contest's rules."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from .problem import INFINITE_COST, ShardingProblem


class _Flat:
    """The problem's tables concatenated into flat arrays (built once per problem)."""

    def __init__(self, p: ShardingProblem) -> None:
        sizes = p.num_strategies()
        self.sizes = sizes
        self.node_off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.cost = np.concatenate(p.node_costs) if p.num_nodes else np.zeros(0)
        self.usage = np.concatenate(p.node_usages) if p.num_nodes else np.zeros(0)
        if p.num_edges:
            esz = np.array([r.size for r in p.edge_costs], np.int64)
            self.edge_off = np.concatenate([[0], np.cumsum(esz)[:-1]]).astype(np.int64)
            self.ecost = np.concatenate([r.ravel() for r in p.edge_costs])
        else:
            self.edge_off = np.zeros(0, np.int64)
            self.ecost = np.zeros(0)
        iv = p.intervals
        live = iv[:, 0] < iv[:, 1]
        self.live_nodes = np.flatnonzero(live)
        times, inv = np.unique(iv[live].ravel(), return_inverse=True)
        inv = inv.reshape(-1, 2)
        self.num_times = len(times)
        self.start_idx = inv[:, 0]
        self.end_idx = inv[:, 1]


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def flat(p: ShardingProblem) -> _Flat:
    f = _CACHE.get(p)
    if f is None:
        f = _CACHE[p] = _Flat(p)
    return f


def usage_profile(p: ShardingProblem, strategies: Sequence[int] | np.ndarray) -> np.ndarray:
    """Total usage at each distinct event time (float64 array) for the given choice."""
    f = flat(p)
    s = np.asarray(strategies, np.int64)
    use = f.usage[f.node_off[f.live_nodes] + s[f.live_nodes]]
    delta = np.zeros(f.num_times + 1)
    np.add.at(delta, f.start_idx, use)
    np.add.at(delta, f.end_idx, -use)
    return np.cumsum(delta)[:-1]


def peak_usage(p: ShardingProblem, strategies: Sequence[int] | np.ndarray) -> float:
    prof = usage_profile(p, strategies)
    return float(prof.max()) if prof.size else 0.0


def evaluate(p: ShardingProblem, strategies: Sequence[int] | np.ndarray) -> tuple[float, bool]:
    """Returns (cost, feasible) of a choice of one strategy index per node.

    cost is the sum of the chosen node costs and edge-matrix entries. feasible is False
    when a chosen cost is forbidden (>= INFINITE_COST) or the usage limit is exceeded.
    """
    f = flat(p)
    s = np.asarray(strategies, np.int64)
    if s.shape != (p.num_nodes,):
        raise ValueError(
            f"evaluate: expected {p.num_nodes} strategy indices, got shape {s.shape}"
        )
    if s.size and (s.min() < 0 or np.any(s >= f.sizes)):
        raise ValueError("evaluate: a strategy index is out of range for its node")
    nc = f.cost[f.node_off + s]
    if p.num_edges:
        u, v = p.edges[:, 0], p.edges[:, 1]
        ec = f.ecost[f.edge_off + s[u] * f.sizes[v] + s[v]]
    else:
        ec = np.zeros(0)
    cost = float(nc.sum() + ec.sum())
    feasible = not (np.any(nc >= INFINITE_COST) or np.any(ec >= INFINITE_COST))
    if feasible and p.usage_limit is not None:
        feasible = peak_usage(p, s) <= p.usage_limit
    return cost, feasible

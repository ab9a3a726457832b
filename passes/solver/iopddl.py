"""Reader for the ASPLOS'25 IOPDDL contest instance format (.json or .json.gz)."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np

from .problem import ShardingProblem


def _field(obj: dict, key: str, where: str, path: str) -> object:
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"{path}: missing field {where}{key!r}")
    return obj[key]


def load_iopddl(path: str | os.PathLike) -> ShardingProblem:
    """Reads a contest instance: ``{"problem": {"nodes": ..., "edges": ..., "usage_limit"}}``.

    Edge cost matrices are stored flattened with index ``s_u * |S_v| + s_v``.
    Raises ValueError naming the file and the field when the file is malformed.
    """
    path = os.fspath(path)
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError, EOFError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read contest instance: {exc}") from exc
    prob = _field(doc, "problem", "", path)
    nodes = _field(prob, "nodes", "problem.", path)
    edges = _field(prob, "edges", "problem.", path)
    try:
        intervals = np.asarray(_field(nodes, "intervals", "problem.nodes.", path), np.int64)
        if intervals.ndim != 2 or intervals.shape[1:] != (2,):
            raise ValueError("expected a list of [start, end] pairs")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: bad field problem.nodes.intervals: {exc}") from exc
    costs_in = _field(nodes, "costs", "problem.nodes.", path)
    usages_in = _field(nodes, "usages", "problem.nodes.", path)
    n = len(intervals)
    for name, val in (("costs", costs_in), ("usages", usages_in)):
        if not isinstance(val, list) or len(val) != n:
            raise ValueError(f"{path}: problem.nodes.{name} must be a list of {n} lists")
    node_costs, node_usages = [], []
    for v in range(n):
        try:
            c = np.asarray(costs_in[v], np.float64)
            m = np.asarray(usages_in[v], np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: bad field problem.nodes.costs/usages[{v}]: {exc}") from exc
        if c.ndim != 1 or c.size == 0 or c.shape != m.shape:
            raise ValueError(
                f"{path}: problem.nodes.costs[{v}] and usages[{v}] must be equal-length "
                f"non-empty lists, got shapes {c.shape} and {m.shape}"
            )
        node_costs.append(c)
        node_usages.append(m)
    try:
        pairs = np.asarray(_field(edges, "nodes", "problem.edges.", path), np.int64)
        pairs = pairs.reshape(-1, 2)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: bad field problem.edges.nodes: {exc}") from exc
    if pairs.size and (pairs.min() < 0 or pairs.max() >= n):
        raise ValueError(f"{path}: problem.edges.nodes refers to a node outside [0, {n})")
    ecosts_in = _field(edges, "costs", "problem.edges.", path)
    if not isinstance(ecosts_in, list) or len(ecosts_in) != len(pairs):
        raise ValueError(f"{path}: problem.edges.costs must be a list of {len(pairs)} lists")
    edge_costs = []
    for e, (u, v) in enumerate(pairs):
        shape = (node_costs[u].size, node_costs[v].size)
        try:
            r = np.asarray(ecosts_in[e], np.float64).reshape(shape)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"{path}: bad field problem.edges.costs[{e}] (edge {u}->{v}, expected "
                f"{shape[0]}x{shape[1]} entries): {exc}"
            ) from exc
        edge_costs.append(r)
    limit = prob.get("usage_limit")
    if limit is not None and not isinstance(limit, (int, float)):
        raise ValueError(f"{path}: problem.usage_limit must be a number, got {limit!r}")
    name = prob.get("name") or os.path.basename(path)
    return ShardingProblem(
        node_costs=tuple(node_costs),
        node_usages=tuple(node_usages),
        intervals=intervals,
        edges=pairs,
        edge_costs=tuple(edge_costs),
        usage_limit=None if limit is None else float(limit),
        name=str(name),
    )

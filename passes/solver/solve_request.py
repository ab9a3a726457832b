"""The "solve" request: one `ShardingProblem` solved by `solve()` in a worker process.

Request arrays: sizes [n], costs / usages [sum sizes], intervals [n, 2], edges [E, 2],
edge_costs [sum S_u*S_v] (row-major per edge); meta: usage_limit, name, node_names,
time_limit_s (seconds), backend, threads.
Answer arrays: strategies [n]; meta: cost, lower_bound, status, seconds, feasible, stats
— or meta {"error": text, "kind": the exception's type name, ...} when the solve raised.
"""

from __future__ import annotations

import numpy as np

from .problem import ShardingProblem, Solution
from .reduce import InfeasibleError
from .solve import solve
from .wire import Arrays, Meta


def request(problem: ShardingProblem, time_limit_s: float, backend: str,
            threads: int) -> tuple[Arrays, Meta]:
    """The arrays and meta that ask a worker for `solve(problem, ...)`."""
    meta = {"usage_limit": problem.usage_limit, "name": problem.name,
            "node_names": list(problem.node_names or ()) or None,
            "time_limit_s": float(time_limit_s), "backend": backend, "threads": threads}
    if meta["node_names"] is None:
        meta["node_names"] = [""] * problem.num_nodes
    return problem_arrays(problem), meta


def problem_arrays(problem: ShardingProblem) -> Arrays:
    """The arrays of a `ShardingProblem` (ragged per-node and per-edge tables flattened)."""
    costs = [np.asarray(c, np.float64) for c in problem.node_costs]
    return {
        "sizes": np.array([c.size for c in costs], np.int64),
        "costs": np.concatenate(costs) if costs else np.zeros(0),
        "usages": (np.concatenate([np.asarray(u, np.float64) for u in problem.node_usages])
                   if costs else np.zeros(0)),
        "intervals": np.asarray(problem.intervals, np.int64).reshape(-1, 2),
        "edges": np.asarray(problem.edges, np.int64).reshape(-1, 2),
        "edge_costs": (np.concatenate([np.asarray(r, np.float64).ravel()
                                       for r in problem.edge_costs])
                       if len(problem.edge_costs) else np.zeros(0)),
    }


def problem_from_arrays(arrays: Arrays, meta: Meta) -> ShardingProblem:
    """`problem_arrays`' inverse (the worker's side)."""
    sizes = arrays["sizes"]
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    costs = tuple(arrays["costs"][a:b] for a, b in zip(bounds[:-1], bounds[1:]))
    usages = tuple(arrays["usages"][a:b] for a, b in zip(bounds[:-1], bounds[1:]))
    edge_costs, k = [], 0
    for u, v in arrays["edges"]:
        n = int(sizes[u] * sizes[v])
        edge_costs.append(arrays["edge_costs"][k:k + n].reshape(int(sizes[u]), int(sizes[v])))
        k += n
    return ShardingProblem(node_costs=costs, node_usages=usages, intervals=arrays["intervals"],
                           edges=arrays["edges"], edge_costs=tuple(edge_costs),
                           usage_limit=meta["usage_limit"],
                           node_names=tuple(meta["node_names"]), name=meta["name"])


def handle(arrays: Arrays, meta: Meta) -> tuple[Arrays, Meta]:
    """Solves one request in this process (the worker's handler); an exception is
    answered as meta {"error": ...}, for the parent to raise."""
    try:
        problem = problem_from_arrays(arrays, meta)
        sol = solve(problem, time_limit_s=meta["time_limit_s"], backend=meta["backend"],
                    threads=meta["threads"])
        return ({"strategies": np.array(sol.strategies, np.int64)},
                {"cost": sol.cost, "lower_bound": sol.lower_bound, "status": sol.status,
                 "seconds": sol.seconds, "feasible": sol.feasible, "stats": sol.stats})
    except Exception as err:  # sent back: the parent raises it (or solves in-process)
        return {}, {"error": str(err), "kind": type(err).__name__,
                    "smallest_peak_usage": getattr(err, "smallest_peak_usage", None),
                    "usage_limit": getattr(err, "usage_limit", None)}


def solution(problem: ShardingProblem, arrays: Arrays, meta: Meta) -> Solution:
    """The `Solution` a worker answered for `problem` (marked stats["worker"]); raises
    `InfeasibleError` or `RuntimeError` where the worker's solve raised."""
    if "error" in meta:
        if meta.get("kind") == "InfeasibleError":
            raise InfeasibleError(meta["smallest_peak_usage"], meta["usage_limit"],
                                  problem.name)
        raise RuntimeError(f"solver worker: {meta['kind']}: {meta['error']}")
    return Solution(
        strategies=tuple(int(x) for x in np.asarray(arrays["strategies"])),
        cost=float(meta["cost"]), lower_bound=meta["lower_bound"], status=meta["status"],
        seconds=float(meta["seconds"]), feasible=bool(meta["feasible"]),
        stats=dict(meta["stats"], worker=True))

"""A sharding-solver worker process: reads `ShardingProblem`s, solves them, answers.

`autopar.solve_pool` starts it as `python _solve_worker.py PASSES_DIR` (a script, not
`-m`): it registers an empty `autopar` / `autopar.passes` package whose path is the
installed one and imports only `autopar.passes.solver` (numpy, PuLP, the solver backends),
not autopar's API and JAX, so a worker starts in a fraction of a second and never touches
a JAX backend.

Wire format (no pickle): each message is an 8-byte little-endian length followed by an
`np.savez` archive (allow_pickle=False) whose "meta" entry is UTF-8 JSON.
Problem: sizes [n], costs / usages [sum sizes], intervals [n, 2], edges [E, 2],
edge_costs [sum S_u*S_v] (row-major per edge); meta: usage_limit, name, node_names,
time_limit_s, backend, threads.
Answer: strategies [n]; meta: cost, lower_bound, status, seconds, feasible, stats — or
meta {"error": text} when the solve raised (`kind` names the exception type).
"""

from __future__ import annotations

import io
import json
import os
import select
import struct
import sys
import time
import types
from typing import Any

import numpy as np

MAX_FRAME_BYTES = 1 << 40  # 1 TiB: far above any problem, far below 8 bytes of ASCII text


def write_frame(fd: int, payload: bytes) -> None:
    data = struct.pack("<Q", len(payload)) + payload
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_frame(fd: int, deadline: float | None = None) -> bytes | None:
    """The next frame's payload (None at the end of the stream).  `deadline`
    (`time.monotonic()` seconds): `TimeoutError` if the frame has not arrived by then."""
    head = _read_exact(fd, 8, deadline)
    if head is None:
        return None
    (size,) = struct.unpack("<Q", head)
    if size > MAX_FRAME_BYTES:  # not a length we wrote: text on the stream (a stray print)
        raise OSError(f"solver worker stream: frame of {size:,} bytes announced, at most "
                      f"{MAX_FRAME_BYTES:,} expected (the stream is corrupt)")
    return _read_exact(fd, size, deadline)


def _read_exact(fd: int, size: int, deadline: float | None = None) -> bytes | None:
    chunks, left = [], size
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError(f"no answer on the solver worker's stream by the deadline "
                                   f"({size - left:,} of {size:,} bytes read)")
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def encode(arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta, default=_json_default).encode(),
                                     dtype=np.uint8), **arrays)
    return buf.getvalue()


def decode(payload: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with np.load(io.BytesIO(payload), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files if k != "meta"}
        meta = json.loads(z["meta"].tobytes().decode())
    return arrays, meta


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


def problem_arrays(problem) -> dict[str, np.ndarray]:
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


def problem_from_arrays(arrays: dict[str, np.ndarray], meta: dict[str, Any], cls):
    sizes = arrays["sizes"]
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    costs = tuple(arrays["costs"][a:b] for a, b in zip(bounds[:-1], bounds[1:]))
    usages = tuple(arrays["usages"][a:b] for a, b in zip(bounds[:-1], bounds[1:]))
    edge_costs, k = [], 0
    for u, v in arrays["edges"]:
        n = int(sizes[u] * sizes[v])
        edge_costs.append(arrays["edge_costs"][k:k + n].reshape(int(sizes[u]), int(sizes[v])))
        k += n
    return cls(node_costs=costs, node_usages=usages, intervals=arrays["intervals"],
               edges=arrays["edges"], edge_costs=tuple(edge_costs),
               usage_limit=meta["usage_limit"], node_names=tuple(meta["node_names"]),
               name=meta["name"])


def _import_solver(passes_dir: str):
    for name, path in (("autopar", os.path.dirname(os.path.abspath(__file__))),
                       ("autopar.passes", passes_dir)):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [path]
            sys.modules[name] = pkg
    from autopar.passes import solver

    return solver


def main(passes_dir: str) -> None:
    solver = _import_solver(passes_dir)
    from autopar.passes.solver.tb2_worker import private_stdout

    fd_in, fd_out = sys.stdin.fileno(), private_stdout()
    while True:
        frame = read_frame(fd_in)
        if frame is None:
            return
        arrays, meta = decode(frame)
        try:
            problem = problem_from_arrays(arrays, meta, solver.ShardingProblem)
            sol = solver.solve(problem, time_limit_s=meta["time_limit_s"],
                               backend=meta["backend"], threads=meta["threads"])
            answer = ({"strategies": np.array(sol.strategies, np.int64)},
                      {"cost": sol.cost, "lower_bound": sol.lower_bound,
                       "status": sol.status, "seconds": sol.seconds,
                       "feasible": sol.feasible, "stats": sol.stats})
        except Exception as err:  # sent back: the parent raises it (or solves in-process)
            smallest = getattr(err, "smallest_peak_usage", None)
            answer = ({}, {"error": str(err), "kind": type(err).__name__,
                           "smallest_peak_usage": smallest,
                           "usage_limit": getattr(err, "usage_limit", None)})
        write_frame(fd_out, encode(*answer))


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # the script's folder holds autopar's modules: no top-level imports
    main(sys.argv[1])

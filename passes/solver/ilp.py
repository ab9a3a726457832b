"""The ILP on a reduced problem (Alpa's linearization), solved with PuLP: CBC or HiGHS.

    min  sum_v c_v . x_v + sum_(u,v) R_uv . e_uv
    s.t. sum_i x_v[i] = 1;  sum_j e_uv[i, j] = x_u[i];  sum_i e_uv[i, j] = x_v[j]
         running sum over checkpoints k:  U_k = U_(k-1) + sum_(v enters at k) du_v . x_v
                                                        - sum_(v leaves at k) du_v . x_v
         U_k <= cap_k
Forbidden entries (>= INFINITE_COST) get no variable.  e is continuous: with one-hot
marginals its only feasible value is the product x_u x_v^T.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
import time

import numpy as np
import pulp

from .problem import INFINITE_COST
from .reduce import Reduced

# Seconds per model nonzero for building + writing + reading a PuLP model (measured
# conservatively on the 2-core machine); used to skip the ILP when it cannot fit.
SECONDS_PER_NONZERO = 2.5e-5


def model_nonzeros(red: Reduced) -> int:
    nz = 0
    for c in red.costs:
        nz += 2 * c.size
    for _u, _v, r in red.edges:
        nz += 3 * int(np.count_nonzero(r < INFINITE_COST))
    for v in range(red.num_nodes):
        if red.rng[v, 1] > red.rng[v, 0]:
            nz += 2 * int(np.count_nonzero(red.du[v]))
    nz += 3 * len(red.cap)
    return nz


def _build(red: Reduced, warm: np.ndarray | None):
    prob = pulp.LpProblem("sharding", pulp.LpMinimize)
    x = []
    obj = []
    for v, c in enumerate(red.costs):
        xs = [pulp.LpVariable(f"x{v}_{i}", cat=pulp.LpBinary) for i in range(c.size)]
        for i, var in enumerate(xs):
            if c[i] >= INFINITE_COST:
                var.upBound = 0
            elif c[i]:
                obj.append((var, float(c[i])))
        prob += pulp.lpSum(xs) == 1, f"one{v}"
        x.append(xs)
    for k, (u, v, r) in enumerate(red.edges):
        rows: list[list] = [[] for _ in range(r.shape[0])]
        cols: list[list] = [[] for _ in range(r.shape[1])]
        ii, jj = np.nonzero(r < INFINITE_COST)
        for i, j in zip(ii.tolist(), jj.tolist()):
            e = pulp.LpVariable(f"e{k}_{i}_{j}", 0, 1)
            if r[i, j]:
                obj.append((e, float(r[i, j])))
            rows[i].append(e)
            cols[j].append(e)
            if warm is not None:
                e.setInitialValue(1.0 if (warm[u] == i and warm[v] == j) else 0.0)
        for i, es in enumerate(rows):
            prob += pulp.lpSum(es) - x[u][i] == 0, f"r{k}_{i}"
        for j, es in enumerate(cols):
            prob += pulp.lpSum(es) - x[v][j] == 0, f"c{k}_{j}"
    prob += pulp.LpAffineExpression(obj)
    ncp = len(red.cap)
    if ncp:
        enter: list[list] = [[] for _ in range(ncp + 1)]
        for v in range(red.num_nodes):
            a, b = int(red.rng[v, 0]), int(red.rng[v, 1])
            if b <= a:
                continue
            for i in np.flatnonzero(red.du[v]).tolist():
                enter[a].append((x[v][i], float(red.du[v][i])))
                enter[b].append((x[v][i], -float(red.du[v][i])))
        prev = None
        for k in range(ncp):
            uk = pulp.LpVariable(f"U{k}", upBound=float(red.cap[k]))
            terms = [(uk, 1.0)] + [(var, -co) for var, co in enter[k]]
            if prev is not None:
                terms.append((prev, -1.0))
            prob += pulp.LpAffineExpression(terms) == 0, f"m{k}"
            prev = uk
    if warm is not None:
        for v, xs in enumerate(x):
            for i, var in enumerate(xs):
                var.setInitialValue(1.0 if warm[v] == i else 0.0)
    return prob, x


def _cbc_killer_path(tmpdir: str, deadline_epoch: float) -> str:
    """A wrapper around PuLP's CBC binary that is killed at `deadline_epoch` (time.time()).

    The remaining time is computed when CBC starts, so the time PuLP spends writing the
    model counts against the same deadline.
    """
    cbc = pulp.PULP_CBC_CMD().path
    tout = shutil.which("timeout")
    path = os.path.join(tmpdir, "cbc_guarded")
    with open(path, "w") as f:
        f.write(
            "#!/bin/sh\n"
            "now=$(date +%s.%N)\n"
            f"left=$(awk -v d={deadline_epoch:.3f} -v n=\"$now\" "
            "'BEGIN { x = d - n; if (x < 0.1) x = 0.1; printf \"%.2f\", x }')\n"
            f'exec {tout} -s KILL "$left" {cbc} "$@"\n'
        )
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


def solve_ilp(red: Reduced, backend: str, deadline: float, warm: np.ndarray | None,
              threads: int, verbose: bool) -> dict:
    """Returns {"status": "optimal"|"feasible"|"none", "strategies", "bound", ...}."""
    t0 = time.perf_counter()
    prob, x = _build(red, warm if backend == "cbc" else None)
    build_s = time.perf_counter() - t0
    remaining = deadline - time.perf_counter()
    out = {"build_seconds": build_s, "status": "none", "strategies": None, "bound": None}
    if remaining <= 0.5:
        return out
    if backend == "cbc":
        with tempfile.TemporaryDirectory() as tmp:
            # CBC's own limit leaves room for writing/reading; the wrapper kills it hard.
            solver = pulp.COIN_CMD(
                path=_cbc_killer_path(tmp, time.time() + remaining - 0.2),
                timeLimit=max(0.1, 0.8 * remaining - 0.5), threads=threads, msg=verbose,
                warmStart=warm is not None,
            )
            try:
                prob.solve(solver)
            except pulp.PulpSolverError as exc:
                out["error"] = str(exc)
                return out
    else:
        import highspy

        highspy.Highs.resetGlobalScheduler(True)  # LNS sub-solves may have used 1 thread
        solver = pulp.HiGHS(timeLimit=max(0.1, remaining - 0.3), threads=threads, msg=verbose)
        timer = threading.Timer(max(0.1, remaining), lambda: _cancel(prob))
        timer.start()
        try:
            prob.solve(solver)
        finally:
            timer.cancel()
        try:
            bound = prob.solverModel.getInfo().mip_dual_bound
            if np.isfinite(bound):
                out["bound"] = float(bound)
        except AttributeError:
            pass
    out["solve_seconds"] = time.perf_counter() - t0 - build_s
    if prob.sol_status not in (1, 2):
        return out
    s = np.zeros(red.num_nodes, np.int64)
    for v, xs in enumerate(x):
        vals = [var.value() or 0.0 for var in xs]
        s[v] = int(np.argmax(vals))
    out["strategies"] = s
    out["status"] = "optimal" if prob.sol_status == 1 else "feasible"
    return out


def _cancel(prob) -> None:
    model = getattr(prob, "solverModel", None)
    if model is not None:
        model.cancelSolve()

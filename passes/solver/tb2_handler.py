"""The "tb2" request: one cost-function-network model solved by toulbar2.

toulbar2 keeps its options and its timer in process-wide state, so every solve runs in a
worker process of its own (worker.py, started by pool.py; this module imports only numpy,
and pytoulbar2 when it solves, to start fast).  Several workers give parallel solves, and
a worker that overruns can be interrupted or killed.

A model is integer-valued already (costs scaled by the caller, see cfn.py):
  sizes [n]           domain size of each variable
  unary [sum sizes]   cost of each value; +inf removes the value from the domain
  edges [E, 2]        binary cost functions; costs [sum S_u*S_v], row-major per edge,
                      +inf marks a forbidden pair (a hard constraint)
  kn_ptr [K+1], kn_var, kn_val, kn_coef, kn_cap [K]
                      knapsack k: sum of kn_coef over its terms (kn_var == kn_val) <= kn_cap
  best [n] (optional) value tried first by the search (a warm start)
meta: ub (exclusive upper bound or null), time_limit_s (toulbar2's own CPU-time limit,
seconds), backtrack_limit, lds, seed, base (name of a cached model this request patches:
only its unary is sent), cache (name under which to keep this model), load_only (keep it,
solve nothing).

Interruption: the parent sends SIGVTALRM at its wall-clock deadline; toulbar2's timer
handler catches it and Solve returns the best solution found so far.  The timer is
stopped (its "interrupted" flag cleared) right before each Solve so that a late signal
from the previous request cannot cut the next one short.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .wire import Arrays, Meta

# toulbar2 search settings autopar solves with, set on every solve: options are
# process-wide (an experiment's `configure` may have changed them in this process).
SEARCH_OPTIONS = {
    "DEE": 1,  # dead-end elimination (1: in preprocessing and search)
    "elimDegree": 3,  # variable elimination during search up to this degree
    "LcLevel": 4,  # local consistency: 1 AC, 2 DAC, 3 FDAC, 4 EDAC (toulbar2's default)
    "hbfs": 1,  # hybrid best-first search (0: depth-first branch and bound)
    "searchMethod": 0,  # 0 branch and bound (HBFS/DFBB), 2 DGVNS (decomposition-guided VNS)
    "restart": -1,  # DGVNS: backtracks between restarts (-1: none)
    "elimDegree_preprocessing": -1,  # variable elimination in preprocessing up to this degree
}

#: A hook `configure(pytoulbar2.pytb2, meta)` run after autopar's settings, before the
#: model is posted (experiments set other toulbar2 options with it).
Configure = Callable[[Any, Meta], None]


def _set_options(tb2, meta: dict) -> None:
    """Every option this worker relies on, set explicitly: they are process-wide."""
    o = tb2.option
    o.verbose = -1
    o.showSolutions = 0
    o.allSolutions = 0
    o.decimalPoint = 0
    o.seed = int(meta.get("seed", 1))
    o.lds = int(meta.get("lds", 0))
    o.backtrackLimit = int(meta.get("backtrack_limit") or np.iinfo(np.int64).max)
    o.vac = 0
    o.useRASPS = 0
    o.solutionBasedPhaseSaving = True
    for name, value in SEARCH_OPTIONS.items():
        setattr(o, name, value)


def _post(cfn, model: dict) -> None:
    w = cfn.CFN.wcsp
    sizes = model["sizes"].astype(np.int64)
    n = len(sizes)
    for i, k in enumerate(sizes.tolist()):
        w.makeEnumeratedVariable(f"x{i}", 0, k - 1)
    unary = model["unary"]
    off = np.zeros(n + 1, np.int64)
    off[1:] = np.cumsum(sizes)
    for k in np.unique(sizes).tolist():
        idx = np.flatnonzero(sizes == k)
        if k < 2:
            continue
        tab = unary[off[idx][:, None] + np.arange(k)[None, :]]
        fin = np.where(np.isfinite(tab), tab, 0.0)
        # Forbidden values leave the domain; the rest becomes unary cost functions.
        for r, c in zip(*np.nonzero(~np.isfinite(tab))):
            w.remove(int(idx[r]), int(c))
        cfn.AddFunctions(idx.astype(np.int64), np.ascontiguousarray(fin))
    const = float(unary[off[:-1][sizes == 1]].sum()) if n else 0.0
    if const:
        w.postNullaryConstraint(const)
    edges = model["edges"].astype(np.int64).reshape(-1, 2)
    if len(edges):
        su, sv = sizes[edges[:, 0]], sizes[edges[:, 1]]
        eoff = np.zeros(len(edges) + 1, np.int64)
        eoff[1:] = np.cumsum(su * sv)
        costs = model["costs"]
        shapes = su * 4096 + sv
        for key in np.unique(shapes).tolist():
            ids = np.flatnonzero(shapes == key)
            a, b = divmod(key, 4096)
            tab = costs[eoff[ids][:, None] + np.arange(a * b)[None, :]].reshape(-1, a, b)
            cfn.AddFunctions(edges[ids], np.ascontiguousarray(tab))
    ptr = model.get("kn_ptr")
    if ptr is not None and len(ptr) > 1:
        var, val, coef, cap = model["kn_var"], model["kn_val"], model["kn_coef"], model["kn_cap"]
        for k in range(len(ptr) - 1):
            lo, hi = int(ptr[k]), int(ptr[k + 1])
            scope: list[int] = []
            terms: dict[int, list[str]] = {}
            for x, v, c in zip(var[lo:hi].tolist(), val[lo:hi].tolist(), coef[lo:hi].tolist()):
                if x not in terms:
                    scope.append(x)
                    terms[x] = []
                terms[x].append(f"{v} {-c}")
            params = str(-int(cap[k])) + "".join(
                f" {len(terms[x])} " + " ".join(terms[x]) for x in scope)
            w.postKnapsackConstraint(scope, params, kp=True)
    best = model.get("best")
    if best is not None and len(best) == n:
        for i, v in enumerate(best.tolist()):
            if w.canbe(i, int(v)):
                w.setBestValue(i, int(v))


def solve_model(model: Arrays, meta: Meta,
                configure: Configure | None = None) -> tuple[Arrays, Meta]:
    """Builds and solves one model in this process; returns (arrays, meta) to send back.

    meta of the answer: status "optimal" | "feasible" | "none" (nothing below ub found,
    or limit hit first) | "infeasible" (proved: nothing below ub) | "error"; cost and
    lower_bound in the model's integer units; seconds of wall clock.  A search that hit
    no limit (toulbar2's option `limited` stays false) proves its answer optimal, even
    where toulbar2's reported dual bound lags behind.
    """
    import pytoulbar2

    t0 = time.perf_counter()
    tb2 = pytoulbar2.pytb2
    ub = meta.get("ub")
    out: dict = {"status": "none", "cost": None, "lower_bound": None}
    try:
        cfn = pytoulbar2.CFN(ubinit=None if ub is None else float(ub), verbose=-1)
        _set_options(tb2, meta)
        if configure is not None:
            configure(tb2, meta)
        _post(cfn, model)
        cfn.CFN.timerStop()  # clears a stale interrupt flag
        res = cfn.Solve(timeLimit=max(1, int(meta.get("time_limit_s", 0) or 0)))
        lb = float(cfn.GetDDualBound())
        complete = not bool(tb2.option.limited)  # no time, backtrack or LDS limit hit
        cfn.CFN.timerStop()  # a CPU timer left running would interrupt the next solve
    except (tb2.Contradiction, RuntimeError, ValueError) as exc:
        if isinstance(exc, tb2.Contradiction):
            out["status"] = "infeasible"
        else:
            out.update(status="error", message=f"{type(exc).__name__}: {exc}")
        out["seconds"] = time.perf_counter() - t0
        return {}, out
    arrays = {}
    if res is not None:
        arrays["values"] = np.asarray(res[0], np.int64)
        cost = float(res[1])
        optimal = complete or lb >= cost - 0.5
        out.update(cost=cost, lower_bound=cost if optimal else min(lb, cost),
                   status="optimal" if optimal else "feasible")
    else:
        out["lower_bound"] = lb
        if complete or (ub is not None and lb >= float(ub) - 0.5):
            out["status"] = "infeasible"
            if ub is not None:
                out["lower_bound"] = float(ub)
    out["seconds"] = time.perf_counter() - t0
    return arrays, out


def solve_inline(model: Arrays, meta: Meta,
                 configure: Configure | None = None) -> tuple[Arrays, Meta]:
    """`solve_model` in the calling process (pool.InlinePool), toulbar2's prints sent to
    /dev/null.

    toulbar2 prints through C stdio, whose buffer outlives the redirection: it is flushed
    before file descriptor 1 is restored, or the text would land on the caller's stdout
    later.
    """
    sys.stdout.flush()
    _flush_c_stdio()
    saved = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        return solve_model(model, meta, configure)
    finally:
        _flush_c_stdio()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def _flush_c_stdio() -> None:
    """fflush(NULL): writes out every C stdio buffer of this process (C++ streams share
    them by default)."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to load (not Linux or macOS)
        pass


class Handler:
    """The worker's "tb2" handler: solves each model it is sent, or a patch of the model
    it keeps (meta "base": the request's arrays replace the kept model's)."""

    def __init__(self, configure: Configure | None = None) -> None:
        self.configure = configure
        self.cache: dict[str, Arrays] = {}

    def __call__(self, arrays: Arrays, meta: Meta) -> tuple[Arrays, Meta]:
        base = meta.get("base")
        if base is not None:
            model = dict(self.cache[base])
            model.update(arrays)
        else:
            model = arrays
        if meta.get("cache") is not None:
            self.cache = {meta["cache"]: model}
        if meta.get("load_only"):
            return {}, {"status": "loaded"}
        return solve_model(model, meta, self.configure)

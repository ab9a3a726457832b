"""A toulbar2 worker process: reads cost-function-network models, solves them, answers.

toulbar2 keeps its options and its timer in process-wide state, so every solve runs in a
worker process of its own (pool.py starts them as `python tb2_worker.py`; this file
imports only numpy and pytoulbar2, not autopar, to start fast).  Several workers give
parallel solves, and a worker that overruns can be interrupted or killed.

Wire format (no pickle): each message is an 8-byte little-endian length followed by an
`np.savez` archive (allow_pickle=False) whose "meta" entry is UTF-8 JSON for scalars.

A model is integer-valued already (costs scaled by the caller, see cfn.py):
  sizes [n]           domain size of each variable
  unary [sum sizes]   cost of each value; +inf removes the value from the domain
  edges [E, 2]        binary cost functions; costs [sum S_u*S_v], row-major per edge,
                      +inf marks a forbidden pair (a hard constraint)
  kn_ptr [K+1], kn_var, kn_val, kn_coef, kn_cap [K]
                      knapsack k: sum of kn_coef over its terms (kn_var == kn_val) <= kn_cap
  best [n] (optional) value tried first by the search (a warm start)
meta: ub (exclusive upper bound or null), time_limit_s (toulbar2's own CPU-time limit),
backtrack_limit, lds, seed, base (name of a cached model this request patches: only its
unary is sent), cache (name under which to keep this model), options (toulbar2 search
settings other than autopar's, by name: see TUNABLE_OPTIONS; for experiments such as
benchmarks/solver_tb2_settings.py).

Interruption: the parent sends SIGVTALRM at its wall-clock deadline; toulbar2's timer
handler catches it and Solve returns the best solution found so far.  The timer is
stopped (its "interrupted" flag cleared) right before each Solve so that a late signal
from the previous request cannot cut the next one short.
"""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import sys
import time

import numpy as np

_HEADER = struct.Struct("<Q")
# toulbar2 options a request may override (meta "options"), with the value every other
# request gets: options are process-wide, so each solve sets all of them.
TUNABLE_OPTIONS = {
    "DEE": 1,  # dead-end elimination (1: in preprocessing and search)
    "elimDegree": 3,  # variable elimination during search up to this degree
    "LcLevel": 4,  # local consistency: 1 AC, 2 DAC, 3 FDAC, 4 EDAC (toulbar2's default)
    "hbfs": 1,  # hybrid best-first search (0: depth-first branch and bound)
    "searchMethod": 0,  # 0 branch and bound (HBFS/DFBB), 2 DGVNS (decomposition-guided VNS)
    "restart": -1,  # DGVNS: backtracks between restarts (-1: none)
    "elimDegree_preprocessing": -1,  # variable elimination in preprocessing up to this degree
}


def encode(arrays: dict, meta: dict) -> bytes:
    """One message: the arrays and the JSON-encoded scalars in an npz archive."""
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    return buf.getvalue()


def decode(data: bytes) -> tuple[dict, dict]:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files if k != "meta"}
        meta = json.loads(bytes(z["meta"]).decode())
    return arrays, meta


def write_frame(fd: int, payload: bytes) -> None:
    data = _HEADER.pack(len(payload)) + payload
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> bytes | None:
    head = read_exact(fd, _HEADER.size)
    if head is None:
        return None
    return read_exact(fd, _HEADER.unpack(head)[0])


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
    extra = meta.get("options") or {}
    unknown = sorted(set(extra) - set(TUNABLE_OPTIONS))
    if unknown:
        raise ValueError(f"toulbar2 options {unknown} cannot be set per request "
                         f"(tunable: {sorted(TUNABLE_OPTIONS)})")
    for name, default in TUNABLE_OPTIONS.items():
        setattr(o, name, int(extra.get(name, default)))


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


def solve_model(model: dict, meta: dict) -> tuple[dict, dict]:
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


def solve_inline(model: dict, meta: dict) -> tuple[dict, dict]:
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
        return solve_model(model, meta)
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


def private_stdout() -> int:
    """A worker's answer channel: a private copy of stdout (returned), with file
    descriptor 1 and `sys.stdout` pointed at stderr, so that a library printing from C
    (toulbar2, HiGHS's banner) cannot write into the answer stream and leave the parent
    waiting for a frame that never ends."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return fd


def main() -> None:
    """Serves requests from stdin until it closes; answers on the original stdout."""
    if sys.platform.startswith("linux"):  # die with the parent, even mid-solve
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    proto_out = private_stdout()
    signal.signal(signal.SIGVTALRM, lambda *_: None)  # an early interrupt is a no-op
    cache: dict = {}
    while True:
        frame = read_frame(0)
        if frame is None:
            return
        arrays, meta = decode(frame)
        base = meta.get("base")
        if base is not None:
            model = dict(cache[base])
            model.update(arrays)
        else:
            model = arrays
        if meta.get("cache") is not None:
            cache = {meta["cache"]: model}
        if meta.get("load_only"):
            write_frame(proto_out, encode({}, {"status": "loaded"}))
            continue
        ans_arrays, ans_meta = solve_model(model, meta)
        write_frame(proto_out, encode(ans_arrays, ans_meta))


if __name__ == "__main__":
    main()

"""Large-neighbourhood search: re-solve regions of the current answer exactly with HiGHS.

All nodes outside a region keep their strategies; the region's nodes see their outside
neighbours as unary costs and the usage of the outside nodes as a reduced capacity at each
checkpoint.  The sub-problem (Alpa's linearization, memory as a running sum over the
region's interval end points) is built with numpy and handed to highspy directly,
warm-started from the current answer, so an accepted region never makes the answer worse.
Regions: breadth-first balls (hubs come with their leaves) around expensive nodes, and
windows of the timeline (nodes live at a tight checkpoint, which trade memory).
"""

from __future__ import annotations

import importlib.util
import threading
import time

import numpy as np

from .local_search import LocalSearch

_INF = np.inf
WINDOW_EVERY = 3  # every third region is a timeline window (memory trades)
ANCHORED_WINDOWS = 0.5  # share of windows around a node whose ball found nothing


def _pow2_scale(value: float, target: float) -> float:
    """A power of two that brings `value` to about `target` (1 if it is already below)."""
    if not value > target:
        return 1.0
    return float(2.0 ** np.ceil(np.log2(value / target)))


def available() -> bool:
    return importlib.util.find_spec("highspy") is not None


class _SubMip:
    """The sub-MIP being assembled: column blocks (cost, bounds) and row blocks (sparse
    triplets, bounds), in the order they are added."""

    def __init__(self) -> None:
        self.cost: list[np.ndarray] = []
        self.lower: list[np.ndarray] = []
        self.upper: list[np.ndarray] = []
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.rlo: list[np.ndarray] = []
        self.rhi: list[np.ndarray] = []
        self.ncol = self.nrow = 0

    def add_columns(self, cost: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
        """Appends len(cost) columns; their indices."""
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        first = self.ncol
        self.ncol += len(cost)
        return first + np.arange(len(cost))

    def add_rows(self, rows: list[np.ndarray], cols: list[np.ndarray], vals: list[np.ndarray],
                 lo: np.ndarray, hi: np.ndarray) -> None:
        """Appends len(lo) rows; `rows` counts from the first of them."""
        self.rows += [self.nrow + r for r in rows]
        self.cols += cols
        self.vals += vals
        self.rlo.append(lo)
        self.rhi.append(hi)
        self.nrow += len(lo)

    def arrays(self, nint: int) -> dict:
        """The model as Highs.passModel's arrays (column-wise), the first `nint` columns
        integer, the objective scaled by a power of two."""
        r = np.concatenate(self.rows).astype(np.int64)
        c = np.concatenate(self.cols).astype(np.int64)
        val = np.concatenate(self.vals)
        order = np.lexsort((r, c))
        r, c, val = r[order], c[order], val[order]
        integ = np.zeros(self.ncol, np.int32)
        integ[:nint] = 1
        cost = np.concatenate(self.cost)
        cmax = float(np.abs(cost).max()) if self.ncol else 0.0
        return dict(
            ncol=self.ncol, nrow=self.nrow, cost=cost / _pow2_scale(cmax, 1e6),
            lower=np.concatenate(self.lower), upper=np.concatenate(self.upper),
            rlo=np.concatenate(self.rlo), rhi=np.concatenate(self.rhi),
            start=np.searchsorted(c, np.arange(self.ncol + 1)).astype(np.int32),
            index=r.astype(np.int32), value=val, integ=integ)


def _region_unary(ls: LocalSearch, region: np.ndarray, pos: dict[int, int], whole: bool,
                  domains: list[np.ndarray] | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per region node, its cost with the outside neighbours' choices folded in, and the
    mask of its strategies allowed (nothing outside forbids them, within `domains`)."""
    s = ls.s
    unary, allowed = [], []
    for i, v in enumerate(region.tolist()):
        t = ls.tot[v].copy()
        fb = ls.forb[v].copy()
        if not whole:
            for w, f, b in ls.adj[v]:
                if w in pos:
                    t -= f[:, s[w]]
                    fb -= b[:, s[w]]
        else:
            t = ls.cf[v]
            fb = ls.cb[v]
        ok = fb == 0
        if domains is not None:
            ok &= domains[i]
        if not whole and not ok[s[v]]:
            ok[s[v]] = True  # keep the current choice available (warm start)
        unary.append(t)
        allowed.append(ok)
    return unary, allowed


def _edge_columns(mip: _SubMip, ls: LocalSearch, region: np.ndarray, pos: dict[int, int],
                  allowed: list[np.ndarray], xoff: np.ndarray) -> list[tuple]:
    """One column per allowed strategy pair of every edge inside the region, tied to the
    two nodes' one-hot columns; per edge (i, k, rows, cols, first column)."""
    edges = []
    for i, v in enumerate(region.tolist()):
        for w, f, b in ls.adj[v]:
            k = pos.get(w)
            if k is not None and k > i:
                edges.append((i, k, f, b))
    e_cols = []
    for i, k, f, b in edges:
        su, sv = f.shape
        ok = (b == 0) & allowed[i][:, None] & allowed[k][None, :]
        ii, jj = np.nonzero(ok)
        m = len(ii)
        if m == 0:
            mip.upper[0][xoff[i]:xoff[i + 1]] = 0.0
            continue
        first = mip.ncol
        cols = mip.add_columns(f[ii, jj], np.zeros(m), np.ones(m))
        # sum_j e_ij - x_ui = 0 for each row i; sum_i e_ij - x_vj = 0 for each column j.
        mip.add_rows([ii, np.arange(su), su + jj, su + np.arange(sv)],
                     [cols, xoff[i] + np.arange(su), cols, xoff[k] + np.arange(sv)],
                     [np.ones(m), -np.ones(su), np.ones(m), -np.ones(sv)],
                     np.zeros(su + sv), np.zeros(su + sv))
        e_cols.append((i, k, ii, jj, first))
    return e_cols


def _memory_columns(mip: _SubMip, ls: LocalSearch, region: np.ndarray, xoff: np.ndarray,
                    whole: bool) -> int:
    """The running sum U_g of the region's excess usage over the segments between its
    interval end points, each capped by the checkpoints' room left (bytes, scaled by a
    power of two); the number of segments."""
    s = ls.s
    a = np.array([ls.a[v] for v in region.tolist()], np.int64)
    b = np.array([ls.b[v] for v in region.tolist()], np.int64)
    memn = np.array([ls.mem[v] for v in region.tolist()], bool)
    if not memn.any():
        return 0
    am, bm = a[memn], b[memn]
    pts = np.unique(np.concatenate([am, bm]))
    lo_k, hi_k = int(pts[0]), int(pts[-1])
    if whole:
        resid = ls.cap[lo_k:hi_k].copy()
    else:
        contrib = np.zeros(hi_k - lo_k + 1)
        idx = np.flatnonzero(memn)
        cur = np.array([ls.du[int(region[j])][s[int(region[j])]] for j in idx])
        np.add.at(contrib, am - lo_k, cur)
        np.add.at(contrib, bm - lo_k, -cur)
        resid = ls.cap[lo_k:hi_k] - ls.use[lo_k:hi_k] + np.cumsum(contrib)[:-1]
    seg_cap = np.minimum.reduceat(resid, pts[:-1] - lo_k)
    # Memory rows in units of mscale (a power of two): HiGHS stalls on huge ranges.
    dmax = max(float(ls.du[int(region[j])].max()) for j in np.flatnonzero(memn))
    mscale = _pow2_scale(max(dmax, float(np.abs(seg_cap).max())), 1e3)
    nseg = len(pts) - 1
    ucol = mip.add_columns(np.zeros(nseg), np.full(nseg, -_INF), seg_cap / mscale)
    # Row g: U_g - U_{g-1} - sum_{enter at g} du.x + sum_{leave at g} du.x = 0.
    rr = [np.arange(nseg), np.arange(1, nseg)]
    cc = [ucol, ucol[:-1]]
    vv = [np.ones(nseg), -np.ones(nseg - 1)]
    ga = np.searchsorted(pts, am)
    gb = np.searchsorted(pts, bm)
    for j, g1, g2 in zip(np.flatnonzero(memn).tolist(), ga.tolist(), gb.tolist()):
        du = ls.du[int(region[j])]
        nzi = np.flatnonzero(du)
        if not len(nzi):
            continue
        cols = xoff[j] + nzi
        rr.append(np.full(len(nzi), g1))
        cc.append(cols)
        vv.append(-du[nzi] / mscale)
        if g2 < nseg:
            rr.append(np.full(len(nzi), g2))
            cc.append(cols)
            vv.append(du[nzi] / mscale)
    mip.add_rows([np.concatenate(rr)], cc, vv, np.zeros(nseg), np.zeros(nseg))
    return nseg


def build_model(ls: LocalSearch, region: np.ndarray, whole: bool = False,
                domains: list[np.ndarray] | None = None):
    """The sub-MIP of `region` given the rest of ls's state.

    Returns (arrays for Highs.passModel, column layout) or None if the region has no
    choice to make.  With whole=True the region is every node and capacities are ls.cap.
    domains: per region node, a boolean mask of the strategies it may take (merge.py);
    its current strategy stays allowed either way.
    """
    pos = {int(v): i for i, v in enumerate(region)}
    unary, allowed = _region_unary(ls, region, pos, whole, domains)
    # Columns: x of every node, then e of every internal edge, then U of every segment.
    xoff = np.zeros(len(region) + 1, np.int64)
    xoff[1:] = np.cumsum([c.size for c in unary])
    mip = _SubMip()
    mip.add_columns(np.concatenate(unary), np.zeros(int(xoff[-1])),
                    np.concatenate(allowed).astype(np.float64))
    # One-hot rows.
    mip.add_rows([np.repeat(np.arange(len(region)), np.diff(xoff))], [np.arange(mip.ncol)],
                 [np.ones(mip.ncol)], np.ones(len(region)), np.ones(len(region)))
    e_cols = _edge_columns(mip, ls, region, pos, allowed, xoff)
    nseg = _memory_columns(mip, ls, region, xoff, whole)
    return mip.arrays(int(xoff[-1])), dict(xoff=xoff, edges=e_cols, nseg=nseg)


def _highs(model: dict, time_limit: float, mip: bool, threads: int = 1):
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", max(0.05, float(time_limit)))
    if threads > 1:
        h.setOptionValue("threads", threads)
    h.setOptionValue("mip_rel_gap", 1e-7)
    integ = model["integ"] if mip else np.zeros(model["ncol"], np.int32)
    h.passModel(model["ncol"], model["nrow"], len(model["value"]), 1, 1, 0.0,
                model["cost"], model["lower"], model["upper"], model["rlo"], model["rhi"],
                model["start"], model["index"], model["value"], integ)
    return h


def warm_values(ls: LocalSearch, region: np.ndarray, model: dict, layout: dict) -> np.ndarray:
    x = np.zeros(model["ncol"])
    xoff = layout["xoff"]
    sr = np.array([ls.s[v] for v in region.tolist()], np.int64)
    x[xoff[:-1] + sr] = 1.0
    for i, k, ii, jj, c0 in layout["edges"]:
        hit = np.flatnonzero((ii == sr[i]) & (jj == sr[k]))
        x[c0 + hit] = 1.0
    return x  # the U columns follow from the rows; HiGHS completes them


def solve_region(ls: LocalSearch, region: np.ndarray, time_limit: float,
                 domains: list[np.ndarray] | None = None) -> tuple[int, bool]:
    """Re-solves `region` exactly (up to the time limit; with `domains`, over those
    strategies only: build_model); applies an improvement.

    Returns the number of nodes changed (0 if no better answer was found) and whether
    HiGHS proved the region's answer optimal.
    """
    model, layout = build_model(ls, region, domains=domains)
    h = _highs(model, time_limit, mip=True)
    x0 = warm_values(ls, region, model, layout)
    nint = int(layout["xoff"][-1])
    h.setSolution(nint, np.arange(nint, dtype=np.int32), x0[:nint])
    # HiGHS does not check its time limit everywhere (it has stalled for minutes in the
    # root node): run it in a thread (it releases the GIL), cancel it past the limit, and
    # give up on it for good if even that does not stop it.
    th = threading.Thread(target=h.run, daemon=True)
    th.start()
    th.join(time_limit + 0.5)
    if th.is_alive():
        h.cancelSolve()
        th.join(1.0)
        if th.is_alive():
            ls.lns_broken = True
            return 0, False
    optimal = h.modelStatusToString(h.getModelStatus()) == "Optimal"
    sol = h.getSolution()
    if not sol.value_valid:
        return 0, False
    val = np.asarray(sol.col_value)
    xoff = layout["xoff"]
    before = ls.key()
    log = []
    for i, v in enumerate(region.tolist()):
        j = int(np.argmax(val[xoff[i]:xoff[i + 1]]))
        if j != ls.s[v]:
            log.append((v, ls.s[v]))
            ls.apply(v, j)
    if not log:
        return 0, optimal
    ok = ls.key() < before and bool(np.all(ls.use <= ls.cap))
    if not ok:
        for v, j in reversed(log):
            ls.apply(v, j)
        return 0, False
    return len(log), optimal


def bfs_region(ls: LocalSearch, seed: int, max_cols: int, rand) -> np.ndarray:
    """A breadth-first ball around `seed` with at most about max_cols x and e columns.

    The seed's neighbours all come first (a hub moves together with its leaves), then
    the ball grows breadth-first, sampling at most 32 neighbours of each further node.
    """
    region = [seed]
    seen = {seed}
    cols = ls.cf[seed].size
    i = 0
    while i < len(region) and cols < max_cols:
        v = region[i]
        i += 1
        nb = ls.nbr_ids[v]
        if i > 1 and len(nb) > 32:
            nb = [nb[j] for j in rand.permutation(len(nb))[:32].tolist()]
        sv = ls.cf[v].size
        for w in nb:
            if w in seen:
                continue
            add = ls.cf[w].size * (1 + sv)
            if cols + add > max_cols:
                continue
            seen.add(w)
            region.append(w)
            cols += add
    return np.array(region, np.int64)


def window_region(ls: LocalSearch, max_cols: int, rand, anchor: int = -1) -> np.ndarray:
    """Nodes live at one tight checkpoint (they trade memory with each other), each with
    a few neighbours, up to about max_cols columns.  The checkpoint is one of the 16
    tightest, or with an anchor node the tightest in its live range (the anchor and its
    neighbours come first)."""
    slack = ls.cap - ls.use
    if anchor >= 0 and ls.mem[anchor]:
        k = ls.a[anchor] + int(np.argmin(slack[ls.a[anchor]:ls.b[anchor]]))
    else:
        tight = np.argpartition(slack, min(16, len(slack) - 1))[:16]
        k = int(tight[int(rand.integers(len(tight)))])
    live = ls.live_at(k)
    live = live[rand.permutation(len(live))].tolist()
    region = []
    seen = set()
    cols = 0
    if anchor >= 0:
        live = [anchor] + live
    for v in live:
        if cols >= max_cols:
            break
        add = ls.cf[v].size
        if v in seen or cols + add > max_cols:
            continue
        seen.add(v)
        region.append(v)
        cols += add
        nb = ls.nbr_ids[v] if v == anchor else ls.nbr_ids[v][:8]
        for w in nb:
            add = ls.cf[w].size * (1 + ls.cf[v].size)
            if w not in seen and cols + add <= max_cols:
                seen.add(w)
                region.append(w)
                cols += add
    return np.array(region, np.int64)


def pick_seed(ls: LocalSearch) -> int:
    """A node on an expensive term, or one of its neighbours (often the hub fixing it)."""
    n = ls.n
    x = int(ls.rand.integers(n))
    for _ in range(8):  # tournament on the local cost
        y = int(ls.rand.integers(n))
        if ls.tot[y][ls.s[y]] > ls.tot[x][ls.s[x]]:
            x = y
    nb = ls.nbr_ids[x]
    if nb and ls.rand.random() < 0.5:
        x = nb[int(ls.rand.integers(len(nb)))]
    return x


def lns(ls: LocalSearch, deadline: float, max_cols: int = 20000, sub_limit: float = 2.0,
        log: list | None = None, max_regions: int | None = None) -> dict:
    """Region re-solves until the deadline; returns counters.

    Seeds: the untried node of largest local cost (its choice's cost given the
    neighbours), every other time a random expensive node or one of its neighbours.  A
    node is tried again once something in its neighbourhood changed.
    """
    import highspy

    highspy.Highs.resetGlobalScheduler(True)  # a previous solve may have used more threads
    tried = improved = changed = stall = 0
    n = ls.n
    done = np.zeros(n, bool)
    windows = bool(len(ls.cap)) and ls.mem_arr.any()
    local = None
    it = 0
    anchors: list = []  # expensive memory nodes whose ball did not improve
    ls.lns_broken = False
    while time.perf_counter() < deadline - 0.05 and not ls.lns_broken:
        if max_regions is not None and tried >= max_regions:
            break
        if it % 32 == 0:
            local = np.array([ls.tot[v][ls.s[v]] for v in range(n)])
        it += 1
        anchor = -1
        if windows and WINDOW_EVERY and it % WINDOW_EVERY == 0:
            seed = -1
            if anchors and ls.rand.random() < ANCHORED_WINDOWS:
                anchor = anchors.pop()
        elif it % 2:
            masked = np.where(done, -np.inf, local)
            seed = int(np.argmax(masked))
            if not np.isfinite(masked[seed]):
                done[:] = False
                continue
            done[seed] = True
        else:
            seed = pick_seed(ls)
        if seed < 0:
            region = window_region(ls, max_cols, ls.rand, anchor)
        else:
            region = bfs_region(ls, seed, max_cols, ls.rand)
        if len(region) < 2:
            continue
        left = deadline - time.perf_counter()
        t_sub = time.perf_counter()
        snap = [ls.s[v] for v in region.tolist()]
        k, optimal = solve_region(ls, region, min(sub_limit, left))
        tried += 1
        if optimal and len(region) == n:
            break  # the whole problem, solved
        stall = 0 if k else stall + 1
        if not k and seed >= 0 and ls.mem[seed] and it % 2:
            anchors = anchors[-63:] + [seed]
        if stall > 2 * n + 50:
            break  # every node tried as a seed, twice, with no gain: a small problem
        if k:
            improved += 1
            changed += k
            for v, old in zip(region.tolist(), snap):
                if ls.s[v] != old:
                    done[v] = False
                    nb = ls.nbr_ids[v]
                    if len(nb) <= 64:
                        done[nb] = False
                    local[v] = ls.tot[v][ls.s[v]]
        if log is not None:
            log.append((time.perf_counter(), ls.cost, len(region), k, seed < 0, optimal,
                        time.perf_counter() - t_sub))
    return {"lns_regions": tried, "lns_improved": improved, "lns_changed": changed,
            "lns_broken": ls.lns_broken}

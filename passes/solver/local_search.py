"""Memory-feasible local search on a reduced problem: the state and moves every solver path
builds on (`heuristic`'s iterated local search, the LNS of `lns` and `tb2_lns`, `penalty`,
`merge`).

State: one strategy per node, the usage at each checkpoint, and for every node the cost
of each of its strategies given its neighbours' current choices, split into a finite
part and a count of forbidden (>= INFINITE_COST) terms so that comparisons stay exact.
A move changes one node; it is allowed only if the usage stays under the limit over the
node's live checkpoints.  Moves improve (forbidden count, cost, usage) lexicographically.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from .problem import INFINITE_COST
from .reduce import Reduced

_EPS = 1e-9
_LOCAL_MAX_DEGREE = 32  # local descents do not fan out from hubs
_CHAIN_MAX_NODES = 400


class LocalSearch:
    def __init__(self, red: Reduced, seed: int = 0) -> None:
        n = red.num_nodes
        self.n = n
        self.rand = np.random.default_rng(seed)
        self.cf = [np.where(c < INFINITE_COST, c, 0.0) for c in red.costs]
        self.cb = [(c >= INFINITE_COST).astype(np.int64) for c in red.costs]
        self.du = red.du
        self.a = red.rng[:, 0].tolist()
        self.b = red.rng[:, 1].tolist()
        self.cap = red.cap.astype(np.float64)
        self.mem = [bool(self.b[v] > self.a[v] and red.du[v].max() > 0) for v in range(n)]
        self.a_arr = np.asarray(self.a, np.int64)
        self.b_arr = np.asarray(self.b, np.int64)
        self.mem_arr = np.asarray(self.mem, bool)
        # adj[v]: (w, F, B) with F/B of shape [S_v, S_w]: finite cost / forbidden flag.
        self.adj: list[list] = [[] for _ in range(n)]
        for u, v, r in red.edges:
            bad = r >= INFINITE_COST
            f = np.where(bad, 0.0, r)
            b = bad.astype(np.int64)
            self.adj[u].append((v, np.ascontiguousarray(f), np.ascontiguousarray(b)))
            self.adj[v].append((u, np.ascontiguousarray(f.T), np.ascontiguousarray(b.T)))
        self.nbr_ids = [[w for w, _, _ in lst] for lst in self.adj]

    # -- state -----------------------------------------------------------------------
    def reset(self, s) -> None:
        n = self.n
        self.s = [int(x) for x in s]
        self.tot = [c.copy() for c in self.cf]
        self.forb = [c.copy() for c in self.cb]
        # adj[v] holds (w, F_vw, B_vw) with v's strategies as rows: v's totals get the
        # column of w's choice.
        for v in range(n):
            for w, f, b in self.adj[v]:
                self.tot[v] += f[:, self.s[w]]
                self.forb[v] += b[:, self.s[w]]
        self.use = np.zeros(len(self.cap) + 1)
        for v in range(n):
            if self.mem[v]:
                self.use[self.a[v]] += self.du[v][self.s[v]]
                self.use[self.b[v]] -= self.du[v][self.s[v]]
        self.use = np.cumsum(self.use)[:-1].copy()
        self.cost = float(sum(self.cf[v][self.s[v]] for v in range(n)))
        self.cost += float(sum(f[self.s[v], self.s[w]] for v in range(n)
                               for w, f, _ in self.adj[v] if v < w))
        self.nforb = int(sum(self.cb[v][self.s[v]] for v in range(n)))
        self.nforb += int(sum(b[self.s[v], self.s[w]] for v in range(n)
                              for w, _, b in self.adj[v] if v < w))

    def live_at(self, k: int) -> np.ndarray:
        """The nodes whose usage counts at checkpoint k."""
        return np.flatnonzero((self.a_arr <= k) & (self.b_arr > k) & self.mem_arr)

    def key(self) -> tuple[int, float]:
        return self.nforb, self.cost

    def slack(self, v: int) -> float:
        a, b = self.a[v], self.b[v]
        return float(np.min(self.cap[a:b] - self.use[a:b]))

    def apply(self, v: int, j: int) -> None:
        old = self.s[v]
        if old == j:
            return
        self.cost += float(self.tot[v][j] - self.tot[v][old])
        self.nforb += int(self.forb[v][j] - self.forb[v][old])
        self.s[v] = j
        for w, f, b in self.adj[v]:
            # f is [S_v, S_w]; w's totals change by row j minus row old.
            self.tot[w] += f[j] - f[old]
            self.forb[w] += b[j] - b[old]
        if self.mem[v]:
            d = self.du[v][j] - self.du[v][old]
            if d:
                self.use[self.a[v]:self.b[v]] += d

    def best(self, v: int) -> int:
        """The best allowed strategy of v given its neighbours (may be the current one)."""
        cur = self.s[v]
        f, t = self.forb[v], self.tot[v]
        if self.mem[v]:
            du = self.du[v]
            allowed = du - du[cur] <= self.slack(v) + _EPS
            fm = np.where(allowed, f, np.iinfo(np.int64).max)
        else:
            du = None
            fm = f
        fmin = fm.min()
        tm = np.where(fm == fmin, t, np.inf)
        j = int(np.argmin(tm))
        if fm[cur] == fmin and tm[cur] <= tm[j] + _EPS * max(1.0, abs(tm[j])):
            j = cur
            if du is not None:  # sideways move to a cheaper-in-memory equal-cost strategy
                eq = tm <= tm[cur]
                k = int(np.argmin(np.where(eq, du, np.inf)))
                if du[k] < du[cur]:
                    j = k
        return j

    def descend(self, queue: deque, log: list | None = None, deadline: float = np.inf,
                max_push_degree: int | None = None) -> None:
        """Best-response moves until the queue empties; changed nodes queue neighbours
        (unless their degree exceeds max_push_degree: hubs are left to full passes)."""
        inq = set(queue)
        count = 0
        while queue:
            v = queue.popleft()
            inq.discard(v)
            j = self.best(v)
            if j != self.s[v]:
                if log is not None:
                    log.append((v, self.s[v]))
                self.apply(v, j)
                nb = self.nbr_ids[v]
                if max_push_degree is not None and len(nb) > max_push_degree:
                    continue
                for w in nb:
                    if w not in inq:
                        inq.add(w)
                        queue.append(w)
            count += 1
            if count % 4096 == 0 and time.perf_counter() > deadline:
                return

    def full_descent(self, deadline: float, first_pass_complete: bool = False) -> None:
        """Descends from every node until no move helps or the deadline passes.

        With first_pass_complete, the first pass ignores the deadline (a feasible answer
        needs at least one full pass).
        """
        first = first_pass_complete
        while first or time.perf_counter() < deadline:
            before = (self.nforb, self.cost, float(self.use.sum()))
            order = self.rand.permutation(self.n).tolist()
            self.descend(deque(order), deadline=np.inf if first else deadline)
            first = False
            after = (self.nforb, self.cost, float(self.use.sum()))
            if after >= before:
                return

    # -- iterated local search -------------------------------------------------------
    def perturb_once(self, size: int) -> bool:
        n = self.n
        v = int(self.rand.integers(n))
        region = [v]
        seen = {v}
        i = 0
        while i < len(region) and len(region) < size:
            nb = self.nbr_ids[region[i]]
            if nb:
                for w in self.rand.permutation(nb)[: max(1, size - len(region))].tolist():
                    if w not in seen:
                        seen.add(w)
                        region.append(w)
            i += 1
        before = self.key()
        log: list = []
        for w in region:
            k = self.cf[w].size
            if k < 2 or len(self.nbr_ids[w]) > _LOCAL_MAX_DEGREE:
                continue
            j = int(self.rand.integers(k))
            if self.mem[w] and self.du[w][j] - self.du[w][self.s[w]] > self.slack(w) + _EPS:
                continue
            log.append((w, self.s[w]))
            self.apply(w, j)
        queue = deque(region)
        for w in region:
            if len(self.nbr_ids[w]) <= _LOCAL_MAX_DEGREE:
                queue.extend(self.nbr_ids[w])
        self.descend(queue, log, max_push_degree=_LOCAL_MAX_DEGREE)
        after = self.key()
        if after[0] < before[0] or (after[0] == before[0] and after[1] < before[1] - _EPS):
            return True
        for w, j in reversed(log):
            self.apply(w, j)
        return False


def _chain(ls: LocalSearch, v: int, j: int, log: list) -> None:
    """Sets v to j, then lets every node left on a forbidden pair re-choose, in BFS order."""
    if ls.mem[v] and ls.du[v][j] - ls.du[v][ls.s[v]] > ls.slack(v) + _EPS:
        return
    log.append((v, ls.s[v]))
    ls.apply(v, j)
    queue = deque([v])
    seen = {v}
    while queue and len(seen) < _CHAIN_MAX_NODES:
        x = queue.popleft()
        sx = ls.s[x]
        for w, _f, b in ls.adj[x]:
            if w in seen or not b[sx, ls.s[w]]:
                continue
            seen.add(w)
            k = ls.best(w)
            if k != ls.s[w]:
                log.append((w, ls.s[w]))
                ls.apply(w, k)
                queue.append(w)


def repair(ls: LocalSearch, deadline: float, tries: int = 8) -> int:
    """Ejection chains from the nodes on forbidden pairs; returns how many were kept."""
    kept = 0
    improved = True
    while improved and ls.nforb and time.perf_counter() < deadline:
        improved = False
        bad = [v for v in range(ls.n) if ls.forb[v][ls.s[v]] > 0]
        for v in ls.rand.permutation(bad).tolist():
            if time.perf_counter() >= deadline:
                break
            if ls.forb[v][ls.s[v]] == 0:
                continue
            order = np.argsort(ls.forb[v], kind="stable")[:tries].tolist()
            for j in order:
                if j == ls.s[v]:
                    continue
                before = ls.key()
                log: list = []
                _chain(ls, v, j, log)
                ls.descend(deque(w for w, _ in log), log, max_push_degree=_LOCAL_MAX_DEGREE)
                if ls.key() < before:
                    kept += 1
                    improved = True
                    break
                for w, k in reversed(log):
                    ls.apply(w, k)
    return kept


def repair_memory(ls: LocalSearch, deadline: float) -> bool:
    """Greedy memory repair of the answer in `ls` where it is over the limit.

    While some checkpoint is over, the node live there whose lower-usage strategy costs
    least per byte of that checkpoint's overflow it removes (capped at the overflow)
    takes it; a move that would add a forbidden term is never made, and a node's usage
    only falls, so no other checkpoint gets worse.  The penalty loop's answers at too low
    a weight are cheap and slightly over: this turns them into feasible candidates (the
    contest winners' repair step).  Returns whether the answer now fits.
    """
    while True:
        over = ls.use - ls.cap
        t = int(np.argmax(over)) if len(over) else 0
        if not len(over) or over[t] <= _EPS:
            return True
        if time.perf_counter() >= deadline:
            return False
        best = (np.inf, -1, -1)
        for v in ls.live_at(t).tolist():
            cur = ls.s[v]
            saved = ls.du[v][cur] - ls.du[v]
            ok = (saved > _EPS) & (ls.forb[v] <= ls.forb[v][cur])
            if not ok.any():
                continue
            rate = np.where(ok, (ls.tot[v] - ls.tot[v][cur])
                            / np.maximum(np.minimum(saved, over[t]), _EPS), np.inf)
            j = int(np.argmin(rate))
            if rate[j] < best[0]:
                best = (float(rate[j]), v, j)
        if best[1] < 0:
            return False  # nothing live at t can use less
        ls.apply(best[1], best[2])


def initial_strategies(red: Reduced) -> np.ndarray:
    """Least excess usage per node (ties: cheapest), avoiding forbidden node costs."""
    out = np.zeros(red.num_nodes, np.int64)
    for v, (c, du) in enumerate(zip(red.costs, red.du)):
        ok = c < INFINITE_COST
        key = np.where(ok, du, np.inf)
        cand = key == key.min()
        out[v] = int(np.argmin(np.where(cand, c, np.inf)))
    return out

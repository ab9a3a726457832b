"""A cheap proven lower bound on a reduced problem: dual of the pairwise LP relaxation.

Any reparametrization of the objective by messages lambda_(e,u)(i),

    theta_u(i)    = c_u(i) + sum_(e at u) lambda_(e,u)(i)
    theta_e(i, j) = R_e(i, j) - lambda_(e,u)(i) - lambda_(e,v)(j),

leaves every assignment's cost unchanged, so sum_u min theta_u + sum_e min theta_e is a
lower bound of the optimum without the memory constraint, hence of the optimum with it.
The messages are improved by damped parallel min-sum diffusion (each node averages its own
term with the min-marginals of its edges), vectorised over groups of equally-shaped edges;
the best bound seen is kept.  Memory prices mu_k >= 0 on the checkpoints may be added
(Lagrangian relaxation: + du_u(i) * sum_(k live) mu_k, - sum_k mu_k cap_k); they start
at zero and move by a projected subgradient step (Polyak's, towards `ub`).  Forbidden
entries are priced at `ub` (any finite price keeps the bound valid: it only relaxes the
problem).

The plain subgradient step zigzags where memory dominates the cost (IOPDDL S: the memory
prices make 80% of the bound).  `DualAscent` can deflect it (each direction adds
`deflection` times the previous one) and halve the step after `patience` iterations
without a better bound.  The deflection helps on IOPDDL S and hurts on A, so the plain
step stays the default (the runs: benchmarks/solver_experiments/measurements.md, "The LP
dual's subgradient step").
"""

from __future__ import annotations

import time

import numpy as np

from .problem import INFINITE_COST
from .reduce import Reduced


class DualAscent:
    """The pairwise-LP dual with memory prices, improved in place by `run` (resumable).

    best: the best proven bound so far (offset excluded; -inf before the first
    iteration); best_mu: the memory prices (per checkpoint of red) at that bound.
    """

    def __init__(self, red: Reduced, ub: float, damping: float = 0.5, price_every: int = 5,
                 step: float = 0.5, deflection: float = 0.0, patience: int = 0) -> None:
        self.red, self.ub, self.damping = red, ub, damping
        self.price_every, self.step = price_every, step
        self.deflection, self.patience = deflection, patience
        n = red.num_nodes
        self.sizes = np.array([c.size for c in red.costs], np.int64)
        self.noff = np.zeros(n + 1, np.int64)
        self.noff[1:] = np.cumsum(self.sizes)
        price = max(abs(ub), 1.0) * 2.0
        self.c = np.minimum(np.concatenate(red.costs), price) if n else np.zeros(0)
        groups: dict = {}
        for u, v, r in red.edges:
            groups.setdefault(r.shape, []).append((u, v, r))
        # All messages in one flat vector: per group, its lambda_(e,u) block then its
        # lambda_(e,v) block; `slot` holds the strategy (flat index) each message enters.
        self.gs = []
        slots = []
        at = 0
        deg = np.zeros(n, np.int64)
        for (su, sv), lst in groups.items():
            uu = np.array([x[0] for x in lst], np.int64)
            vv = np.array([x[1] for x in lst], np.int64)
            rr = np.minimum(np.stack([x[2] for x in lst]), price)
            rr = np.where(rr >= INFINITE_COST, price, rr)
            np.add.at(deg, uu, 1)
            np.add.at(deg, vv, 1)
            fu = (self.noff[uu][:, None] + np.arange(su)[None, :]).ravel()
            fv = (self.noff[vv][:, None] + np.arange(sv)[None, :]).ravel()
            ne = len(lst)
            self.gs.append(dict(r=rr, u=slice(at, at + ne * su),
                                v=slice(at + ne * su, at + ne * (su + sv)),
                                su=(ne, su), sv=(ne, sv)))
            slots += [fu, fv]
            at += ne * (su + sv)
        self.slot = np.concatenate(slots) if slots else np.zeros(0, np.int64)
        self.lam = np.zeros(at)  # the messages
        self._scratch = np.empty(max((g["r"].size for g in self.gs), default=0))
        self.total = int(self.noff[-1])
        self.share_div = np.repeat(deg + 1, self.sizes).astype(np.float64)
        # Memory prices: node u pays du_u(i) * sum of mu over its live checkpoints.
        ncp = len(red.cap)
        self.du = np.concatenate(red.du) if n else np.zeros(0)
        self.a_n, self.b_n = red.rng[:, 0], red.rng[:, 1]
        self.memo = (self.b_n > self.a_n) & np.array([d.max() > 0 for d in red.du], bool)
        self.use_prices = ncp > 0 and bool(self.memo.any())
        self.mu = np.zeros(ncp)
        self.mu_term = np.zeros(self.total)
        self.direction: np.ndarray | None = None
        self.node_of = np.repeat(np.arange(n), self.sizes)
        self.best = -np.inf
        self.best_mu = np.zeros(ncp)
        self.iterations = 0
        self.seconds = 0.0
        self._last_better = 0

    def run(self, deadline: float, max_iters: int = 100_000) -> float:
        """Iterates until `deadline` (time.perf_counter()) or `max_iters` more iterations
        (at least one); returns the best bound so far."""
        t0 = time.perf_counter()
        red, n, total, noff = self.red, self.red.num_nodes, self.total, self.noff
        for _ in range(max_iters):
            it = self.iterations
            self.iterations += 1
            lam = self.lam
            theta = self.c + self.mu_term + np.bincount(self.slot, lam, total)
            lb = float(np.minimum.reduceat(theta, noff[:-1]).sum()) if n else 0.0
            lb -= float(self.mu @ red.cap) if self.use_prices else 0.0
            phi = np.empty_like(lam)  # the edges' min-marginals, laid out as lam
            for g in self.gs:
                pu = phi[g["u"]].reshape(g["su"])
                _min_marginals(g["r"], lam[g["u"]].reshape(g["su"]),
                               lam[g["v"]].reshape(g["sv"]), self._scratch, pu,
                               phi[g["v"]].reshape(g["sv"]))
                lb += float(pu.min(axis=1).sum())
            tot = theta + np.bincount(self.slot, phi, total)
            if lb > self.best:
                self.best, self.best_mu, self._last_better = lb, self.mu.copy(), it
            if time.perf_counter() > deadline:
                break
            if self.use_prices and it % self.price_every == self.price_every - 1:
                self._price_step(tot, it)
            share = tot / self.share_div
            lam += self.damping * (phi - share[self.slot])
        self.seconds += time.perf_counter() - t0
        return self.best

    def _price_step(self, tot: np.ndarray, it: int) -> None:
        """One projected subgradient step of the memory prices.  Decode: each node's best
        strategy by its reparametrized term + incident min-marginals; the subgradient in
        mu is that decoding's usage excess."""
        red, n, noff = self.red, self.red.num_nodes, self.noff
        mins = np.minimum.reduceat(tot, noff[:-1])
        hit = np.flatnonzero(tot <= mins[self.node_of])
        first = np.full(n, -1, np.int64)
        first[self.node_of[hit[::-1]]] = hit[::-1]
        d_sel = np.where(self.memo, self.du[first], 0.0)
        prof = np.zeros(len(red.cap) + 1)
        np.add.at(prof, self.a_n, d_sel)
        np.add.at(prof, self.b_n, -d_sel)
        g = np.cumsum(prof)[:-1] - red.cap
        g = np.where((self.mu <= 0) & (g < 0), 0.0, g)
        if self.deflection:
            if self.direction is not None:
                g = g + self.deflection * self.direction
            self.direction = g
            g = np.where((self.mu <= 0) & (g < 0), 0.0, g)
        if self.patience and it - self._last_better > self.patience:
            self.step *= 0.5
            self._last_better = it
        gg = float(g @ g)
        if gg > 0:
            gap = max(self.ub - self.best, 1e-9 * abs(self.ub))
            self.mu = np.maximum(0.0, self.mu + self.step * gap / gg * g)
            self.mu_term = np.repeat(np.where(self.memo, red.live_sums(self.mu), 0.0),
                                     self.sizes) * self.du


def _min_marginals(r: np.ndarray, lu: np.ndarray, lv: np.ndarray, scratch: np.ndarray,
                   pu: np.ndarray, pv: np.ndarray) -> None:
    """pu[e, i] = min_j te[e, i, j] and pv[e, j] = min_i te[e, i, j] for te = r - lu - lv
    (a group of equally-shaped edges), written in place; `scratch` holds te.  Where the
    group has many edges, a loop over the (few) strategies beats numpy's reduction over
    a short axis 2-4x (IOPDDL S: 36 ms a pass over all edges before)."""
    ne, su, sv = r.shape
    te = scratch[:r.size].reshape(r.shape)
    np.subtract(r, lu[:, :, None], out=te)
    np.subtract(te, lv[:, None, :], out=te)
    if ne < 32:
        te.min(axis=2, out=pu)
        te.min(axis=1, out=pv)
        return
    np.copyto(pu, te[:, :, 0])
    for j in range(1, sv):
        np.minimum(pu, te[:, :, j], out=pu)
    np.copyto(pv, te[:, 0, :])
    for i in range(1, su):
        np.minimum(pv, te[:, i, :], out=pv)


def dual_bound(red: Reduced, deadline: float, ub: float, max_iters: int = 100_000,
               damping: float = 0.5, price_every: int = 5,
               step: float = 0.5) -> tuple[float, dict]:
    """Lower bound on the reduced problem's optimum (offset excluded)."""
    best, _mu, stats = dual_prices(red, deadline, ub, max_iters, damping, price_every, step)
    return best, stats


def dual_prices(red: Reduced, deadline: float, ub: float, max_iters: int = 100_000,
                damping: float = 0.5, price_every: int = 5,
                step: float = 0.5) -> tuple[float, np.ndarray, dict]:
    """dual_bound, and the memory prices (per checkpoint of red) at the best bound."""
    t0 = time.perf_counter()
    da = DualAscent(red, ub, damping, price_every, step)
    best = da.run(deadline, max_iters)
    return best, da.best_mu, {"bound_iterations": da.iterations,
                              "bound_seconds": time.perf_counter() - t0}

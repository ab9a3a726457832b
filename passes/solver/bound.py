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
at zero and move by a projected subgradient step.  Forbidden entries are priced at
`ub` (any finite price keeps the bound valid: it only relaxes the problem).
"""

from __future__ import annotations

import time

import numpy as np

from autopar.passes.solver.problem import INFINITE_COST
from autopar.passes.solver.reduce import Reduced


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
    n = red.num_nodes
    sizes = np.array([c.size for c in red.costs], np.int64)
    noff = np.zeros(n + 1, np.int64)
    noff[1:] = np.cumsum(sizes)
    price = max(abs(ub), 1.0) * 2.0
    c = np.minimum(np.concatenate(red.costs), price) if n else np.zeros(0)
    groups: dict = {}
    for u, v, r in red.edges:
        groups.setdefault(r.shape, []).append((u, v, r))
    gs = []
    deg = np.zeros(n, np.int64)
    for (su, sv), lst in groups.items():
        uu = np.array([x[0] for x in lst], np.int64)
        vv = np.array([x[1] for x in lst], np.int64)
        rr = np.minimum(np.stack([x[2] for x in lst]), price)
        rr = np.where(rr >= INFINITE_COST, price, rr)
        np.add.at(deg, uu, 1)
        np.add.at(deg, vv, 1)
        fu = (noff[uu][:, None] + np.arange(su)[None, :]).ravel()
        fv = (noff[vv][:, None] + np.arange(sv)[None, :]).ravel()
        gs.append(dict(r=rr, fu=fu, fv=fv, lu=np.zeros((len(lst), su)),
                       lv=np.zeros((len(lst), sv))))
    total = int(noff[-1])
    share_div = np.repeat(deg + 1, sizes).astype(np.float64)
    # Memory prices: node u pays du_u(i) * sum of mu over its live checkpoints.
    ncp = len(red.cap)
    du = np.concatenate(red.du) if n else np.zeros(0)
    a_n, b_n = red.rng[:, 0], red.rng[:, 1]
    memo = (b_n > a_n) & np.array([d.max() > 0 for d in red.du], bool)
    use_prices = ncp > 0 and bool(memo.any())
    mu = np.zeros(ncp)
    mu_term = np.zeros(total)
    node_of = np.repeat(np.arange(n), sizes)
    best = -np.inf
    best_mu = np.zeros(len(red.cap))
    it = 0
    for it in range(max_iters):  # noqa: B007
        theta = c + mu_term
        for g in gs:
            theta += np.bincount(g["fu"], g["lu"].ravel(), total)
            theta += np.bincount(g["fv"], g["lv"].ravel(), total)
        phis = []
        lb = float(np.minimum.reduceat(theta, noff[:-1]).sum()) if n else 0.0
        lb -= float(mu @ red.cap) if use_prices else 0.0
        tot = theta.copy()
        for g in gs:
            te = g["r"] - g["lu"][:, :, None] - g["lv"][:, None, :]
            pu = te.min(axis=2)
            pv = te.min(axis=1)
            lb += float(pu.min(axis=1).sum())
            tot += np.bincount(g["fu"], pu.ravel(), total)
            tot += np.bincount(g["fv"], pv.ravel(), total)
            phis.append((pu, pv))
        if lb > best:
            best, best_mu = lb, mu.copy()
        if time.perf_counter() > deadline:
            break
        if use_prices and it % price_every == price_every - 1:
            # Decode: each node's best strategy by its reparametrized term + incident
            # min-marginals; subgradient of the dual in mu is the usage excess.
            mins = np.minimum.reduceat(tot, noff[:-1])
            hit = np.flatnonzero(tot <= mins[node_of])
            first = np.full(n, -1, np.int64)
            first[node_of[hit[::-1]]] = hit[::-1]
            d_sel = np.where(memo, du[first], 0.0)
            prof = np.zeros(ncp + 1)
            np.add.at(prof, a_n, d_sel)
            np.add.at(prof, b_n, -d_sel)
            g = np.cumsum(prof)[:-1] - red.cap
            g = np.where((mu <= 0) & (g < 0), 0.0, g)
            gg = float(g @ g)
            if gg > 0:
                mu = np.maximum(0.0, mu + step * max(ub - best, 1e-9 * abs(ub)) / gg * g)
                mu_term = np.repeat(np.where(memo, red.live_sums(mu), 0.0), sizes) * du
        share = tot / share_div
        for g, (pu, pv) in zip(gs, phis):
            g["lu"] += damping * (pu - share[g["fu"]].reshape(pu.shape))
            g["lv"] += damping * (pv - share[g["fv"]].reshape(pv.shape))
    return best, best_mu, {"bound_iterations": it + 1,
                           "bound_seconds": time.perf_counter() - t0}

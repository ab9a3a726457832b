"""Sharding-strategy solver: brute force as the oracle on small random problems."""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
import pathlib
import re

import numpy as np
import pytest

from autopar.passes.solver import (
    INFINITE_COST,
    InfeasibleError,
    ShardingProblem,
    evaluate,
    load_iopddl,
    solve,
)
from autopar.passes.solver.problem import scale_costs
from autopar.passes.solver.reduce import reduce_problem
from autopar.passes.solver.solve import cost_scale

IOPDDL = pathlib.Path(__file__).resolve().parent / "data"  # see data/README.md
EXAMPLE = IOPDDL / "example.json"
LAYER = IOPDDL / "gpt-toy-layer-2dev.json.gz"
LAYER_OPTIMUM = 1.4836031988153093e-06  # seconds; toulbar2, HiGHS and CBC agree
BACKENDS = (["cbc"] + (["highs"] if importlib.util.find_spec("highspy") else [])
            + (["toulbar2"] if importlib.util.find_spec("pytoulbar2") else []))


def random_problem(seed: int, limit: str = "none", forbid: float = 0.0) -> ShardingProblem:
    """4-7 nodes, 1-4 strategies, random edges; limit "none", "tight" or "loose"."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 8))
    sizes = rng.integers(1, 5, n)
    costs = [rng.integers(0, 50, k).astype(float) for k in sizes]
    usages = [rng.integers(0, 20, k).astype(float) for k in sizes]
    for c in costs:
        if forbid and c.size > 1 and rng.random() < forbid:
            c[rng.integers(c.size)] = INFINITE_COST
    starts = rng.integers(0, 10, n)
    intervals = np.stack([starts, starts + rng.integers(0, 8, n)], axis=1)
    pairs = [(u, v) for u in range(n) for v in range(n) if u != v and rng.random() < 0.3]
    edges = np.array(pairs, np.int64).reshape(-1, 2)
    ecosts = []
    for u, v in edges:
        r = rng.integers(0, 60, (sizes[u], sizes[v])).astype(float)
        if forbid:
            r[rng.random(r.shape) < forbid] = INFINITE_COST
        ecosts.append(r)
    p = ShardingProblem(tuple(costs), tuple(usages), intervals, edges, tuple(ecosts))
    if limit == "none":
        return p
    lo = slow_peak(p, [int(np.argmin(u)) for u in usages])
    hi = slow_peak(p, [int(np.argmax(u)) for u in usages])
    frac = 0.3 if limit == "tight" else 0.7
    return ShardingProblem(tuple(costs), tuple(usages), intervals, edges, tuple(ecosts),
                           usage_limit=float(lo + frac * (hi - lo)))


def slow_peak(p: ShardingProblem, s) -> float:
    times = range(int(p.intervals.min()), int(p.intervals.max()) + 1)
    return max([sum(p.node_usages[v][s[v]] for v in range(p.num_nodes)
                    if p.intervals[v, 0] <= t < p.intervals[v, 1]) for t in times] + [0.0])


def slow_evaluate(p: ShardingProblem, s) -> tuple[float, bool]:
    cost, ok = 0.0, True
    for v in range(p.num_nodes):
        cost += p.node_costs[v][s[v]]
        ok &= p.node_costs[v][s[v]] < INFINITE_COST
    for (u, v), r in zip(p.edges, p.edge_costs):
        cost += r[s[u], s[v]]
        ok &= r[s[u], s[v]] < INFINITE_COST
    if p.usage_limit is not None:
        ok &= slow_peak(p, s) <= p.usage_limit
    return cost, bool(ok)


def brute_force(p: ShardingProblem) -> float | None:
    best = None
    for s in itertools.product(*[range(c.size) for c in p.node_costs]):
        cost, ok = slow_evaluate(p, s)
        if ok and (best is None or cost < best):
            best = cost
    return best


CASES = [(seed, lim, fb) for seed in range(6) for lim, fb in
         [("none", 0.0), ("tight", 0.0), ("loose", 0.15)]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("seed", "limit", "forbid"), CASES)
def test_solve_matches_brute_force(backend, seed, limit, forbid):
    p = random_problem(seed, limit, forbid)
    want = brute_force(p)
    sol = solve(p, time_limit_s=20.0, backend=backend)
    assert len(sol.strategies) == p.num_nodes
    assert (sol.cost, sol.feasible) == pytest.approx(slow_evaluate(p, sol.strategies))
    if want is None:
        assert not sol.feasible
        return
    assert sol.feasible
    assert sol.status == "optimal"
    assert sol.cost == pytest.approx(want)
    assert sol.lower_bound == pytest.approx(want)
    assert sol.stats["backend"] == backend
    solver_key = "toulbar2_seconds" if backend == "toulbar2" else "ilp_seconds"
    for key in ("nodes_before", "nodes_after", "edges_before", "edges_after",
                "strategies_before", "strategies_after", "backend", "reduce_seconds",
                "heuristic_seconds", solver_key):
        assert key in sol.stats


@pytest.mark.parametrize("backend", BACKENDS)
def test_example_optimum(backend):
    p = load_iopddl(EXAMPLE)
    want = brute_force(p)
    sol = solve(p, time_limit_s=10.0, backend=backend)
    assert sol.status == "optimal" and sol.feasible
    assert sol.cost == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_costs_in_seconds_reach_the_optimum(backend):
    """autopar's own problems are priced in seconds (here 1e-10 to 1e-7 per choice), under
    the MIP solvers' absolute tolerances; solve() scales them first.  Unscaled, HiGHS
    called an answer 4.2% above this layer problem's optimum optimal."""
    p = load_iopddl(LAYER)
    assert cost_scale(p) > 1.0
    sol = solve(p, time_limit_s=30.0, backend=backend)
    assert sol.status == "optimal" and sol.feasible
    assert sol.cost == pytest.approx(LAYER_OPTIMUM, rel=1e-9)
    assert sol.lower_bound == pytest.approx(LAYER_OPTIMUM, rel=1e-6)
    assert sol.stats["cost_scale"] == cost_scale(p)


def test_cost_scale_is_a_power_of_two_that_keeps_forbidden_choices():
    p = random_problem(7, "loose", forbid=0.3)  # feasible: optimum 423
    for base in (p, scale_costs(p, 2.0 ** -40)):
        k = cost_scale(base)
        assert np.log2(k) == int(np.log2(k)) and k > 1.0
        up = scale_costs(base, k)
        top = max(float(c[c < INFINITE_COST].max(initial=0.0))
                  for c in (*up.node_costs, *up.edge_costs))
        assert 2.0 ** 20 <= top < 2.0 ** 21 and cost_scale(up) == 1.0
        for a, c in zip((*base.node_costs, *base.edge_costs), (*up.node_costs, *up.edge_costs)):
            np.testing.assert_array_equal(a, np.where(a < INFINITE_COST, c / k, c))
    assert any((c >= INFINITE_COST).any() for c in p.edge_costs)
    tiny = scale_costs(p, 2.0 ** -40)
    assert solve(tiny, time_limit_s=10.0).cost == pytest.approx(2.0 ** -40 * brute_force(p))
    assert cost_scale(load_iopddl(EXAMPLE)) == 2.0 ** 14  # largest cost 95: 1.56 M


@pytest.mark.parametrize("seed", range(20))
def test_evaluate_matches_reference(seed):
    p = random_problem(seed, ["none", "tight", "loose"][seed % 3], forbid=0.1 * (seed % 2))
    rng = np.random.default_rng(seed + 100)
    for _ in range(10):
        s = [int(rng.integers(c.size)) for c in p.node_costs]
        cost, ok = evaluate(p, s)
        want_cost, want_ok = slow_evaluate(p, s)
        assert ok == want_ok
        assert cost == pytest.approx(want_cost)


def _reduced_brute_force(red):
    best, arg = None, None
    for s in itertools.product(*[range(c.size) for c in red.costs]):
        cost = red.offset + sum(c[i] for c, i in zip(red.costs, s))
        cost += sum(r[s[u], s[v]] for u, v, r in red.edges)
        use = np.zeros(len(red.cap))
        for v, i in enumerate(s):
            use[red.rng[v, 0]:red.rng[v, 1]] += red.du[v][i]
        if cost < INFINITE_COST and np.all(use <= red.cap) and (best is None or cost < best):
            best, arg = cost, s
    return best, arg


@pytest.mark.parametrize("seed", range(12))
def test_reductions_preserve_optimum(seed):
    p = random_problem(seed, ["none", "tight", "loose"][seed % 3], forbid=0.1 * (seed % 2))
    want = brute_force(p)
    red, stats = reduce_problem(p)
    assert stats["nodes_after"] <= stats["nodes_before"]
    assert stats["strategies_after"] <= stats["strategies_before"]
    got, arg = _reduced_brute_force(red)
    if want is None:
        assert got is None
        return
    assert got == pytest.approx(want)
    assert slow_evaluate(p, red.expand(arg)) == (pytest.approx(want), True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fallback_is_feasible(backend):
    p = load_iopddl(IOPDDL / "asplos-2025-iopddl-G.json.gz")
    sol = solve(p, time_limit_s=0.5, backend=backend)
    assert sol.status == "fallback"
    if backend == "toulbar2":  # too short for worker processes: the ILP path's heuristic
        assert sol.stats["backend"] in ("highs", "cbc") and "toulbar2_skipped" in sol.stats
    assert sol.feasible
    assert evaluate(p, sol.strategies) == (pytest.approx(sol.cost), True)
    assert sol.seconds < 1.5


def test_infeasible_limit_raises():
    p = random_problem(3, "none")
    lo = slow_peak(p, [int(np.argmin(u)) for u in p.node_usages])
    assert lo > 0
    bad = ShardingProblem(p.node_costs, p.node_usages, p.intervals, p.edges, p.edge_costs,
                          usage_limit=lo - 1)
    with pytest.raises(InfeasibleError) as info:
        solve(bad, time_limit_s=5.0)
    assert info.value.smallest_peak_usage == pytest.approx(lo)
    assert info.value.usage_limit == lo - 1
    assert f"{lo:g}" in str(info.value) and f"{lo - 1:g}" in str(info.value)


def test_load_json_and_gz_roundtrip(tmp_path):
    p = load_iopddl(EXAMPLE)
    assert p.num_nodes == 5 and p.num_edges == 5 and p.usage_limit == 50
    assert p.edge_costs[2].shape == (2, 2) and p.edge_costs[2][1, 0] == 20
    gz = tmp_path / "ex.json.gz"
    with gzip.open(gz, "wt") as f:
        f.write(EXAMPLE.read_text())
    q = load_iopddl(gz)
    assert q.num_nodes == p.num_nodes
    for a, b in zip(p.edge_costs + p.node_costs, q.edge_costs + q.node_costs):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(p.intervals, q.intervals)


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda d: d["problem"]["nodes"].pop("usages"), "usages"),
    (lambda d: d["problem"]["edges"]["costs"][0].append(1), "edges.costs[0]"),
    (lambda d: d["problem"].pop("edges"), "edges"),
])
def test_malformed_file(tmp_path, mutate, field):
    doc = json.loads(EXAMPLE.read_text())
    mutate(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=re.escape(field)) as info:
        load_iopddl(bad)
    assert str(bad) in str(info.value)


@pytest.mark.skipif(importlib.util.find_spec("highspy") is None, reason="needs highspy")
@pytest.mark.parametrize("seed", range(8))
def test_lns_heuristic_feasible_and_exact_without_limit(seed):
    import time

    from autopar.passes.solver.heuristic import heuristic

    limit = ["none", "tight", "loose"][seed % 3]
    p = random_problem(seed, limit, forbid=0.1 * (seed % 2))
    want = brute_force(p)
    red, _ = reduce_problem(p)
    if want is None or red.num_nodes < 2:
        return
    s, stats = heuristic(red, time.perf_counter() + 2.0)
    cost, ok = slow_evaluate(p, red.expand(s))
    assert ok and cost >= want - 1e-6
    assert stats["seconds"] < 2.5
    if limit == "none":
        assert cost == pytest.approx(want)


@pytest.mark.parametrize("seed", range(12))
def test_dual_bound_is_valid(seed):
    import time

    from autopar.passes.solver.bound import dual_bound

    p = random_problem(seed, ["none", "tight", "loose"][seed % 3], forbid=0.1 * (seed % 2))
    want = brute_force(p)
    if want is None:
        return
    red, _ = reduce_problem(p)
    lb, stats = dual_bound(red, time.perf_counter() + 0.3, want - red.offset, max_iters=200)
    assert lb + red.offset <= want + 1e-6 * max(1.0, abs(want))
    assert stats["bound_iterations"] >= 1


@pytest.mark.parametrize("seed", range(6))
def test_deflected_dual_ascent_is_valid_and_resumes_where_it_stopped(seed):
    """The deflected subgradient (lagrange.py's LP dual) gives valid bounds, and running
    it in pieces is the same as running it at once."""
    import time

    from autopar.passes.solver.bound import DualAscent

    p = random_problem(seed, ["tight", "loose"][seed % 2], forbid=0.1 * (seed % 3 == 0))
    want = brute_force(p)
    if want is None:
        return
    red, _ = reduce_problem(p)
    far = time.perf_counter() + 60.0
    once = DualAscent(red, want - red.offset, deflection=0.95, patience=3)
    once.run(far, 120)
    pieces = DualAscent(red, want - red.offset, deflection=0.95, patience=3)
    for n in (7, 50, 63):
        pieces.run(far, n)
    assert pieces.iterations == once.iterations == 120
    assert pieces.best == once.best
    np.testing.assert_array_equal(pieces.best_mu, once.best_mu)
    assert once.best + red.offset <= want + 1e-6 * max(1.0, abs(want))


@pytest.mark.parametrize("shape", [(40, 3, 5), (40, 1, 6), (5, 4, 3), (33, 7, 1)])
def test_min_marginals_loop_matches_numpy(shape):
    from autopar.passes.solver.bound import _min_marginals

    rng = np.random.default_rng(sum(shape))
    r = rng.random(shape)
    lu, lv = rng.random(shape[:2]), rng.random((shape[0], shape[2]))
    pu, pv = np.empty(shape[:2]), np.empty((shape[0], shape[2]))
    _min_marginals(r, lu, lv, np.empty(r.size + 3), pu, pv)
    te = r - lu[:, :, None] - lv[:, None, :]
    np.testing.assert_array_equal(pu, te.min(axis=2))
    np.testing.assert_array_equal(pv, te.min(axis=1))

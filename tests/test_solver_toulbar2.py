"""The toulbar2 backend: models, worker pool, exact and large-problem paths.

Brute force is the oracle on small seeded random problems (test_solver.py runs its cases
on every installed backend, toulbar2 included); these tests cover what is particular to
toulbar2: integer scaling of float costs, forbidden entries, the knapsack constraints,
the wall-clock guard, and the penalty + LNS path (forced on a small instance).
"""

from __future__ import annotations

import importlib.util
import itertools
import pathlib
import signal
import time

import numpy as np
import pytest
from test_solver import brute_force, random_problem, slow_evaluate, slow_peak

from autopar.passes.solver import (
    BACKENDS,
    DEFAULT_BACKEND,
    INFINITE_COST,
    InfeasibleError,
    ShardingProblem,
    evaluate,
    lns,
    load_iopddl,
    solve,
)
from autopar.passes.solver.backend import AUTO_TOULBAR2_MIN_NODES, resolve_backend
from autopar.passes.solver.cfn import build_model, nondominated_points
from autopar.passes.solver.reduce import reduce_problem

pytestmark = pytest.mark.skipif(importlib.util.find_spec("pytoulbar2") is None,
                                reason="needs pytoulbar2")
DATA = pathlib.Path(__file__).resolve().parent / "data"


def test_backend_option():
    assert DEFAULT_BACKEND == "auto"
    assert set(BACKENDS) == {"auto", "toulbar2", "highs", "cbc"}
    assert resolve_backend("auto") == "toulbar2"
    assert resolve_backend("auto", AUTO_TOULBAR2_MIN_NODES) == "toulbar2"
    assert resolve_backend("auto", AUTO_TOULBAR2_MIN_NODES - 1) == "highs"
    assert resolve_backend("cbc") == "cbc"
    with pytest.raises(ValueError, match="'toulbar2'"):
        resolve_backend("gurobi")


@pytest.mark.parametrize("seed", range(30))
def test_nondominated_points_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, npt = int(rng.integers(1, 12)), int(rng.integers(1, 15))
    a = rng.integers(0, npt, n)
    b = np.minimum(a + rng.integers(1, 6, n), npt)
    cap = rng.integers(0, 4, npt).astype(float)
    live = (a[None, :] <= np.arange(npt)[:, None]) & (b[None, :] > np.arange(npt)[:, None])
    want = []
    for k in range(npt):
        if not live[k].any():
            continue
        dom = any(j != k and not (live[k] & ~live[j]).any()
                  and (cap[j] < cap[k] or (cap[j] == cap[k] and j < k)) for j in range(npt))
        if not dom:
            want.append(k)
    got = nondominated_points(a, b, cap)
    assert got == want
    # Nothing is lost: every point's constraint is implied by a kept one.
    for k in range(npt):
        if live[k].any():
            assert any(not (live[k] & ~live[j]).any() and cap[j] <= cap[k] for j in got)


@pytest.mark.parametrize("seed", range(20))
def test_knapsack_terms_match_a_term_by_term_build(seed):
    """build_model gathers each variable's knapsack terms once; the arrays must be those
    of writing every (knapsack, variable, value) term out, with shared and unshared usage
    vectors, zero usages and empty knapsacks."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 8))
    sizes = rng.integers(1, 5, n)
    uses = [np.maximum(rng.normal(size=k), 0.0) * 1e3 for k in sizes]
    knaps = []
    for _ in range(int(rng.integers(1, 7))):
        vs = rng.choice(n, int(rng.integers(0, n + 1)), replace=False).astype(np.int64)
        knaps.append((vs, [uses[v] if rng.random() < 0.7 else uses[v].copy() for v in vs],
                      float(rng.uniform(0, 3e3))))
    m = build_model([np.zeros(k) for k in sizes], [], knaps)
    u = m.usage_scale
    ptr, var, val, coef = [0], [], [], []
    for vs, us, _c in knaps:
        for x, use in zip(vs.tolist(), us):
            for j in np.flatnonzero(use > 0).tolist():
                var.append(x)
                val.append(j)
                coef.append(int(np.ceil(use[j] * u)))
        ptr.append(len(var))
    assert m.arrays["kn_ptr"].tolist() == ptr
    assert m.arrays["kn_var"].tolist() == var
    assert m.arrays["kn_val"].tolist() == val
    assert m.arrays["kn_coef"].tolist() == coef
    assert m.arrays["kn_cap"].tolist() == [int(np.floor(c * u)) for _v, _u, c in knaps]


def _float_problem(seed: int, limit: bool) -> ShardingProblem:
    """Costs in seconds (1e-6 .. 1e2, float), some forbidden entries, usages in bytes."""
    rng = np.random.default_rng(seed)
    p = random_problem(seed, "tight" if limit else "none", forbid=0.2)
    scale = 10.0 ** rng.uniform(-6, 2, 1)[0]
    costs = tuple(np.where(c >= INFINITE_COST, c, c * scale * rng.uniform(0.5, 1.5, c.size))
                  for c in p.node_costs)
    ecosts = tuple(np.where(r >= INFINITE_COST, 1e30, r * scale) for r in p.edge_costs)
    return ShardingProblem(costs, p.node_usages, p.intervals, p.edges, ecosts,
                           usage_limit=p.usage_limit)


@pytest.mark.parametrize(("seed", "limit"), itertools.product(range(6), [False, True]))
def test_float_costs_and_forbidden_entries(seed, limit):
    p = _float_problem(seed, limit)
    want = brute_force(p)
    try:
        sol = solve(p, time_limit_s=20.0, backend="toulbar2")
    except InfeasibleError:
        assert want is None
        return
    cost, ok = slow_evaluate(p, sol.strategies)
    if want is None:
        assert not sol.feasible
        return
    assert ok and sol.feasible  # forbidden entries (1e18, 1e30) are never chosen
    assert cost == pytest.approx(want, rel=1e-9)
    assert sol.status == "optimal" and sol.stats["backend"] == "toulbar2"


def test_example_and_g_exact_optimum():
    ex = solve(load_iopddl(DATA / "example.json"), time_limit_s=10.0, backend="toulbar2")
    assert (ex.cost, ex.status, ex.lower_bound) == (445.0, "optimal", 445.0)
    p = load_iopddl(DATA / "asplos-2025-iopddl-G.json.gz")
    sol = solve(p, time_limit_s=120.0, backend="toulbar2")
    assert sol.stats["mode"] == "exact"
    assert (sol.cost, sol.feasible, sol.status) == (217_039.0, True, "optimal")
    assert sol.lower_bound == 217_039.0


@pytest.mark.parametrize("limit_s", [0.3, 2.0])
def test_time_limit_returns_feasible(limit_s):
    p = load_iopddl(DATA / "asplos-2025-iopddl-G.json.gz")
    t0 = time.perf_counter()
    sol = solve(p, time_limit_s=limit_s, backend="toulbar2")
    assert time.perf_counter() - t0 < limit_s + 2.0  # the guard: interrupt, then kill
    assert sol.feasible and evaluate(p, sol.strategies) == (pytest.approx(sol.cost), True)


def test_penalty_and_lns_path(monkeypatch):
    from autopar.passes.solver import toulbar2

    monkeypatch.setattr(toulbar2, "EXACT_MAX_NODES", 0)
    p = load_iopddl(DATA / "asplos-2025-iopddl-G.json.gz")
    sol = solve(p, time_limit_s=6.0, backend="toulbar2")
    assert sol.stats["mode"] == "penalty+lns"
    assert sol.feasible and sol.cost >= 217_039.0
    assert evaluate(p, sol.strategies) == (pytest.approx(sol.cost), True)
    assert sol.stats["penalty_solves"] >= 1
    if lns.available():  # the loop's answers are recombined before the LNS
        assert sol.stats["merge_answers"] >= 1
        assert sol.stats["merge_cost"] <= sol.stats["penalty_cost"]


def test_penalty_weights_from_memory_prices(monkeypatch):
    """Large problems start the penalty loop from the pairwise-LP dual's memory prices:
    one weight per node, PRICE_FACTOR x the prices over its live checkpoints, floored;
    the dual's bound is a valid lower bound.  With no price above zero (here: a known
    cost far above the optimum, which makes the dual's steps overshoot) the loop starts
    from one uniform weight.  Either way it returns a feasible answer."""
    import time

    from autopar.passes.solver import toulbar2
    from autopar.passes.solver.reduce import reduce_problem

    p = load_iopddl(DATA / "asplos-2025-iopddl-G.json.gz")
    red, _ = reduce_problem(p)
    w, stats = toulbar2._price_weights(red, 1.05 * 217_039.0 - red.offset,
                                       time.perf_counter() + 2.0)
    assert w.shape == (red.num_nodes,)
    assert w.min() >= toulbar2.PRICE_FLOOR * w.max() * (1 - 1e-12) > 0
    assert len(np.unique(w)) > 1  # tight checkpoints price their nodes higher
    assert stats["price_lp_bound"] <= 217_039.0 + 1e-6
    w, stats = toulbar2._price_weights(red, 1e4 * 217_039.0, time.perf_counter() + 0.5)
    assert w == stats["initial_weight"] == toulbar2._initial_weight(red, 1e4 * 217_039.0)

    monkeypatch.setattr(toulbar2, "EXACT_MAX_NODES", 0)
    sol = solve(p, time_limit_s=12.0, backend="toulbar2")
    assert sol.stats["mode"] == "penalty+lns" and sol.stats["price_seconds"] > 0
    assert sol.feasible and sol.cost >= 217_039.0
    assert evaluate(p, sol.strategies) == (pytest.approx(sol.cost), True)


@pytest.mark.parametrize("final_polish_s", [0.0, 10.0])
def test_last_round_answers_get_the_final_polish(final_polish_s):
    """The penalty loop's last round ends at its deadline, and its answers (as a rule the
    cheapest) are repaired and polished in final_polish_s past it; with no such window
    they are dropped.  Fake pool on a small random problem: round 1 answers a feasible
    choice, round 2 (which runs past the deadline) the cheapest one, over the limit."""
    from autopar.passes.solver.heuristic import heuristic
    from autopar.passes.solver.local_search import LocalSearch
    from autopar.passes.solver.penalty import Penalty, penalty_search
    from autopar.passes.solver.pool import Answer

    red, _ = reduce_problem(random_problem(4, "tight"))
    pen = Penalty(red, 1.0, 2)
    choices = [np.array(z) for z in itertools.product(*[range(c.size) for c in red.costs])]
    x = min(choices, key=pen.real_cost)  # cheapest with no memory limit
    y, _ = heuristic(red, time.perf_counter() + 1.0, use_lns=False)  # within the limit
    assert (pen.usage(x) > red.cap).any() and (pen.usage(y) <= red.cap).all()
    assert pen.real_cost(x) < pen.real_cost(y)
    deadline = time.perf_counter() + 2.0
    rounds = []

    class FakePool:
        size = 2

        def start(self, reqs):
            rounds.append(reqs)
            return len(rounds)

        def wait(self, batch, end):
            if batch == 1:
                return [Answer({"values": y}, {}), Answer({"values": y}, {})]
            time.sleep(max(0.0, deadline + 0.05 - time.perf_counter()))
            return [Answer({"values": x}, {}), Answer({"values": y}, {})]

    answers = []
    best, cost, counts = penalty_search(red, LocalSearch(red, 0), FakePool(), deadline, 1.0,
                                        1.0, hard_deadline=deadline + 30.0,
                                        final_polish_s=final_polish_s, answers=answers)
    assert counts["penalty_rounds"] == 2
    # Every answer is kept for the recombination (merge.py), over the limit or not.
    assert [(c, list(z)) for c, z in answers] == [
        (pen.real_cost(z), list(z)) for z in (y, y, x, y)]
    assert (pen.usage(best) <= red.cap).all() and cost == pytest.approx(pen.real_cost(best))
    assert cost <= pen.real_cost(y)
    assert counts["penalty_repaired"] == (1 if final_polish_s else 0)


def test_region_model_is_exact():
    """A region covering every node, knapsacks included, solves the whole problem."""
    from autopar.passes.solver.local_search import LocalSearch, initial_strategies
    from autopar.passes.solver.pool import Request, WorkerPool
    from autopar.passes.solver.tb2_lns import apply_answer, region_model

    found = 0
    with WorkerPool(1) as pool:
        for seed in range(12):
            p = random_problem(seed, "tight")
            want = brute_force(p)
            red, _ = reduce_problem(p)
            if want is None or red.num_nodes < 2:
                continue
            ls = LocalSearch(red)
            ls.reset(initial_strategies(red))
            if ls.nforb or np.any(ls.use > ls.cap):
                continue
            region = np.arange(red.num_nodes)
            model, cur = region_model(ls, region)
            ans = pool.run([Request(model.arrays, {"ub": cur + 1, "time_limit_s": 10})],
                           time.perf_counter() + 10)[0]
            assert ans.meta["status"] == "optimal"
            apply_answer(ls, region, ans.arrays["values"])
            got = slow_evaluate(p, red.expand(np.array(ls.s)))
            assert got == (pytest.approx(want), True)
            found += 1
    assert found >= 3


def test_pool_interrupts_and_survives_stale_signal():
    from autopar.passes.solver.cfn import reduced_model
    from autopar.passes.solver.pool import Request, WorkerPool

    red, _ = reduce_problem(load_iopddl(DATA / "asplos-2025-iopddl-G.json.gz"))
    model = reduced_model(red, memory=True)
    with WorkerPool(1, grace_s=1.0) as pool:
        warm = reduced_model(red)  # no memory: solved at once; the worker is then ready
        pool.run([Request(warm.arrays, {"time_limit_s": 10})], time.perf_counter() + 30)
        t0 = time.perf_counter()
        ans = pool.run([Request(model.arrays, {"time_limit_s": 100})], t0 + 0.2)[0]
        assert time.perf_counter() - t0 < 0.2 + 1.0 + 0.5
        assert ans is None or ans.meta["status"] in ("feasible", "none", "optimal")
        # A late interrupt arriving between two requests must not cut the next one.
        pool._worker(0).proc.send_signal(signal.SIGVTALRM)
        time.sleep(0.2)
        ans = pool.run([Request(warm.arrays, {"time_limit_s": 100})],
                       time.perf_counter() + 60)[0]
        assert ans.meta["status"] == "optimal"


def test_same_answer_twice():
    p = random_problem(5, "tight")
    a = solve(p, time_limit_s=20.0, backend="toulbar2")
    b = solve(p, time_limit_s=20.0, backend="toulbar2")
    assert a.strategies == b.strategies and a.status == b.status == "optimal"
    assert slow_peak(p, a.strategies) <= p.usage_limit


def _dense_problem(seed: int, limit: bool) -> ShardingProblem:
    """Like the compiler's layer problems on 2-D meshes: few nodes, dozens of strategies
    each, dense pairwise costs (a complete graph on 6 nodes x 40 strategies: tens of
    thousands of ILP nonzeros, nothing for the reductions to eliminate)."""
    rng = np.random.default_rng(seed)
    n, k = 6, 40
    costs = tuple(rng.uniform(0.0, 1e-3, k) for _ in range(n))
    usages = tuple(rng.integers(1, 100, k).astype(float) for _ in range(n))
    intervals = np.array([[0, n]] * n, np.int64)
    edges = np.array(list(itertools.combinations(range(n), 2)), np.int64)
    ecosts = tuple(rng.uniform(0.0, 2e-3, (k, k)) for _ in edges)
    p = ShardingProblem(costs, usages, intervals, edges, ecosts)
    if not limit:
        return p
    return ShardingProblem(costs, usages, intervals, edges, ecosts,
                           usage_limit=0.5 * sum(float(u.mean()) for u in usages))


@pytest.mark.parametrize("limit", [False, True])
def test_auto_solves_dense_small_problems_with_toulbar2_in_process(limit):
    """"auto" gives a small problem whose ILP would be large (dense 2-D-mesh costs: HiGHS
    took 12-13 s where toulbar2 took 0.2 s) to toulbar2 in this process: the proven
    optimum, no worker processes, within the limit."""
    from autopar.passes.solver.ilp import SECONDS_PER_NONZERO, model_nonzeros

    p = _dense_problem(0, limit)
    red, _ = reduce_problem(p)
    assert red.num_nodes == 6 and model_nonzeros(red) * SECONDS_PER_NONZERO > 0.5
    # The reference: toulbar2's worker path, with its proof (HiGHS needs about a minute).
    want = solve(p, time_limit_s=60.0, backend="toulbar2")
    assert want.status == "optimal" and want.lower_bound == pytest.approx(want.cost)
    assert not want.stats["in_process"]
    t0 = time.perf_counter()
    sol = solve(p, time_limit_s=1.0)
    assert time.perf_counter() - t0 < 2.5  # toulbar2's CPU timer: whole seconds
    assert sol.stats["backend"] == "toulbar2" and sol.stats["in_process"]
    assert "toulbar2 in process" in sol.stats["auto"]
    assert sol.status == "optimal" and sol.feasible
    assert sol.cost == pytest.approx(want.cost, rel=1e-6)
    assert evaluate(p, sol.strategies) == (pytest.approx(sol.cost), True)


def test_inline_timer_does_not_outlive_its_solve():
    """An in-process solve cut short by toulbar2's CPU timer answers with what it has; the
    timer is stopped afterwards (the next solve runs to its optimum, and CPU-bound work
    after it is not interrupted)."""
    from autopar.passes.solver.toulbar2 import solve_toulbar2

    red, _ = reduce_problem(load_iopddl(DATA / "asplos-2025-iopddl-G.json.gz"))
    # 1.5 s: toulbar2 starts only with >= 0.5 s left after the local search, which on a
    # loaded 2-core CI machine took more than the 0.1 s a 0.6-s deadline left it.
    x, _, status, stats = solve_toulbar2(red, time.perf_counter() + 1.5, inline=True)
    assert stats["in_process"] and stats["mode"] == "exact" and x is not None
    assert status in ("feasible", "optimal", "fallback")  # whatever it had when cut short
    p = _dense_problem(1, False)
    sol = solve(p, time_limit_s=1.0)
    assert sol.status == "optimal" and sol.stats["in_process"]
    t0 = time.process_time()
    while time.process_time() - t0 < 1.5:  # a stale CPU timer would fire here
        pass


def test_memory_repair_fits_and_adds_no_forbidden_term():
    """repair_memory only lowers nodes' usage and never adds a forbidden term; without
    forbidden terms it always fits when the least-usage choice does."""
    from autopar.passes.solver.local_search import LocalSearch, repair_memory

    repaired = 0
    for seed in range(40):
        forbid = 0.15 if seed % 2 else 0.0
        try:
            red, _ = reduce_problem(random_problem(seed, "tight", forbid))
        except InfeasibleError:  # forbidden strategies left no choice under the limit
            continue
        if red.num_nodes < 2:
            continue
        ls = LocalSearch(red)
        ls.reset([int(np.argmax(d)) for d in red.du])  # the most usage: over the limit
        if not np.any(ls.use > ls.cap + 1e-9):
            continue
        s0, forb0 = list(ls.s), ls.nforb
        fits = repair_memory(ls, time.perf_counter() + 5)
        assert fits == bool(np.all(ls.use <= ls.cap + 1e-9))
        assert ls.nforb <= forb0
        assert all(red.du[v][ls.s[v]] <= red.du[v][s0[v]] for v in range(red.num_nodes))
        if not forbid:
            assert fits, seed
        repaired += fits
    assert repaired >= 8

    # G: each node's cheapest strategy breaks the limit; the repair makes it fit.
    red, _ = reduce_problem(load_iopddl(DATA / "asplos-2025-iopddl-G.json.gz"))
    ls = LocalSearch(red)
    ls.reset([int(np.argmin(c)) for c in red.costs])
    assert np.any(ls.use > ls.cap)
    forb0 = ls.nforb
    assert repair_memory(ls, time.perf_counter() + 10)
    assert np.all(ls.use <= ls.cap) and ls.nforb <= forb0

"""The solver experiments in benchmarks/solver_experiments (no solve path uses them): the
Lagrangian bound, leaf folding, and toulbar2 settings chosen per request."""

from __future__ import annotations

import importlib.util
import itertools
import pathlib
import time

import numpy as np
import pytest
from test_solver import brute_force, random_problem

from autopar.passes.solver import load_iopddl
from autopar.passes.solver.reduce import reduce_problem

pytestmark = pytest.mark.skipif(importlib.util.find_spec("pytoulbar2") is None,
                                reason="needs pytoulbar2")
DATA = pathlib.Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize("seed", [1, 4, 7])
def test_lagrangian_bound_is_valid(seed):
    from benchmarks.solver_experiments.lagrange import lagrangian_bound

    p = random_problem(seed, "tight")
    want = brute_force(p)
    if want is None:
        return
    lb, stats = lagrangian_bound(p, time_limit_s=2.5, upper_bound=want)
    assert lb is not None and lb <= want + 1e-6 * max(1.0, abs(want))
    assert lb >= stats.get("lp_bound", -np.inf) - 1e-6 * max(1.0, abs(want))


def _fake_bound_pool(calls: list, answer):
    """A WorkerPool stand-in for lagrange.py: records each round's requests in `calls` and
    answers every subproblem with choice 0 everywhere and (status, lower bound) =
    answer()."""
    from autopar.passes.solver.pool import Answer

    class FakePool:
        grace_s = 0.0

        def __init__(self, size):
            self.size = size

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def run(self, reqs, deadline):
            calls.append(reqs)
            status, lb = answer()
            n = len(reqs[0].base_arrays["sizes"])
            return [Answer({"values": np.zeros(n, np.int64)},
                           {"status": status, "lower_bound": lb}) for _ in reqs]

    return FakePool


def test_lagrangian_round_without_proof_is_solved_again_with_its_answers(monkeypatch):
    """A round whose subproblems toulbar2 did not prove is solved again at the same
    prices, each warm-started and bounded by the cheapest answer just found (on IOPDDL M
    this turned a bound stuck at the LP's, 0.86 of the known one, into 0.999)."""
    from benchmarks.solver_experiments import lagrange

    calls = []
    monkeypatch.setattr(lagrange, "WorkerPool", _fake_bound_pool(
        calls, lambda: ("feasible" if len(calls) == 1 else "optimal", 0.0)))
    p = random_problem(4, "tight")
    lagrange.lagrangian_bound(p, time_limit_s=1.5, upper_bound=brute_force(p))
    assert len(calls) >= 2
    first, again = calls[0], calls[1]
    assert all("ub" not in r.meta for r in first)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a.arrays["unary"], b.arrays["unary"])  # same prices
        assert "ub" in b.meta and "best" in b.arrays


@pytest.mark.parametrize("tb2_better", [False, True])
def test_lagrangian_goes_back_to_the_lp_dual_when_toulbar2_bounds_worse(monkeypatch,
                                                                         tb2_better):
    """Where toulbar2's first bounds (round and retry) are below the LP dual's, the rest of
    the time goes to the LP dual (IOPDDL S: 0.815 of the known bound -> 0.95); where they
    are above, the subgradient rounds go on."""
    from benchmarks.solver_experiments import lagrange

    calls = []
    monkeypatch.setattr(lagrange, "WorkerPool", _fake_bound_pool(
        calls, lambda: ("feasible", 1e30 if tb2_better else -1e30)))
    p = random_problem(4, "tight")
    want = brute_force(p)
    lb, stats = lagrange.lagrangian_bound(p, time_limit_s=1.5, upper_bound=want)
    if tb2_better:
        assert len(calls) > 2 and "lagrange_lp_resumed" not in stats
    else:
        assert len(calls) == 2 and stats["lagrange_lp_resumed"]
        assert stats["lagrange_seconds"] >= 1.4  # the LP dual used the rest of the time
        assert stats["lp_bound"] <= lb <= want + 1e-6 * max(1.0, abs(want))


def test_worker_options_are_per_request():
    """A request's toulbar2 options (meta "options") apply to that solve only; an unknown
    option is an error answer naming it, not a crash or a silent default."""
    import pytoulbar2

    from autopar.passes.solver.cfn import reduced_model
    from benchmarks.solver_experiments.tb2_options import TUNABLE_OPTIONS, solve_inline

    red, _ = reduce_problem(random_problem(5, "tight"))
    model = reduced_model(red, memory=True).arrays  # small: optimal under any setting
    base = solve_inline(model, {"time_limit_s": 20})
    assert base[1]["status"] == "optimal"
    other = {"DEE": 0, "elimDegree": 0, "LcLevel": 1, "hbfs": 0, "restart": 10000}
    got = solve_inline(model, {"time_limit_s": 20, "options": other})
    assert got[1]["status"] == "optimal" and got[1]["cost"] == base[1]["cost"]
    option = pytoulbar2.pytb2.option
    assert (option.DEE, option.elimDegree, option.hbfs, option.restart) == (0, 0, 0, 10000)
    again = solve_inline(model, {"time_limit_s": 20})
    assert again[1]["cost"] == base[1]["cost"]
    assert (option.DEE, option.elimDegree, option.hbfs) == (1, 3, 1)  # back to autopar's
    # The other search methods, on a memory-free model (the penalty loop's kind): G
    # without its memory limit, 816 nodes, optimal in well under a second.
    red_g, _ = reduce_problem(load_iopddl(DATA / "asplos-2025-iopddl-G.json.gz"))
    free = reduced_model(red_g, memory=False).arrays
    opt = solve_inline(free, {"time_limit_s": 20})
    assert opt[1]["status"] == "optimal"
    searches = [{"searchMethod": 2, "restart": 10000}, {"elimDegree_preprocessing": 2}]
    assert set(other).union(*searches) == set(TUNABLE_OPTIONS)
    for opts in searches:
        ans = solve_inline(free, {"time_limit_s": 20, "lds": 4, "options": opts})
        assert ans[1]["cost"] == opt[1]["cost"], opts
        assert ans[1]["lower_bound"] <= opt[1]["cost"]
    solve_inline(free, {"time_limit_s": 20})
    assert (option.searchMethod, option.elimDegree_preprocessing, option.restart) == (0, -1, -1)
    bad = solve_inline(model, {"time_limit_s": 20, "options": {"vnsKmax": 4}})
    assert bad[0] == {} and bad[1]["status"] == "error" and "vnsKmax" in bad[1]["message"]


def _tree_model(seed: int) -> dict:
    """A random pairwise model (tb2_handler's arrays) with a cycle, chains and leaves of
    leaves, integer costs and some forbidden entries."""
    rng = np.random.default_rng(seed)
    n = 9
    sizes = rng.integers(1, 4, n)
    edges = [(0, 1), (1, 2), (2, 0), (2, 3), (3, 4), (4, 5), (1, 6), (6, 7), (0, 8)]
    costs = []
    for a, b in edges:
        t = rng.integers(0, 20, (sizes[a], sizes[b])).astype(np.float64)
        t[rng.random(t.shape) < 0.15] = np.inf
        costs.append(t.ravel())
    unary = rng.integers(0, 20, int(sizes.sum())).astype(np.float64)
    unary[rng.random(unary.shape) < 0.1] = np.inf
    return {"sizes": sizes, "edges": np.array(edges), "costs": np.concatenate(costs),
            "unary": unary}


def _model_cost(m: dict, x) -> float:
    off = np.concatenate([[0], np.cumsum(m["sizes"])])
    c = sum(m["unary"][off[v] + x[v]] for v in range(len(x)))
    k = 0
    for a, b in m["edges"].tolist():
        sb = m["sizes"][b]
        c += m["costs"][k + x[a] * sb + x[b]]
        k += m["sizes"][a] * sb
    return float(c)


@pytest.mark.parametrize("seed", range(6))
def test_leaf_fold_is_exact(seed):
    """The folded core's optimum, expanded, is the whole model's optimum; every core
    answer costs what its expansion does, and a whole answer's core cost is at most its
    own."""
    from benchmarks.solver_experiments.fold import LeafFold

    m = _tree_model(seed)
    fold = LeafFold(m["sizes"], m["edges"], m["costs"])
    assert fold.core.tolist() == [0, 1, 2]  # the triangle stays; the rest folds
    assert fold.num_folded == 6
    folded = fold.fold(m["unary"])
    core = {"unary": fold.core_unary(folded), **fold.arrays}
    whole = [_model_cost(m, x) for x in itertools.product(*map(range, m["sizes"]))]
    best_core = min(itertools.product(*map(range, core["sizes"])),
                    key=lambda xc: _model_cost(core, xc))
    x = fold.expand(np.array(best_core), folded)
    assert _model_cost(m, x) == min(whole)
    for xc in itertools.product(*map(range, core["sizes"])):
        x = fold.expand(np.array(xc), folded)
        assert _model_cost(core, xc) == _model_cost(m, x)
        assert fold.core_cost(folded, x) == _model_cost(core, xc)
    for xw in itertools.product(*map(range, m["sizes"])):
        assert fold.core_cost(folded, np.array(xw)) <= _model_cost(m, xw)


def test_leaf_fold_keeps_toulbar2_optimum_on_g():
    """G's penalized model (one weight on every memory node) solved by toulbar2 on the
    whole model and on its folded core: the same proven optimum, and the expansion of the
    core's answer costs exactly that on the whole model."""
    from autopar.passes.solver.penalty import Penalty
    from autopar.passes.solver.tb2_handler import solve_inline
    from benchmarks.solver_experiments.fold import LeafFold

    red, _ = reduce_problem(load_iopddl(DATA / "asplos-2025-iopddl-G.json.gz"))
    pen = Penalty(red, 1.0, 1)
    unary, _ = pen.unary(pen.weights(0))
    fold = LeafFold(**pen.edge_arrays)
    assert 0 < len(fold.core) < red.num_nodes
    whole = solve_inline({**pen.edge_arrays, "unary": unary}, {"time_limit_s": 20})
    folded = fold.fold(unary)
    core = solve_inline({**fold.arrays, "unary": fold.core_unary(folded)}, {"time_limit_s": 20})
    assert whole[1]["status"] == core[1]["status"] == "optimal"
    assert core[1]["cost"] == whole[1]["cost"]
    x = fold.expand(core[0]["values"], folded)
    assert pen.model_cost(unary, x) == whole[1]["cost"]


def test_options_worker_applies_each_requests_options():
    """The experiment's own worker process (tb2_options.COMMAND, on the shared pool):
    a request's options reach toulbar2, an unknown one is an error answer naming it."""
    from autopar.passes.solver.cfn import reduced_model
    from autopar.passes.solver.pool import Request, WorkerPool
    from benchmarks.solver_experiments import tb2_options

    red, _ = reduce_problem(random_problem(5, "tight"))
    model = reduced_model(red, memory=True).arrays
    with WorkerPool(1, command=tb2_options.COMMAND) as pool:
        plain, other, bad = pool.run(
            [Request(model, {"time_limit_s": 20}),
             Request(model, {"time_limit_s": 20, "options": {"DEE": 0, "hbfs": 0}}),
             Request(model, {"time_limit_s": 20, "options": {"vnsKmax": 4}})],
            time.perf_counter() + 60)
    assert plain.meta["status"] == other.meta["status"] == "optimal"
    assert other.meta["cost"] == plain.meta["cost"]
    assert bad.meta["status"] == "error" and "vnsKmax" in bad.meta["message"]

"""merge.py: the recombination of several answers is the optimum over their strategies.

Brute force over the product of each node's strategies (the incumbent's and the
answers') is the oracle, on small seeded random problems with a memory limit.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from test_solver import random_problem

from autopar.passes.solver import InfeasibleError, lns
from autopar.passes.solver.heuristic import heuristic
from autopar.passes.solver.local_search import LocalSearch, initial_strategies
from autopar.passes.solver.merge import merge
from autopar.passes.solver.reduce import reduce_problem

pytestmark = pytest.mark.skipif(not lns.available(), reason="needs highspy")


def _fits(ls: LocalSearch) -> bool:
    return ls.nforb == 0 and bool(np.all(ls.use <= ls.cap + 1e-9))


def test_merge_is_the_optimum_over_the_answers_strategies():
    checked = improved = 0
    for seed in range(40):
        try:
            red, _ = reduce_problem(random_problem(seed, "tight", 0.15 if seed % 3 else 0.0))
        except InfeasibleError:  # forbidden strategies left no choice under the limit
            continue
        if red.num_nodes < 3:
            continue
        rng = np.random.default_rng(seed)
        base = initial_strategies(red)  # the least usage: within the limit, seldom cheap
        ls = LocalSearch(red, seed)
        ls.reset(base)
        if not _fits(ls):
            base, _ = heuristic(red, time.perf_counter() + 0.2, use_lns=False)
            ls.reset(base)
        if not _fits(ls):
            continue
        # Random answers, over the limit or with forbidden terms as they come.
        answers = [np.array([rng.integers(c.size) for c in red.costs]) for _ in range(3)]
        domains = [sorted({int(base[v])} | {int(x[v]) for x in answers})
                   for v in range(red.num_nodes)]
        if np.prod([len(d) for d in domains]) > 1000:
            continue  # brute force too slow
        want = np.inf
        for s in itertools.product(*domains):
            ls.reset(s)
            if _fits(ls):
                want = min(want, ls.cost)
        ls.reset(base)
        cost0 = ls.cost
        stats = merge(ls, answers, time.perf_counter() + 10.0)
        assert stats["merge_optimal"] and stats["merge_answers"] == 3
        assert _fits(ls)
        assert all(ls.s[v] in domains[v] for v in range(red.num_nodes))
        assert ls.cost == pytest.approx(want, abs=1e-6)
        assert (stats["merge_changed"] > 0) == (want < cost0 - 1e-6)
        checked += 1
        improved += want < cost0 - 1e-6
    assert checked >= 10 and improved >= 3


def test_merge_keeps_the_incumbent_when_no_answer_helps():
    red, _ = reduce_problem(random_problem(2, "tight"))
    base, _ = heuristic(red, time.perf_counter() + 0.2, use_lns=False)
    ls = LocalSearch(red)
    ls.reset(base)
    stats = merge(ls, [base, base], time.perf_counter() + 5.0)
    assert stats["merge_nodes"] == 0 and stats["merge_changed"] == 0
    assert list(ls.s) == [int(x) for x in base]


def test_merge_stops_adding_answers_at_its_strategy_budget():
    for seed in range(20):  # a problem where the other answer differs on 2+ nodes
        red, _ = reduce_problem(random_problem(seed, "tight"))
        base, _ = heuristic(red, time.perf_counter() + 0.2, use_lns=False)
        other = np.array([(int(b) + 1) % c.size for b, c in zip(base, red.costs)])
        extra = int(np.sum(other != base))
        if extra >= 2:
            break
    assert extra >= 2
    ls = LocalSearch(red)
    ls.reset(base)
    stats = merge(ls, [other, other, base], time.perf_counter() + 5.0, max_extra=extra - 1)
    assert stats["merge_answers"] == 0 and stats["merge_nodes"] == 0
    stats = merge(ls, [other, other], time.perf_counter() + 5.0, max_extra=extra)
    assert stats["merge_answers"] == 2 and stats["merge_strategies"] == extra
    assert stats["merge_nodes"] == extra


def test_penalty_loop_recombines_its_answers_each_round():
    """penalty_search's recombine step: a fake pool answers the cheapest choice (over the
    limit) and a feasible one each round.  The step gets the best feasible answer in
    `ls` and the answers so far cheapest first, and what it leaves in `ls` becomes the
    loop's best (here the brute-force optimum, which the polish alone misses on this
    problem: 427 against 408).  With merge as the step, the loop's best is at least as
    cheap as the best feasible mix of the two answers."""
    from autopar.passes.solver.penalty import Penalty, penalty_search
    from autopar.passes.solver.pool import Answer

    red, _ = reduce_problem(random_problem(59, "tight"))
    pen = Penalty(red, 1.0, 2)

    def fits(z) -> bool:
        return bool((pen.usage(z) <= red.cap + 1e-9).all()) and pen.allowed(z)

    choices = [np.array(z) for z in itertools.product(*[range(c.size) for c in red.costs])]
    x = min(choices, key=pen.real_cost)
    y = initial_strategies(red)
    opt = min((z for z in choices if fits(z)), key=pen.real_cost)
    assert not fits(x) and fits(y)
    mixes = [np.array(z) for z in itertools.product(*[sorted({int(a), int(b)})
                                                         for a, b in zip(x, y)])]
    want = min(pen.real_cost(z) for z in mixes if fits(z))
    assert pen.real_cost(opt) < want < pen.real_cost(y)

    class FakePool:
        size = 2

        def start(self, reqs):
            return None

        def wait(self, batch, end):
            time.sleep(0.05)
            return [Answer({"values": x}, {}), Answer({"values": y}, {})]

    calls = []

    def to_optimum(ls, answers, stop):
        calls.append(([pen.real_cost(a) for a in answers], fits(np.array(ls.s))))
        ls.reset(opt)

    for step in (to_optimum, merge):
        answers = []
        best, cost, counts = penalty_search(red, LocalSearch(red, 0), FakePool(),
                                            time.perf_counter() + 1.5, 1.0, 1.0,
                                            answers=answers, recombine=step)
        assert counts["penalty_recombined"] >= 1
        assert fits(best) and cost == pytest.approx(pen.real_cost(best))
        assert cost <= (pen.real_cost(opt) if step is to_optimum else want) + 1e-9
    assert calls and all(ok and costs == sorted(costs) for costs, ok in calls)

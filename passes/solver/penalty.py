"""The memory limit as per-node penalties with adaptive weights, solved by toulbar2.

Each memory node v pays w_v * du_v(i) for its strategy i (du: usage above the node's
minimum), and toulbar2 solves the unconstrained pairwise problem.  A round solves L
weight levels at once (one per worker, in parallel); level j of node v lies between the
largest weight known to leave a checkpoint of v's live range over the limit (lo_v) and
the smallest known to keep it under (hi_v), spread geometrically.  After the round each
node narrows [lo_v, hi_v] from the levels' outcomes (nodes interact, so a bracket that
proves wrong is widened again).  Before any outcome is known the levels are
w0_v * 4^k around a first guess w0 (one weight, or one per node: toulbar2.py derives
them from memory prices).  Every answer without an overflow is a feasible candidate; a local-search
descent (local_search.LocalSearch) polishes it.
(1st place of the ASPLOS'25 IOPDDL contest: Staudt & Blacher, "Soft Constraints, Strong
Solutions"; this is our own implementation of the idea.)  An answer over the limit
that is cheaper than the best feasible one is repaired greedily (local_search.repair_memory)
and polished the same way.  With a `recombine` step (merge.py) the answers so far are
also recombined after each round: far cheaper than any repair on IOPDDL S.

Tried on IOPDDL S and not adopted (benchmarks/solver_experiments/measurements.md,
"Penalty weights"): prices per checkpoint instead of brackets per node, and hard memory
knapsacks at the worst overflowing checkpoints.

What is deterministic: the weights of round r and the workers' seeds follow from the
answers of rounds < r.  What is not: toulbar2 runs each level until a wall-clock slice
ends, so its answers depend on the machine's speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from .cfn import (
    assignment_cost,
    build_model,
    shifted_tables,
    table_offsets,
)
from .local_search import LocalSearch, repair_memory
from .pool import Request, WorkerPool
from .problem import INFINITE_COST
from .reduce import Reduced

# A penalty worth this many times all the costs together is as good as infinite.
_MAX_PENALTY_SPAN = 16.0


class RangeMax:
    """Maximum of a vector over index ranges [a, b) (sparse table, O(1) per query)."""

    def __init__(self, x: np.ndarray) -> None:
        self.levels = [np.asarray(x, np.float64)]
        k = 1
        while 2 * k <= len(x):
            prev = self.levels[-1]
            self.levels.append(np.maximum(prev[:-k], prev[k:]))
            k *= 2

    def query(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """max x[a_i:b_i] for each i (-inf where the range is empty)."""
        ln = b - a
        out = np.full(len(a), -np.inf)
        ok = ln > 0
        if not ok.any():
            return out
        lvl = np.zeros(len(a), np.int64)
        lvl[ok] = np.floor(np.log2(ln[ok])).astype(np.int64)
        for j in np.unique(lvl[ok]).tolist():
            m = ok & (lvl == j)
            t = self.levels[j]
            out[m] = np.maximum(t[a[m]], t[b[m] - (1 << j)])
        return out


class Penalty:
    """Per-node weight brackets and the penalized models of a reduced problem."""

    def __init__(self, red: Reduced, w0: float | np.ndarray, levels: int) -> None:
        self.red = red
        self.levels = levels
        n = red.num_nodes
        self.a = red.rng[:, 0].astype(np.int64)
        self.b = red.rng[:, 1].astype(np.int64)
        self.mem = (self.b > self.a) & np.array(
            [d.max() > 0 for d in red.du] + [False])[:n]
        self.lo = np.zeros(n)
        self.hi = np.full(n, np.inf)
        self.w0 = np.broadcast_to(np.asarray(w0, np.float64), (n,))
        self.broken_ever = np.zeros(n, bool)
        self.sizes = np.array([c.size for c in red.costs], np.int64)
        self.du = np.concatenate(red.du) if n else np.zeros(0)
        self.cost = np.concatenate(red.costs) if n else np.zeros(0)
        self.node_of = np.repeat(np.arange(n), self.sizes)
        base = build_model(list(red.costs), red.edges)
        self.scale = base.cost_scale
        self.edge_arrays = {k: base.arrays[k] for k in ("sizes", "edges", "costs")}
        self.offsets = table_offsets(self.sizes, self.edge_arrays["edges"])
        self.off = self.offsets[0]
        _, self.edge_offset, span_e, _ = shifted_tables([r for _u, _v, r in red.edges])
        span = shifted_tables(list(red.costs))[2] + span_e
        self._unary0: np.ndarray | None = None
        self._offset0 = 0.0
        dmax = np.array([d.max() for d in red.du] + [0.0])[:n]
        self.w_cap = _MAX_PENALTY_SPAN * max(span, 1.0) / max(float(dmax.sum()), 1e-300)

    def weights(self, j: int) -> np.ndarray:
        """Per-node weights of level j of self.levels; 0 for nodes that never matter for
        memory."""
        lv = self.levels
        frac = (j + 1) / (lv + 1)
        lo, hi = self.lo, self.hi
        w = np.empty(len(lo))
        both = (lo > 0) & np.isfinite(hi)
        w[both] = lo[both] * (hi[both] / lo[both]) ** frac
        up = (lo > 0) & ~np.isfinite(hi)
        w[up] = lo[up] * 4.0 ** (j + 1)
        down = (lo <= 0) & np.isfinite(hi)
        w[down] = hi[down] / 4.0 ** (lv - j)
        none = (lo <= 0) & ~np.isfinite(hi)
        w[none] = self.w0[none] * 4.0 ** (j - (lv - 1) / 2)
        return np.where(self.mem, np.minimum(w, self.w_cap), 0.0)

    def unary(self, w: np.ndarray) -> tuple[np.ndarray, float]:
        """Scaled penalized unary costs (flat, +inf forbidden) and their offset."""
        u = self.cost + w[self.node_of] * self.du
        fin = self.cost < INFINITE_COST
        um = np.where(fin, u, np.inf)
        mins = np.minimum.reduceat(um, self.off[:-1]) if len(um) else np.zeros(0)
        mins = np.where(np.isfinite(mins), mins, 0.0)
        shifted = np.where(fin, np.round((u - mins[self.node_of]) * self.scale), np.inf)
        return shifted, float(mins.sum()) + self.edge_offset

    def model_cost(self, unary: np.ndarray, x: np.ndarray) -> float:
        """Cost in model units of choice x under the scaled `unary` (edges included)."""
        return assignment_cost(unary, self.edge_arrays, self.offsets, x)

    def warm_start(self, unary: np.ndarray, starts: list[np.ndarray],
                   ) -> tuple[np.ndarray | None, float | None]:
        """The cheapest of `starts` under the scaled `unary` (toulbar2's first guess) and
        its model cost + 1 (toulbar2's exclusive upper bound, None when that cost is
        infinite); (None, None) without starts."""
        if not starts:
            return None, None
        costs = [self.model_cost(unary, x) for x in starts]
        k = int(np.argmin(costs))
        return starts[k], (costs[k] + 1.0 if np.isfinite(costs[k]) else None)

    def usage(self, x: np.ndarray) -> np.ndarray:
        """Usage above the constant part at each checkpoint for choice x."""
        d = self.du[self.off[:-1] + x] * self.mem
        prof = np.zeros(len(self.red.cap) + 1)
        np.add.at(prof, self.a, d)
        np.add.at(prof, self.b, -d)
        return np.cumsum(prof)[:-1]

    def real_cost(self, x: np.ndarray) -> float:
        """Cost of choice x in the reduced problem's units (no penalty)."""
        if self._unary0 is None:
            self._unary0, self._offset0 = self.unary(np.zeros(len(self.lo)))
        return self.model_cost(self._unary0, x) / self.scale + self._offset0

    def allowed(self, x: np.ndarray) -> bool:
        """Whether choice x avoids every forbidden node strategy and edge pair."""
        return bool(np.isfinite(self.real_cost(x)))

    def node_overflow(self, over: np.ndarray) -> np.ndarray:
        """Per node: whether a checkpoint of its live range is over the limit."""
        rm = RangeMax(over)
        return self.mem & (rm.query(self.a, self.b) > 0)

    def update(self, ws: list[np.ndarray], broken: list[np.ndarray | None]) -> None:
        """Narrows each node's bracket from one round's outcomes.

        lo_v becomes the largest weight whose answer overflowed at v, hi_v the smallest
        weight above it whose answer did not.  A round where v never overflowed lowers
        lo_v (by 1000x while v has never overflowed, else 1.5x); one where no weight
        above lo_v was enough raises hi_v by 1.35x.
        """
        done = [(w, br) for w, br in zip(ws, broken) if br is not None]
        if not done:
            return
        w = np.stack([d[0] for d in done])
        br = np.stack([d[1] for d in done])
        any_br = br.any(axis=0)
        lo_round = np.where(br, w, -np.inf).max(axis=0)
        hi_round = np.where(~br & (w > lo_round[None, :]), w, np.inf).min(axis=0)
        self.broken_ever |= any_br
        lo = np.where(any_br, lo_round, self.lo / np.where(self.broken_ever, 1.5, 1000.0))
        hi = np.where(np.isfinite(hi_round), hi_round,
                      np.maximum(self.hi, lo) * 1.35)
        self.lo = np.where(self.mem, lo, 0.0)
        self.hi = np.where(self.mem, np.maximum(hi, self.lo), np.inf)


def penalty_search(red: Reduced, ls: LocalSearch, pool: WorkerPool, deadline: float,
                   w0: float | np.ndarray, solve_s: float, seed: int = 0, levels: int | None = None,
                   log: list | None = None, hard_deadline: float | None = None,
                   on_first_round: Callable[[float], None] | None = None,
                   final_polish_s: float = 0.0, answers: list | None = None,
                   recombine: Callable[[LocalSearch, list, float], object] | None = None,
                   ) -> tuple[np.ndarray | None, float, dict]:
    """Rounds of penalized toulbar2 solves until `deadline` (time.perf_counter()), or
    until `hard_deadline` while no feasible answer has been found.

    Each solve gets `solve_s` seconds of CPU time (toulbar2's own limit; the wall clock
    only interrupts it at the end); a round in which some level found nothing at all
    makes the next one 1.5x longer.  Each level
    starts from the best (under its weights) of the last round's answers and the best
    feasible answer, with that answer's penalized cost as toulbar2's upper bound.  The
    local-search polish of a round's feasible answers runs in this process while the
    workers solve the next round.  `on_first_round(stop)` runs here while the workers
    solve the first round.  `ls` is used as scratch state.  Returns
    the best feasible reduced-problem choice found (or None), its cost, and counters.
    The last round's answers (as a rule the loop's cheapest) arrive at `deadline`: they
    get `final_polish_s` seconds past it (within `hard_deadline`) for their repair and
    polish, the cheapest first.  `log` (a list) receives (time.perf_counter(), level,
    within the limit, largest overflow, cost) per answer, with level -1 for each new best
    after the polish (-2 after the recombination).  `answers` (a list) receives (cost,
    choice) for every toulbar2 answer without a forbidden term, within the limit or not.
    `recombine(ls, answers, stop)` (merge.merge), when given with `answers`, runs after
    each round's polish while the workers solve the next round: on `ls` holding the best
    feasible answer, with the answers so far cheapest first; what it leaves in `ls` is
    the new best when cheaper (later rounds start from it).
    """
    loop = _PenaltyLoop(red, ls, pool, Penalty(red, w0, levels or pool.size), deadline,
                        deadline if hard_deadline is None else max(deadline, hard_deadline),
                        solve_s, seed, log, answers, recombine)
    return loop.run(on_first_round, final_polish_s)


class _PenaltyLoop:
    """The state of one `penalty_search`: the best feasible answer, the last round's
    answers, the answers waiting for the polish, and the counters."""

    def __init__(self, red: Reduced, ls: LocalSearch, pool: WorkerPool, pen: Penalty,
                 deadline: float, hard_deadline: float, solve_s: float, seed: int,
                 log: list | None, answers: list | None,
                 recombine: Callable[[LocalSearch, list, float], object] | None) -> None:
        self.red, self.ls, self.pool, self.pen = red, ls, pool, pen
        self.deadline, self.hard_deadline = deadline, hard_deadline
        self.solve_s, self.seed = solve_s, seed
        self.log, self.answers, self.recombine = log, answers, recombine
        self.best: np.ndarray | None = None
        self.cost = np.inf
        self.prev: list[np.ndarray | None] = []  # the last round's answers
        self.counts = {"penalty_rounds": 0, "penalty_solves": 0, "penalty_feasible": 0,
                       "penalty_repaired": 0, "penalty_recombined": 0}
        self.base_key = f"penalty-{id(pen)}"
        # Answers waiting for the polish: (choice, fits); one over the limit is repaired
        # first.
        self.pending: list[tuple[np.ndarray, bool]] = []

    def run(self, on_first_round: Callable[[float], None] | None,
            final_polish_s: float) -> tuple[np.ndarray | None, float, dict]:
        while time.perf_counter() < self.end_time() - 0.5:
            end = self.end_time()
            ws = [self.pen.weights(j) for j in range(self.pen.levels)]
            reqs, warm = self._requests(ws)
            # toulbar2 stops itself after solve_s seconds of CPU time (a slice that does not
            # shrink when the machine is busy); the wall clock only guards the end.
            batch = self.pool.start(reqs)
            if self.counts["penalty_rounds"] == 0 and on_first_round is not None:
                on_first_round(min(end, time.perf_counter() + self.solve_s))
            self.polish(min(end, time.perf_counter() + self.solve_s))
            if self.recombine is not None and self.best is not None and self.answers:
                self._recombine(min(end, time.perf_counter() + self.solve_s))
            replies = self.pool.wait(batch, end)
            self.counts["penalty_rounds"] += 1
            xs = [ans.arrays["values"] if ans is not None and "values" in ans.arrays else x0
                  for ans, x0 in zip(replies, warm)]  # no answer below the bound: x0 stands
            if any(x is None for x in xs):
                self.solve_s *= 1.5
            self.prev = list(xs)
            self.pen.update(ws, self._take(xs))
        if self.best is None:
            self.polish(self.hard_deadline)  # the first feasible answer is worth a late polish
        else:
            # The last round's answers are the loop's cheapest as a rule: they get up to
            # final_polish_s past `deadline`, the cheapest first.
            self.pending.sort(key=lambda p: self.pen.real_cost(p[0]))
            self.polish(min(self.hard_deadline,
                            max(self.deadline, time.perf_counter()) + final_polish_s))
        return self.best, self.cost, self.counts

    def end_time(self) -> float:
        return self.deadline if self.best is not None or self.pending else self.hard_deadline

    def _found(self, x: np.ndarray, cost: float, level: int | None) -> None:
        self.best, self.cost = x, cost
        if level is not None and self.log is not None:
            self.log.append((time.perf_counter(), level, True, 0.0, cost))

    def polish(self, stop: float) -> None:
        """Repairs (when worth it) and descends from the pending answers until `stop`."""
        ls, pen = self.ls, self.pen
        while self.pending:
            x, fits = self.pending.pop(0)
            if not fits:
                # Worth repairing only if it is cheaper than the best so far before the
                # repair (which only adds cost) and there is time for it.
                if time.perf_counter() >= stop or pen.real_cost(x) >= self.cost:
                    continue
                ls.reset(x)
                if not repair_memory(ls, stop):
                    continue
                self.counts["penalty_repaired"] += 1
            elif self.best is not None and time.perf_counter() >= stop:
                cost = pen.real_cost(x)  # no time for the local search
                if cost < self.cost:
                    self._found(x, cost, None)
                continue
            else:
                ls.reset(x)
            if ls.cost < self.cost * (1 + 1e-3):
                ls.full_descent(stop)
            if ls.cost < self.cost:
                self._found(np.array(ls.s, np.int64), float(ls.cost), -1)

    def _requests(self, ws: list[np.ndarray]) -> tuple[list[Request], list]:
        """One toulbar2 request per weight level, warm-started from the best of the last
        round's answers and the best feasible one; and each level's warm start."""
        reqs, warm = [], []
        for w in ws:
            unary, _ = self.pen.unary(w)
            arrays = {"unary": unary}
            starts = [x for x in (*self.prev, self.best) if x is not None]
            meta = {"time_limit_s": int(max(1, round(self.solve_s))), "lds": 4,
                    "seed": self.seed + 1}
            x0, ub = self.pen.warm_start(unary, starts)
            if x0 is not None:
                arrays["best"] = x0
            if ub is not None:
                meta["ub"] = ub
            warm.append(x0)
            reqs.append(Request(arrays, meta, base=self.base_key,
                                base_arrays=self.pen.edge_arrays))
        return reqs, warm

    def _recombine(self, stop: float) -> None:
        """Recombines the answers so far (cheapest first) around the best feasible one."""
        self.ls.reset(self.best)
        self.recombine(self.ls, [z for _c, z in sorted(self.answers, key=lambda a: a[0])],
                       stop)
        self.counts["penalty_recombined"] += 1
        if self.ls.cost < self.cost:
            self._found(np.array(self.ls.s, np.int64), float(self.ls.cost), -2)

    def _take(self, xs: list[np.ndarray | None]) -> list[np.ndarray | None]:
        """Counts, logs and queues a round's answers; per level, the nodes whose live range
        overflowed (None where the level gave no answer)."""
        pen = self.pen
        broken: list[np.ndarray | None] = []
        for j, x in enumerate(xs):
            if x is None:
                broken.append(None)
                continue
            self.counts["penalty_solves"] += 1
            over = pen.usage(x) - self.red.cap
            br = pen.node_overflow(over)
            broken.append(br)
            allowed = pen.allowed(x)
            ok = not br.any() and bool(np.all(over <= 1e-9)) and allowed
            if self.log is not None:
                self.log.append((time.perf_counter(), j, ok,
                                 float(over.max()) if len(over) else 0.0, pen.real_cost(x)))
            if ok:
                self.counts["penalty_feasible"] += 1
                self.pending.append((x, True))
            elif allowed:
                self.pending.append((x, False))
            if self.answers is not None and allowed:
                self.answers.append((pen.real_cost(x), x))
        return broken

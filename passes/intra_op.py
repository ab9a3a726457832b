"""Intra-op pass: a sharding spec for every value of a program on one logical mesh.

`run(graph, mesh, ...)` builds a `ShardingProblem` (Alpa §4): one ILP node per group of
values that share a decision — an equation with enumerated strategies (dot, conv, gather,
program inputs, ...) plus the followers merged into it (elementwise, reshape, reductions,
...) — with per-strategy compute + communication seconds and bytes per device, and one
edge per pair of groups connected by an operand, carrying the resharding seconds.  The
solver picks one strategy per group; the result gives every value its spec.

Program inputs (parameters, optimizer state, batch) are nodes too, so sharding optimizer
state across the data-parallel axis (ZeRO) can come out of the search.  `ties` connect a
step's output to the input it replaces (new params → params): the program keeps the
input's spec for that output, and the edge prices the resharding that costs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from autopar.cost_model import collectives
from autopar.cost_model.units import format_bytes
from autopar.graph import Graph, Lit, Value, is_numeric

from . import fallbacks, primitives
from . import memory as mem
from . import strategies as st
from .sharding_spec import (
    COMBINE_BYTES,
    MeshContext,
    Spec,
    enumerate_specs,
    full_rematerialization,
    gather_first,
    is_slice,
    is_valid,
    replicated,
    reshard_s,
)
from .solver import DEFAULT_BACKEND, Backend, InfeasibleError, ShardingProblem, Solution, solve


class MemoryBudgetError(ValueError):
    """No sharding of the program fits the per-device memory budget."""

    def __init__(self, budget_bytes: float, smallest_bytes: float, mesh_shape: tuple[int, ...]):
        self.budget_bytes = budget_bytes
        self.smallest_bytes = smallest_bytes
        super().__init__(
            f"no plan fits {format_bytes(budget_bytes)} per device on logical mesh "
            f"{mesh_shape}: the smallest found needs {format_bytes(smallest_bytes)} "
            f"(raise memory_budget_bytes, use more devices, or shrink the model/batch)"
        )


@dataclasses.dataclass(frozen=True)
class IntraOpResult:
    """The pass's answer for one logical mesh.

    Attributes:
      mesh: the logical mesh.
      value_specs: spec of every value with a decision (inputs and equation outputs).
      out_specs: spec of every program output (tied outputs take their input's spec).
      cost_s: objective: predicted seconds per step (compute + communication).
      compute_s / comm_s: the two parts of `cost_s` (resharding counts as communication).
      memory_bytes: predicted peak bytes per device.
      solution: the solver's answer.
      stats: sizes before/after merging followers, seconds per phase.
      operand_specs: (equation, operand position, spec) where a matmul, convolution,
        gather or scatter reads an operand in another layout than the operand's own; the
        emitter pins these, so XLA reshards exactly as priced.
      memory: the `passes.memory` estimate behind `memory_bytes` (its terms).
      bucket_alpha_s: seconds of latency the combined reductions pay beyond what the
        objective prices: rules pro-rate α to a reduction's share of a `COMBINE_BYTES`
        bucket, but every bucket pays a whole α, so P lazily reduced bytes per device pay
        α·(⌈P/C⌉ − P/C) more.  Not in `cost_s`: a pipeline stage buckets the reductions of
        all its layers together; `step_s` adds it for a program run on its own.
    """

    mesh: MeshContext
    value_specs: Mapping[int, Spec]
    out_specs: tuple[Spec, ...]
    cost_s: float
    compute_s: float
    comm_s: float
    memory_bytes: float
    solution: Solution
    stats: dict
    operand_specs: tuple[tuple[int, int, Spec], ...] = ()
    memory: mem.MemoryEstimate | None = None
    bucket_alpha_s: float = 0.0

    @property
    def step_s(self) -> float:
        """Predicted seconds of the program run on its own: `cost_s` + `bucket_alpha_s`."""
        return self.cost_s + self.bucket_alpha_s


@dataclasses.dataclass
class _Group:
    """An ILP node under construction: values that share one decision."""

    num_strategies: int
    names: list[str]
    compute_s: np.ndarray
    comm_s: np.ndarray
    members: list[int] = dataclasses.field(default_factory=list)
    label: str = ""
    # (output value, bytes per device of its unreduced partial sum per strategy)
    partials: list[tuple[int, np.ndarray]] = dataclasses.field(default_factory=list)


def run(graph: Graph, mesh: MeshContext, **options: Any) -> IntraOpResult:
    """Chooses a spec for every value of `graph` on `mesh`: `start(graph, mesh,
    **options).result()` (the options are `start`'s)."""
    return start(graph, mesh, **options).result()


class Submit(Protocol):
    """Hands a problem to a solver that may run elsewhere (`autopar.solve_pool.SolvePool`):
    returns a future of `passes.solver.solve(problem, time_limit_s=, backend=)`."""

    def __call__(self, problem: ShardingProblem, *, time_limit_s: float,
                 backend: str) -> Future: ...


def start(graph: Graph, mesh: MeshContext, *,
          forced: Mapping[int, Spec] | None = None,
          ties: Sequence[tuple[int, int]] = (),
          memory_budget_bytes: float | None = None,
          batch_size: int | None = None,
          solver: Backend = DEFAULT_BACKEND,
          time_limit_s: float = 60.0,
          comm_scale: Mapping[int, float] | None = None,
          traffic: Mapping[int, float] | None = None,
          value_costs: Mapping[int, Callable[[Spec], float]] | None = None,
          submit: Submit | None = None,
          retry_time_limit_s: float | None = None,
          builds: BuildCache | None = None) -> PendingRun:
    """`run` in two halves: builds the problem now and, given `submit`, hands it to a
    solver running elsewhere; `.result()` waits for the answer and reads the plan off it
    (re-solving here with the memory rows if the answer does not fit the budget).

    Args:
      graph: the program.
      mesh: the logical mesh.
      forced: input value id → the only spec it may take (DataParallel, ZeRO, ...).
      ties: (output position, input value id) pairs: the output replaces that input.
      memory_budget_bytes: peak bytes per device the plan must fit, or None.
      batch_size: leading size of the batch inputs (helps opaque control flow).
      solver / time_limit_s: passed to `passes.solver.solve`.
      comm_scale: equation index → factor on the communication its strategies carry (e.g.
        1/B for the matmuls producing parameter gradients that are reduced once per B
        micro-batches).
      traffic: value id → device-memory bytes moved per byte of the value (at its chosen
        layout) by work outside the program that each run pays for — e.g. 3 for a
        parameter gradient added into an accumulator (read both, write the sum) — priced
        at the mesh's memory bandwidth on the value's producer.
      value_costs: value id → seconds each run pays, as a function of the value's spec,
        for work outside the program (e.g. a parameter's all-gather after an update on
        its ZeRO split, amortized over the micro-batches).
      submit: where to solve (default: here, when `.result()` is called).
      retry_time_limit_s: with a short `time_limit_s`, the limit of one more solve when the
        first answer is not known to be within RETRY_GAP of the optimum (`unproven`): the
        exact solver had no time for it, as on a loaded machine.
      builds: where to keep the built problem for later calls on the same graph and mesh
        that differ only in `traffic` and `value_costs` (`BuildCache`).
    """
    t0 = time.perf_counter()
    builder = (builds.builder(graph, mesh, forced, ties, batch_size, comm_scale)
               if builds is not None else _built(graph, mesh, forced, ties, batch_size,
                                                 comm_scale))
    builder.add_traffic(traffic or {})
    builder.add_value_costs(value_costs or {})
    # Solve without the memory rows first: most plans fit, and the unconstrained problem
    # reduces much further (memory-free leaves and chains are eliminated exactly).
    problem = builder.problem(None)
    t_build = time.perf_counter() - t0
    future = (submit(problem, time_limit_s=time_limit_s, backend=solver)
              if submit is not None else None)
    run = PendingRun(graph, mesh, builder, problem, future, t_build, tuple(ties),
                     memory_budget_bytes, solver, time_limit_s, submit, retry_time_limit_s)
    if future is not None and retry_time_limit_s is not None \
            and retry_time_limit_s > time_limit_s:
        # The retry is handed over as soon as the first answer is known to need it, not
        # when `.result()` is asked: the pool solves it while the caller builds.
        future.add_done_callback(run._retry_early)
    return run


@dataclasses.dataclass
class PendingRun:
    """An intra-op problem built and (maybe) being solved elsewhere; see `start`."""

    graph: Graph
    mesh: MeshContext
    builder: _ProblemBuilder
    problem: ShardingProblem
    future: Future | None
    build_s: float
    ties: tuple[tuple[int, int], ...]
    memory_budget_bytes: float | None
    solver: Backend
    time_limit_s: float
    submit: Submit | None = None
    retry_time_limit_s: float | None = None
    # The retry's future once handed over (`_retry`), under `_lock` (the pool's thread may
    # hand it over when the first answer arrives).
    _retried: Future | None = dataclasses.field(default=None, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def _retry(self) -> Future:
        """The future of the longer solve, handed to `submit` once."""
        assert self.submit is not None and self.retry_time_limit_s is not None
        with self._lock:
            if self._retried is None:
                self._retried = self.submit(self.problem, time_limit_s=self.retry_time_limit_s,
                                            backend=self.solver)
            return self._retried

    def _retry_early(self, first: Future) -> None:
        """Done-callback of the first solve: hands over the retry at once if it needs one."""
        if not first.cancelled() and first.exception() is None \
                and unproven(first.result()):
            self._retry()

    def result(self) -> IntraOpResult:
        graph, mesh, builder, problem = self.graph, self.mesh, self.builder, self.problem
        solver, time_limit_s = self.solver, self.time_limit_s
        memory_budget_bytes = self.memory_budget_bytes
        solution = (self.future.result() if self.future is not None else
                    solve(problem, time_limit_s=time_limit_s, backend=solver))
        retry = self.retry_time_limit_s
        if retry is not None and retry > time_limit_s and unproven(solution):
            again = (self._retry().result() if self.submit is not None else
                     solve(problem, time_limit_s=retry, backend=solver))
            if again.feasible and (not solution.feasible or again.cost <= solution.cost):
                again.stats["retried_after"] = solution.status
                solution = again
        return _finish(graph, mesh, builder, problem, solution, self.build_s, self.ties,
                       memory_budget_bytes, solver, time_limit_s)


RETRY_GAP = 0.01
"""`unproven`: the relative gap between an answer's cost and its lower bound above which a
short solve is worth repeating with more time."""


def unproven(solution: Solution) -> bool:
    """Whether `solution` may be more than RETRY_GAP above the optimum: the heuristic's
    answer (the exact solver found nothing in time), or an exact solver's answer whose lower
    bound is unknown or further than that below it."""
    if solution.status == "optimal":
        return False
    if solution.status == "fallback" or solution.lower_bound is None:
        return True
    return solution.cost - solution.lower_bound > RETRY_GAP * abs(solution.cost)


def _finish(graph: Graph, mesh: MeshContext, builder: _ProblemBuilder,
            problem: ShardingProblem, solution: Solution, t_build: float,
            ties: Sequence[tuple[int, int]], memory_budget_bytes: float | None,
            solver: Backend, time_limit_s: float) -> IntraOpResult:
    """The plan read off `solution` (re-solved under scaled memory caps until the memory
    model's estimate fits `memory_budget_bytes`: `fit_budget`)."""
    estimate = builder.estimate(solution.strategies)
    memory_bound = False
    solves = 1
    if memory_budget_bytes is not None and estimate.peak_bytes > memory_budget_bytes:
        memory_bound = True
        fitted = fit_budget(builder, float(memory_budget_bytes), solution, estimate,
                            solver=solver, time_limit_s=time_limit_s)
        solves += fitted.solves
        if fitted.solution is None:
            raise MemoryBudgetError(float(memory_budget_bytes),
                                    fitted.smallest.peak_bytes, mesh.shape)
        solution, estimate = fitted.solution, fitted.estimate
    return _result(builder, solution, estimate, ties, {
        "build_s": t_build, "memory_bound": memory_bound, "memory_solves": solves})


def _result(builder: _ProblemBuilder, solution: Solution, estimate: mem.MemoryEstimate,
            ties: Sequence[tuple[int, int]], extra: dict) -> IntraOpResult:
    """The pass's answer for one solution of `builder`'s problem."""
    graph = builder.graph
    mesh = builder.mesh
    problem_nodes = len(builder.groups)
    choice = solution.strategies
    value_specs = {vid: builder.specs[vid][choice[g]] for vid, g in builder.group_of.items()}
    operand_specs = {
        (eqn, k): req[choice[g]] for eqn, k, vid, g, req in builder.operand_requirements
        if req[choice[g]] is not None and req[choice[g]] != value_specs[vid]}
    # Other reads in another layout are pinned too where XLA would not move them as priced:
    # a split moved between dims with several axes involved (routed by the emitter through
    # `gather_first`; XLA would replicate), and a read that an equation broadcasts to more
    # elements (XLA would compute the broadcast's consumers in the small operand's layout
    # and move the large result: a [B,1,1,S] mask bias added to [B,h,S,S] scores).
    for eqn, k, vid, g, req in builder.requirements:
        want, have = req[choice[g]], value_specs[vid]
        if want is not None and k >= 0 and want != have and (
                full_rematerialization(have, want) or _broadcasts(graph, eqn, vid)):
            operand_specs.setdefault((eqn, k), want)
    operand_specs = tuple((e, k, sp) for (e, k), sp in sorted(operand_specs.items()))
    out_specs = []
    tied = dict(ties)
    for pos, op in enumerate(graph.outvars):
        if pos in tied and tied[pos] in value_specs:
            out_specs.append(value_specs[tied[pos]])
        elif isinstance(op, int) and op in value_specs:
            out_specs.append(value_specs[op])
        else:
            shape = op.shape if isinstance(op, Lit) else graph.values[op].shape
            out_specs.append(replicated(len(shape)))
    compute = float(sum(g.compute_s[choice[i]] for i, g in enumerate(builder.groups)))
    stats = {
        "values_with_decision": len(builder.group_of),
        "nodes_before_merge": builder.nodes_before_merge,
        "nodes_after_merge": problem_nodes,
        "edges": len(builder.edges),
        "strategies": int(sum(g.num_strategies for g in builder.groups)),
        **extra,
        "solve_s": solution.seconds,
        "solver_status": solution.status,
        "solver": dict(solution.stats),
        "memory": estimate.to_json(),
    }
    return IntraOpResult(mesh, value_specs, tuple(out_specs), float(solution.cost), compute,
                         float(solution.cost) - compute, estimate.peak_bytes, solution, stats,
                         operand_specs, estimate, _bucket_alpha_s(builder, choice))


def _bucket_alpha_s(builder: _ProblemBuilder, choice: Sequence[int]) -> float:
    """`IntraOpResult.bucket_alpha_s` of the solution `choice`: the α the last, partly
    filled bucket of the lazily reduced (combined) partial sums pays beyond its pro-rated
    share, on the slowest link of the mesh's split axes."""
    lazy = sum(float(p[choice[g]]) for g, grp in enumerate(builder.groups)
               for vid, p in grp.partials if not builder.buffers.urgent[vid])
    axes = tuple(a for a in builder.mesh.axes if builder.mesh.size(a) > 1)
    if lazy <= 0 or not axes:
        return 0.0
    buckets = lazy / COMBINE_BYTES
    return builder.mesh.group_link(axes).alpha_s * (math.ceil(buckets) - buckets)


def _broadcasts(graph: Graph, eqn: int, vid: int) -> bool:
    """Equation `eqn` writes more elements than it reads from value `vid`."""
    e = graph.eqns[eqn]
    return any(graph.values[o].size > graph.values[vid].size for o in e.outputs)


@dataclasses.dataclass(frozen=True)
class Fitted:
    """`fit_budget`'s answer: the cheapest solution found whose estimate fits (None if
    none), the smallest estimate seen, and the number of solves."""

    solution: Solution | None
    estimate: mem.MemoryEstimate | None
    smallest: mem.MemoryEstimate
    solves: int


# Solves `fit_budget` may spend looking for a plan under a memory budget.
MAX_BUDGET_SOLVES = 6


def fit_budget(builder: _ProblemBuilder, budget_bytes: float, unconstrained: Solution,
               unconstrained_estimate: mem.MemoryEstimate, *, solver: Backend,
               time_limit_s: float, max_solves: int = MAX_BUDGET_SOLVES) -> Fitted:
    """The cheapest layout whose `passes.memory` estimate fits `budget_bytes`.

    The ILP's memory rows bound each group's buffers over the group's whole interval and
    cannot see resharded copies, so its usage is not the estimate: the usage limit given
    to the ILP (the cap) is scaled by the ratio of the two on the last solution and
    corrected until the estimate fits, then bisected towards a faster plan that still fits.
    """
    base = builder.problem(None)
    best: tuple[Solution, mem.MemoryEstimate] | None = None
    smallest = unconstrained_estimate
    fits_cap: float | None = None      # largest cap whose solution fits
    over_cap: float | None = None      # smallest cap whose solution does not fit
    floor: float | None = None         # the ILP's least possible usage (at the cap floor)
    ratio = _peak_memory(base, unconstrained.strategies) / max(
        unconstrained_estimate.peak_bytes, 1.0)
    cap = budget_bytes * ratio
    solves = 0
    while solves < max_solves:
        if floor is not None:
            cap = max(cap, floor)
        solves += 1
        try:
            sol = solve(builder.problem(cap), time_limit_s=time_limit_s, backend=solver)
        except InfeasibleError as err:
            if floor is not None:
                break
            floor = err.smallest_peak_usage * (1 + 1e-9)
            over_cap = cap if over_cap is None else min(over_cap, cap)
            cap = floor
            continue
        est = builder.estimate(sol.strategies)
        if est.peak_bytes < smallest.peak_bytes:
            smallest = est
        if est.peak_bytes <= budget_bytes:
            if best is None or sol.cost < best[0].cost:
                best = (sol, est)
            fits_cap = cap if fits_cap is None else max(fits_cap, cap)
            if sol.cost <= unconstrained.cost * (1 + 1e-9):
                break
            if over_cap is None:
                if est.peak_bytes > 0.95 * budget_bytes:
                    break
                cap *= budget_bytes / est.peak_bytes  # room left: try a faster plan
                continue
        else:
            over_cap = cap if over_cap is None else min(over_cap, cap)
            if fits_cap is None:
                if floor is not None and cap <= floor:
                    break
                cap *= 0.98 * budget_bytes / est.peak_bytes
                continue
        if over_cap / fits_cap < 1.05:
            break
        cap = math.sqrt(fits_cap * over_cap)
    if best is None:
        return Fitted(None, None, smallest, solves)
    return Fitted(best[0], best[1], smallest, solves)


class BuildCache:
    """Built problems (`start` before `traffic` and `value_costs`) kept for reuse.

    A stage search prices each layer on each sub-mesh twice, time-optimal and memory-lean
    (`autopar.pipeline_search`): the two problems differ only in the parameters' value
    costs, so the second call copies the first one's groups instead of enumerating every
    equation's strategies again; and every mesh's problem of one graph shares one buffer
    analysis (`memory.analyze`).  Entries match on the graph object (identity), the mesh
    (equality) and the other build inputs; the cache lives as long as its owner (one
    search).
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, list[tuple[Graph, MeshContext, _ProblemBuilder]]] = {}
        self._buffers: dict[tuple[int, bool], tuple[Graph, mem.BufferInfo]] = {}
        # Per logical mesh: the dot strategies every build on it has enumerated
        # (`_ProblemBuilder.dot_strategies`), shared by the layers of one search.
        self._dots: dict[tuple[int, ...], list[tuple[MeshContext, dict]]] = {}
        self.hits = 0

    def builder(self, graph: Graph, mesh: MeshContext, forced: Mapping[int, Spec] | None,
                ties: Sequence[tuple[int, int]], batch_size: int | None,
                comm_scale: Mapping[int, float] | None) -> _ProblemBuilder:
        """A fresh copy of `_built(...)` for these inputs, built on the first call."""
        key = (id(graph), mesh.shape, tuple(sorted((forced or {}).items())),
               tuple(map(tuple, ties)), batch_size, tuple(sorted((comm_scale or {}).items())))
        entries = self._entries.setdefault(key, [])
        for g, m, base in entries:
            if g is graph and m == mesh:
                self.hits += 1
                return base.fork()
        # The buffer analysis reads the graph and the device kind only: one per graph and
        # kind, whatever the mesh's shape.
        bkey = (id(graph), _cpu_buffers(mesh))
        found = self._buffers.get(bkey)
        shared = found[1] if found is not None and found[0] is graph else None
        dots = self._dots.setdefault(mesh.shape, [])
        memo = next((d for m, d in dots if m == mesh), None)
        if memo is None:
            memo = {}
            dots.append((mesh, memo))
        base = _built(graph, mesh, forced, ties, batch_size, comm_scale, buffers=shared,
                      dots=memo)
        if shared is None:
            self._buffers[bkey] = (graph, base.buffers)
        entries.append((graph, mesh, base))
        return base.fork()


def _cpu_buffers(mesh: MeshContext) -> bool:
    """`memory.analyze`'s `cpu` argument for a problem on `mesh` (and BuildCache's key for
    sharing that analysis)."""
    return mesh.backend == "cpu"


def _scatter_as_all_reduce(mesh: MeshContext) -> bool:
    """Whether `mesh`'s backend runs a reduce-scatter as an all-reduce and a slice
    (`collectives.LOWERINGS`): its result then keeps the unscattered size in memory."""
    return collectives.lowered_kind("reduce-scatter", mesh.backend) == "all-reduce"


def _built(graph: Graph, mesh: MeshContext, forced: Mapping[int, Spec] | None,
           ties: Sequence[tuple[int, int]], batch_size: int | None,
           comm_scale: Mapping[int, float] | None = None,
           buffers: mem.BufferInfo | None = None,
           dots: dict | None = None) -> _ProblemBuilder:
    """The problem builder with every group and edge, ties included (`buffers`: the
    graph's `memory.analyze`, when the caller has it; `dots`: a dot-strategy memo shared
    with other builds on the same mesh, `_ProblemBuilder.dot_strategies`)."""
    builder = _ProblemBuilder(graph, mesh, dict(forced or {}), batch_size, comm_scale, buffers,
                              dots)
    builder.build()
    for pos, in_vid in ties:
        out = graph.outvars[pos]
        if isinstance(out, int) and graph.values[out].producer is not None:
            builder.aliased.add(out)
            builder.tie_pairs.append((out, in_vid))
        if isinstance(out, int) and out in builder.group_of and in_vid in builder.group_of:
            builder.require(out, in_vid, builder.specs[in_vid])
    return builder


def _peak_memory(problem: ShardingProblem, choice: Sequence[int]) -> float:
    if problem.num_nodes == 0:
        return 0.0
    horizon = int(problem.intervals[:, 1].max()) + 1
    usage = np.zeros(horizon + 1)
    for v, (s, e) in enumerate(problem.intervals):
        if e > s:
            usage[s] += problem.node_usages[v][choice[v]]
            usage[e] -= problem.node_usages[v][choice[v]]
    return float(np.cumsum(usage).max())


class _ProblemBuilder:
    def __init__(self, graph: Graph, mesh: MeshContext, forced: dict[int, Spec],
                 batch_size: int | None, comm_scale: Mapping[int, float] | None = None,
                 buffers: mem.BufferInfo | None = None, dots: dict | None = None):
        self.graph = graph
        self.mesh = mesh
        self.forced = forced
        self.batch_size = batch_size
        self.comm_scale = dict(comm_scale or {})
        self.groups: list[_Group] = []
        self.group_of: dict[int, int] = {}          # value id → group
        self.specs: dict[int, list[Spec]] = {}       # value id → spec per group strategy
        self.fixed: set[int] = set()                 # values with no decision (replicated)
        self.from_broadcast: set[int] = set()
        self.edges: dict[tuple[int, int], np.ndarray] = {}
        self.nodes_before_merge = 0
        # Memo tables: a group's strategies give its values few distinct specs, so pricing
        # per distinct spec (pair) instead of per strategy (pair) is exact and much faster.
        self._reshard: dict[tuple[Spec, Spec, float], float] = {}
        self._valid: dict[tuple[Spec, tuple[int, ...]], bool] = {}
        # (equation, operand position, value, group, spec per strategy) of enumerated
        # equations: the layouts their chosen strategy reads its operands in.
        self.operand_requirements: list[tuple[int, int, int, int, list]] = []
        # (equation, operand position, operand value, consumer group, spec per strategy)
        # of every operand.
        self.requirements: list[tuple[int, int, int, int, list]] = []
        self._buffers = buffers  # memory.analyze(graph), computed when first asked
        self._dots = {} if dots is None else dots  # see `dot_strategies`
        self._follows: dict[tuple, dict] = {}  # see `add_follower`
        self._tables: dict[tuple, np.ndarray] = {}  # see `require`
        # Answers these three memos gave instead of computing them again (`MEMOIZE`).
        self.memo_hits = {"dot": 0, "follow": 0, "table": 0}
        self.aliased: set[int] = set()   # outputs written into their donated input
        self.tie_pairs: list[tuple[int, int]] = []  # (output value, input value it replaces)

    def fork(self) -> _ProblemBuilder:
        """A copy that `add_traffic` / `add_value_costs` can change without touching this
        one (the groups' compute costs are copied; everything else, fixed once built, is
        shared)."""
        out = copy.copy(self)
        out.groups = [dataclasses.replace(g, compute_s=g.compute_s.copy()) for g in self.groups]
        return out

    # -- groups -----------------------------------------------------------------------------

    def new_group(self, names: list[str], compute_s: Sequence[float],
                  comm_s: Sequence[float], label: str) -> int:
        self.groups.append(_Group(len(names), names, np.asarray(compute_s, dtype=np.float64),
                                  np.asarray(comm_s, dtype=np.float64), label=label))
        self.nodes_before_merge += 1
        return len(self.groups) - 1

    def add_member(self, gid: int, vid: int, specs: list[Spec]) -> None:
        value = self.graph.values[vid]
        fixed_specs = [s if self._is_valid(s, value.shape) else replicated(value.ndim)
                       for s in specs]
        self.group_of[vid] = gid
        self.specs[vid] = fixed_specs
        self.groups[gid].members.append(vid)

    def _is_valid(self, spec: Spec, shape: tuple[int, ...]) -> bool:
        key = (spec, shape)
        ok = self._valid.get(key)
        if ok is None:
            ok = self._valid[key] = is_valid(spec, shape, self.mesh)
        return ok

    def reshard_cost(self, a: Spec, b: Spec | None, nbytes: float) -> float:
        """`reshard_s(a, b, nbytes)`, memoized (0 when `b` is None: any layout)."""
        if b is None or a == b:
            return 0.0
        key = (a, b, nbytes)
        cost = self._reshard.get(key)
        if cost is None:
            cost = self._reshard[key] = reshard_s(a, b, nbytes, self.mesh)
        return cost

    def require(self, vid: int, consumer_vid_or_gid: int, required: Sequence[Spec | None],
                *, consumer_is_group: bool = False, eqn: int | None = None,
                position: int = -1) -> None:
        """Operand `vid` must arrive in `required[j]` when the consumer's group picks j
        (`eqn`, `position`: the consuming equation and operand, where the resharded copy is
        made)."""
        gv = consumer_vid_or_gid if consumer_is_group else self.group_of[consumer_vid_or_gid]
        if eqn is not None:
            self.requirements.append((eqn, position, vid, gv, list(required)))
        gu = self.group_of[vid]
        nbytes = self.graph.values[vid].nbytes
        src_index, src_specs = _distinct(self.specs[vid])
        req_index, req_specs = _distinct(required)
        tkey = (nbytes, tuple(src_specs), tuple(req_specs))
        table = self._tables.get(tkey) if MEMOIZE else None
        if table is None:
            table = np.array(
                [[self.reshard_cost(a, b, nbytes) for b in req_specs] for a in src_specs],
                dtype=np.float64).reshape(len(src_specs), len(req_specs))
            if MEMOIZE:
                self._tables[tkey] = table
        else:
            self.memo_hits["table"] += 1
        if gu == gv:
            g = self.groups[gu]
            g.comm_s += table[src_index, req_index]
            return
        mat = table[src_index[:, None], req_index[None, :]]
        key = (gu, gv)
        self.edges[key] = self.edges[key] + mat if key in self.edges else mat

    # -- building ---------------------------------------------------------------------------

    def build(self) -> None:
        graph = self.graph
        for v in graph.values:
            if v.const_index is not None:
                self.fixed.add(v.id)
        for vid in graph.invars:
            self.add_input(graph.values[vid])
        for eqn in graph.eqns:
            rule = st.strategy_rules.get(eqn.name)
            operand_ids = [op for op in eqn.inputs if isinstance(op, int)]
            if all(op in self.fixed for op in operand_ids) and (
                    rule is None and primitives.info(eqn.name).source or
                    rule is not None and rule.kind == "follow"):
                self.fixed.update(eqn.outputs)
                continue
            if rule is None:
                rule = st.rule_for(eqn.name, eqn.where())
            info = self.info(eqn)
            lead = rule.leader(info) if rule is not None and rule.kind == "follow" else None
            if rule is not None and rule.kind == "follow" and lead is not None:
                self.add_follower(info, rule, lead)
            else:
                self.add_enumerated(info, rule)
            if eqn.name == "broadcast_in_dim":
                self.from_broadcast.update(eqn.outputs)

    def info(self, eqn) -> st.EqnInfo:
        vals = self.graph.values
        in_shapes, in_bytes, fixed, bcast = [], [], [], []
        for op in eqn.inputs:
            if isinstance(op, Lit):
                in_shapes.append(tuple(op.shape))
                in_bytes.append(0.0)
                fixed.append(True)
                bcast.append(False)
            else:
                in_shapes.append(vals[op].shape)
                in_bytes.append(float(vals[op].nbytes))
                fixed.append(op in self.fixed)
                bcast.append(op in self.from_broadcast)
        outs = [vals[o] for o in eqn.outputs]
        return st.EqnInfo(eqn, tuple(in_shapes), tuple(o.shape for o in outs),
                          tuple(in_bytes), tuple(float(o.nbytes) for o in outs), tuple(fixed),
                          tuple(bcast), self.batch_size,
                          eqn_out_dtype=outs[0].dtype if outs else np.float32,
                          fused_bytes=float(self.buffers.eqn_bytes[eqn.index]))

    def add_input(self, value: Value) -> None:
        if value.id in self.forced:
            specs = [self.forced[value.id]]
        elif not is_numeric(value.dtype):
            specs = [replicated(value.ndim)]
        else:
            specs = list(enumerate_specs(value.shape, self.mesh))
        names = [f"input {s}" for s in specs]
        gid = self.new_group(names, [0.0] * len(specs), [0.0] * len(specs),
                             f"input {value.input_index} {value.shape}")
        self.add_member(gid, value.id, specs)

    def add_follower(self, info: st.EqnInfo, rule: st.StrategyRule, lead: int) -> None:
        eqn = info.eqn
        lead_vid = eqn.inputs[lead]
        gid = self.group_of[lead_vid]
        group = self.groups[gid]
        lead_specs = self.specs[lead_vid]
        self.nodes_before_merge += 1
        out_specs: list[list[Spec]] = [[] for _ in eqn.outputs]
        in_specs: list[list[Spec | None]] = [[] for _ in eqn.inputs]
        compute, comm = np.zeros(group.num_strategies), np.zeros(group.num_strategies)
        # The rule's answer depends only on the leader's spec: once per distinct spec, and
        # for the table's own rules once per equation signature (`_follow_key`: repeated
        # blocks of a model repeat their equations).
        key = _follow_key(info, rule, lead) if MEMOIZE else None
        shared: dict[Spec, tuple[st.FollowResult, float]] = (
            {} if key is None else self._follows.setdefault(key, {}))
        done: dict[Spec, tuple[st.FollowResult, float]] = {}
        for i in range(group.num_strategies):
            hit = done.get(lead_specs[i])
            if hit is None and lead_specs[i] in shared:
                hit = shared[lead_specs[i]]
                self.memo_hits["follow"] += 1
            if hit is None:
                try:
                    res = rule.follow(info, lead, lead_specs[i], self.mesh)
                    ok = True
                except Exception:  # reported, with this equation's line, by _safe_follow
                    res, ok = _safe_follow(rule, info, lead, lead_specs[i], self.mesh), False
                shards = self.mesh.shards(res.out_specs[0]) if res.out_specs else 1
                hit = (res, st.compute_s(info, shards, self.mesh))
                if ok:
                    shared[lead_specs[i]] = hit
            done[lead_specs[i]] = hit
            res, compute[i] = hit
            for k, s in enumerate(res.out_specs):
                out_specs[k].append(s)
            for k, s in enumerate(res.in_specs):
                in_specs[k].append(s)
            comm[i] = res.comm_s
        group.compute_s += compute
        group.comm_s += comm
        for k, vid in enumerate(eqn.outputs):
            self.add_member(gid, vid, out_specs[k])
        for k, op in enumerate(eqn.inputs):
            # The leader's own re-layout (dropped axes) is priced by the rule's comm_s.
            if k != lead and isinstance(op, int) and op not in self.fixed:
                self.require(op, gid, in_specs[k], consumer_is_group=True, eqn=eqn.index,
                             position=k)

    def add_enumerated(self, info: st.EqnInfo, rule: st.StrategyRule | None) -> None:
        eqn = info.eqn
        strategies: list[st.Strategy] = []
        if rule is not None and rule.kind == "enumerate":
            try:
                strategies = (self.dot_strategies(info) if rule.enumerate is st.enumerate_dot
                              else rule.enumerate(info, self.mesh))
            except Exception as err:  # a rule bug must never break planning
                fallbacks.report("intra-op", f"the strategy rule for {eqn.name!r} raised "
                                 f"{type(err).__name__}: {err}; replicated", eqn.where())
        if not strategies:
            strategies = [st.replicated_strategy(info, self.mesh)]
        strategies = _dedupe(strategies)
        scale = self.comm_scale.get(eqn.index, 1.0)
        comm = [s.comm_s * scale + self.uncombined_alpha_s(eqn, s) for s in strategies]
        gid = self.new_group([s.name for s in strategies], [s.compute_s for s in strategies],
                             comm, f"{eqn.name} @ {eqn.where()}")
        for k, vid in enumerate(eqn.outputs):
            self.add_member(gid, vid, [s.out_specs[k] for s in strategies])
        partial = np.array([s.partial_bytes for s in strategies])
        if eqn.outputs and partial.any():
            self.groups[gid].partials.append((eqn.outputs[0], partial))
        for k, op in enumerate(eqn.inputs):
            if isinstance(op, int) and op not in self.fixed:
                required = [s.in_specs[k] for s in strategies]
                self.require(op, gid, required, consumer_is_group=True, eqn=eqn.index,
                             position=k)
                self.operand_requirements.append((eqn.index, k, op, gid, required))

    def dot_strategies(self, info: st.EqnInfo) -> list[st.Strategy]:
        """`enumerate_dot(info, mesh)`, memoized on everything it reads (dimension numbers,
        shapes, bytes, FLOPs, output dtype; the mesh is the builder's): a transformer's
        blocks repeat the same matmuls, within a layer and across the layers of a search
        (GPT-39B: a quarter of the layer-ILP build time went to enumerating them again)."""
        eqn = info.eqn
        key = (info.params["dimension_numbers"], info.in_shapes, info.out_shapes,
               info.in_nbytes, info.out_nbytes, eqn.flops, eqn.bytes_accessed,
               info.fused_bytes, info.eqn_out_dtype)
        found = self._dots.get(key) if MEMOIZE else None
        if found is None:
            found = st.enumerate_dot(info, self.mesh)
            if MEMOIZE:
                self._dots[key] = found
        else:
            self.memo_hits["dot"] += 1
        return list(found)

    def uncombined_alpha_s(self, eqn, strategy: st.Strategy) -> float:
        """The latency a partial-sum reduction pays beyond its share of a combined bucket
        when the critical path waits for it (an activation's reduction is not combined with
        others, passes/memory.py `urgent`): rules price α pro-rated to a 30 MiB bucket."""
        if not strategy.partial_axes or not eqn.outputs:
            return 0.0
        if not self.buffers.urgent[eqn.outputs[0]]:
            return 0.0
        link = self.mesh.group_link(strategy.partial_axes)
        return link.alpha_s * max(0.0, 1.0 - strategy.partial_bytes / COMBINE_BYTES)

    def add_traffic(self, traffic: Mapping[int, float]) -> None:
        """`start`'s `traffic`: each value's extra memory traffic, per strategy of its group
        (a value without a decision is replicated: the same cost for every plan)."""
        bandwidth = self.mesh.cluster.memory_bandwidth_bytes_per_s

        def cost(factor: float, nbytes: float) -> Callable[[Spec], float]:
            return lambda spec: factor * nbytes / self.mesh.shards(spec) / bandwidth

        self.add_value_costs({vid: cost(factor, self.graph.values[vid].nbytes)
                              for vid, factor in traffic.items()})

    def add_value_costs(self, costs: Mapping[int, Callable[[Spec], float]]) -> None:
        """`start`'s `value_costs`: seconds per strategy of the value's group (a value
        without a decision is replicated: the same cost for every plan)."""
        for vid, fn in costs.items():
            gid = self.group_of.get(vid)
            if gid is None:
                continue
            self.groups[gid].compute_s += np.array([fn(spec) for spec in self.specs[vid]])

    # -- the problem ------------------------------------------------------------------------

    @property
    def buffers(self) -> mem.BufferInfo:
        if self._buffers is None:
            self._buffers = mem.analyze(self.graph, cpu=_cpu_buffers(self.mesh))
        return self._buffers

    def problem(self, memory_budget_bytes: float | None) -> ShardingProblem:
        costs, usages, intervals, names = [], [], [], []
        members_by_group: dict[int, list[int]] = defaultdict(list)
        for vid, gid in self.group_of.items():
            members_by_group[gid].append(vid)
        for gid, g in enumerate(self.groups):
            members = members_by_group[gid]
            costs.append(g.compute_s + g.comm_s)
            usage, interval = self.group_usage(members, g)
            usages.append(usage)
            intervals.append(interval)
            names.append(g.label)
        edges = list(self.edges)
        return ShardingProblem(
            node_costs=tuple(costs),
            node_usages=tuple(usages),
            intervals=np.array(intervals, dtype=np.int64).reshape(-1, 2),
            edges=np.array(edges, dtype=np.int64).reshape(-1, 2),
            edge_costs=tuple(self.edges[e] for e in edges),
            usage_limit=memory_budget_bytes,
            node_names=tuple(names),
            name="intra-op",
        )

    def group_usage(self, members: list[int], group: _Group
                    ) -> tuple[np.ndarray, tuple[int, int]]:
        """Peak bytes per device of the group's buffers (passes/memory.py: materialized
        members over their fused liveness, inputs over the whole step, outputs aliased to a
        donated input excluded, unreduced partial sums), per strategy, and the interval
        covering them (a bound on the group's footprint at any time of it)."""
        num = group.num_strategies
        info = self.buffers
        vals = self.graph.values
        rows, spans = [], []
        for v in members:
            if not info.materialized[v] or v in self.aliased:
                continue
            index, distinct = _distinct(self.specs[v])
            shards = np.array([self.mesh.shards(sp) for sp in distinct], dtype=np.float64)
            rows.append(float(vals[v].nbytes) / shards[index])
            spans.append((int(info.start[v]), max(int(info.end[v]), int(info.start[v]) + 1)))
        for v, partial in group.partials:
            s0 = int(info.start[v])
            rows.append(np.asarray(partial, dtype=np.float64))
            spans.append((s0, s0 + 1))
        if not rows:
            return np.zeros(num), (0, 0)
        per = np.array(rows)
        sp = np.array(spans, dtype=np.int64)
        starts = np.unique(sp[:, 0])
        alive = (sp[:, 0][None, :] <= starts[:, None]) & (starts[:, None] < sp[:, 1][None, :])
        usage = (alive.astype(np.float64) @ per).max(axis=0)
        return usage, (int(sp[:, 0].min()), int(sp[:, 1].max()))

    def estimate(self, choice: Sequence[int]) -> mem.MemoryEstimate:
        """`passes.memory.estimate` of the layout the strategies `choice` give."""
        return mem.estimate(self.graph, self.buffers, **self.layout_terms(choice))

    def layout_terms(self, choice: Sequence[int]) -> dict:
        """The layout-dependent arguments of `passes.memory.estimate` for `choice`."""
        graph = self.graph
        info = self.buffers
        spec_of = {vid: self.specs[vid][choice[g]] for vid, g in self.group_of.items()}

        def value_bytes(vid: int) -> float:
            spec = spec_of.get(vid)
            return graph.values[vid].nbytes / (self.mesh.shards(spec) if spec else 1)

        partial = {}
        for gid, g in enumerate(self.groups):
            for vid, per in g.partials:
                if per[choice[gid]] > 0:
                    partial[vid] = float(per[choice[gid]])
        reshards = []
        for eqn, _, vid, gid, required in self.requirements:
            want = required[choice[gid]]
            have = spec_of.get(vid)
            if want is None or have is None or want == have:
                continue
            sliced = is_slice(have, want)
            if sliced and primitives.info(graph.eqns[eqn].name).reads_fused:
                continue  # the slice is fused into the reader, which reads the whole value
            # A move XLA would do by replicating is routed through the gathered layout
            # (`gather_first`): that copy for one step, then the target's until the last
            # read.  One-axis moves are all-to-alls straight into the target.
            nbytes = graph.values[vid].nbytes
            gathered = nbytes / self.mesh.shards(gather_first(have, want)) \
                if full_rematerialization(have, want) else 0.0
            reshards.append(mem.Reshard(vid, want, nbytes / self.mesh.shards(want),
                                        int(info.runs_at[eqn]), eqn=eqn, slice=sliced,
                                        gathered=gathered))
        for out, inp in self.tie_pairs:
            want, have = spec_of.get(inp), spec_of.get(out)
            if want is None or have is None or want == have or is_slice(have, want):
                continue
            reshards.append(mem.Reshard(out, want, graph.values[out].nbytes
                                        / self.mesh.shards(want), int(info.start[out]),
                                        until=info.horizon))
        return dict(value_bytes=value_bytes, aliased=self.aliased, partial=partial,
                    reshards=reshards,
                    scatter_as_all_reduce=_scatter_as_all_reduce(self.mesh))


def _distinct(specs: Sequence[Spec | None]) -> tuple[np.ndarray, list[Spec | None]]:
    """(index of each entry in the distinct list, the distinct specs in first-seen order)."""
    index: dict[Spec | None, int] = {}
    out = np.fromiter((index.setdefault(s, len(index)) for s in specs), dtype=np.int64,
                      count=len(specs))
    return out, list(index)


def _dedupe(strategies: list[st.Strategy]) -> list[st.Strategy]:
    """One strategy per (output specs, input specs): the cheapest (exact: the rest of the
    problem only sees the specs)."""
    best: dict[tuple, st.Strategy] = {}
    for s in strategies:
        key = (s.out_specs, s.in_specs)
        if key not in best or s.compute_s + s.comm_s < best[key].compute_s + best[key].comm_s:
            best[key] = s
    return list(best.values())


# Whether problem builds reuse the strategies and resharding tables of equal equations
# (`_ProblemBuilder.dot_strategies`, `add_follower`, `require`): exact, as the keys hold all
# the rules read; False rebuilds every one (the tests' reference).
MEMOIZE = True

# Follow rules that read only the equation's name, params, shapes and bytes (`_follow_key`).
_PURE_FOLLOWS = frozenset({st.follow_elementwise, st.follow_reduce, st.follow_transpose,
                           st.follow_squeeze, st.follow_broadcast, st.follow_reshape})


def _follow_key(info: st.EqnInfo, rule: st.StrategyRule, lead: int) -> tuple | None:
    """Everything a pure follow rule and `st.compute_s` read of `info` (None: not a pure
    rule, or params that do not hash): equations with equal keys follow alike."""
    if rule.follow not in _PURE_FOLLOWS:
        return None
    eqn = info.eqn
    key = (rule.follow, eqn.name, tuple(sorted(eqn.params.items())), lead, info.in_shapes,
           info.out_shapes, info.in_nbytes, info.out_nbytes, info.in_fixed,
           info.in_from_broadcast, info.batch_size, eqn.flops, eqn.bytes_accessed,
           info.fused_bytes, info.eqn_out_dtype)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _safe_follow(rule: st.StrategyRule, info: st.EqnInfo, lead: int, spec: Spec,
                 mesh: MeshContext) -> st.FollowResult:
    try:
        return rule.follow(info, lead, spec, mesh)
    except Exception as err:  # a rule bug must never break planning: replicate
        fallbacks.report("intra-op", f"the follow rule for {info.eqn.name!r} raised "
                         f"{type(err).__name__}: {err}; replicated", info.eqn.where())
        rep_in = tuple(replicated(len(s)) for s in info.in_shapes)
        cost = reshard_s(spec, replicated(len(spec)), info.in_nbytes[lead], mesh)
        return st.FollowResult(tuple(replicated(len(s)) for s in info.out_shapes), rep_in, cost)


# -- pricing a given plan (used by benchmarks/cost_model_accuracy) ----------------------------


@dataclasses.dataclass(frozen=True)
class SpecsPrice:
    """The cost model's figures for one fixed layout on one cluster.

    Attributes:
      cost_s / compute_s / comm_s: as in `IntraOpResult` (resharding counts as comm).
      memory_bytes: predicted peak bytes per device.
      bucket_alpha_s: as in `IntraOpResult`.
    """

    cost_s: float
    compute_s: float
    comm_s: float
    memory_bytes: float
    bucket_alpha_s: float = 0.0

    @property
    def step_s(self) -> float:
        """`cost_s` + `bucket_alpha_s`: a single-mesh plan's `Plan.predicted.step_s`."""
        return self.cost_s + self.bucket_alpha_s


def price_specs(graph: Graph, value_specs: Mapping[int, Spec],
                meshes: Sequence[MeshContext], *,
                forced: Mapping[int, Spec] | None = None,
                ties: Sequence[tuple[int, int]] = (),
                batch_size: int | None = None,
                solver: Backend = DEFAULT_BACKEND,
                time_limit_s: float = 60.0) -> list[SpecsPrice]:
    """Prices the program with its values laid out as `value_specs` (a plan's input and
    intermediate specs), on each of `meshes` (one logical shape, possibly different
    clusters), without searching a new layout.

    A node's strategy is one of those giving all its values exactly these specs; where
    several do (e.g. a replicated matmul output computed locally or by all-reducing
    partial sums), the cheapest consistent set under ``meshes[0]`` is taken (the ILP
    restricted to them), so on the plan's own cluster this is the search's objective.
    The same strategies are then priced under every mesh.

    Raises:
      ValueError: a node has no strategy matching `value_specs`, or the meshes differ in
        shape.
    """
    if not meshes:
        return []
    if any(m.shape != meshes[0].shape for m in meshes):
        raise ValueError(f"price_specs: meshes must share one shape, got "
                         f"{[m.shape for m in meshes]}")

    def build(mesh: MeshContext) -> _ProblemBuilder:
        return _built(graph, mesh, forced, ties, batch_size)

    from .solver import INFINITE_COST, evaluate

    base = build(meshes[0])
    members: dict[int, list[int]] = defaultdict(list)
    for vid, gid in base.group_of.items():
        members[gid].append(vid)
    problem = base.problem(None)
    costs = []
    for gid, g in enumerate(base.groups):
        allowed = np.ones(g.num_strategies, dtype=bool)
        for vid in members[gid]:
            if vid in value_specs:
                allowed &= np.array([s == tuple(value_specs[vid]) for s in base.specs[vid]])
        if not allowed.any():
            raise ValueError(f"price_specs: no strategy of {g.label} gives its values the "
                             f"requested specs")
        costs.append(np.where(allowed, problem.node_costs[gid], INFINITE_COST))
    restricted = dataclasses.replace(problem, node_costs=tuple(costs))
    choice = solve(restricted, time_limit_s=time_limit_s, backend=solver).strategies
    out = []
    for mesh in meshes:
        b = base if mesh is meshes[0] else build(mesh)
        if [g.num_strategies for g in b.groups] != [g.num_strategies for g in base.groups]:
            raise ValueError("price_specs: the problem's structure differs between clusters")
        p = b.problem(None)
        cost, _ = evaluate(p, choice)
        compute = float(sum(g.compute_s[choice[i]] for i, g in enumerate(b.groups)))
        out.append(SpecsPrice(cost, compute, cost - compute, b.estimate(choice).peak_bytes,
                              _bucket_alpha_s(b, choice)))
    return out

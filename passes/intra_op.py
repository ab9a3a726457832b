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

import dataclasses
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from autopar.cost_model.units import format_bytes
from autopar.passes.ir import Graph, Lit

from . import memory as mem
from .problem_builder import (
    ProblemBuilder,
    bucket_alpha_s,
    cpu_buffers,
    peak_memory,
)
from .sharding_spec import (
    MeshContext,
    Spec,
    full_rematerialization,
    replicated,
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
          builds: BuildCache | None = None,
          awaited: Collection[int] = ()) -> PendingRun:
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
      awaited: output value ids that work outside the program waits for as soon as they
        are made (a pipeline layer's activations and input cotangents): a reduction that
        makes one pays its whole latency, as one a matmul reads does, rather than a share
        of a combined bucket (`memory.analyze`).
    """
    t0 = time.perf_counter()
    builder = (builds.builder(graph, mesh, forced, ties, batch_size, comm_scale, awaited)
               if builds is not None else _built(graph, mesh, forced, ties, batch_size,
                                                 comm_scale, awaited=awaited))
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
    builder: ProblemBuilder
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


def _finish(graph: Graph, mesh: MeshContext, builder: ProblemBuilder,
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


def _result(builder: ProblemBuilder, solution: Solution, estimate: mem.MemoryEstimate,
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
                         operand_specs, estimate, bucket_alpha_s(builder, choice))


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


def fit_budget(builder: ProblemBuilder, budget_bytes: float, unconstrained: Solution,
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
    ratio = peak_memory(base, unconstrained.strategies) / max(
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
        self._entries: dict[tuple, list[tuple[Graph, MeshContext, ProblemBuilder]]] = {}
        self._buffers: dict[tuple[int, bool, frozenset[int]], tuple[Graph, mem.BufferInfo]] = {}
        # Per logical mesh: the dot strategies every build on it has enumerated
        # (`ProblemBuilder.dot_strategies`), shared by the layers of one search.
        self._dots: dict[tuple[int, ...], list[tuple[MeshContext, dict]]] = {}
        self.hits = 0

    def builder(self, graph: Graph, mesh: MeshContext, forced: Mapping[int, Spec] | None,
                ties: Sequence[tuple[int, int]], batch_size: int | None,
                comm_scale: Mapping[int, float] | None, awaited: Collection[int] = ()
                ) -> ProblemBuilder:
        """A fresh copy of `_built(...)` for these inputs, built on the first call."""
        awaited = frozenset(awaited)
        key = (id(graph), mesh.shape, tuple(sorted((forced or {}).items())),
               tuple(map(tuple, ties)), batch_size, tuple(sorted((comm_scale or {}).items())),
               awaited)
        entries = self._entries.setdefault(key, [])
        for g, m, base in entries:
            if g is graph and m == mesh:
                self.hits += 1
                return base.fork()
        # The buffer analysis reads the graph, the device kind and the awaited outputs
        # only: one per graph, kind and awaited set, whatever the mesh's shape.
        bkey = (id(graph), cpu_buffers(mesh), awaited)
        found = self._buffers.get(bkey)
        shared = found[1] if found is not None and found[0] is graph else None
        dots = self._dots.setdefault(mesh.shape, [])
        memo = next((d for m, d in dots if m == mesh), None)
        if memo is None:
            memo = {}
            dots.append((mesh, memo))
        base = _built(graph, mesh, forced, ties, batch_size, comm_scale, buffers=shared,
                      dots=memo, awaited=awaited)
        if shared is None:
            self._buffers[bkey] = (graph, base.buffers)
        entries.append((graph, mesh, base))
        return base.fork()


def _built(graph: Graph, mesh: MeshContext, forced: Mapping[int, Spec] | None,
           ties: Sequence[tuple[int, int]], batch_size: int | None,
           comm_scale: Mapping[int, float] | None = None,
           buffers: mem.BufferInfo | None = None,
           dots: dict | None = None, awaited: Collection[int] = ()) -> ProblemBuilder:
    """The problem builder with every group and edge, ties included (`buffers`: the
    graph's `memory.analyze` with `awaited`, when the caller has it; `dots`: a
    dot-strategy memo shared with other builds on the same mesh,
    `ProblemBuilder.dot_strategies`; `awaited`: `start`'s)."""
    builder = ProblemBuilder(graph, mesh, dict(forced or {}), batch_size, comm_scale, buffers,
                              dots, awaited)
    builder.build()
    for pos, in_vid in ties:
        out = graph.outvars[pos]
        if isinstance(out, int) and graph.values[out].producer is not None:
            builder.aliased.add(out)
            builder.tie_pairs.append((out, in_vid))
        if isinstance(out, int) and out in builder.group_of and in_vid in builder.group_of:
            builder.require(out, in_vid, builder.specs[in_vid])
    return builder


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

    def build(mesh: MeshContext) -> ProblemBuilder:
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
                              bucket_alpha_s(b, choice)))
    return out

"""Plan search for one traced program: runs the intra-op pass on each candidate logical
mesh and keeps the cheapest, producing a `Plan`.

A micro-batched step (N > 1) holds N copies of the forward+backward; the emitted program
reduces each gradient once per step (`microbatch.ReducedOnce`), so each copy's gradient
contractions carry 1/N of their communication (the ILP's `comm_scale`), as the pipeline
planner prices a stage's.

A method with a batch axis (`ShardParallel(batch_axis=...)`, its `batch_mesh_axis`) adds
`BATCH_AXIS_PENALTY_S` to every layout that splits a batch dim over another mesh axis
(`intra_op.start`'s `value_costs`)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future

import jax

from autopar.cost_model import ClusterSpec
from autopar.graph import Graph, Lit
from autopar.passes import intra_op, primitives
from autopar.passes.sharding_spec import MeshContext, Spec, replicated, state_split

from . import flat_view
from .methods import Method, Role
from .microbatch import reduced_once
from .plan import Plan, PredictedCost
from .solve_pool import SolvePool, answer_bound_s


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A traced step and the facts about its inputs the planner needs.

    Attributes:
      graph: the flattened program.
      input_names: pytree path of every flattened input.
      roles: "batch", "param" or "state" for every flattened input.
      ties: (output position, input position): the output replaces that input.
      batch_size: leading size of the batch inputs, if any.
    """

    graph: Graph
    input_names: tuple[str, ...]
    roles: tuple[Role, ...]
    ties: tuple[tuple[int, int], ...]
    batch_size: int | None

    @property
    def in_shapes(self) -> list[tuple[int, ...]]:
        return [self.graph.values[v].shape for v in self.graph.invars]

    @property
    def out_shapes(self) -> list[tuple[int, ...]]:
        return [op.shape if isinstance(op, Lit) else self.graph.values[op].shape
                for op in self.graph.outvars]


def input_roles(graph: Graph, batch_positions: set[int]) -> tuple[Role, ...]:
    """Batch inputs by position; a non-batch input read (directly or through layout-only
    ops) by a matmul, convolution, gather or loop is a parameter; the rest is state."""
    roles: list[Role] = []
    for pos, vid in enumerate(graph.invars):
        if pos in batch_positions:
            roles.append("batch")
            continue
        frontier, seen, is_param = [vid], {vid}, False
        while frontier and not is_param:
            v = frontier.pop()
            for e in graph.consumers[v]:
                eqn = graph.eqns[e]
                facts = primitives.info(eqn.name)
                if facts.param_use:
                    is_param = True
                    break
                if facts.layout_only:
                    for o in eqn.outputs:
                        if o not in seen:
                            seen.add(o)
                            frontier.append(o)
        roles.append("param" if is_param else "state")
    return tuple(roles)


def fingerprint(graph: Graph, cluster: ClusterSpec, extra: str = "") -> str:
    """16 hex digits of SHA-256 over the program text (with avals), the cluster and
    `extra` (e.g. the micro-batch count of a pipeline traced at micro-batch size)."""
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", graph.text()) + extra
    h = hashlib.sha256(text.encode())
    h.update(json.dumps(cluster.to_json(), sort_keys=True).encode())
    return h.hexdigest()[:16]


def search(program: Program, method: Method, cluster: ClusterSpec,
           device_ids: Sequence[int], *, fp: str,
           progress: Callable[[str], None] | None = None) -> Plan:
    """Finds the cheapest plan of `method` for `program` on the devices `device_ids`;
    `progress(message)` is called before each mesh shape's ILP."""
    t0 = time.perf_counter()
    graph = program.graph
    n = len(device_ids)
    budget = method.memory_budget_bytes
    if budget is None:
        budget = cluster.memory_bytes
    results, errors = [], []
    shapes = method.mesh_shapes(n)
    started, mirrors = [], {}
    micro = method.num_micro_batches
    # Every mesh ILP of this search: the same program, budget, solver and scaling.
    start = functools.partial(
        intra_op.start, graph,
        ties=[(out_pos, graph.invars[in_pos]) for out_pos, in_pos in program.ties],
        memory_budget_bytes=budget, batch_size=program.batch_size, solver=method.solver,
        time_limit_s=method.time_limit_s,
        comm_scale=({k: 1.0 / micro for k in reduced_once(graph)}
                    if isinstance(micro, int) and micro > 1 else None))
    batch_axis_of = getattr(method, "batch_mesh_axis", None)
    # A fixed 2-D mesh is also solved as one axis (flat_view): plans that split every
    # value over all devices are found directly there, not through re-layouts.
    flat = flat_view.flat_shape(shapes[0]) if len(shapes) == 1 else None
    flat_start = (_flat_start(program, method, cluster, shapes[0], flat)
                  if flat is not None else None)
    pool = SolvePool(None if len(shapes) > 1 or flat_start is not None else 0)
    submit = WatchedSubmit(pool.submit)
    batch_led = batch_dims(program, micro) if batch_axis_of is not None else {}
    penalties: dict[tuple[int, ...], dict[int, Callable[[Spec], float]]] = {}
    try:
        for k, shape in enumerate(shapes):
            mesh = MeshContext.build(shape, cluster)
            forced_pos = method.forced_specs(program.in_shapes, program.roles, mesh)
            forced = {graph.invars[pos]: spec for pos, spec in forced_pos.items()}
            axis = batch_axis_of(mesh) if batch_axis_of is not None else None
            penalties[shape] = (batch_axis_only(batch_led, axis)
                                if axis is not None and batch_led else {})
            # With a batch axis the costs are not symmetric in the axes: no mirror images.
            twin = None if axis is not None else next(
                (m for m, f, _ in started if is_mirror(mesh, forced, m, f)), None)
            if twin is not None:  # same cost as its mirror image, solved already
                mirrors[shape] = twin.shape
                continue
            if progress:
                progress(f"mesh ILP {k + 1}/{len(shapes)}: logical mesh {shape}")
            started.append((mesh, forced, start(mesh, forced=forced,
                                                value_costs=penalties[shape], submit=submit)))
        flat_run = None
        if flat_start is not None:
            flat_mesh, flat_forced = flat_start
            if progress:
                progress(f"mesh ILP: logical mesh {shapes[0]} as one axis {flat}")
            flat_run = start(flat_mesh, forced=flat_forced, submit=submit)
        for mesh, forced, run in started:
            if _answer_or_lean(run, mesh, forced, program, start, penalties[mesh.shape],
                               results, errors, progress) and progress:
                best = min(results, key=lambda r: r.step_s)
                progress(f"mesh ILP {mesh.shape} solved: {results[-1].step_s * 1e3:.3f} ms "
                         f"(best {best.step_s * 1e3:.3f} ms on {best.mesh.shape})")
        if flat_run is not None:
            try:
                results.append(answer(flat_run, f"the mesh ILP on logical mesh {flat}"))
            except intra_op.MemoryBudgetError as err:
                errors.append(err)
    except BaseException:
        pool.close(cancel=True)
        raise
    pool.close()
    best = _best(results, errors, penalties)
    stats = dict(best.stats)
    stats["search_s"] = time.perf_counter() - t0
    stats["phases_s"] = {"mesh ILPs": stats["search_s"]}
    if flat_run is not None:
        stats["flat_view"] = (f"logical mesh {shapes[0]} also solved as {flat} over the same "
                              f"devices; kept {best.mesh.shape}")
    if mirrors:
        stats["mirror_meshes"] = {str(a): str(b) for a, b in mirrors.items()}
    if batch_axis_of is not None and batch_axis_of(best.mesh) is not None:
        stats["batch_axis"] = batch_axis_of(best.mesh)
    candidates = _with_mirrors([(r.mesh.shape, r.step_s) for r in results], mirrors,
                               [*shapes, flat] if flat_run is not None else shapes)
    return _plan_of(best, program, method, cluster, device_ids, fp, stats, candidates)


def _answer_or_lean(run: intra_op.PendingRun, mesh: MeshContext, forced: dict[int, Spec],
                    program: Program, start: Callable[..., intra_op.PendingRun],
                    penalties: Mapping[int, Callable[[Spec], float]],
                    results: list[intra_op.IntraOpResult],
                    errors: list[intra_op.MemoryBudgetError],
                    progress: Callable[[str], None] | None) -> bool:
    """Appends the answer of one mesh ILP to `results`; when it does not fit the budget,
    appends its error to `errors` and solves the mesh again with every parameter and
    optimizer state split (`lean_forced`), in this process.  True when the first ILP
    answered."""
    try:
        results.append(answer(run, f"the mesh ILP on logical mesh {mesh.shape}"))
        return True
    except intra_op.MemoryBudgetError as err:
        errors.append(err)
    lean = lean_forced(forced, program, mesh)
    if lean == forced:
        return False
    if progress:
        progress(f"mesh ILP {mesh.shape}: the budget again, every parameter and optimizer "
                 "state split")
    try:
        results.append(answer(start(mesh, forced=lean, value_costs=penalties),
                              f"the memory-lean mesh ILP on logical mesh {mesh.shape}"))
    except intra_op.MemoryBudgetError as lean_err:
        errors.append(lean_err)
    return False


def _best(results: list[intra_op.IntraOpResult], errors: list[intra_op.MemoryBudgetError],
          penalties: Mapping[tuple[int, ...], Mapping[int, Callable[[Spec], float]]]
          ) -> intra_op.IntraOpResult:
    """The fastest answer; with a batch axis, the fastest that keeps every batch dim on
    it.  Raises the error of the smallest budget shortfall when no mesh fits."""
    if not results:
        raise min(errors, key=lambda e: e.smallest_bytes)
    if any(penalties.values()):
        kept = [r for r in results
                if not carries_penalty(r.value_specs, penalties[r.mesh.shape].items())]
        if not kept:
            raise ValueError(f"batch_axis: the solver found no layout on the logical meshes "
                             f"{[r.mesh.shape for r in results]} that keeps every batch dim "
                             f"off the other mesh axes (raise time_limit_s)")
        results = kept
    return min(results, key=lambda r: r.step_s)


def _plan_of(best: intra_op.IntraOpResult, program: Program, method: Method,
             cluster: ClusterSpec, device_ids: Sequence[int], fp: str, stats: dict,
             candidates: tuple) -> Plan:
    """The single-mesh plan of the chosen mesh ILP's answer."""
    graph = program.graph
    micro = method.num_micro_batches
    decided = {v: s for v, s in best.value_specs.items() if graph.values[v].producer is not None}
    return Plan(
        fingerprint=fp,
        method=method.name,
        cluster=cluster.name,
        mesh_shape=best.mesh.shape,
        mesh_axes=best.mesh.axes,
        device_ids=tuple(device_ids),
        input_names=program.input_names,
        in_specs=tuple(best.value_specs[v] for v in graph.invars),
        out_specs=best.out_specs,
        value_specs=tuple(sorted(decided.items())),
        predicted=PredictedCost(best.step_s, best.compute_s, best.comm_s + best.bucket_alpha_s,
                                best.memory_bytes, graph.total_flops()),
        solver=stats,
        candidates=candidates,
        operand_specs=best.operand_specs,
        num_micro_batches=micro if isinstance(micro, int) else 1,
    )


def _flat_start(program: Program, method: Method, cluster: ClusterSpec,
                shape: tuple[int, ...], flat: tuple[int]
                ) -> tuple[MeshContext, dict[int, Spec]] | None:
    """(the 1-D mesh `flat`, its forced specs by value id) where the flat view of the fixed
    2-D logical mesh `shape` applies: no batch axis on `shape` (the plan must keep the batch
    on that axis alone) and the same input contract on both meshes (`flat_view.lifts_to`);
    None otherwise."""
    graph = program.graph
    mesh = MeshContext.build(shape, cluster)
    batch_axis_of = getattr(method, "batch_mesh_axis", None)
    if batch_axis_of is not None and batch_axis_of(mesh) is not None:
        return None
    forced = {graph.invars[pos]: spec for pos, spec in method.forced_specs(
        program.in_shapes, program.roles, mesh).items()}
    flat_mesh = MeshContext.build(flat, cluster)
    flat_forced = {graph.invars[pos]: spec for pos, spec in method.forced_specs(
        program.in_shapes, program.roles, flat_mesh).items()}
    return (flat_mesh, flat_forced) if flat_view.lifts_to(flat_forced, forced, mesh) else None


#: Seconds added to a layout that splits a batch dim over a mesh axis other than the
#: method's batch axis (`batch_axis_only`): more than any step takes, so the search takes
#: such a layout only where no other exists (the value of the pipeline planner's
#: `LEAN_PENALTY_S`; the pipeline planner holds a (dp, tp) stage's batch to dp with it).
BATCH_AXIS_PENALTY_S = 1e4


def batch_dims(program: Program, num_micro_batches: int | str = 1
               ) -> dict[int, tuple[int, ...]]:
    """Value id → the dims that carry the batch, for every value computed from a batch
    input of `program`: its dims of the batch size or, with N micro-batches, of the
    micro-batch size (`batch_carried_dims`)."""
    size = program.batch_size
    if not size:
        return {}
    sizes = {size}
    if isinstance(num_micro_batches, int) and num_micro_batches > 1 \
            and size % num_micro_batches == 0:
        sizes.add(size // num_micro_batches)
    graph = program.graph
    return batch_carried_dims(graph, [v for v, role in zip(graph.invars, program.roles)
                                      if role == "batch"], size, sizes)


def batch_carried_dims(graph: Graph, batch_inputs: Sequence[int], batch_size: int,
                       sizes: Collection[int]) -> dict[int, tuple[int, ...]]:
    """Value id → its dims whose size is in `sizes`, for every value of `graph` computed
    from the inputs `batch_inputs` whose leading dim is `batch_size` (a model dim of such a
    size is taken for a batch dim too, which only narrows its layouts)."""
    carried = graph.computed_from(v for v in batch_inputs
                                  if graph.values[v].shape[:1] == (batch_size,))
    out = {}
    for vid in carried:
        dims = tuple(d for d, n in enumerate(graph.values[vid].shape) if n in sizes)
        if dims:
            out[vid] = dims
    return out


def batch_axis_only(batch_led: dict[int, tuple[int, ...]], axis: str
                    ) -> dict[int, Callable[[Spec], float]]:
    """`intra_op.start`'s `value_costs`: `BATCH_AXIS_PENALTY_S` seconds on every layout of
    a value in `batch_led` (value id → its batch dims, `batch_dims`) that splits a batch
    dim over a mesh axis other than `axis` (Alpa's force_batch_dim_to_mesh_dim; the pipeline
    planner holds a fixed (dp, tp) stage's batch to its first axis with it)."""
    def cost(spec: Spec, dims: tuple[int, ...]) -> float:
        off = any(a != axis for d in dims if d < len(spec) for a in spec[d])
        return BATCH_AXIS_PENALTY_S if off else 0.0

    return {vid: functools.partial(cost, dims=dims) for vid, dims in batch_led.items()}


def carries_penalty(value_specs: Mapping[int, Spec],
                    penalties: Iterable[tuple[int, Callable[[Spec], float]]]) -> bool:
    """Whether a solution's layouts `value_specs` (value id → spec) carry a penalty: a
    positive cost of `penalties` ((value id, seconds per spec) pairs, e.g.
    `batch_axis_only`'s) on a value it lays out.  Read off the layouts, not the solution's
    cost: a step can take longer than any penalty (e.g. on a communication-only cluster)."""
    return any(cost(value_specs[v]) > 0 for v, cost in penalties if v in value_specs)


def lean_forced(forced: dict[int, Spec], program: Program, mesh: MeshContext
                ) -> dict[int, Spec]:
    """`forced` (value id → spec) with every parameter and optimizer-state input it leaves
    free split over all of `mesh`'s axes (`state_split` of the whole value: ZeRO-3's layout):
    the memory-lean start a budget the free search cannot fit is tried from.  The ILP's
    memory rows do not see the copies a gather makes, so under a tight cap the free search
    finds layouts that keep parameters split and gather them in bulk — more memory, by the
    memory model, than ZeRO-3's, which gathers each where it is used (the 4 x 1024 MLP with
    AdamW on (8,), tests/test_memory_budget.py: 11.87 MiB at best against 11.27 MiB for
    ZeRO-3's layout, under a budget of 11.31 MiB)."""
    graph = program.graph
    out = dict(forced)
    for pos, (shape, role) in enumerate(zip(program.in_shapes, program.roles)):
        vid = graph.invars[pos]
        if role in ("param", "state") and vid not in out:
            out[vid] = state_split(replicated(len(shape)), shape, mesh)
    return out


def is_mirror(mesh: MeshContext, forced: dict[int, Spec], other: MeshContext,
              other_forced: dict[int, Spec]) -> bool:
    """Whether `mesh` is `other` with its two axes swapped, both axes on the same link
    and the forced specs swapped alike: the cost model sees axes only through their size
    and link, so both meshes have the same optimum (one solve serves both)."""
    if len(mesh.shape) != 2 or mesh.shape != other.shape[::-1] or mesh.shape[0] == mesh.shape[1]:
        return False
    if not (mesh.links[0] == mesh.links[1] == other.links[0] == other.links[1]):
        return False
    swap = {mesh.axes[0]: other.axes[1], mesh.axes[1]: other.axes[0]}
    renamed = {v: tuple(frozenset(swap[a] for a in dim) for dim in spec)
               for v, spec in forced.items()}
    return renamed == {v: tuple(frozenset(dim) for dim in spec)
                       for v, spec in other_forced.items()}


def _with_mirrors(candidates: list[tuple[tuple[int, ...], float]],
                  mirrors: dict[tuple[int, ...], tuple[int, ...]],
                  order: Sequence[tuple[int, ...]]) -> tuple:
    """The mesh shapes tried with their costs, mirror images taking their twin's, in the
    order they were listed."""
    cost = dict(candidates)
    cost.update((m, cost[t]) for m, t in mirrors.items() if t in cost)
    return tuple((s, cost[s]) for s in order if s in cost)


def describe_path(path) -> str:
    return jax.tree_util.keystr(path) or "<root>"


# ---- bounded waits on the solver pool's answers -----------------------------------------

class SolveTimeoutError(TimeoutError):
    """The answer to a sharding problem did not come within its bound (`answer_wait_s`)
    while no other problem of the same search was answered: the solver pool is stuck."""


def answer_wait_s(time_limit_s: float) -> float:
    """Seconds a planner waits for an answer to a problem with this solver time limit
    while no other problem of its pool is answered: twice the pool's own bound on a worker
    (`solve_pool.answer_bound_s`), which covers the worker's wait and then the solve in the
    pool's thread that replaces a worker past its bound."""
    return 2.0 * answer_bound_s(time_limit_s)


class WatchedSubmit:
    """`submit` (a `SolvePool.submit`) whose futures' `result()` gives up, with
    `SolveTimeoutError`, once the pool has answered nothing for `bound_s(time limit)`
    seconds (default `answer_wait_s`; of the longest time limit submitted so far) since
    this problem was submitted.

    The bound follows the pool's progress rather than each problem's own wait: a problem
    queued behind many others waits as long as answers keep coming.  One per pool, shared by
    every problem handed to it.
    """

    def __init__(self, submit: Callable[..., Future],
                 bound_s: Callable[[float], float] | None = None):
        self._submit = submit
        self._bound_s = bound_s if bound_s is not None else answer_wait_s
        self._lock = threading.Lock()
        self._answered_at = time.monotonic()   # when the pool last answered a problem
        self._longest_limit_s = 0.0
        self.answers = 0

    def __call__(self, problem, *, time_limit_s: float, backend: str, **options) -> Future:
        with self._lock:
            self._longest_limit_s = max(self._longest_limit_s, float(time_limit_s))
        out = _WatchedFuture(self, getattr(problem, "name", "problem"),
                             getattr(problem, "num_nodes", None), float(time_limit_s))
        inner = self._submit(problem, time_limit_s=time_limit_s, backend=backend, **options)
        inner.add_done_callback(out._take)   # runs at once when `inner` is done already
        return out

    def _answered(self) -> None:
        with self._lock:
            self._answered_at = time.monotonic()
            self.answers += 1

    def _quiet_since(self, submitted_at: float) -> tuple[float, float]:
        """(the moment from which silence counts for a problem submitted at
        `submitted_at`, the bound in seconds)."""
        with self._lock:
            return (max(self._answered_at, submitted_at),
                    self._bound_s(self._longest_limit_s))


class _WatchedFuture(Future):
    """The pool's future, copied over when it completes; `result()` without a timeout is
    bounded by the pool's progress (`WatchedSubmit`)."""

    def __init__(self, watch: WatchedSubmit, name: str, nodes: int | None,
                 time_limit_s: float):
        super().__init__()
        self._watch, self._name, self._nodes = watch, name, nodes
        self._time_limit_s = time_limit_s
        self._submitted_at = time.monotonic()

    def _take(self, inner: Future) -> None:
        if inner.cancelled():
            self.cancel()
            return
        self._watch._answered()
        err = inner.exception()
        if err is not None:
            self.set_exception(err)
        else:
            self.set_result(inner.result())

    def result(self, timeout: float | None = None):
        if timeout is not None:
            return super().result(timeout)
        while True:
            since, bound = self._watch._quiet_since(self._submitted_at)
            left = since + bound - time.monotonic()
            if left <= 0 and not self.done():
                waited = time.monotonic() - self._submitted_at
                nodes = "" if self._nodes is None else f" of {self._nodes} nodes"
                raise SolveTimeoutError(
                    f"no answer to sharding problem {self._name!r}{nodes} (solver time limit "
                    f"{self._time_limit_s:g} s) after {waited:.0f} s, and no other problem of "
                    f"this search was answered in the last {bound:.0f} s "
                    f"(planner.answer_wait_s: twice solve_pool.answer_bound_s of the longest "
                    f"time limit, {self._watch._longest_limit_s:g} s): the solver pool is stuck")
            try:
                return super().result(timeout=max(left, 0.0))
            except TimeoutError:
                if self.done():   # the solve itself raised a TimeoutError
                    raise


def answer(run: intra_op.PendingRun, what: str) -> intra_op.IntraOpResult:
    """`run.result()`, with `what` (e.g. "the mesh ILP on logical mesh (2, 4)") named when
    its answer does not come in time (`SolveTimeoutError`)."""
    try:
        return run.result()
    except SolveTimeoutError as err:
        raise SolveTimeoutError(f"{what}: {err}") from None

"""`parallelize`: trace a train step, search (or load) a plan, emit and cache the program."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from autopar.cost_model import ClusterSpec
from autopar.cost_model.units import format_bytes

from . import (
    global_data,
    micro_batches,
    outer,
    pipeline,
    pipeline_search,
    plan_cache,
    plan_exchange,
    planner,
    schedules,
    transfer,
)
from .constraints import build_mesh
from .emit import emit
from .executable import Executable
from .methods import Method, ShardParallel
from .passes import fallbacks, inter_op
from .passes.intra_op import MemoryBudgetError
from .plan import Plan, PlanError, verify_plan
from .runtime import PipelineRuntime
from .step_trace import StepTrace, trace_step
from .traced import OtherShapes, Traced, leaf_positions


class FingerprintError(PlanError):
    """A plan made for another program or cluster."""


def _normalize_argnums(name: str, argnums: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(argnums, int):
        argnums = (argnums,)
    out = tuple(argnums)
    if any(not isinstance(i, int) or i < 0 for i in out):
        raise ValueError(f"parallelize({name}={argnums!r}): expected non-negative ints")
    return out


class ParallelizedFunction:
    """A train step run under an automatically found (or given) parallel plan.

    Call it like the original function.  The first call with new input shapes traces,
    plans and compiles; later calls reuse the program.
    """

    def __init__(self, fun: Callable, *, method: Method | None, batch_argnums: Sequence[int],
                 static_argnums: Sequence[int],
                 donate_argnums: Sequence[int] | Literal["auto"],
                 plan: Plan | str | os.PathLike | None, devices: Sequence[jax.Device] | None,
                 cluster: ClusterSpec | str | None, offline: bool = False,
                 progress: Callable[[str], None] | None = None):
        self.fun = fun
        self.progress = progress
        self.method = method if method is not None else ShardParallel()
        self.batch_argnums = _normalize_argnums("batch_argnums", batch_argnums)
        self.static_argnums = _normalize_argnums("static_argnums", static_argnums)
        self.donate_argnums: tuple[int, ...] | Literal["auto"] = (
            "auto" if isinstance(donate_argnums, str) and donate_argnums == "auto"
            else _normalize_argnums("donate_argnums", donate_argnums))
        self.devices = list(devices) if devices is not None else None
        self._cluster = cluster
        self.offline = offline
        if isinstance(plan, str | os.PathLike):
            plan = Plan.load(plan)
        self.fixed_plan: Plan | None = plan
        self._cache: dict[Any, Traced] = {}
        self._fast: Callable | None = None
        functools.update_wrapper(self, fun)

    # -- public -----------------------------------------------------------------------------

    def __call__(self, *args):
        fast = self._fast
        if fast is not None:
            try:
                return fast(*args)
            except OtherShapes:
                pass
        traced, leaves = self._traced(args)
        if not traced.executable.one_program:   # the pipeline's schedule, driven from here
            out = traced.executable(*leaves)
            return jax.tree_util.tree_unflatten(traced.out_tree, out)
        donated = set(traced.donated_leaves())
        # The first call already goes through the fast path's jit (calling the plan's own
        # jit first compiled the same program twice).  Donated arguments are laid out on
        # private copies (the caller's arrays stay valid), committed ones moved (jit refuses
        # a committed array in another layout), and so are the arrays of the other
        # arguments but the batch (the state): on later calls they arrive as this step's
        # outputs, committed to the mesh, and a committed array has another type than an
        # uncommitted one (its mesh is in its aval), so leaving them uncommitted now
        # retraced and compiled the step a second time on the second call.  The batch's
        # uncommitted arrays and host values (numpy arrays, Python scalars: never a step's
        # output) go as they are, as they will on later calls.
        spans = transfer.multi_process()
        shardings = traced._shardings("in")
        leaf_pos = leaf_positions(traced.in_tree, traced._positions)
        moving = [k for k, x in enumerate(leaves)
                  if k in donated or spans or getattr(x, "committed", False)
                  or (isinstance(x, jax.Array) and leaf_pos[k] not in self.batch_argnums)]
        for k, x in zip(moving, outer.place_all([leaves[k] for k in moving],
                                                [shardings[k] for k in moving])):
            leaves[k] = x
        placed = list(args)
        for pos, x in zip(traced._positions, jax.tree_util.tree_unflatten(traced.in_tree,
                                                                           leaves)):
            placed[pos] = x
        self._fast = fast = traced.fast_call()
        return fast(*placed)

    def trace(self, *args) -> Traced:
        """The step traced and planned for these arguments (arrays or
        `jax.ShapeDtypeStruct`s), without running it; cached per argument shapes."""
        return self._traced(args)[0]

    def get_plan(self, *args) -> Plan:
        """The plan for these arguments (arrays or `jax.ShapeDtypeStruct`s), searched or
        loaded, without running the step."""
        return self.trace(*args).plan

    def lower(self, *args):
        """`self.trace(*args).lower()`: JAX's lowered program(s) for these arguments."""
        return self.trace(*args).lower()

    def input_shardings(self, *args) -> tuple:
        """`self.trace(*args).input_shardings()`: the sharding of every dynamic argument
        leaf the program expects (arguments may be `jax.ShapeDtypeStruct`s)."""
        return self.trace(*args).input_shardings()

    def output_shardings(self, *args) -> Any:
        """`self.trace(*args).output_shardings()`: the sharding of every output leaf."""
        return self.trace(*args).output_shardings()

    # -- internals --------------------------------------------------------------------------

    def _split(self, args: tuple) -> tuple[list, tuple, list[int]]:
        for i in self.static_argnums:
            if i >= len(args):
                raise ValueError(f"static_argnums {i} is out of range for {len(args)} arguments")
        dynamic = [a for i, a in enumerate(args) if i not in self.static_argnums]
        static = tuple((i, args[i]) for i in self.static_argnums)
        positions = [i for i in range(len(args)) if i not in self.static_argnums]
        return dynamic, static, positions

    def _traced(self, args: tuple) -> tuple[Traced, list]:
        dynamic, static, positions = self._split(args)
        leaves, in_tree = jax.tree_util.tree_flatten(dynamic)
        try:
            avals = tuple((tuple(jax.numpy.shape(x)), str(jax.numpy.result_type(x)),
                           getattr(x, "weak_type", False)) for x in leaves)
        except TypeError as err:
            raise TypeError(f"{self.__name__}: every argument leaf must be an array or a number "
                            f"(mark other arguments with static_argnums): {err}") from None
        try:
            key = (in_tree, avals, static)
            hash(key)
        except TypeError:
            raise TypeError(f"{self.__name__}: static arguments must be hashable, got "
                            f"{[type(v).__name__ for _, v in static]}") from None
        traced = self._cache.get(key)
        if traced is None:
            traced = self._plan(dynamic, static, positions, in_tree)
            self._cache[key] = traced
        return traced, leaves

    def _devices(self) -> list[jax.Device]:
        if self.offline:
            raise RuntimeError("this step was planned offline (autopar.plan) for a cluster "
                               "this process does not have; run it with "
                               "autopar.parallelize(step, plan=...) on that cluster")
        return self.devices if self.devices is not None else list(jax.devices())

    def _plan(self, dynamic: list, static: tuple, positions: list[int], in_tree) -> Traced:
        if self.offline:
            cluster = _resolve_cluster(self._cluster, None)
            device_ids = list(range(cluster.num_devices))
            devices = None
        else:
            devices = self._devices()
            cluster = _resolve_cluster(self._cluster, devices)
            device_ids = [d.id for d in devices]
        fixed = self.fixed_plan
        if fixed is None and self.method.num_micro_batches == "auto":
            def search_counts() -> Traced:
                return micro_batches.search(self, dynamic, static, positions, in_tree,
                                            cluster, device_ids)

            if not plan_exchange.spans_processes(devices):
                return search_counts()
            # Across processes, process 0 chooses the count (the searches could differ);
            # every process then traces at that count and checks the plan like a given one.
            fixed = plan_exchange.one_plan(None, devices, lambda: search_counts().plan,
                                         lambda plan: plan, None)
        pipelined = bool(fixed.stages) if fixed is not None else self.method.pipelined
        micro = fixed.num_micro_batches if fixed is not None else self.method.num_micro_batches
        traced, split, fp = self._trace_for(dynamic, static, positions, in_tree, micro,
                                            pipelined, cluster)
        program = traced.program

        def check(candidate: Plan) -> Plan:
            if candidate.fingerprint != fp:
                raise FingerprintError(
                    f"plan fingerprint {candidate.fingerprint} does not match this program "
                    f"({fp}) on cluster {cluster.name}: the plan was made for another program, "
                    f"input shapes or cluster; re-run the search (get_plan / `autopar plan`)")
            _verify(candidate, program, split, device_ids)
            return candidate

        def search() -> Plan:
            return self._search_cached(self.method, traced, split, fp, cluster, device_ids)

        # Across processes, process 0 searches (or reads its cache) and every process runs
        # its plan.
        plan = plan_exchange.one_plan(fp, devices, search, check, fixed)
        out = Traced(program, plan, split, traced.out_tree, in_tree, traced.args_info,
                     _trace=traced, _positions=positions, _trace_static=static, _step=self)
        if (fixed is None and devices is not None
                and self.method.memory_budget_bytes is not None
                and not plan_exchange.spans_processes(devices)):
            out = self._fit_compiled_memory(out, fp, cluster, device_ids)
        return out

    def _fit_compiled_memory(self, out: Traced, fp: str, cluster: ClusterSpec,
                             device_ids: list[int]) -> Traced:
        """A budgeted plan, checked against the programs XLA builds: its compiled peak per
        device (`memory_analysis()`: argument + output − alias + temp; for a pipeline the
        largest stage's, `PipelineCompiled.stage_memory_bytes`: its backward or one-program
        step, the other micro-batches' residuals in flight and the optimizer state of its
        apply segments) must fit `memory_budget_bytes`.  Over it, the search runs again
        under a cap tightened by the overshoot (the memory model's error on this program),
        or, when the model sees no plan under that cap, under the smallest peak it does
        see (if below the plan that compiled over), at most `_BUDGET_ROUNDS` times;
        `MemoryBudgetError` if no searched plan compiles within the budget.  The compiled
        peaks go into `plan.solver["compiled_memory"]`."""
        budget = float(self.method.memory_budget_bytes)
        cap, peaks = budget, []
        for _ in range(_BUDGET_ROUNDS):
            peak = _compiled_peak_bytes(out)
            peaks.append(peak)
            if peak <= budget:
                record = {"budget_bytes": budget, "compiled_bytes": peaks, "cap_bytes": cap}
                return dataclasses.replace(out, plan=dataclasses.replace(
                    out.plan, solver={**out.plan.solver, "compiled_memory": record}))
            cap *= budget / peak * _BUDGET_MARGIN
            if self.progress:
                self.progress(f"compiled peak {format_bytes(peak)} is over the budget "
                              f"{format_bytes(budget)}: searching under {format_bytes(cap)}")
            try:
                plan = self._search_under(cap, out, fp, cluster, device_ids)
            except MemoryBudgetError as e:
                # No plan is predicted under the tightened cap: take the smallest the model
                # sees, if it is smaller than the plan that compiled over the budget.
                cap = e.smallest_bytes * (1 + 1e-9)
                if cap >= out.plan.predicted.memory_bytes:
                    break
                try:
                    plan = self._search_under(cap, out, fp, cluster, device_ids)
                except (MemoryBudgetError, inter_op.NoStageLayoutError):
                    break
            except inter_op.NoStageLayoutError:
                break
            if (plan.value_specs == out.plan.value_specs and plan.in_specs == out.plan.in_specs
                    and plan.stages == out.plan.stages):
                break   # the same plan again (a fixed layout: DataParallel, ZeRO)
            out = dataclasses.replace(out, plan=plan, _executable=None, _layouts={},
                                      _built_fallbacks=[])
        raise MemoryBudgetError(budget, min(peaks), tuple(out.plan.mesh_shape))

    def _search_under(self, cap: float, out: Traced, fp: str, cluster: ClusterSpec,
                      device_ids: list[int]) -> Plan:
        """The plan of `out`'s program searched under a memory cap of `cap` bytes."""
        method = dataclasses.replace(self.method, memory_budget_bytes=cap)
        return self._search_cached(method, out._trace, out.split, fp, cluster, device_ids)

    def _trace_for(self, dynamic: list, static: tuple, positions: list[int], in_tree,
                   micro: int, pipelined: bool, cluster: ClusterSpec
                   ) -> tuple[StepTrace, pipeline.SplitStep | None, str]:
        """The step traced for `micro` micro-batches, its pipeline split (None on one mesh)
        and its fingerprint on `cluster`."""
        if self.progress:
            self.progress("trace" if micro == 1 else f"trace (micro-batches {micro})")
        traced = trace_step(self.fun, dynamic, static, positions, in_tree,
                            self.batch_argnums, micro, accumulate=not pipelined)
        program = traced.program
        split = pipeline.split(traced.micro, set(traced.batch_positions)) if pipelined else None
        fp = planner.fingerprint(program.graph, cluster, extra=(
            f"micro_batches={micro} full_batch={program.batch_size}" if pipelined else ""))
        return traced, split, fp

    def _search_cached(self, method: Method, traced: StepTrace, split: pipeline.SplitStep | None,
                       fp: str, cluster: ClusterSpec, device_ids: list[int]) -> Plan:
        """The plan of `method` for a traced step: from the plan cache when it holds one
        for exactly this search (verified against the program), else searched and stored."""
        program = traced.program
        cache = plan_cache.PlanCache.default()
        key, fields = plan_cache.cache_key(
            fp, method, cluster, device_ids=device_ids, roles=program.roles,
            input_names=program.input_names, ties=program.ties,
            extra=f"batch_argnums={self.batch_argnums}")
        t0 = time.perf_counter()
        hit = cache.load(key, fp, verify=lambda p: _verify(p, program, split, device_ids))
        if hit is not None:
            path = str(cache.path(key))
            if self.progress:
                self.progress(f"plan cache hit: {path}")
            return dataclasses.replace(hit, solver={**hit.solver, "plan_cache": {
                "hit": True, "path": path, "lookup_s": time.perf_counter() - t0}})
        if self.progress and cache.enabled:
            self.progress("plan cache miss: searching")
        with fallbacks.collecting() as found:
            plan = self._search(method, traced, split, fp, cluster, device_ids)
        if found:
            plan = dataclasses.replace(plan, solver={
                **plan.solver, "fallbacks": [f.to_json() for f in found]})
        stored = cache.store(key, plan, fields)
        if stored is None:
            return plan
        return dataclasses.replace(plan, solver={**plan.solver, "plan_cache": {
            "hit": False, "path": str(stored)}})

    def _search(self, method: Method, traced: StepTrace, split: pipeline.SplitStep | None,
                fp: str, cluster: ClusterSpec, device_ids: list[int]) -> Plan:
        program = traced.program
        if split is not None:
            return pipeline_search.search(
                split, method, cluster, device_ids, fp=fp,
                input_names=program.input_names, in_shapes=program.in_shapes,
                out_shapes=program.out_shapes,
                batch_size=_micro_size(program, method.num_micro_batches),
                progress=self.progress,
                state_bytes_per_param_byte=_state_per_param_byte(program))
        return planner.search(program, method, cluster, device_ids, fp=fp,
                              progress=self.progress)

    def _build(self, traced: Traced) -> Executable:
        """The executable of a traced step on this process's devices: the one place that
        chooses between a single mesh's program and the pipeline runtime."""
        devices = self._devices()
        donate = traced.donated_leaves()
        if traced.plan.stages:
            return _pipeline_runtime(traced, devices, donate)
        return emit(traced.graph, traced.plan, build_mesh(traced.plan, devices), donate)

    def _donated_args(self, traced: Traced) -> tuple[int, ...]:
        """Argument positions to donate: with "auto", those whose every leaf is replaced
        by an output (the state); else the user's `donate_argnums`."""
        if self.donate_argnums != "auto":
            return tuple(self.donate_argnums)
        tied = {i for _, i in traced.program.ties}
        leaf_pos = leaf_positions(traced.in_tree, traced._positions)
        out = []
        for pos in traced._positions:
            mine = [k for k, p in enumerate(leaf_pos) if p == pos]
            if mine and all(k in tied for k in mine):
                out.append(pos)
        return tuple(out)


def _verify(plan: Plan, program: planner.Program, split: pipeline.SplitStep | None,
            device_ids: Sequence[int]) -> None:
    """`verify_plan` of `plan` against the traced program (and its pipeline split)."""
    value_shapes = {v.id: v.shape for v in program.graph.values if v.producer is not None}
    stage_shapes = ({v.id: v.shape for v in split.forward_graph().values}
                    if split is not None else None)
    verify_plan(plan, program.in_shapes, program.out_shapes, value_shapes,
                max(device_ids) + 1, stage_value_shapes=stage_shapes)


def _compiled_peak_bytes(traced: Traced) -> float:
    """The compiled peak per device of a traced plan's step, bytes: the program's
    `memory_analysis()` (one mesh) or the largest stage's (pipelines)."""
    return traced.executable.compiled_peak_bytes(traced.lower().compile())


# Searches `_fit_compiled_memory` may run for a budgeted plan, and the margin it takes
# below the budget on each (the memory model's error is not the same on every layout).
_BUDGET_ROUNDS = 4
_BUDGET_MARGIN = 0.99


def _state_per_param_byte(program: planner.Program) -> float:
    """Bytes of the step's state inputs (optimizer moments, counters, statistics) per byte
    of its parameters (AdamW: 2)."""
    total = {"param": 0, "state": 0}
    for vid, role in zip(program.graph.invars, program.roles):
        if role in total:
            total[role] += program.graph.values[vid].nbytes
    return total["state"] / total["param"] if total["param"] else 0.0


def _micro_size(program: planner.Program, num_micro_batches: int) -> int | None:
    b = program.batch_size
    return b // num_micro_batches if b else None


def _pipeline_runtime(traced: Traced, devices, donate: Sequence[int]) -> PipelineRuntime:
    plan = traced.plan
    by_id = {d.id: d for d in devices}
    meshes = []
    for st in plan.stages:
        grid = np.array([by_id[i] for i in st.device_ids], dtype=object).reshape(st.mesh_shape)
        meshes.append(Mesh(grid, st.mesh_axes,
                           axis_types=(AxisType.Auto,) * len(st.mesh_axes)))
    sched = schedules.make(plan.schedule, len(plan.stages), plan.num_micro_batches)
    return PipelineRuntime(traced.split, traced.split.forward_graph(), plan, meshes, sched,
                           set(traced._trace.batch_positions), ties=traced.program.ties,
                           donate=donate)


def _resolve_cluster(cluster: ClusterSpec | str | None, devices) -> ClusterSpec:
    if cluster is None:
        if devices is None:
            raise ValueError("offline planning needs a cluster: a ClusterSpec, a preset name "
                             f"(one of {ClusterSpec.presets()}) or a JSON path")
        return ClusterSpec.from_devices(devices)
    if isinstance(cluster, ClusterSpec):
        return cluster
    if os.path.exists(cluster):
        return ClusterSpec.load(cluster)
    return ClusterSpec.preset(cluster)


def parallelize(fun: Callable | None = None, *, method: Method | None = None,
                batch_argnums: int | Sequence[int] = (1,),
                static_argnums: int | Sequence[int] = (),
                donate_argnums: int | Sequence[int] | Literal["auto"] = "auto",
                plan: Plan | str | os.PathLike | None = None,
                devices: Sequence[jax.Device] | None = None,
                cluster: ClusterSpec | str | None = None):
    """Parallelizes a train step; usable as `@parallelize` or `@parallelize(method=...)`.

    Args:
      fun: the step, a pure function of pytrees of arrays.
      method: `ShardParallel()` (default), `DataParallel()`, `Zero2Parallel()`,
        `Zero3Parallel()`.
      batch_argnums: positions of the batch arguments (split over devices by data parallel
        plans; their dim 0 is the batch).
      static_argnums: positions of hashable non-array arguments (a new value re-plans).
      donate_argnums: positions whose buffers the step may reuse; "auto" (the default)
        donates every argument the step returns a replacement for (the state: parameters,
        optimizer state), as `jax.jit(donate_argnums=...)` would — the arrays passed in are
        then deleted.  `()` turns donation off.
      plan: a `Plan` or the path of a saved one: run it without searching.
      devices: devices to use (default: all of `jax.devices()`).
      cluster: cost model: a `ClusterSpec`, a preset name or a JSON path
        (default: `ClusterSpec.from_devices(devices)`).
    """
    def wrap(f: Callable) -> ParallelizedFunction:
        return ParallelizedFunction(f, method=method, batch_argnums=batch_argnums,
                                    static_argnums=static_argnums, donate_argnums=donate_argnums,
                                    plan=plan, devices=devices, cluster=cluster)

    return wrap(fun) if fun is not None else wrap


def place(step: ParallelizedFunction, *args) -> tuple:
    """`args` laid out as `step`'s program expects them (`step.input_shardings(*args)`):
    every leaf of every dynamic argument moved by one `jax.device_put` (device to device
    for arrays already on devices: no host gather); static arguments returned as given.
    Across processes (`global_data.place_leaves`, which every process calls): numpy values
    and arrays on this process's own devices (what `init_state()` returns when every process
    runs it) are each process's copy of the same value, and each process cuts its shards
    from it; global arrays (over several processes' devices) move device to device.
    A step called on the placed arguments moves nothing before it runs.

    Example: `state, batch = autopar.place(step, init_state(), batch)`.
    """
    traced = step.trace(*args)
    dynamic, _, positions = step._split(args)
    leaves = jax.tree_util.tree_leaves(dynamic)
    shardings = traced._shardings("in")
    moved = (jax.device_put(leaves, shardings) if not transfer.multi_process()
             else global_data.place_leaves(leaves, shardings, traced.program.input_names))
    placed = jax.tree_util.tree_unflatten(traced.in_tree, moved)
    out = list(args)
    for pos, value in zip(positions, placed):
        out[pos] = value
    return tuple(out)


def plan(train_step: Callable, *abstract_args, cluster: ClusterSpec | str,
         method: Method | None = None, batch_argnums: int | Sequence[int] = (1,),
         static_argnums: int | Sequence[int] = (),
         progress: Callable[[str], None] | None = None) -> Plan:
    """Plans `train_step` for `cluster` without its devices (abstract shapes and the
    cluster's cost model only).  Arguments may be arrays or `jax.ShapeDtypeStruct`s.
    `progress(message)` is called at each phase boundary of the search (trace, layering,
    each layer / stage / mesh-shape ILP, stage DP)."""
    step = ParallelizedFunction(train_step, method=method, batch_argnums=batch_argnums,
                                static_argnums=static_argnums, donate_argnums=(), plan=None,
                                devices=None, cluster=cluster, offline=True,
                                progress=progress)
    return step.get_plan(*abstract_args)

"""The pipeline runtime: runs a split step on stage sub-meshes under a schedule.

Per stage: a forward jit returning (outputs, `jax.vjp` residuals, integer outputs) and a
backward jit applying the residuals to the output cotangents, each on the stage's own
`Mesh`.  Activations and cotangents move between stages with `jax.device_put`; dispatch is
asynchronous, so stages overlap.  Gradients accumulate per stage (the loss cotangent of a
micro-batch is 1/N, so the sums are means).  The outer program (apply-grad, and the
batch-free work before the marker) runs as jitted segments, each on the stage that holds
most of its inputs; the few values a segment needs from other stages are moved explicitly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.graph import Graph, Lit, is_float

from .microbatch import micro_slice
from .pipeline import SplitStep, StageProgram
from .schedules import Schedule


def _on_mesh(x: Any, sharding: NamedSharding) -> Any:
    """`x` laid out as `sharding` (no copy when it already is)."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    return jax.device_put(x, sharding)


def _on_devices(x: Any, mesh: Mesh) -> Any:
    """`x` on `mesh`'s devices: kept as is if already there, else replicated there."""
    if isinstance(x, jax.Array) and x.sharding.device_set == set(mesh.devices.flat):
        return x
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))


@dataclasses.dataclass(frozen=True, eq=False)
class StageFunction:
    """A stage of F as a function: (differentiable inputs, other inputs) → (float outputs,
    integer outputs), with the value ids of each list."""

    graph: Graph
    program: StageProgram
    diff_ids: tuple[int, ...]
    nondiff_ids: tuple[int, ...]
    float_outs: tuple[int, ...]
    int_outs: tuple[int, ...]
    remat: bool = False

    @staticmethod
    def build(graph: Graph, program: StageProgram, diff_values: set[int],
              remat: bool = False) -> StageFunction:
        """`remat`: the forward keeps only the stage inputs and the backward recomputes the
        stage (`jax.checkpoint`) — the step's own `jax.checkpoint`/`nn.remat` boundaries are
        gone once F is flattened, so pipelines rematerialize per stage instead."""
        values = graph.values
        diff = tuple(v for v in program.inputs if v in diff_values and is_float(values[v].dtype))
        return StageFunction(
            graph, program, diff, tuple(v for v in program.inputs if v not in diff),
            tuple(v for v in program.outputs if is_float(values[v].dtype)),
            tuple(v for v in program.outputs if not is_float(values[v].dtype)), remat)

    def __call__(self, diff: Sequence[Any], nondiff: Sequence[Any]):
        env = dict(zip(self.diff_ids, diff))
        env.update(zip(self.nondiff_ids, nondiff))
        self.graph.run_eqns(self.program.eqns, env)
        return [env[o] for o in self.float_outs], [env[o] for o in self.int_outs]

    def forward(self, diff: Sequence[Any], nondiff: Sequence[Any]):
        """(float outputs, vjp function holding the residuals, integer outputs)."""
        fun = lambda *d: self(d, nondiff)
        return jax.vjp(jax.checkpoint(fun) if self.remat else fun, *diff, has_aux=True)

    def forward_backward(self, diff: Sequence[Any], nondiff: Sequence[Any],
                         cts: Sequence[Any]):
        """One micro-batch's forward and backward (what the planner prices)."""
        outs, vjp_fn, ints = self.forward(diff, nondiff)
        return outs, ints, vjp_fn(list(cts))


class StageRunner:
    """Compiled forward and backward of one stage on its mesh."""

    def __init__(self, fn: StageFunction, mesh: Mesh, input_specs: dict[int, PartitionSpec]):
        self.fn = fn
        self.program = fn.program
        self.mesh = mesh
        self.diff_ids, self.nondiff_ids = list(fn.diff_ids), list(fn.nondiff_ids)
        self.float_outs, self.int_outs = list(fn.float_outs), list(fn.int_outs)
        self.shardings = {v: NamedSharding(mesh, input_specs.get(v, PartitionSpec()))
                          for v in fn.program.inputs}
        self.forward = jax.jit(fn.forward)
        self.backward = jax.jit(lambda vjp_fn, cts: vjp_fn(cts))

    def place(self, vid: int, x: Any) -> Any:
        return _on_mesh(x, self.shardings[vid])


@dataclasses.dataclass(eq=False)
class _Segment:
    stage: int
    eqns: list[int]
    inputs: list[Any] = dataclasses.field(default_factory=list)
    outputs: list[Any] = dataclasses.field(default_factory=list)
    fn: Any = None


class PipelineRuntime:
    """Runs one step of a split program.

    Args:
      split: the step split around its compute-grad equation.
      graph: F flattened (the graph `split.forward_graph()` returns).
      stages: (program, mesh, input specs) of every stage, in pipeline order.
      schedule: the task order (GPipe or 1F1B).
      batch_positions: step input positions of the batch leaves.
    """

    def __init__(self, split: SplitStep, graph: Graph,
                 stages: Sequence[tuple[StageProgram, Mesh, dict[int, PartitionSpec]]],
                 schedule: Schedule, batch_positions: set[int]):
        self.split = split
        self.graph = graph
        self.schedule = schedule
        self.num_micro_batches = schedule.num_micro_batches
        jaxpr = split.step.jaxpr
        # F inputs: value ids in `graph`, and which step variable feeds each.
        self.f_inputs = list(graph.invars)
        self.f_source = list(split.forward_inputs)
        batch_vars = {v for i, v in enumerate(jaxpr.invars) if i in batch_positions}
        self.f_is_batch = [v in batch_vars for v in self.f_source]
        diff_values = {self.f_inputs[j] for j in split.diff_inputs}
        produced = {o for prog, _, _ in stages for i in prog.eqns for o in graph.eqns[i].outputs}
        self.stages = [StageRunner(StageFunction.build(graph, prog, diff_values | produced,
                                                       remat=split.remat), mesh, specs)
                       for prog, mesh, specs in stages]
        self.stage_of_value = {o: s for s, st in enumerate(self.stages)
                               for i in st.program.eqns for o in graph.eqns[i].outputs}
        self.owner = self._owners()
        self.pre, self.post = self._segments()
        self.in_flight_max: list[int] = [0] * len(self.stages)

    # ---- placement -------------------------------------------------------------------------

    def _owners(self) -> dict[int, int]:
        """F input value → the first stage that reads it (where its gradient lands)."""
        owner: dict[int, int] = {}
        for s, st in enumerate(self.stages):
            for v in st.program.inputs:
                owner.setdefault(v, s)
        return owner

    def _segments(self) -> tuple[list[_Segment], list[_Segment]]:
        split = self.split
        jaxpr = split.step.jaxpr
        home: dict[Any, int] = {}
        last = len(self.stages) - 1
        for src, vid in zip(self.f_source, self.f_inputs):
            if not isinstance(src, jcore.Literal) and vid in self.owner:
                home.setdefault(src, self.owner[vid])
        marker = split.marker_eqn
        grads = marker.outvars[len(marker.outvars) - len(split.diff_inputs):]
        for v in marker.outvars[:len(marker.outvars) - len(split.diff_inputs)]:
            home[v] = last
        for v, j in zip(grads, split.diff_inputs):
            home[v] = self.owner.get(self.f_inputs[j], 0)
        nbytes = lambda v: int(np.prod(v.aval.shape)) * getattr(v.aval.dtype, "itemsize", 4)

        def assign(indices: list[int]) -> list[_Segment]:
            # Each equation runs on the stage holding most of its input bytes.  Its round is
            # one more than that of any input made on another stage (a transfer happens
            # between rounds); equations of one (round, stage) form one jitted segment, and
            # segments run round by round, so data only flows forward.  A global grad-norm
            # clip, say, becomes: per-stage partial norms, one combine, per-stage updates.
            rounds: dict[Any, int] = {}
            groups: dict[tuple[int, int], _Segment] = {}
            for i in indices:
                eqn = jaxpr.eqns[i]
                ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
                known = [v for v in ins if v in home]
                stage = home[max(known, key=nbytes)] if known else 0
                for v in ins:
                    home.setdefault(v, stage)
                r = max([rounds.get(v, 0) + (home[v] != stage) for v in ins], default=0)
                seg = groups.get((r, stage))
                if seg is None:
                    seg = groups[(r, stage)] = _Segment(stage, [])
                seg.eqns.append(i)
                for v in eqn.outvars:
                    home[v] = stage
                    rounds[v] = r
            return [groups[k] for k in sorted(groups)]

        skip = split.forward_eqns | {split.marker}
        pre = assign([i for i in range(split.marker) if i not in skip])
        post = assign([i for i in range(split.marker + 1, len(jaxpr.eqns))])
        self._wire(pre + post)
        return pre, post

    def _wire(self, segments: list[_Segment]) -> None:
        jaxpr = self.split.step.jaxpr
        needed_later: set[Any] = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
        needed_later.update(v for v in self.f_source if not isinstance(v, jcore.Literal))
        for seg in segments:
            produced = {v for i in seg.eqns for v in jaxpr.eqns[i].outvars}
            reads: list[Any] = []
            for i in seg.eqns:
                for v in jaxpr.eqns[i].invars:
                    if not isinstance(v, jcore.Literal) and v not in produced and v not in reads:
                        reads.append(v)
            seg.inputs = reads
        for seg in segments:
            produced = [v for i in seg.eqns for v in jaxpr.eqns[i].outvars]
            used_elsewhere = {v for other in segments if other is not seg for v in other.inputs}
            seg.outputs = [v for v in produced if v in used_elsewhere or v in needed_later]
            seg.fn = jax.jit(self._segment_fn(seg))

    def _segment_fn(self, seg: _Segment):
        jaxpr = self.split.step.jaxpr
        consts = dict(zip(jaxpr.constvars, self.split.step.consts))

        def fn(*xs):
            env = dict(consts)
            env.update(zip(seg.inputs, xs))
            read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
            for i in seg.eqns:
                e = jaxpr.eqns[i]
                with e.ctx.manager:
                    outs = e.primitive.bind(*[read(v) for v in e.invars],
                                            **e.primitive.get_bind_params(e.params))
                env.update(zip(e.outvars, outs if e.primitive.multiple_results else [outs]))
            return [env[v] for v in seg.outputs]

        return fn

    def _run_segments(self, segments: list[_Segment], env: dict[Any, Any]) -> None:
        for seg in segments:
            mesh = self.stages[seg.stage].mesh
            args = [_on_devices(env[v], mesh) for v in seg.inputs]
            env.update(zip(seg.outputs, seg.fn(*args)))

    def lower(self, *flat_args: Any) -> PipelineLowered:
        """Every stage's programs, for inspection (`.compile()`)."""
        return PipelineLowered(self)

    # ---- one step --------------------------------------------------------------------------

    def __call__(self, *flat_args: Any) -> list[Any]:
        split, graph = self.split, self.graph
        jaxpr = split.step.jaxpr
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, split.step.consts))
        env.update(zip(jaxpr.invars, flat_args))
        self._run_segments(self.pre, env)
        n = self.num_micro_batches
        full = {vid: (src.val if isinstance(src, jcore.Literal) else env[src])
                for vid, src in zip(self.f_inputs, self.f_source)}
        batch_vids = {vid for vid, b in zip(self.f_inputs, self.f_is_batch) if b}
        acts: dict[tuple[int, int], Any] = {}
        cts: dict[tuple[int, int], Any] = {}
        residuals: dict[tuple[int, int], Any] = {}
        grads: dict[int, Any] = {}
        placed: dict[tuple[int, int], Any] = {}
        alive = [0] * len(self.stages)
        self.in_flight_max = [0] * len(self.stages)
        loss_vid = graph.outvars[0]
        outputs = list(graph.outvars)
        final = {op for op in outputs if isinstance(op, int)}

        def stage_input(s: int, vid: int, m: int) -> Any:
            st = self.stages[s]
            if vid in full:
                if vid in batch_vids:
                    return st.place(vid, micro_slice(full[vid], n, m))
                key = (s, vid)
                if key not in placed:
                    placed[key] = st.place(vid, full[vid])
                return placed[key]
            return st.place(vid, acts[(vid, m)])

        for task in self.schedule.order():
            s, m = task.stage, task.micro_batch
            st = self.stages[s]
            if task.kind == "fwd":
                diff = [stage_input(s, v, m) for v in st.diff_ids]
                nondiff = [stage_input(s, v, m) for v in st.nondiff_ids]
                outs, vjp_fn, ints = st.forward(diff, nondiff)
                for v, x in zip(st.float_outs + st.int_outs, list(outs) + list(ints)):
                    acts[(v, m)] = x
                residuals[(s, m)] = vjp_fn
                alive[s] += 1
                self.in_flight_max[s] = max(self.in_flight_max[s], alive[s])
            else:
                out_cts = []
                for v in st.float_outs:
                    ct = cts.pop((v, m), None)
                    if ct is None:
                        ct = jnp.zeros_like(acts[(v, m)])
                    if v == loss_vid:
                        ct = ct + jnp.asarray(1.0 / n, acts[(v, m)].dtype)
                    out_cts.append(ct)
                in_cts = st.backward(residuals.pop((s, m)), out_cts)
                alive[s] -= 1
                for v in st.float_outs + st.int_outs:   # consumers' forwards are done
                    if v not in final:
                        acts.pop((v, m), None)
                for v, g in zip(st.diff_ids, in_cts):
                    if v in full:   # a parameter: its gradient lives on its owner stage
                        g = self.stages[self.owner[v]].place(v, g)
                        grads[v] = g if v not in grads else grads[v] + g
                    else:
                        g = _on_mesh(g, acts[(v, m)].sharding)
                        cts[(v, m)] = g if (v, m) not in cts else cts[(v, m)] + g
        # The marker's outputs: mean loss and aux over micro-batches, then the gradients.
        marker = split.marker_eqn
        values = []
        for op in outputs:
            if isinstance(op, Lit):
                values.append(op.value)
                continue
            parts = [acts[(op, m)] for m in range(n)] if (op, 0) in acts else [full[op]] * n
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            values.append(total / n if is_float(parts[0].dtype) else parts[-1])
        grad_values = []
        for j in split.diff_inputs:
            vid = self.f_inputs[j]
            grad_values.append(grads[vid] if vid in grads else jnp.zeros_like(full[vid]))
        env.update(zip(marker.outvars, values + grad_values))
        self._run_segments(self.post, env)
        return [v.val if isinstance(v, jcore.Literal) else env[v] for v in jaxpr.outvars]

    # ---- layouts (`Traced.input_shardings` / `output_shardings`, checkpoints) --------------

    def input_shardings(self) -> list[jax.sharding.Sharding]:
        """Where each flattened step input must be for a call to move nothing: a leaf that a
        stage reads (parameters, the batch) on the mesh of the first stage that reads it, in
        that stage's input spec; a leaf only the outer program reads, replicated on the
        mesh of the first segment that reads it; an unread leaf replicated on stage 0."""
        home: dict[Any, jax.sharding.Sharding] = {}
        for src, vid in zip(self.f_source, self.f_inputs):
            if not isinstance(src, jcore.Literal) and vid in self.owner:
                home.setdefault(src, self.stages[self.owner[vid]].shardings[vid])
        for seg in self.pre + self.post:
            for v in seg.inputs:
                home.setdefault(v, NamedSharding(self.stages[seg.stage].mesh, PartitionSpec()))
        default = NamedSharding(self.stages[0].mesh, PartitionSpec())
        return [home.get(v, default) for v in self.split.step.jaxpr.invars]

    def output_shardings(self) -> list[jax.sharding.Sharding]:
        """The layout of each flattened step output when the inputs are laid out as
        `input_shardings()` says, read from the compiled programs that make it (stage
        forwards for the loss and aux, outer segments for the rest); a constant output
        (returned as a host value) is listed as replicated on the last stage."""
        split, graph = self.split, self.graph
        jaxpr = split.step.jaxpr
        env: dict[Any, Any] = {v: jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=s)
                               for v, s in zip(jaxpr.invars, self.input_shardings())}
        env.update(zip(jaxpr.constvars, split.step.consts))

        def run(segments: list[_Segment]) -> None:
            for seg in segments:
                mesh = self.stages[seg.stage].mesh
                args = [_abstract_on(env[v], mesh) for v in seg.inputs]
                env.update(zip(seg.outputs, seg.fn.lower(*args).compile().output_shardings))
                for v in seg.outputs:
                    env[v] = jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=env[v])

        run(self.pre)
        full = {vid: env[src] for vid, src in zip(self.f_inputs, self.f_source)
                if not isinstance(src, jcore.Literal)}
        final = {op for op in graph.outvars if isinstance(op, int)}
        made: dict[int, jax.sharding.Sharding] = {}
        for st in self.stages:
            if final.isdisjoint(st.float_outs + st.int_outs):
                continue
            spec = lambda v, st=st: jax.ShapeDtypeStruct(
                graph.values[v].shape, graph.values[v].dtype, sharding=st.shardings[v])
            outs, _, ints = st.forward.lower([spec(v) for v in st.diff_ids],
                                             [spec(v) for v in st.nondiff_ids]
                                             ).compile().output_shardings
            made.update(zip(st.float_outs + st.int_outs, list(outs) + list(ints)))
        last = NamedSharding(self.stages[-1].mesh, PartitionSpec())
        values = [last if not isinstance(op, int)
                  else made[op] if op in made else _sharding_of(full.get(op), last)
                  for op in graph.outvars]
        differentiated = {v for st in self.stages for v in st.diff_ids}
        for j in split.diff_inputs:
            vid = self.f_inputs[j]
            values.append(self.stages[self.owner[vid]].shardings[vid] if vid in differentiated
                          else _sharding_of(full.get(vid), last))
        marker = split.marker_eqn
        for v, s in zip(marker.outvars, values):
            env[v] = jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=s)
        run(self.post)
        return [last if isinstance(v, jcore.Literal) else _sharding_of(env[v], last)
                for v in jaxpr.outvars]


def _sharding_of(x: Any, default: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """The sharding of an array or a sharded `ShapeDtypeStruct`; `default` for host values."""
    sharding = getattr(x, "sharding", None)
    return sharding if isinstance(sharding, jax.sharding.Sharding) else default


def _abstract_on(x: Any, mesh: Mesh) -> jax.ShapeDtypeStruct:
    """What `_on_devices(x, mesh)` gives, as a sharded `ShapeDtypeStruct`."""
    replicated = NamedSharding(mesh, PartitionSpec())
    sharding = _sharding_of(x, replicated)
    if sharding.device_set != set(mesh.devices.flat):
        sharding = replicated
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


@dataclasses.dataclass(frozen=True)
class StageCompiled:
    """JAX's compiled forward and backward programs of one stage."""

    stage: int
    forward: Any
    backward: Any


class PipelineLowered:
    """`step.lower(...)` for pipeline plans: `.compile()` compiles every stage."""

    def __init__(self, runtime: PipelineRuntime):
        self.runtime = runtime

    def compile(self) -> list[StageCompiled]:
        out = []
        graph = self.runtime.graph
        for s, st in enumerate(self.runtime.stages):
            def spec(v, st=st):
                val = graph.values[v]
                return jax.ShapeDtypeStruct(val.shape, val.dtype, sharding=st.shardings[v])

            diff = [spec(v) for v in st.diff_ids]
            nondiff = [spec(v) for v in st.nondiff_ids]
            fwd = st.forward.lower(diff, nondiff)
            outs, vjp_fn, _ = jax.eval_shape(st.fn.forward, diff, nondiff)
            bwd = st.backward.lower(vjp_fn, list(outs))
            out.append(StageCompiled(s, fwd.compile(), bwd.compile()))
        return out

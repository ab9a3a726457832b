"""The pipeline runtime: runs a split step on stage sub-meshes under a schedule.

Per step: the outer program's batch-free work (`outer`), then for every task of the
schedule (computed once) one call — a stage's forward or backward on one micro-batch
(`stage_runner`) — with the activations moved to the next stage's layout and the
cotangents moved back by `jax.device_put`; dispatch is asynchronous, so stages overlap.
Each stage adds its micro-batches' parameter gradients into donated accumulators, kept
unreduced over the data-parallel axes, and reduces them once at the end of the step
(`finalize`).  Loss and aux outputs are averaged over micro-batches (the loss cotangent of
a micro-batch is 1/N, so the gradient sums are means).  Then apply-grad runs as jitted
segments on the owner stages, with parameters and optimizer state in the plan's layouts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.extend.core as jcore
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding

from autopar.cost_model import hlo_audit
from autopar.graph import Graph, Lit, is_float

from . import outer, schedules, transfer
from .layer import differentiable_values
from .microbatch import micro_slice
from .pipeline import SplitStep, program_for_range
from .plan import Plan
from .schedules import Schedule
from .stage_runner import StageRunner

# Largest step output (bytes) that is not state and is returned on every process of a
# multi-process pipeline (the loss and metrics; see PipelineRuntime._outputs_everywhere).
EVERYWHERE_MAX_BYTES = 1 << 20


class PipelineRuntime:
    """Runs one step of a split program under a pipeline plan.

    Args:
      split: the step split around its compute-grad equation.
      graph: F flattened (the graph `split.forward_graph()` returns).
      plan: the plan (its `stages`).
      meshes: every stage's `Mesh`, in pipeline order.
      schedule: the task order (GPipe or 1F1B).
      batch_positions: step input positions of the batch leaves.
      ties: (step output position, step input position) pairs: the output replaces the input.
      donate: step input positions whose buffers the step may reuse (tied state).
    """

    #: A call drives every stage's programs from Python (`executable.Executable`).
    one_program: ClassVar[bool] = False

    def __init__(self, split: SplitStep, graph: Graph, plan: Plan, meshes: Sequence[Mesh],
                 schedule: Schedule, batch_positions: set[int],
                 ties: Sequence[tuple[int, int]] = (), donate: Sequence[int] = ()):
        self.split, self.graph, self.plan = split, graph, plan
        self.meshes = list(meshes)
        self.schedule = schedule
        self.order = tuple(schedule.order())
        self.num_micro_batches = n = schedule.num_micro_batches
        jaxpr = split.step.jaxpr
        self.f_inputs = list(graph.invars)
        self.f_source = list(split.forward_inputs)
        batch_vars = {v for i, v in enumerate(jaxpr.invars) if i in batch_positions}
        self.batch_vids = {vid for vid, src in zip(self.f_inputs, self.f_source)
                           if src in batch_vars}
        params = {self.f_inputs[j] for j in split.diff_inputs}
        diff = differentiable_values(graph, sorted(params))
        programs = [program_for_range(graph, *st.eqn_range) for st in plan.stages]
        self.stage_of_value = {o: s for s, prog in enumerate(programs) for i in prog.eqns
                               for o in graph.eqns[i].outputs}
        receivers = [[v for v in prog.outputs if v in diff and is_float(graph.values[v].dtype)
                      and any(v in later.inputs for later in programs[s + 1:])]
                     for s, prog in enumerate(programs)]
        loss = graph.outvars[0] if isinstance(graph.outvars[0], int) else None
        static_ids = set(self.f_inputs) - self.batch_vids
        f_outputs = frozenset(op for op in graph.outvars if isinstance(op, int))
        self.stages = [StageRunner(graph, st, mesh, diff, params, static_ids, receivers[s],
                                   loss, n, split.remat, f_outputs)
                       for s, (st, mesh) in enumerate(zip(plan.stages, self.meshes))]
        # Per stage output, how many stages read it (each in its forward of a micro-batch).
        self._readers = {v: sum(v in st.micro_ids for st in self.stages)
                         for prog in programs for v in prog.outputs}
        self.owner: dict[int, int] = {}
        for s, st in enumerate(self.stages):
            for v in st.program.inputs:
                self.owner.setdefault(v, s)
        self._lay_out_transfers(programs)
        self._splitters = [self._splitter(st) for st in self.stages]
        self.pre, self.post = self._outer(ties, donate)
        self.in_flight_max: list[int] = [0] * len(self.stages)
        # Emulated CPU devices in one process: a step returns once its results are ready.
        # With the next step dispatched while this one runs, XLA's CPU client interleaved
        # the two steps' programs differently on different devices and an all-gather
        # waited forever for its last device (1 stage on 8 devices, the 5th unblocked step,
        # jax 0.10.2); pipelined steps on other platforms stay asynchronous, and several
        # processes dispatch synchronously already (distributed.initialize).
        self._everywhere = self._outputs_everywhere(ties)
        self._wait_for_step = (not transfer.multi_process() and all(
            d.platform == "cpu" for m in self.meshes for d in m.devices.flat))
        # One stage whose schedule runs each micro-batch's forward then its backward (1F1B):
        # nothing overlaps, and the whole stage step is one program (`fused_step`).
        alternating = tuple(("fwd" if k % 2 == 0 else "bwd", 0, k // 2)
                            for k in range(2 * n))
        self.fused = (len(self.stages) == 1 and self.stages[0].can_fuse(self.batch_vids)
                      and tuple((t.kind, t.stage, t.micro_batch) for t in self.order)
                      == alternating)

    # ---- construction -----------------------------------------------------------------------

    def _lay_out_transfers(self, programs: Sequence[Any]) -> None:
        """Each activation leaves its stage in the tiling its first reader takes it in, and
        each cotangent goes back in the tiling of its activation's planned layout
        (`StageRunner.send`), where the two stages have as many devices."""
        # Where each cotangent arrives: its activation's planned layout on the producer.
        self._ct_shardings = {v: self.stages[self.stage_of_value[v]].output_sharding(v)
                              for st in self.stages for v in st.act_ct_ids
                              if v in self.stage_of_value}

        def devices(st: StageRunner) -> list[jax.Device]:
            return list(st.mesh.devices.flat)

        sends: list[dict[int, Sharding]] = []
        for s, st in enumerate(self.stages):
            sends.append({})
            for v in st.float_outs + st.int_outs:
                reader = next((c for c in range(s + 1, len(self.stages))
                               if v in programs[c].inputs), None)
                if reader is not None and len(devices(self.stages[reader])) == len(devices(st)):
                    sends[s][v] = transfer.with_tiling(
                        self.stages[reader].input_shardings[v], devices(st))
        for st, outs in zip(self.stages, sends):
            cts = {}
            for v in st.act_ct_ids:
                p = self.stage_of_value.get(v)
                if p is not None and len(devices(self.stages[p])) == len(devices(st)):
                    cts[v] = transfer.with_tiling(self._ct_shardings[v], devices(st))
            st.send(outs, cts)

    def _splitter(self, st: StageRunner):
        """One jit per stage: every batch input it reads → its N micro-batches, in the
        stage's layout (strided rows: no data moves under a batch-split layout)."""
        vids = [v for v in st.micro_ids if v in self.batch_vids]
        if not vids:
            return vids, None
        n = self.num_micro_batches
        shardings = [st.input_shardings[v] for v in vids]
        fn = jax.jit(lambda *xs: [[micro_slice(x, n, m) for m in range(n)] for x in xs],
                     in_shardings=shardings, out_shardings=[[sh] * n for sh in shardings])
        return vids, fn

    def _outer(self, ties: Sequence[tuple[int, int]], donate: Sequence[int]):
        split = self.split
        closed = split.step
        jaxpr = closed.jaxpr
        marker = split.marker_eqn
        num_grads = len(split.diff_inputs)
        home: dict[Any, int] = {}
        known: dict[Any, tuple[int, Sharding]] = {}
        # A parameter, its gradient and everything elementwise from them (optimizer moments,
        # the update) take the parameter's state layout; the parameter itself, as the step
        # takes and returns it, keeps the layout its stage reads it in.
        as_read: dict[Any, tuple[int, Sharding]] = {}
        for src, vid in zip(self.f_source, self.f_inputs):
            if isinstance(src, jcore.Literal) or vid not in self.owner:
                continue
            s = self.owner[vid]
            st = self.stages[s]
            home.setdefault(src, s)
            if vid not in self.batch_vids:
                known.setdefault(src, (s, st.state_shardings.get(vid, st.input_shardings[vid])))
                if vid in st.state_shardings:
                    as_read.setdefault(src, (s, st.input_shardings[vid]))
        for v, j in zip(marker.outvars[len(marker.outvars) - num_grads:], split.diff_inputs):
            vid = self.f_inputs[j]
            s = self.owner.get(vid, 0)
            home[v] = s
            if vid in self.owner:
                known[v] = (s, self.stages[s].state_shardings[vid])
        for v, op in zip(marker.outvars, self.graph.outvars):
            if isinstance(op, int) and op in self.stage_of_value:
                home.setdefault(v, self.stage_of_value[op])
        tie_vars = [(jaxpr.outvars[o], jaxpr.invars[i]) for o, i in ties]
        skip = split.forward_eqns | {split.marker}
        pre_eqns = [i for i in range(split.marker) if i not in skip]
        post_eqns = list(range(split.marker + 1, len(jaxpr.eqns)))
        layouts = outer.state_layouts(jaxpr, pre_eqns + post_eqns, known, tie_vars)
        layouts.update(as_read)
        layouts.update((out, as_read[inp]) for out, inp in tie_vars
                       if inp in as_read and not isinstance(out, jcore.Literal))
        self.layouts = layouts
        for v, (s, _) in layouts.items():
            home.setdefault(v, s)
        pre = outer.assign(jaxpr, pre_eqns, home)
        post = outer.assign(jaxpr, post_eqns, home)
        needed = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
        needed.update(v for v in self.f_source if not isinstance(v, jcore.Literal))
        donated = set(donate)
        donatable = {jaxpr.invars[i] for _, i in ties if i in donated}
        outer.wire(closed, pre + post, needed, layouts, self.meshes, donatable)
        return pre, post

    # ---- one step ---------------------------------------------------------------------------

    def __call__(self, *flat_args: Any) -> list[Any]:
        split = self.split
        jaxpr = split.step.jaxpr
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, split.step.consts))
        env.update(zip(jaxpr.invars, flat_args))
        outer.run(self.pre, env)
        full = {vid: (src.val if isinstance(src, jcore.Literal) else env[src])
                for vid, src in zip(self.f_inputs, self.f_source)}
        static = [tuple(_stage_input(full[v], st.input_shardings[v])
                        for v in st.static_ids) for st in self.stages]
        if self.fused:
            st = self.stages[0]
            batch = [outer.place(full[v], st.input_shardings[v]) for v in st.micro_ids]
            self.in_flight_max = [1]
            return self._finish(env, full, [st.fused_step(static[0], batch)])
        parts: dict[tuple[int, int], list[Any]] = {}
        for s, (vids, fn) in enumerate(self._splitters):
            if fn is not None:
                st = self.stages[s]
                xs = [outer.place(full[v], st.input_shardings[v]) for v in vids]
                if st.local:
                    parts.update(((v, s), p) for v, p in zip(vids, fn(*xs)))
        acc = [st.zeros() if st.local else None for st in self.stages]
        # A stage's outputs, kept on its devices until the last stage reading them has run
        # that micro-batch's forward (`_readers`), and their layouts, kept until the
        # producer's backward (the cotangents coming back are laid out like them).
        acts: dict[tuple[int, int], Any] = {}
        unread: dict[tuple[int, int], int] = {}
        act_shardings: dict[tuple[int, int], Sharding] = {}
        cts: dict[tuple[int, int], Any] = {}
        saved: dict[tuple[int, int], tuple[list, list]] = {}
        alive = [0] * len(self.stages)
        self.in_flight_max = [0] * len(self.stages)
        for task in self.order:
            s, m = task.stage, task.micro_batch
            st = self.stages[s]
            if task.kind == "fwd":
                split_ids = self._splitters[s][0]
                micro = [(parts[(v, s)][m] if st.local else None) if v in split_ids else
                         outer.place(acts[(v, m)], st.input_shardings[v])
                         for v in st.micro_ids]
                for v in st.micro_ids:
                    if (v, m) in unread:
                        unread[(v, m)] -= 1
                        if not unread[(v, m)]:
                            del unread[(v, m)], acts[(v, m)]
                floats, ints, res = (st.forward(static[s], micro) if st.local
                                     else st.remote_forward())
                for v, x in zip(st.float_outs + st.int_outs, list(floats) + list(ints)):
                    act_shardings[(v, m)] = x.sharding
                    if self._readers.get(v):
                        acts[(v, m)], unread[(v, m)] = x, self._readers[v]
                saved[(s, m)] = ([micro[k] for k in st.kept_positions], res)
                alive[s] += 1
                self.in_flight_max[s] = max(self.in_flight_max[s], alive[s])
            else:
                kept, res = saved.pop((s, m))
                incoming = [cts.pop((v, m)) for v in st.ct_receivers]
                if st.local:
                    act_cts, acc[s] = st.backward(static[s], kept, res, incoming, acc[s])
                else:
                    act_cts = st.remote_backward()
                alive[s] -= 1
                for v, g in zip(st.act_ct_ids, act_cts):
                    g = outer.place(g, self._ct_shardings.get(v) or act_shardings[(v, m)])
                    if (v, m) in cts:   # a second consumer: add on the producer's devices
                        g = cts[(v, m)] + g if self.stages[self.stage_of_value[v]].local else g
                    cts[(v, m)] = g
                for v in st.float_outs + st.int_outs:   # consumers' forwards are done
                    act_shardings.pop((v, m), None)
        return self._finish(env, full, [st.finalize(a) if st.local else st.remote_finalize()
                                        for st, a in zip(self.stages, acc)])

    def _finish(self, env: dict[Any, Any], full: dict[int, Any],
                reduced: list[tuple[list, list]]) -> list[Any]:
        """The step after the stages: their reduced gradients and F outputs (`reduced`, per
        stage) into the marker's outputs, then apply-grad; the step's outputs."""
        split, graph = self.split, self.graph
        jaxpr = split.step.jaxpr
        grads, means = self._finalize(reduced)
        marker = split.marker_eqn
        values = [op.value if isinstance(op, Lit) else means[op] if op in means else full[op]
                  for op in graph.outvars]
        env.update(zip(marker.outvars, values + grads))
        outer.run(self.post, env)
        outs = [v.val if isinstance(v, jcore.Literal) else env[v] for v in jaxpr.outvars]
        for k, sharding in self._everywhere.items():
            outs[k] = transfer.to_every_process(outs[k], sharding)
        if self._wait_for_step:
            jax.block_until_ready(outs)
        return outs

    def _finalize(self, reduced: list[tuple[list, list]]) -> tuple[list[Any], dict[int, Any]]:
        """Each stage's reduced accumulators (what `finalize` returned) → the gradients in
        the marker's order (a parameter read by several stages summed on its owner), and
        F's outputs averaged over the micro-batches, by value id."""
        by_param: dict[int, Any] = {}
        means: dict[int, Any] = {}
        for st, (grads, outs) in zip(self.stages, reduced):
            means.update(zip(st.f_out_ids, outs))
            for v, g in zip(st.param_ids, grads):
                owner = self.stages[self.owner[v]]
                g = outer.place(g, owner.state_shardings[v])
                by_param[v] = by_param[v] + g if v in by_param and owner.local else g
        out = []
        for j in self.split.diff_inputs:
            vid = self.f_inputs[j]
            if vid in by_param:
                out.append(by_param[vid])
            else:   # not read by any stage: a zero gradient
                value = self.graph.values[vid]
                out.append(jax.numpy.zeros(value.shape, value.dtype))
        return out, means

    # ---- layouts ----------------------------------------------------------------------------

    def _f_output_sharding(self, vid: int) -> Sharding:
        return self.stages[self.stage_of_value[vid]].output_sharding(vid)

    def _sharding_of(self, var: Any, segments_key: str) -> Sharding:
        """Where the step keeps `var` (a step input or output variable)."""
        layout = self.layouts.get(var)
        if layout is not None:
            return layout[1]
        marker = self.split.marker_eqn
        for out, op in zip(marker.outvars, self.graph.outvars):
            if out is var and isinstance(op, int) and op in self.stage_of_value:
                return self._f_output_sharding(op)
        for src, vid in zip(self.f_source, self.f_inputs):
            if src is var and vid in self.owner:
                st = self.stages[self.owner[vid]]
                return NamedSharding(st.mesh, st.input_shardings[vid].spec)
        for seg in self.pre + self.post:
            names = seg.inputs if segments_key == "in" else seg.outputs
            shardings = seg.in_shardings if segments_key == "in" else seg.out_shardings
            if var in names:
                return shardings[names.index(var)]
        return NamedSharding(self.meshes[0], jax.sharding.PartitionSpec())

    def input_shardings(self) -> list[Sharding]:
        """The sharding the step takes each flattened input in (passing inputs laid out so
        moves nothing)."""
        return [self._sharding_of(v, "in") for v in self.split.step.jaxpr.invars]

    def output_shardings(self) -> list[Sharding | None]:
        """The sharding of each flattened output the step returns (None: a literal)."""
        return [None if isinstance(v, jcore.Literal) else
                self._everywhere[k] if k in self._everywhere else self._sharding_of(v, "out")
                for k, v in enumerate(self.split.step.jaxpr.outvars)]

    def _outputs_everywhere(self, ties: Sequence[tuple[int, int]]) -> dict[int, Sharding]:
        """Output positions returned replicated on every device of the step, by sharding:
        across processes, the outputs that are not new state (tied to no input) and at most
        EVERYWHERE_MAX_BYTES, whose layout leaves some process without them (the loss and
        metrics on the last stage): each process can then read them (`float(loss)`)."""
        if not transfer.multi_process():
            return {}
        devices = list(dict.fromkeys(d for m in self.meshes for d in m.devices.flat))
        everyone = {d.process_index for d in devices}
        whole = NamedSharding(Mesh(np.array(devices, dtype=object), ("_all",)),
                              jax.sharding.PartitionSpec())
        tied = {o for o, _ in ties}
        out: dict[int, Sharding] = {}
        for k, v in enumerate(self.split.step.jaxpr.outvars):
            if isinstance(v, jcore.Literal) or k in tied:
                continue
            nbytes = int(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize
            holders = {d.process_index for d in self._sharding_of(v, "out").device_set}
            if nbytes <= EVERYWHERE_MAX_BYTES and holders != everyone:
                out[k] = whole
        return out

    # ---- inspection -------------------------------------------------------------------------

    def lower(self, *args: Any) -> PipelineLowered:
        """Every program of one step, for inspection (`.compile()`)."""
        return PipelineLowered(self)

    def compiled_peak_bytes(self, compiled: PipelineCompiled) -> float:
        """The largest stage's compiled peak per device (`PipelineCompiled.
        stage_memory_bytes`), bytes."""
        return float(max(compiled.stage_memory_bytes()))


@dataclasses.dataclass(frozen=True)
class StageCompiled:
    """JAX's compiled programs of one stage: `forward` and `backward` run once per
    micro-batch, `zeros` and `finalize` (the gradient reduction) once per step; or, when
    the step runs the stage as one program (`step`, a one-stage 1F1B pipeline), that
    program once per step (the four others are compiled for inspection, not run).
    `param_bytes`: bytes per device of the parameters the stage owns (updates), as it
    reads them; `sent_bytes`: of the forward's outputs, bytes per device of those later
    stages read (held until they have read them, not until the backward); `kept_bytes`:
    bytes per device of the micro-batch inputs the step keeps for the backward to read
    again (a rematerialized layer's input) instead of the forward saving a copy."""

    stage: int
    forward: Any
    backward: Any
    zeros: Any
    finalize: Any
    step: Any = None
    param_bytes: float = 0.0
    sent_bytes: float = 0.0
    kept_bytes: float = 0.0


@dataclasses.dataclass(frozen=True)
class PipelineCompiled:
    """Every compiled program of one pipelined step.

    Attributes:
      stages: per stage, its compiled programs.
      segments: (stage, compiled) of every outer-program segment (apply-grad), run once
        per step.
      num_micro_batches: how many times each forward and backward runs per step.
    """

    stages: tuple[StageCompiled, ...]
    segments: tuple[tuple[int, Any], ...]
    num_micro_batches: int
    plan: Plan

    def programs(self) -> list[tuple[str, int, Any, int]]:
        """(name, stage, compiled, calls per step) of every program."""
        out = []
        for c in self.stages:
            if c.step is not None:
                out.append(("step", c.stage, c.step, 1))
                continue
            out += [("forward", c.stage, c.forward, self.num_micro_batches),
                    ("backward", c.stage, c.backward, self.num_micro_batches),
                    ("zeros", c.stage, c.zeros, 1), ("finalize", c.stage, c.finalize, 1)]
        out += [("apply", s, c, 1) for s, c in self.segments]
        return out

    def audits(self) -> list[tuple[str, int, hlo_audit.Audit, int]]:
        """(name, stage, HLO audit on the stage's mesh, calls per step) of every program."""
        out = []
        for name, s, compiled, calls in self.programs():
            st = self.plan.stages[s]
            out.append((name, s, hlo_audit.audit(compiled, st.mesh_shape, st.mesh_axes), calls))
        return out

    def collective_bytes_per_step(self) -> dict[str, float]:
        """Bytes per device of each collective kind over one step (every call counted)."""
        total: dict[str, float] = {}
        for _, _, audit, calls in self.audits():
            for kind, nbytes in audit.bytes_by_kind().items():
                total[kind] = total.get(kind, 0.0) + nbytes * calls
        return total

    def stage_memory_bytes(self) -> list[float]:
        """Per stage, bytes per device of the compiled step at its peak: the backward
        program (its arguments hold the parameters, one micro-batch's residuals and the
        gradient accumulators; plus its outputs and temporaries), the residuals of the other
        micro-batches the schedule keeps in flight (the forward's saved outputs, not those
        it sends on: the step drops its copy once the stages reading them have; and the
        inputs it keeps for the backward to read again), and the
        optimizer state the stage's apply segments hold beyond parameters and gradients."""
        sched = schedules.make(self.plan.schedule or "1f1b", len(self.stages),
                               self.num_micro_batches)
        in_flight = sched.max_in_flight()
        out = []
        for c in self.stages:
            peak = hlo_audit.MemoryUsage.of(c.step or c.backward).total_bytes
            # A one-program step holds its micro-batch's residuals in its temporaries.
            fwd_out = 0 if c.step is not None else max(
                0.0, c.forward.memory_analysis().output_size_in_bytes - c.sent_bytes
            ) + c.kept_bytes
            extra_state = 0
            for s, seg in self.segments:
                if s == c.stage:
                    m = seg.memory_analysis()
                    extra_state = max(extra_state, m.alias_size_in_bytes)
            # The apply segments update parameters and optimizer state in place (aliased);
            # the parameters are already in the backward's arguments.
            out.append(float(peak + (in_flight[c.stage] - 1) * fwd_out
                             + max(0, extra_state - c.param_bytes)))
        return out


class PipelineLowered:
    """`step.lower(...)` for pipeline plans: `.compile()` compiles every program."""

    def __init__(self, runtime: PipelineRuntime):
        self.runtime = runtime

    def compile(self) -> PipelineCompiled:
        rt = self.runtime
        stages = []
        for s, st in enumerate(rt.stages):
            low = st.lower_all(fused=rt.fused)
            owned = sum(_shard_bytes(rt.graph.values[v], st.input_shardings[v])
                        for v in st.param_ids if rt.owner[v] == s)
            sent = sum(_shard_bytes(rt.graph.values[v], st.send_sharding(v))
                       for v in st.float_outs + st.int_outs)
            kept = sum(_shard_bytes(rt.graph.values[v], st.input_shardings[v])
                       for v in st.kept_micro)
            stages.append(StageCompiled(s, *(low[k].compile() for k in
                                              ("forward", "backward", "zeros", "finalize")),
                                        step=low["step"].compile() if rt.fused else None,
                                        param_bytes=float(owned), sent_bytes=float(sent),
                                        kept_bytes=float(kept)))
        segments = []
        for seg in rt.pre + rt.post:
            args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=sh)
                    for v, sh in zip(seg.inputs, seg.in_shardings)]
            segments.append((seg.stage, seg.fn.lower(*args).compile()))
        return PipelineCompiled(tuple(stages), tuple(segments), rt.num_micro_batches, rt.plan)


def _shard_bytes(value: Any, sharding: Sharding) -> int:
    """Bytes of one device's piece of a graph value laid out as `sharding`."""
    return math.prod(sharding.shard_shape(tuple(value.shape))) * np.dtype(value.dtype).itemsize


def _stage_input(x: Any, sharding: Sharding) -> Any:
    """A step input (parameters, state) laid out for a stage.  Across processes a copy is
    moved, not the input itself: the receiving process reads a cross-process copy later,
    and apply-grad may donate (delete) the input before it has ("CopyRawSubBufferToHost()
    called on deleted or donated buffer" in 1 of 8 runs of a 2-process pipeline)."""
    if transfer.multi_process() and isinstance(x, jax.Array) and x.sharding != sharding:
        x = x.copy()
    # In one process `outer.place` moves device to device through fresh buffers
    # (`transfer.local_move`): the moved copy keeps no hold on `x`, whose donation by
    # apply-grad would otherwise be silently refused (a `device_put` of a replicated tied
    # embedding onto another stage's split layout did; every step then copied it).
    return outer.place(x, sharding)


"""One pipeline stage's compiled programs, emitted from its plan.

A stage runs its layers one after another, each under the layer's own intra-op solution
(`LayerPlan`: a sharding constraint on every value of the layer's forward+backward program,
the program the planner priced).  Per micro-batch the stage has two programs:

* forward: (stage inputs) → (float outputs, integer outputs, saved residuals);
* backward: (saved residuals, output cotangents, gradient accumulators) → (cotangents of
  the activations it received, updated accumulators).  The accumulators are donated; the
  parameter gradients in them stay unreduced over the data-parallel axes (`grad_accum`).

and per step two more: `zeros` (fresh accumulators) and `finalize` (accumulators → one
gradient per parameter in its state layout, `StagePlan.state_specs`: the step's one
reduction, a reduce-scatter where the optimizer state is split over the data-parallel
axes, else an all-reduce).

Inputs are split in two lists: `static` (F inputs that do not change between
micro-batches: parameters, RNG keys, ...), passed as one tuple built once per step, and
`micro` (the batch slices and the activations of earlier stages).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from autopar.graph import Graph, is_float
from autopar.passes.sharding_spec import Spec

from . import ordering, transfer
from .constraints import Constraints, to_pspec
from .grad_accum import (
    Deferral,
    DeferredBackward,
    GradSum,
    as_grad_sum,
    reduce_to,
    skip_sums,
    stacked_spec,
)
from .layer import LayerProgram
from .microbatch import micro_slice
from .passes import fallbacks
from .pipeline import StageProgram, program_for_range
from .plan import LayerPlan, StagePlan

#: Most micro-batches `fused_step` writes out one after another in its program: the
#: program grows (and its compile time) with each; more run as a loop over groups of
#: this many.
UNROLL = 8

Ref = tuple[int, Any]
"""Where a residual comes from: (layer, fb value id) computed in the stage, or (-1, F id)
for a stage input."""


@dataclasses.dataclass(frozen=True, eq=False)
class _Layer:
    program: LayerProgram
    constraints: Constraints | None
    deferred: DeferredBackward | None
    # The planned layout of each diff input's cotangent (`fn.diff_ids` order; None where
    # the plan names none).
    ct_specs: tuple[Spec | None, ...] = ()
    # The plan's layout of each value of the layer's forward+backward program.
    specs: Mapping[int, Spec] = dataclasses.field(default_factory=dict)


class StageError(ValueError):
    """A stage plan that does not match the program the runtime traced."""


class StageRunner:
    """Compiled forward, backward, zeros and finalize of one stage on its mesh.

    Args:
      graph: F flattened.
      plan: the stage's plan (mesh, input specs, per-layer solutions).
      mesh: the stage's `Mesh`.
      diff_values: F value ids that carry gradients.
      params: F input ids of the differentiated parameters.
      static_ids: F input ids that do not change between micro-batches.
      ct_receivers: float outputs of the stage whose cotangents later stages send back.
      loss_vid: F id of the loss (seeded with 1/num_micro_batches), if the stage makes it.
      num_micro_batches: micro-batches per step.
      remat: rematerialize every layer in the backward (the step does somewhere); else the
        layers the plan rematerializes (`LayerPlan.remat`).
      f_outputs: F's output value ids (loss and aux).
    """

    def __init__(self, graph: Graph, plan: StagePlan, mesh: Mesh, diff_values: set[int],
                 params: set[int], static_ids: set[int], ct_receivers: Sequence[int],
                 loss_vid: int | None, num_micro_batches: int, remat: bool,
                 f_outputs: frozenset[int] = frozenset()):
        self.graph, self.plan, self.mesh = graph, plan, mesh
        self.program: StageProgram = program_for_range(graph, *plan.eqn_range)
        specs = dict(plan.input_specs)
        self.input_shardings = {v: NamedSharding(mesh, to_pspec(specs[v])) if v in specs
                                else NamedSharding(mesh, PartitionSpec())
                                for v in self.program.inputs}
        # Each input's layout as the plan gives it (replicated where it gives none).
        self.input_specs: dict[int, Spec] = {
            v: specs.get(v, ((),) * graph.values[v].ndim) for v in self.program.inputs}
        self.static_ids = tuple(v for v in self.program.inputs if v in static_ids)
        self.micro_ids = tuple(v for v in self.program.inputs if v not in static_ids)
        values = graph.values
        self.float_outs = tuple(v for v in self.program.outputs if is_float(values[v].dtype))
        self.int_outs = tuple(v for v in self.program.outputs if not is_float(values[v].dtype))
        self.ct_receivers = tuple(ct_receivers)
        self.param_ids = tuple(v for v in self.program.inputs if v in params)
        # Each parameter's reduced gradient (and, on its owner, optimizer state and update):
        # the plan's state layout — the parameter's cut over the data-parallel axes (ZeRO-2)
        # — or the parameter's own.
        state = dict(plan.state_specs)
        self.state_specs: dict[int, Spec] = {
            v: state.get(v) or self.input_specs[v] for v in self.param_ids}
        self.state_shardings = {v: NamedSharding(mesh, to_pspec(self.state_specs[v]))
                                for v in self.param_ids}
        self.act_ct_ids = tuple(v for v in self.micro_ids
                                if v in diff_values and is_float(values[v].dtype))
        self.loss_vid = loss_vid if loss_vid in self.float_outs else None
        self.scale = 1.0 / num_micro_batches
        self.num_micro_batches = num_micro_batches
        self.layers = self._layers(diff_values, remat)
        self.refs = self._residual_refs()
        self.held_specs = self._held_specs()
        self.saved_refs = tuple(r for r in self.refs if r[0] != -1)
        # Micro-batch inputs the backward reads again (e.g. a rematerialized layer's input):
        # the runtime still holds them, so they are passed again rather than saved (a jit
        # returning its input would copy it).
        micro = set(self.micro_ids)
        self.kept_micro = tuple(r[1] for r in self.refs if r[0] == -1 and r[1] in micro)
        self.kept_positions = tuple(self.micro_ids.index(v) for v in self.kept_micro)
        # F's outputs (loss, aux) made here: averaged over the micro-batches in the
        # accumulators too (integer ones keep the last micro-batch's value).
        self.f_out_ids = tuple(v for v in self.program.outputs if v in f_outputs)
        self._grad_parts = self._discover_grad_parts()
        self._grad_specs = self._planned_grad_specs()
        acc_sh = self.accumulator_shardings()
        out_sh = [self.output_sharding(v) for v in self.f_out_ids]
        # (accumulators, F-output sums) as zeros / backward leave them; (gradients, F
        # outputs) as finalize returns them.
        self._acc_shardings = (acc_sh, out_sh)
        self._reduced_shardings = ([self.state_shardings[v] for v in self.param_ids], out_sh)
        # Every program's outputs have explicit layouts: across processes, the ones that do
        # not run a stage still know where its results live (transfer.placeholder).
        self.local = transfer.is_local(NamedSharding(mesh, PartitionSpec()))
        self.act_ct_shardings = [self.input_shardings[v] for v in self.act_ct_ids]
        self._sends: dict[int, Sharding] = {}
        self._ct_sends: dict[int, Sharding] = {}
        self._build_step_programs()
        self.zeros = jax.jit(self._zeros, out_shardings=self._acc_shardings)
        self.finalize = jax.jit(self._finalize, out_shardings=self._reduced_shardings)

    def _build_step_programs(self) -> None:
        self.forward = jax.jit(self._forward, out_shardings=(
            [self.send_sharding(v) for v in self.float_outs],
            [self.send_sharding(v) for v in self.int_outs], None))
        # Activation cotangents: as `send` set them; else XLA picks their layout in one
        # process, and across processes they need a layout known to every process (the
        # consumer's input layout).
        ct_sh = ([self._ct_sends.get(v, sh) for v, sh in zip(self.act_ct_ids,
                                                             self.act_ct_shardings)]
                 if self._ct_sends or transfer.multi_process() else None)
        self.backward = jax.jit(self._backward, donate_argnums=(4,),
                                out_shardings=(ct_sh, self._acc_shardings))

    def send(self, outputs: Mapping[int, Sharding], cotangents: Mapping[int, Sharding]) -> None:
        """Lays out the outputs a later stage reads and the cotangents sent back to earlier
        stages as they travel: in the receiver's tiling, on this stage's devices
        (`transfer.with_tiling`).  The transfer is then a copy shard by shard, and the
        re-layout happens inside this stage's program instead of a program of its own
        (or a pass through the host) per micro-batch.  Values missing keep the plan's."""
        self._sends = dict(outputs)
        self._ct_sends = dict(cotangents)
        self._build_step_programs()

    def send_sharding(self, vid: int) -> Sharding:
        """The layout the forward gives its output `vid`: as it travels (`send`), else the
        producing layer's planned layout."""
        return self._sends.get(vid) or self.output_sharding(vid)

    # ---- construction -----------------------------------------------------------------------

    def _layers(self, diff_values: set[int], remat: bool) -> list[_Layer]:
        plans: Sequence[LayerPlan | None] = self.plan.layer_plans or [None]
        out = []
        for k, lp in enumerate(plans):
            rng = lp.eqn_range if lp is not None else self.plan.eqn_range
            prog = LayerProgram.build(self.graph, program_for_range(self.graph, *rng),
                                      diff_values, remat=remat or (lp is not None and lp.remat))
            if lp is None:
                fallbacks.report("pipeline stage", "a stage plan without layer plans: its "
                                 "layers run unconstrained (XLA's partitioner lays them out)",
                                 f"stage of layers {getattr(self.plan, 'layers', '?')}")
                out.append(_Layer(prog, None, None))
                continue
            specs = dict(lp.value_specs)
            ct_specs = tuple(specs.get(op) if isinstance(op, int) else None
                             for op in prog.fb.outvars[prog.num_outs:])
            if len(prog.fb.values) != lp.num_values:
                raise StageError(
                    f"stage layer {k} (equations {rng[0]}-{rng[1]}): the plan's solution is "
                    f"for a forward+backward program of {lp.num_values} values, this program "
                    f"has {len(prog.fb.values)} (a plan from another autopar or JAX version?"
                    f" re-run the search)")
            # The stage's parameters arrive in its input layouts and stay alive: each
            # reader slices its layout straight from them.
            f_ids = list(prog.fn.diff_ids) + list(prog.fn.nondiff_ids)
            raw = [(fb_id, self.input_specs[f])
                   for fb_id, f in zip(prog.fb.invars, f_ids) if f in self.param_ids]
            constraints = Constraints.build(prog.fb, self.mesh, lp.value_specs,
                                            lp.operand_specs, raw_inputs=raw)
            grads = [op for op, vid in zip(prog.fb.outvars[prog.num_outs:], prog.fn.diff_ids)
                     if vid in self.param_ids]
            deferral = Deferral.find(prog.fb, prog.backward_eqns, grads, dict(lp.value_specs),
                                     {(e, j): s for e, j, s in lp.operand_specs})
            out.append(_Layer(prog, constraints,
                              DeferredBackward(prog.fb, deferral, self.mesh) if deferral
                              else None, ct_specs, specs))
        return out

    def _residual_refs(self) -> tuple[Ref, ...]:
        """Every residual of every layer, named once: by its F id when it is a layer input
        (a stage input, or an earlier layer's output), else by (layer, fb id)."""
        refs: list[Ref] = []
        stage_inputs = set(self.program.inputs)
        for k, layer in enumerate(self.layers):
            lp = layer.program
            f_of = dict(zip(lp.fb.invars, list(lp.fn.diff_ids) + list(lp.fn.nondiff_ids)))
            for vid in lp.residuals:
                if vid in f_of:
                    fid = f_of[vid]
                    ref = (-1, fid) if fid in stage_inputs else (-2, fid)
                else:
                    ref = (k, vid)
                if ref not in refs:
                    refs.append(ref)
        return tuple(refs)

    def _held_specs(self) -> dict[int, Spec]:
        """Per F id of a layer input, the layout it is held in between the layers reading
        it: a stage input's, or the output layout of the layer producing it."""
        held = dict(self.input_specs)
        for layer in self.layers:
            lp = layer.program
            outs = list(lp.fn.float_outs) + list(lp.fn.int_outs)
            for fid, op in zip(outs, lp.fb.outvars[:len(outs)]):
                if isinstance(op, int) and op in layer.specs:
                    held.setdefault(fid, layer.specs[op])
        return held

    def _discover_grad_parts(self) -> dict[int, dict[tuple[str, ...], jax.ShapeDtypeStruct]]:
        """Per parameter, the parts its gradient sum has (traced once, abstractly)."""
        if not self.param_ids:
            return {}
        static = [self._aval(v) for v in self.static_ids]
        micro = [self._aval(v) for v in self.micro_ids]
        _, _, saved = jax.eval_shape(self._forward, static, micro)
        saved = saved[:len(saved) - len(self.f_out_ids)]
        kept = [self._aval(v) for v in self.kept_micro]
        cts = [self._aval(v) for v in self.ct_receivers]
        found: dict[int, dict[tuple[str, ...], jax.ShapeDtypeStruct]] = {}

        def probe(static, kept, saved, cts):
            sums = self._backward_sums(static, kept, saved, cts)[1]
            return {v: {",".join(k): x for k, x in s.parts.items()} for v, s in sums.items()}

        shapes = jax.eval_shape(probe, static, kept, saved, cts)
        for v, parts in shapes.items():
            found[v] = {tuple(a for a in k.split(",") if a): x for k, x in parts.items()}
        return found

    def output_sharding(self, vid: int) -> NamedSharding:
        """The layout the stage's forward gives its output `vid` (the producing layer's
        planned spec; replicated when the plan has none)."""
        for layer, lp in zip(self.layers, self.plan.layer_plans or [None] * len(self.layers)):
            prog = layer.program
            outs = dict(zip(list(prog.fn.float_outs) + list(prog.fn.int_outs), prog.fb.outvars))
            if vid in outs and lp is not None:
                spec = dict(lp.value_specs).get(outs[vid])
                if spec is not None:
                    return NamedSharding(self.mesh, to_pspec(spec))
        return NamedSharding(self.mesh, PartitionSpec())

    def _placeholders(self, vids: Sequence[int], shardings: Sequence[Any]) -> list[jax.Array]:
        return [transfer.placeholder(self.graph.values[v].shape, self.graph.values[v].dtype,
                                     sh) for v, sh in zip(vids, shardings)]

    def remote_forward(self) -> tuple[list, list, None]:
        """What `forward` returns, on a process that holds none of the stage's devices."""
        return (self._placeholders(self.float_outs, map(self.send_sharding, self.float_outs)),
                self._placeholders(self.int_outs, map(self.send_sharding, self.int_outs)),
                None)

    def remote_backward(self) -> list:
        """The activation cotangents `backward` returns, elsewhere."""
        return self._placeholders(self.act_ct_ids, [
            self._ct_sends.get(v, sh) for v, sh in zip(self.act_ct_ids, self.act_ct_shardings)])

    def remote_finalize(self) -> tuple[list, list]:
        """What `finalize` returns, elsewhere."""
        grads_sh, outs_sh = self._reduced_shardings
        return (self._placeholders(self.param_ids, grads_sh),
                self._placeholders(self.f_out_ids, outs_sh))

    def _aval(self, vid: int) -> jax.ShapeDtypeStruct:
        v = self.graph.values[vid]
        return jax.ShapeDtypeStruct(v.shape, v.dtype)

    def _planned_grad_specs(self) -> dict[int, Spec]:
        """Per parameter, the layout its gradient is accumulated in: the one its layer's
        plan gives it (the first layer that reads it: the backward adds the later layers'
        contributions into it), else the parameter's own."""
        out: dict[int, Spec] = {}
        plans = self.plan.layer_plans or []
        for layer, lp in zip(reversed(self.layers), reversed(plans)):
            prog = layer.program
            specs = dict(lp.value_specs)
            for op, vid in zip(prog.fb.outvars[prog.num_outs:], prog.fn.diff_ids):
                if vid in self.param_ids and isinstance(op, int) and op in specs:
                    out[vid] = specs[op]
        return {v: out.get(v) or self.input_specs[v] for v in self.param_ids}

    def accumulator_shardings(self) -> list[dict[tuple[str, ...], NamedSharding]]:
        """The accumulators' layouts: each gradient as its layer's plan computes it (partial
        sums stacked on a leading axis), so that adding a micro-batch's gradient moves no
        data; `finalize` reduces and lays them out as the parameters once per step."""
        return [{axes: NamedSharding(self.mesh, to_pspec(self._acc_spec(v, axes)))
                 for axes in self._grad_parts[v]} for v in self.param_ids]

    def _acc_spec(self, vid: int, axes: tuple[str, ...]) -> Spec:
        """The layout of parameter `vid`'s accumulator part kept unreduced over `axes`
        (`()`: the reduced part, in the gradient's own layout)."""
        spec = self._grad_specs[vid]
        return stacked_spec(spec, axes) if axes else spec

    # ---- the programs -----------------------------------------------------------------------

    def _forward(self, static: Sequence[Any], micro: Sequence[Any]):
        env = dict(zip(self.static_ids, static))
        env.update(zip(self.micro_ids, micro))
        computed: dict[tuple[int, int], Any] = {}
        for k, layer in enumerate(self.layers):
            lp = layer.program
            c = layer.constraints
            hooks = {} if c is None else dict(on_value=c.on_value, on_operand=c.on_operand)
            floats, ints, residuals = lp.run_forward([env[v] for v in lp.fn.diff_ids],
                                                     [env[v] for v in lp.fn.nondiff_ids],
                                                     **hooks)
            env.update(zip(lp.fn.float_outs, floats))
            env.update(zip(lp.fn.int_outs, ints))
            computed.update(((k, vid), x) for vid, x in zip(lp.residuals, residuals))
        saved = [computed[r] if r[0] >= 0 else env[r[1]] for r in self.saved_refs]
        saved += [env[v] for v in self.f_out_ids]
        return [env[v] for v in self.float_outs], [env[v] for v in self.int_outs], saved

    def _backward_sums(self, static: Sequence[Any], kept: Sequence[Any], saved: Sequence[Any],
                       cts: Sequence[Any],
                       acc: Sequence[Mapping[tuple[str, ...], Any]] | None = None,
                       ) -> tuple[list[Any], dict[int, GradSum]]:
        """(cotangents of the received activations, gradient sum per parameter).  With
        `acc` (the accumulators' parts per parameter) each layer's gradients are added to
        them as the layer's backward produces them, and the sums include `acc`."""
        totals = None if acc is None else {v: dict(parts) for v, parts in
                                           zip(self.param_ids, acc)}
        by_ref = dict(zip(self.saved_refs, saved))
        by_ref.update(((-1, v), x) for v, x in zip(self.static_ids, static))
        by_ref.update(((-1, v), x) for v, x in zip(self.kept_micro, kept))
        ct: dict[int, Any] = dict(zip(self.ct_receivers, cts))
        if self.loss_vid is not None:
            seed = jnp.asarray(self.scale, self.graph.values[self.loss_vid].dtype)
            ct[self.loss_vid] = ct[self.loss_vid] + seed if self.loss_vid in ct else \
                jnp.broadcast_to(seed, self.graph.values[self.loss_vid].shape)
        static_ids = set(self.static_ids)
        for k in reversed(range(len(self.layers))):
            layer = self.layers[k]
            lp = layer.program
            f_of = dict(zip(lp.fb.invars, list(lp.fn.diff_ids) + list(lp.fn.nondiff_ids)))
            residuals = []
            for vid in lp.residuals:
                fid = f_of.get(vid)
                if fid is None:
                    residuals.append(by_ref[(k, vid)])
                else:
                    residuals.append(by_ref.get((-1, fid), by_ref.get((-2, fid))))
            out_cts = [ct.pop(v) if v in ct else jnp.zeros(self.graph.values[v].shape,
                                                           self.graph.values[v].dtype)
                       for v in lp.fn.float_outs]
            out_cts = [x.total() if isinstance(x, GradSum) else x for x in out_cts]
            c = layer.constraints
            hooks = {} if c is None else dict(on_value=skip_sums(c.on_value),
                                              on_operand=c.on_operand)
            if layer.deferred is not None:
                hooks["override"] = layer.deferred
            if totals is not None:
                # The layer's recomputation waits for its output cotangents (XLA would
                # start every layer's recomputation early and hold them all).  A layer
                # input is tied as it is held (a layout this layer reads it in would be
                # gathered once for the forward and the backward, and held between).
                at = [i for i, v in enumerate(lp.residuals) if f_of.get(v) not in static_ids]
                ct_vars = lp.fb.invars[len(f_of):]
                held = [self.held_specs.get(f_of[v]) if v in f_of else layer.specs.get(v)
                        for v in lp.residuals]
                tied = ordering.after(
                    [(residuals[i], held[i]) for i in at],
                    [(x, layer.specs.get(v)) for v, x in zip(ct_vars, out_cts)], self.mesh)
                for i, x in zip(at, tied):
                    residuals[i] = x
            in_cts = lp.run_backward(residuals, out_cts, **hooks)
            if totals is not None:
                in_cts = self._accumulate(layer, in_cts, totals, tie=k > 0)
            for v, g in zip(lp.fn.diff_ids, in_cts):
                if g is None:    # added to its accumulator
                    continue
                if v in ct:
                    ct[v] = as_grad_sum(ct[v]) + as_grad_sum(g)
                else:
                    ct[v] = g
        act_cts = [ct[v].total() if isinstance(ct.get(v), GradSum) else ct.get(v)
                   for v in self.act_ct_ids]
        act_cts = [x if x is not None else jnp.zeros(self.graph.values[v].shape,
                                                     self.graph.values[v].dtype)
                   for x, v in zip(act_cts, self.act_ct_ids)]
        if totals is not None:
            return act_cts, {v: GradSum(totals[v]) for v in self.param_ids}
        grads = {v: as_grad_sum(ct[v]) if v in ct else GradSum(
            {(): jnp.zeros(self.graph.values[v].shape, self.graph.values[v].dtype)})
                 for v in self.param_ids}
        return act_cts, grads

    def _accumulate(self, layer: _Layer, in_cts: list[Any],
                    totals: dict[int, dict[tuple[str, ...], Any]], tie: bool) -> list[Any]:
        """Adds a layer's parameter gradients (from `in_cts`) to `totals` in place, and
        returns `in_cts` with those entries None.  With `tie`, the layer's other input
        cotangents are made to depend on the updated sums (`autopar.ordering`), so that
        XLA adds each layer's gradients into the accumulators before the next layer's
        backward starts: otherwise XLA:CPU computes the whole cotangent chain first and
        holds every layer's activations, and every layer's gradient beside its
        accumulator, to the end of the backward."""
        out = list(in_cts)
        sources, targets, where = [], [], []
        ct_specs = layer.ct_specs or (None,) * len(in_cts)
        for i, (v, g) in enumerate(zip(layer.program.fn.diff_ids, in_cts)):
            if v in totals:
                for axes, x in as_grad_sum(g).parts.items():
                    totals[v][axes] = totals[v][axes] + x
                    sources.append((totals[v][axes], self._acc_spec(v, axes)))
                out[i] = None
            elif tie and not isinstance(g, GradSum):
                targets.append((g, ct_specs[i]))
                where.append(i)
        for i, x in zip(where, ordering.after(targets, sources, self.mesh) if tie else ()):
            out[i] = x
        return out

    def _backward(self, static, kept, saved, cts, acc):
        """One micro-batch's backward; `acc` = (gradient parts per parameter, running sums
        of F's outputs) and `saved` ends with this micro-batch's F outputs."""
        grad_acc, out_acc = acc
        f_values = saved[len(saved) - len(self.f_out_ids):]
        saved = saved[:len(saved) - len(self.f_out_ids)]
        act_cts, grads = self._backward_sums(static, kept, saved, cts, grad_acc)
        new_grads = [dict(grads[v].parts) for v in self.param_ids]
        new_outs = [total + x if is_float(x.dtype) else x for total, x in zip(out_acc, f_values)]
        return act_cts, (new_grads, new_outs)

    def _zeros(self):
        grads = [{axes: jnp.zeros(s.shape, s.dtype) for axes, s in self._grad_parts[v].items()}
                 for v in self.param_ids]
        return grads, [jnp.zeros(self.graph.values[v].shape, self.graph.values[v].dtype)
                       for v in self.f_out_ids]

    def _finalize(self, acc):
        """(each parameter's gradient, reduced once; the mean of each float F output over
        the micro-batches, the last micro-batch's integer ones)."""
        grad_acc, out_acc = acc
        return ([reduce_to(parts, self.state_specs[v], self.mesh, have=self._grad_specs[v])
                 for v, parts in zip(self.param_ids, grad_acc)],
                [x * jnp.asarray(self.scale, x.dtype) if is_float(x.dtype) else x
                 for x in out_acc])

    # ---- one program for a whole step -------------------------------------------------------

    def can_fuse(self, batch_ids: set[int]) -> bool:
        """Whether the stage's step can run as one program (`fused_step`): it is the only
        stage (every non-static input is a batch input; no cotangent comes in or goes out)
        and it runs on this process's devices."""
        return (self.local and not transfer.multi_process() and not self.ct_receivers
                and not self.act_ct_ids and all(v in batch_ids for v in self.micro_ids))

    def _hoistable(self, vid: int) -> bool:
        """Whether the stage may make from static input `vid` a loop-invariant value XLA
        would hoist out of `fused_step`'s micro-batches and hold through the step: its layout splits
        it (a layer reading it whole all-gathers it) or the stage casts it.  A replicated
        input read as it is offers nothing to hoist; tying it to each micro-batch would
        only copy it (`t - 0`, twice per micro-batch), unpriced."""
        if any(dim for dim in self.input_specs[vid]):
            return True
        lo, hi = self.plan.eqn_range
        return any(lo <= k < hi and self.graph.eqns[k].name == "convert_element_type"
                   for k in self.graph.consumers[vid])

    @functools.cached_property
    def fused_step(self):
        """The step of a one-stage pipeline under 1F1B as one program: (static inputs, batch
        inputs in the stage's layout) → what `finalize` returns.  Each micro-batch's forward
        then its backward into the accumulators, the same layer programs and layouts as
        `forward` / `backward` / `zeros` / `finalize`, launched once per step instead of
        2N + 2 times.  Micro-batches are written out one after another in groups of up to
        `UNROLL`, a loop over the groups (`fori_loop`) when there are more: a loop over
        single micro-batches made the step up to 1.2x slower than the same work written
        out (benchmarks/results/runtime_overhead.md has the step times now), and the
        written-out program compiles in time that grows with its length.  Inside a group,
        each micro-batch's inputs are made to depend on the gradients the one before added
        (`ordering.after`), so that one micro-batch's residuals are live at a time, as 1F1B
        promises (else XLA may run several forwards first and hold all their residuals)."""
        acc_sh = self._acc_shardings
        micro_sh = [self.input_shardings[v] for v in self.micro_ids]
        n = self.num_micro_batches
        tied = [k for k, v in enumerate(self.static_ids) if self._hoistable(v)]

        def tie(static: Sequence[Any], sources: Sequence[tuple[Any, Spec]]) -> list[Any]:
            out = list(static)
            targets = [(static[k], self.input_specs[self.static_ids[k]]) for k in tied]
            for k, x in zip(tied, ordering.after(targets, sources, self.mesh)):
                out[k] = x
            return out

        def one(static, micro, acc):
            # The static inputs made to depend on this micro-batch (else XLA would hoist
            # their all-gathers and casts out of the step and hold every layer's gathered
            # or cast weights through the whole step); the backward's on the forward's last
            # output, so that XLA does not merge the two (one copy of every weight held
            # from the forward to the backward).
            _, _, saved = self._forward(
                tie(static, [(x, self.input_specs[v]) for v, x in zip(self.micro_ids, micro)]),
                micro)
            ends = saved[len(saved) - len(self.f_out_ids):]
            static = tie(static, [(x, ((),) * x.ndim) for x in ends if x.size == 1])
            kept = [micro[k] for k in self.kept_positions]
            _, acc = self._backward(static, kept, saved, [], acc)
            return jax.lax.with_sharding_constraint(acc, acc_sh)

        def added(acc) -> list[tuple[Any, Spec]]:
            """The gradient accumulators with their layouts."""
            return [(x, self._acc_spec(v, axes))
                    for v, parts in zip(self.param_ids, acc[0]) for axes, x in parts.items()]

        group = max(g for g in range(1, min(n, UNROLL) + 1) if n % g == 0)

        def run_group(k, static, batch, acc):
            """Micro-batches k·group ... k·group + group - 1, one after another."""
            for j in range(group):
                micro = [jax.lax.with_sharding_constraint(micro_slice(x, n, k * group + j), sh)
                         for x, sh in zip(batch, micro_sh)]
                if j:
                    # A micro-batch starts once the one before has added its gradients
                    # (between groups the loop orders them).
                    micro = ordering.after(
                        [(x, self.input_specs[v]) for v, x in zip(self.micro_ids, micro)],
                        added(acc), self.mesh)
                acc = one(static, micro, acc)
            return acc

        def step(static, batch):
            acc = jax.lax.with_sharding_constraint(self._zeros(), acc_sh)
            if group == n:
                acc = run_group(0, static, batch, acc)
            else:
                acc = jax.lax.fori_loop(0, n // group,
                                        lambda k, a: run_group(k, static, batch, a), acc)
            return self._finalize(acc)

        return jax.jit(step, in_shardings=(
            tuple(self.input_shardings[v] for v in self.static_ids), micro_sh),
            out_shardings=self._reduced_shardings)

    # ---- lowering ---------------------------------------------------------------------------

    def lower_all(self, fused: bool = False) -> dict[str, Any]:
        """JAX `Lowered` of each program for one micro-batch (forward, backward) and one step
        (zeros, finalize; and `fused_step` as "step" when `fused`)."""
        shard = lambda v: jax.ShapeDtypeStruct(self.graph.values[v].shape,
                                               self.graph.values[v].dtype,
                                               sharding=self.input_shardings[v])
        static = [shard(v) for v in self.static_ids]
        micro = [shard(v) for v in self.micro_ids]
        fwd = self.forward.lower(static, micro)
        floats, _, saved = jax.eval_shape(self._forward, static, micro)
        fwd_sh = fwd.compile().output_shardings
        # Cotangents arrive in their activation's planned layout (the runtime puts them
        # there; `send` lays them out to travel so).
        cts = [jax.ShapeDtypeStruct(self.graph.values[v].shape, self.graph.values[v].dtype,
                                    sharding=self.output_sharding(v)) for v in self.ct_receivers]
        saved_sh = fwd_sh[2]
        saved = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)
                 for s, sh in zip(saved, saved_sh)]
        acc = ([{axes: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh[axes])
                 for axes, s in self._grad_parts[v].items()}
                for v, sh in zip(self.param_ids, self.accumulator_shardings())],
               [jax.ShapeDtypeStruct(self.graph.values[v].shape, self.graph.values[v].dtype,
                                     sharding=self.output_sharding(v)) for v in self.f_out_ids])
        kept = [micro[k] for k in self.kept_positions]
        out = {"forward": fwd, "backward": self.backward.lower(static, kept, saved, cts, acc),
               "zeros": self.zeros.lower(), "finalize": self.finalize.lower(acc)}
        if fused:
            batch = [jax.ShapeDtypeStruct((v.shape[0] * self.num_micro_batches,) + v.shape[1:],
                                          v.dtype, sharding=v.sharding) for v in micro]
            out["step"] = self.fused_step.lower(tuple(static), batch)
        return out


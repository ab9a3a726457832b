"""Pricing one layer range of a pipeline on a sub-mesh: its forward+backward solved by the
intra-op ILP on each logical mesh (`start_price_stage` -> `LayerCost`), identical layers
sharing one solve (`reuse`), and the resharding a layer's layouts
make with its neighbours (`Neighbours`, `neighbour_reshard_s`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from autopar import pipeline
from autopar.cost_model import ClusterSpec
from autopar.grad_accum import Deferral, defers, passes_sums, unreduced_spec
from autopar.graph import Graph
from autopar.layer import LayerProgram, differentiable_values
from autopar.passes import intra_op, primitives
from autopar.passes.sharding_spec import (
    MeshContext,
    Spec,
    reshard_s,
)
from autopar.planner import (
    answer,
    batch_axis_only,
    batch_carried_dims,
    carries_penalty,
)

from .state import (
    StateSplit,
    _lean_penalty,
    _memory_charge_s,
    _param_cost,
)

# Layer costs only rank stage layouts: a short solver limit per layer solve (the solver then
# returns its best incumbent) keeps dozens of layer solves affordable.  Seconds.
LAYER_TIME_LIMIT_S = 1.0


# A layer solve whose answer is not proved within intra_op.RETRY_GAP of the optimum gets one
# more solve with this limit (seconds): on a loaded machine (measured: 8 busy processes on 2
# cores) 16 of 45 one-second gpt-toy layer solves returned the heuristic's answer, and the
# plan for 2 devices came out 1.24x slower than data parallelism.
LAYER_RETRY_TIME_LIMIT_S = 5.0


# Bytes moved per byte of a parameter gradient when a micro-batch's gradient is added into
# the accumulator: read both, write the sum (`stage_runner` backward).
ACCUMULATE_TRAFFIC = 3.0


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer range's forward+backward solved on one logical mesh.

    The per-value tuples are positional — `input_specs` and `ct_out_specs` aligned with the
    range's `StageProgram.inputs` (in first-read order), `output_specs` and `ct_in_specs`
    with its `outputs` (sorted value ids) — so a result cached for one layer applies
    position by position to an identical layer.  `ct_out_specs[k]` is the layout the
    backward gives input k's cotangent in (None: no cotangent); `ct_in_specs[k]` the layout
    it wants output k's in.  `value_specs` / `operand_specs` are the solution over the
    layer's forward+backward program (ids of that program, the same for identical layers).
    """

    cost_s: float
    memory_bytes: float
    mesh: MeshContext
    input_specs: tuple[Spec, ...]
    residual_bytes: float = 0.0
    output_specs: tuple[Spec, ...] = ()
    ct_out_specs: tuple[Spec | None, ...] = ()
    ct_in_specs: tuple[Spec | None, ...] = ()
    value_specs: tuple[tuple[int, Spec], ...] = ()
    operand_specs: tuple[tuple[int, int, Spec], ...] = ()
    num_values: int = 0
    # Per input (aligned with `input_specs`), bytes per device of a parameter's gradient
    # accumulator as the runtime keeps it (`grad_accum`: unreduced over the axes of the
    # contraction that produces it, so a gradient laid out split over the data-parallel
    # axes is accumulated whole); None for other inputs.
    accumulator_bytes: tuple[float | None, ...] = ()
    # The inputs among the residuals (`residual_bytes` counts them at this layer's layout):
    # (position in `input_specs`, bytes per device at that layout).  The runtime keeps such
    # a value once, as its producer laid it out (`stage_memory_bytes`).
    input_residuals: tuple[tuple[int, float], ...] = ()
    # Whether the layouts carry a penalty (`LEAN_PENALTY_S`: a lean solve's parameter not
    # cut finely; `BATCH_AXIS_PENALTY_S`: a batch dim off a fixed stage's data-parallel
    # axis), read off the layouts, not the cost: a step may take longer than the penalty
    # (any layer on a communication-only cluster at 1 s/byte).
    penalized: bool = False
    # Seconds per micro-batch of `cost_s` no layout of this layer on this mesh goes below
    # and no micro-batch count changes (`_fixed_floor_s`; `StageCostTable.fixed_s`).
    fixed_floor_s: float = 0.0
    # `_memoized`'s store (parameter bytes, update seconds, memory terms): the stage search
    # asks for the same layer's terms once per layer range holding it (thousands of times
    # on GPT-39B).
    _memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


def diff_values(split: pipeline.SplitStep, graph: Graph) -> set[int]:
    """Value ids of F that carry gradients (`layer.differentiable_values`)."""
    return differentiable_values(graph, [graph.invars[j] for j in split.diff_inputs])


def logical_shapes(submesh: tuple[int, int]) -> list[tuple[int, ...]]:
    """Logical meshes worth pricing on a (hosts, devices) sub-mesh: 1-D, and 2-D with the
    smaller axis first inside one host (both axes have the same link there, so (a, b) and
    (b, a) cost the same), or hosts x devices across hosts."""
    hosts, per_host = submesh
    n = hosts * per_host
    if hosts > 1:
        return [(n,), (hosts, per_host)]
    return [(n,)] + [(a, n // a) for a in range(2, n) if n % a == 0 and a <= n // a]


def price_stage(graph: Graph, program: pipeline.StageProgram, diff: set[int],
                cluster: ClusterSpec, submesh: tuple[int, int], **kw
                ) -> dict[tuple[int, ...], LayerCost]:
    """`start_price_stage(...)()`: the layer range priced on every logical shape."""
    return start_price_stage(graph, program, diff, cluster, submesh, **kw)()


def start_price_stage(graph: Graph, program: pipeline.StageProgram, diff: set[int],
                      cluster: ClusterSpec, submesh: tuple[int, int], *, solver: str,
                      time_limit_s: float, batch_size: int | None,
                      forced_batch_axis: bool = False,
                      shapes: Sequence[tuple[int, ...]] | None = None,
                      input_rule: Callable[[int, MeshContext], Spec | None] | None = None,
                      remat: bool = False, num_micro_batches: int = 1,
                      layer: LayerProgram | None = None,
                      submit: intra_op.Submit | None = None,
                      update: StateSplit | None = None,
                      lean: bool = False,
                      memory_price: float = 0.0,
                      retry_time_limit_s: float | None = None,
                      builds: intra_op.BuildCache | None = None,
                      neighbours: Neighbours | None = None
                      ) -> Callable[[], dict[tuple[int, ...], LayerCost]]:
    """Intra-op plans of one layer range's forward+backward on a sub-mesh, one per logical
    mesh shape (`shapes`, default: 1-D and every 2-D factorization).

    `input_rule(vid, mesh)` may force the spec of a range input (F value id `vid`);
    None leaves it to the search.

    With `num_micro_batches` B > 1 the ILP discounts the communication of the matmuls
    producing parameter gradients by 1/B (gradients accumulate locally and are reduced once
    per step), so it chooses layouts for the amortized cost; `cost_s` is per micro-batch
    with that reduction amortized.

    With `update`, each parameter's spec is priced its update once per step (amortized):
    at that spec, or on its state split plus the all-gather back (`StateSplit.cost_s`). A
    parameter kept replicated for free slicing is updated whole on every device, or
    gathered whole after a split update; one split as its readers read it is neither.

    With `lean`, every parameter must be cut into as many shards as its shape allows on
    the mesh (`LEAN_PENALTY_S` on any other layout): the memory-lean end of the layer's
    time/memory trade-off, which a stage takes when its time-optimal layouts do not fit.
    With `memory_price` (seconds per byte per device, `KNEE_FRACTIONS`) every parameter's
    layout also pays for the bytes it keeps on each device (the parameter, its gradient and
    its optimizer state): a point between the two ends.

    With `neighbours` (give one logical `shapes`), the ILP also pays, per micro-batch, for
    resharding between the layer and the layers next to it (`Neighbours`): its layout is
    chosen knowing theirs (`search`'s `aligned`).  Those charges are not in the returned
    `cost_s`: the stage prices the resharding between its layers itself
    (`internal_reshard_s`).

    `layer` is `LayerProgram.build(graph, program, diff, remat=remat)` when the caller
    already has it (one trace serves every sub-mesh).  The problems are built now and
    handed to `submit` (solved elsewhere, `autopar.solve_pool`) when given; the returned
    function waits for their answers and gives the plans (`retry_time_limit_s`, `builds`:
    see `intra_op.start`)."""
    if layer is None:
        layer = LayerProgram.build(graph, program, diff, remat=remat)
    fn, fb = layer.fn, layer.fb
    f_ids = list(fn.diff_ids) + list(fn.nondiff_ids)
    position = {vid: k for k, vid in enumerate(f_ids)}
    params = set(graph.invars) & set(fn.diff_ids)
    sub = cluster.with_devices(*submesh)
    per_micro_inputs = {fb.invars[k] for k, vid in enumerate(f_ids) if vid not in params}
    grad_outs = [op for op, vid in zip(fb.outvars[len(fb.outvars) - len(fn.diff_ids):],
                                       fn.diff_ids) if vid in params and isinstance(op, int)]
    scale, traffic = _accumulation(fb, grad_outs, num_micro_batches)
    # What the layer hands on (activations forward, cotangents back) is read by the layers
    # next to it as soon as it is made: only its parameters' gradients wait for the step's
    # end, so only their reductions may be combined in buckets.
    awaited = {op for op in fb.outvars if isinstance(op, int)} - set(grad_outs)
    param_fvs = [(fb.invars[k], graph.values[vid]) for k, vid in enumerate(f_ids)
                 if vid in params]   # (FB input, the parameter's graph value)
    param_inputs = param_fvs if update is not None or lean or memory_price else []
    batch_led = _batch_led(fb, f_ids, params, batch_size) \
        if forced_batch_axis and batch_size else {}
    pending = []
    charges: dict[tuple[int, ...], dict[int, Callable[[Spec], float]]] = {}
    penalties: dict[tuple[int, ...], list[tuple[int, Callable[[Spec], float]]]] = {}
    for shape in shapes or logical_shapes(submesh):
        mesh = MeshContext.build(shape, sub)
        if neighbours:
            charges[shape] = _neighbour_costs(layer, position, graph, neighbours, mesh)
        updates, penalties[shape] = _value_costs(
            mesh, param_inputs, update, lean, num_micro_batches, memory_price, batch_led,
            charges.get(shape, {}))
        forced = _forced_inputs(layer, f_ids, mesh, input_rule,
                                batch_size if forced_batch_axis else None)
        pending.append((shape, mesh, updates, intra_op.start(
            fb, mesh, forced=forced, batch_size=batch_size, solver=solver,
            time_limit_s=time_limit_s, comm_scale=scale, traffic=traffic,
            value_costs=updates, submit=submit, retry_time_limit_s=retry_time_limit_s,
            builds=builds, awaited=awaited)))
    # The parameters' own work is priced apart from its update only without other charges
    # on their layouts (`_fixed_floor_s`), with the updates priced on the same mesh.
    plain = not (lean or memory_price or neighbours or batch_led)
    param_ids = {fv for fv, _ in param_fvs} if plain else set()

    def priced(shape: tuple[int, ...], mesh: MeshContext, updates, run) -> LayerCost:
        p = _priced(graph, program, layer, position, per_micro_inputs, mesh, answer(
            run, f"the layer ILP ({len(program.eqns)} equations) on sub-mesh {submesh}, "
                 f"logical mesh {shape}"))
        held = memory_price * _held_bytes(p, program, params, graph, update) \
            if memory_price else 0.0
        p = _uncharged(p, held, charges.get(shape, {}), penalties[shape])
        floor = _fixed_floor_s(fb, run, grad_outs, param_ids, updates if plain else {}, mesh)
        return dataclasses.replace(p, fixed_floor_s=floor) if floor else p

    return lambda: {shape: priced(shape, mesh, updates, run)
                    for shape, mesh, updates, run in pending}


def _accumulation(fb: Graph, grad_outs: Sequence[int], num_micro_batches: int,
                  ) -> tuple[dict[int, float], dict[int, float]]:
    """Gradient accumulation as the layer ILP sees it: the communication scale (1/B) of the
    matmuls producing parameter gradients, which are reduced once per step, and the
    traffic of adding each micro-batch's gradients (FB outputs `grad_outs`) into the
    stage's accumulators at their layout (unreduced: a data-parallel layout adds whole
    gradients on every device)."""
    scale = ({i: 1.0 / num_micro_batches for i in _gradient_matmuls(fb, grad_outs)}
             if num_micro_batches > 1 and grad_outs else {})
    return scale, {vid: ACCUMULATE_TRAFFIC for vid in grad_outs}


def _value_costs(mesh: MeshContext, param_inputs: Sequence[tuple[int, Any]],
                 update: StateSplit | None, lean: bool, num_micro_batches: int,
                 memory_price: float, batch_led: Mapping[int, tuple[int, ...]],
                 neighbour_charges: Mapping[int, Callable[[Spec], float]],
                 ) -> tuple[dict[int, Callable[[Spec], float]],
                            list[tuple[int, Callable[[Spec], float]]]]:
    """The per-layout costs (seconds) the layer ILP adds on `mesh` to FB values: each
    parameter input's update, lean penalty and held bytes (`_param_cost`), the batch-axis
    penalty of batch-led values and the neighbour charges; and the penalties among them,
    which the priced layer gives back (`_uncharged`)."""
    lean_costs = {fv: _lean_penalty(value.shape, mesh)
                  for fv, value in param_inputs} if lean else {}
    updates = {fv: _param_cost(update, lean_costs.get(fv), value.shape, value.nbytes, mesh,
                               num_micro_batches, memory_price)
               for fv, value in param_inputs}
    # The data-parallel axis is the only one the batch is split over, so a (dp, tp)
    # stage is tensor-parallel over tp, not data-parallel over dp x tp.
    held = batch_axis_only(batch_led, mesh.axes[0]) if batch_led else {}
    return (_summed(_summed(updates, held), neighbour_charges),
            [*lean_costs.items(), *held.items()])


def _batch_led(fb: Graph, f_ids: Sequence[int], params: set[int],
               batch_size: int) -> dict[int, tuple[int, ...]]:
    """The batch dims of a layer's values, carried from its non-parameter inputs of the
    batch's size: a fixed (dp, tp) layout splits the batch over dp only, the other axes
    split the model."""
    return batch_carried_dims(fb, [v for k, v in enumerate(fb.invars)
                                   if k >= len(f_ids) or f_ids[k] not in params],
                              batch_size, {batch_size})


def _uncharged(p: LayerCost, held_s: float, charges: Mapping[int, Callable[[Spec], float]],
               penalties: Sequence[tuple[int, Callable[[Spec], float]]]) -> LayerCost:
    """A layer solution's time without what its ILP paid beyond the step's seconds: the
    memory price of the bytes it holds (`held_s`) and the resharding to its neighbours
    (`charges`, by value; the stage prices that itself); `penalized` when one of its
    values carries a penalty (`penalties`)."""
    vs = dict(p.value_specs)
    charge = held_s + sum(fn(vs[v]) for v, fn in charges.items() if v in vs)
    penalized = carries_penalty(vs, penalties)
    return dataclasses.replace(p, cost_s=p.cost_s - charge, penalized=penalized) \
        if charge or penalized else p


def _forced_inputs(layer: LayerProgram, f_ids: Sequence[int], mesh: MeshContext,
                   input_rule: Callable[[int, MeshContext], Spec | None] | None,
                   batch_size: int | None) -> dict[int, Spec]:
    """The specs a layer ILP fixes for its inputs (`fb`'s invars) on `mesh`: those
    `input_rule` gives (by F value id), and with `batch_size` every non-parameter input of
    the batch's size split over the mesh's first axis (when that axis divides it)."""
    fn, fb = layer.fn, layer.fb
    forced = {}
    if input_rule is not None:
        for pos, vid in enumerate(fb.invars[:len(f_ids)]):
            spec = input_rule(f_ids[pos], mesh)
            if spec is not None:
                forced[vid] = spec
    if batch_size:
        for pos, vid in enumerate(fb.invars):
            v = fb.values[vid]
            if pos >= len(fn.diff_ids) and v.shape and v.shape[0] == batch_size \
                    and batch_size % mesh.shape[0] == 0:
                forced[vid] = ((mesh.axes[0],),) + ((),) * (v.ndim - 1)
    return forced


def _fixed_floor_s(fb: Graph, run: intra_op.PendingRun, grad_outs: Sequence[int],
                   param_ids: set[int], updates: Mapping[int, Callable[[Spec], float]],
                   mesh: MeshContext) -> float:
    """Seconds per micro-batch of a layer ILP's cost on `mesh` that no layout goes below
    and no micro-batch count changes (`run`: the problem as handed to the solver):

    * adding the parameter gradients `grad_outs` into their accumulators:
      `ACCUMULATE_TRAFFIC` times each gradient's bytes split over every device of `mesh`,
      at its memory bandwidth (the ILP charges a gradient with a decision only);
    * the work on the parameters `param_ids` alone (casts of the weights, each micro-batch):
      each ILP group whose values are all `_count_free` costs at least its cheapest
      strategy, less the parameters' updates there (`updates`: seconds per micro-batch by
      spec, amortized over the count, so not fixed).  Empty `param_ids`: none counted.
    """
    builder = run.builder
    decided = builder.group_of
    nbytes = sum(fb.values[v].nbytes for v in grad_outs if v in decided)
    total = (ACCUMULATE_TRAFFIC * nbytes / mesh.num_devices
             / mesh.cluster.memory_bandwidth_bytes_per_s)
    free = _count_free(fb, param_ids)
    for group in builder.groups:
        if not group.members or not all(v in free for v in group.members):
            continue
        cost = group.compute_s + group.comm_s
        for v in group.members:
            if v in updates:
                cost = cost - np.array([updates[v](spec) for spec in builder.specs[v]])
        total += max(0.0, float(cost.min()))
    return total


def _count_free(fb: Graph, param_ids: set[int]) -> set[int]:
    """Values of `fb` whose shape and work no micro-batch count changes: the parameters
    `param_ids`, and what elementwise equations (conversions included) and transposes make
    of them alone (each output the shape of an operand, or a permutation of it)."""
    free = set(param_ids)
    for e in fb.eqns:
        ops = [op for op in e.inputs if isinstance(op, int)]
        if not ops or not all(op in free for op in ops) or len(e.outputs) != 1:
            continue
        if any(not isinstance(op, int) and tuple(op.shape) for op in e.inputs):
            continue    # a literal that is not a scalar
        out = fb.values[e.outputs[0]].shape
        shapes = [fb.values[op].shape for op in ops]
        if (primitives.info(e.name).elementwise and out in shapes
                or e.name == "transpose" and sorted(out) == sorted(shapes[0])):
            free.add(e.outputs[0])
    return free


def _held_bytes(p: LayerCost, prog: pipeline.StageProgram, params: set[int], graph: Graph,
                update: StateSplit | None) -> float:
    """Bytes per device a layer solution keeps of its parameters, their gradients and
    optimizer state (what a memory price charges)."""
    return sum(_memory_charge_s(1.0, update, graph.values[vid].nbytes, p.mesh.shards(spec))
               for vid, spec in zip(prog.inputs, p.input_specs) if vid in params)


def _priced(graph: Graph, program: pipeline.StageProgram, layer: LayerProgram,
            position: dict[int, int], per_micro_inputs: set[int], mesh: MeshContext,
            res: intra_op.IntraOpResult) -> LayerCost:
    """A layer range's intra-op solution on one logical mesh, read positionally."""
    fn, fb = layer.fn, layer.fb
    f_ids = list(fn.diff_ids) + list(fn.nondiff_ids)
    vs = res.value_specs
    specs = tuple(vs[fb.invars[position[vid]]] for vid in program.inputs)
    outs = dict(zip(list(fn.float_outs) + list(fn.int_outs), fb.outvars))
    cts_out = dict(zip(fn.diff_ids, fb.outvars[layer.num_outs:]))
    cts_in = dict(zip(fn.float_outs, fb.invars[len(f_ids):]))
    spec_of = lambda op: vs.get(op) if isinstance(op, int) else None
    params = set(graph.invars) & set(fn.diff_ids)
    grads = {vid: op for vid, op in cts_out.items()
             if vid in params and isinstance(op, int) and op in vs}
    deferral = Deferral.find(fb, layer.backward_eqns, list(grads.values()), vs,
                             {(e, j): s for e, j, s in res.operand_specs})

    def accumulator(vid: int) -> float | None:
        if vid not in grads:
            return None
        axes = deferral.unreduced_axes(fb, grads[vid]) if deferral else ()
        return graph.values[vid].nbytes / mesh.shards(unreduced_spec(vs[grads[vid]], axes))

    residuals = _residuals(fb, layer.num_outs, per_micro_inputs)
    at_layout = lambda v: fb.values[v].nbytes / mesh.shards(vs[v]) if v in vs \
        else fb.values[v].nbytes
    return LayerCost(
        res.cost_s, res.memory_bytes, mesh, specs,
        float(sum(at_layout(v) for v in residuals)),
        output_specs=tuple(spec_of(outs[v]) or ((),) * graph.values[v].ndim
                           for v in program.outputs),
        ct_out_specs=tuple(spec_of(cts_out[v]) if v in cts_out else None
                           for v in program.inputs),
        ct_in_specs=tuple(spec_of(cts_in[v]) if v in cts_in else None
                          for v in program.outputs),
        value_specs=tuple(sorted(vs.items())), operand_specs=res.operand_specs,
        num_values=len(fb.values),
        accumulator_bytes=tuple(accumulator(vid) for vid in program.inputs),
        input_residuals=tuple((k, at_layout(fb.invars[position[vid]]))
                              for k, vid in enumerate(program.inputs)
                              if fb.invars[position[vid]] in residuals))


# (spec of a value on one side, spec of its cotangent on the same side or None)
Sides = Mapping[int, tuple[Spec, Spec | None]]


@dataclasses.dataclass(frozen=True)
class Neighbours:
    """What the layers next to a layer do with the values it shares with them.

    Attributes:
      before: range input (F value id) → the spec the layer before makes it in, and the
        spec that layer wants its cotangent in (None: no cotangent).
      after: range output → the spec the layer after reads it in, and the spec that layer
        gives its cotangent in (None: none).
    """

    before: Sides
    after: Sides

    def __bool__(self) -> bool:
        return bool(self.before or self.after)

    def renamed(self, inputs: dict[int, int], outputs: dict[int, int]) -> Neighbours:
        """The same sides keyed by other ids (an identical layer's: `inputs`, `outputs`
        map this layer's ids to them)."""
        return Neighbours({inputs[v]: s for v, s in self.before.items()},
                          {outputs[v]: s for v, s in self.after.items()})

    def key(self) -> tuple:
        return tuple(sorted(self.before.items())), tuple(sorted(self.after.items()))


def _neighbour_costs(layer: LayerProgram, position: dict[int, int], graph: Graph,
                     neighbours: Neighbours, mesh: MeshContext
                     ) -> dict[int, Callable[[Spec], float]]:
    """`start_price_stage`'s charges for `neighbours`: per value of the layer's
    forward+backward program, seconds per micro-batch as a function of its spec — an input
    resharded from the spec it arrives in and its cotangent to the spec wanted; an output
    resharded to the spec its reader wants and its cotangent from the spec it comes in."""
    fn, fb = layer.fn, layer.fb
    cts_out = dict(zip(fn.diff_ids, fb.outvars[layer.num_outs:]))
    outs = dict(zip(list(fn.float_outs) + list(fn.int_outs), fb.outvars))
    cts_in = dict(zip(fn.float_outs, fb.invars[len(position):]))
    into = lambda a, n: lambda spec: reshard_s(a, spec, n, mesh)    # noqa: E731
    out_of = lambda w, n: lambda spec: reshard_s(spec, w, n, mesh)  # noqa: E731
    costs: dict[int, Callable[[Spec], float]] = {}
    for vid, (arrives, wanted_ct) in neighbours.before.items():
        n = graph.values[vid].nbytes
        if vid in position:
            costs = _summed(costs, {fb.invars[position[vid]]: into(arrives, n)})
        if wanted_ct is not None and isinstance(cts_out.get(vid), int):
            costs = _summed(costs, {cts_out[vid]: out_of(wanted_ct, n)})
    for vid, (read, given_ct) in neighbours.after.items():
        n = graph.values[vid].nbytes
        if isinstance(outs.get(vid), int):
            costs = _summed(costs, {outs[vid]: out_of(read, n)})
        if given_ct is not None and vid in cts_in:
            costs = _summed(costs, {cts_in[vid]: into(given_ct, n)})
    return costs


def _summed(a: Mapping[int, Callable[[Spec], float]], b: Mapping[int, Callable[[Spec], float]]
            ) -> dict[int, Callable[[Spec], float]]:
    """Per value, the sum of the cost functions of `a` and `b`."""
    out = dict(a)
    for v, f in b.items():
        g = out.get(v)
        out[v] = f if g is None else functools.partial(lambda f1, f2, spec: f1(spec) + f2(spec),
                                                         g, f)
    return out


def neighbour_reshard_s(p: LayerCost, program: pipeline.StageProgram, graph: Graph,
                        neighbours: Neighbours) -> float:
    """Seconds per micro-batch of resharding between layer solution `p` and its
    `neighbours`, both ways (what `internal_reshard_s` charges at those boundaries)."""
    total = 0.0
    for k, vid in enumerate(program.inputs):
        if vid in neighbours.before:
            arrives, wanted_ct = neighbours.before[vid]
            n = graph.values[vid].nbytes
            total += reshard_s(arrives, p.input_specs[k], n, p.mesh)
            ct = p.ct_out_specs[k] if p.ct_out_specs else None
            if wanted_ct is not None and ct is not None:
                total += reshard_s(ct, wanted_ct, n, p.mesh)
    for k, vid in enumerate(program.outputs):
        if vid in neighbours.after:
            read, given_ct = neighbours.after[vid]
            n = graph.values[vid].nbytes
            total += reshard_s(p.output_specs[k], read, n, p.mesh)
            ct = p.ct_in_specs[k] if p.ct_in_specs else None
            if given_ct is not None and ct is not None:
                total += reshard_s(given_ct, ct, n, p.mesh)
    return total


def _residuals(fb: Graph, num_primal_outs: int, kept_inputs: set[int]) -> set[int]:
    """The values the forward keeps for the backward (one micro-batch in flight): values
    produced up to the forward's last output (the first `num_primal_outs` outputs), and the
    per-micro-batch inputs `kept_inputs`, that are read after it.  Values a rematerialized
    stage recomputes are produced after that point, so they are not among them."""
    producers = [fb.values[op].producer for op in fb.outvars[:num_primal_outs]
                 if isinstance(op, int) and fb.values[op].producer is not None]
    start = max(producers) + 1 if producers else 0
    return {op for e in fb.eqns[start:] for op in e.inputs if isinstance(op, int)
            and (op in kept_inputs or fb.values[op].producer is not None
                 and fb.values[op].producer < start)}


def _gradient_matmuls(fb: Graph, grads: Sequence[int]) -> set[int]:
    """Indices of the contractions producing the parameter gradients `grads` whose
    reduction the runtime defers to once per step (`grad_accum.defers`: matmuls,
    convolutions without grouped features, sums), found by walking back through the
    equations a deferred sum passes (`grad_accum.passes_sums`) — the runtime's own walk."""
    through = lambda k: passes_sums(fb.eqns[k].name)
    return {k for k in fb.producers_back(grads, through) if defers(fb.eqns[k])}


def _memoized(p: LayerCost, what: str, owners: tuple, compute: Callable[[], Any]) -> Any:
    """`compute()`, kept on `p` under `what` and the identities of `owners` (the objects
    it reads besides `p`; the same solution serves identical layers, whose programs
    differ)."""
    key = (what, *map(id, owners))
    hit = p._memo.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], owners)):
        return hit[1]
    out = compute()
    p._memo[key] = (owners, out)
    return out


def _own_edges(p: LayerCost, prog: pipeline.StageProgram, params: set[int]
               ) -> tuple[Sides, Sides]:
    """`Neighbours` sides that want what solution `p` does at its edges: its activation
    inputs arriving (and their cotangents wanted) in its input layouts, its outputs read
    (and their cotangents given) in its output layouts."""
    before = {vid: (spec, p.ct_out_specs[n] if p.ct_out_specs else None)
              for n, (vid, spec) in enumerate(zip(prog.inputs, p.input_specs))
              if vid not in params}
    after = {vid: (spec, p.ct_in_specs[n] if p.ct_in_specs else None)
             for n, (vid, spec) in enumerate(zip(prog.outputs, p.output_specs))}
    return before, after

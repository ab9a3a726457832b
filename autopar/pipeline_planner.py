"""Plan search for pipelines: layering, per-layer intra-op pricing, the stage DP, and a
final intra-op pass per chosen stage (DESIGN §5).

Gradients are priced as accumulated over micro-batches and reduced once per step (Alpa,
Megatron-LM and DeepSpeed do so, and so does the runtime, `grad_accum`): a layer's
parameter-gradient reduction counts 1/B per micro-batch (the ILP's `comm_scale`), and so
does each parameter's optimizer update, priced in the layer ILPs at the parameter's layout
(`StateSplit`: updated whole where it is held, or on its ZeRO-2 split then all-gathered
back, whichever is faster; every state split where memory needs it).

A layer range's cost on a sub-mesh and logical mesh shape is the sum of its layers' costs
(each layer's forward+backward solved by the intra-op ILP; layers with the same program
text share one solve) plus the resharding between its layers; a stage runs all its layers
on one logical shape, the cheapest.  The stage DP (passes.inter_op) picks stages and
sub-meshes minimizing Σ t_i + (B − 1)·max t_i, a stage's time including receiving its
activations and sending their cotangents back (there priced without layouts, which are not
known yet: `transfer_s`).  The assembled plan prices every transfer from the sending and
receiving stages' chosen layouts as the runtime moves it (`passes.transfer_cost`:
re-layout on the sender, the copy of each byte once, the gather or cut on the receiver).
The plan records every layer's solution (`LayerPlan`), which the runtime emits as
sharding constraints.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from autopar.cost_model import ClusterSpec, Link
from autopar.cost_model.collectives import combined_alpha_share, send_recv_s
from autopar.cost_model.compute import compute_time_s
from autopar.cost_model.units import format_bytes
from autopar.graph import Graph
from autopar.passes import inter_op, intra_op, layering, primitives
from autopar.passes.inter_op import NoStageLayoutError
from autopar.passes.sharding_spec import (
    MeshContext,
    Spec,
    enumerate_specs,
    reshard_s,
    state_split,
)
from autopar.passes.transfer_cost import Layout, TransferPrice, price_transfer

from . import pipeline
from .grad_accum import Deferral, defers, passes_sums, unreduced_spec
from .layer import LayerProgram, differentiable_values
from .methods import PipelineMethod
from .plan import LayerPlan, Plan, PredictedCost, StagePlan
from .planner import WatchedSubmit, answer, batch_axis_only, batch_carried_dims, carries_penalty
from .solve_pool import SolvePool

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
class _Priced:
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


@dataclasses.dataclass(frozen=True)
class StageCostTable:
    """What one pipeline search's stage DP priced (`recording`), for `num_micro_batches`
    micro-batches of the step: per layer range and sub-mesh it asked, the seconds per
    micro-batch of the range's fastest time-optimal layouts on it (memory not checked) with
    its activations received as fast as they can be (None: no such layout), and the
    plan's predicted step seconds.  Every stage a plan can hold takes at least that long.

    `fixed_s`: per layer range and sub-mesh, seconds per micro-batch of that least time
    that no layout goes below and no micro-batch count changes (its layers'
    `_Priced.fixed_floor_s`; absent: 0), which a bound for more micro-batches keeps
    unscaled (`micro_batches.lower_bound_s`).  `cross_s`: per range on a sub-mesh inside
    one host of a cluster of several, its least time when the stage before it is on
    another host (what the range reads from the layer before it arrives over the link
    between hosts); absent: the same as `least_s`.  `tied_s`: per sub-mesh of the last
    stage of a pipeline of several, the least seconds per step of moving the parameters
    the first and the last layer both read to it and their gradients back (absent: 0)."""

    num_micro_batches: int
    num_layers: int
    num_devices: int
    submeshes: tuple[tuple[int, int], ...]
    num_stages: int | None
    least_s: Mapping[tuple[int, int, tuple[int, int]], float | None]
    step_s: float
    fixed_s: Mapping[tuple[int, int, tuple[int, int]], float] = dataclasses.field(
        default_factory=dict)
    cross_s: Mapping[tuple[int, int, tuple[int, int]], float] = dataclasses.field(
        default_factory=dict)
    tied_s: Mapping[tuple[int, int], float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"num_micro_batches": self.num_micro_batches, "num_layers": self.num_layers,
                "num_devices": self.num_devices, "submeshes": [list(s) for s in self.submeshes],
                "num_stages": self.num_stages, "step_s": self.step_s,
                "least_s": [[i, j, *sub, c] for (i, j, sub), c in self.least_s.items()],
                "fixed_s": [[i, j, *sub, c] for (i, j, sub), c in self.fixed_s.items()],
                "cross_s": [[i, j, *sub, c] for (i, j, sub), c in self.cross_s.items()],
                "tied_s": [[*sub, c] for sub, c in self.tied_s.items()]}

    @staticmethod
    def from_json(d: dict[str, Any]) -> StageCostTable:
        return StageCostTable(
            d["num_micro_batches"], d["num_layers"], d["num_devices"],
            tuple((h, m) for h, m in d["submeshes"]), d["num_stages"],
            {(i, j, (h, m)): c for i, j, h, m, c in d["least_s"]}, d["step_s"],
            {(i, j, (h, m)): c for i, j, h, m, c in d.get("fixed_s", [])},
            {(i, j, (h, m)): c for i, j, h, m, c in d.get("cross_s", [])},
            {(h, m): c for h, m, c in d.get("tied_s", [])})


_recording: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "autopar_stage_cost_tables", default=False)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Pipeline searches inside the block leave their `StageCostTable` in their plan's
    `solver["stage_costs"]` (`StageCostTable.to_json`; the plans are otherwise unchanged,
    and a plan cache hit brings back the table its search left)."""
    token = _recording.set(True)
    try:
        yield
    finally:
        _recording.reset(token)


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
                ) -> dict[tuple[int, ...], _Priced]:
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
                      ) -> Callable[[], dict[tuple[int, ...], _Priced]]:
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
    scale = ({i: 1.0 / num_micro_batches for i in _gradient_matmuls(fb, grad_outs)}
             if num_micro_batches > 1 and fn.diff_ids else {})
    # Each micro-batch's parameter gradients are added into the stage's accumulators at
    # their layout (unreduced: a data-parallel layout adds whole gradients on every device).
    traffic = {vid: ACCUMULATE_TRAFFIC for vid in grad_outs}
    param_inputs = [(fb.invars[k], graph.values[vid]) for k, vid in enumerate(f_ids)
                    if vid in params] if update is not None or lean or memory_price else []
    # A fixed (dp, tp) layout splits the batch over dp only: the other axes split the model.
    batch_led = (batch_carried_dims(fb, [v for k, v in enumerate(fb.invars)
                                         if k >= len(f_ids) or f_ids[k] not in params],
                                    batch_size, {batch_size})
                 if forced_batch_axis and batch_size else {})
    pending = []
    charges: dict[tuple[int, ...], dict[int, Callable[[Spec], float]]] = {}
    penalties: dict[tuple[int, ...], list[tuple[int, Callable[[Spec], float]]]] = {}
    for shape in shapes or logical_shapes(submesh):
        mesh = MeshContext.build(shape, sub)
        lean_costs = {fv: _lean_penalty(value.shape, mesh)
                      for fv, value in param_inputs} if lean else {}
        updates = {fv: _param_cost(update, lean_costs.get(fv), value.shape, value.nbytes, mesh,
                                   num_micro_batches, memory_price)
                   for fv, value in param_inputs}
        penalties[shape] = list(lean_costs.items())
        if batch_led:
            # The data-parallel axis is the only one the batch is split over, so a (dp,
            # tp) stage is tensor-parallel over tp, not data-parallel over dp x tp.
            held = batch_axis_only(batch_led, mesh.axes[0])
            updates = _summed(updates, held)
            penalties[shape] += held.items()
        if neighbours:
            charges[shape] = _neighbour_costs(layer, position, graph, neighbours, mesh)
            updates = _summed(updates, charges[shape])
        forced = {}
        if input_rule is not None:
            for pos, vid in enumerate(fb.invars[:len(position)]):
                spec = input_rule(f_ids[pos], mesh)
                if spec is not None:
                    forced[vid] = spec
        if forced_batch_axis and batch_size:
            for pos, vid in enumerate(fb.invars):
                v = fb.values[vid]
                if pos >= len(fn.diff_ids) and v.shape and v.shape[0] == batch_size \
                        and batch_size % shape[0] == 0:
                    forced[vid] = ((mesh.axes[0],),) + ((),) * (v.ndim - 1)
        pending.append((shape, mesh, intra_op.start(
            fb, mesh, forced=forced, batch_size=batch_size, solver=solver,
            time_limit_s=time_limit_s, comm_scale=scale, traffic=traffic,
            value_costs=updates, submit=submit, retry_time_limit_s=retry_time_limit_s,
            builds=builds)))
    def uncharged(p: _Priced) -> _Priced:
        """The solution's time without the memory price and the resharding to its
        neighbours its ILP paid (the first is not seconds the step spends, the stage prices
        the second)."""
        charge = memory_price * _held_bytes(p, program, params, graph, update) \
            if memory_price else 0.0
        vs = dict(p.value_specs)
        if p.mesh.shape in charges:
            charge += sum(fn(vs[v]) for v, fn in charges[p.mesh.shape].items() if v in vs)
        penalized = carries_penalty(vs, penalties[p.mesh.shape])
        return dataclasses.replace(p, cost_s=p.cost_s - charge, penalized=penalized) \
            if charge or penalized else p

    # The parameters' own work is priced apart from its update only without other charges
    # on their layouts (`_fixed_floor_s`).
    plain = not (lean or memory_price or neighbours or batch_led)
    param_ids = {fb.invars[k] for k, vid in enumerate(f_ids) if vid in params}

    def floored(p: _Priced, run: intra_op.PendingRun) -> _Priced:
        floor = _fixed_floor_s(fb, run, grad_outs, param_ids if plain else set(),
                               updates if plain else {}, p.mesh)
        return dataclasses.replace(p, fixed_floor_s=floor) if floor else p

    return lambda: {shape: floored(uncharged(_priced(
        graph, program, layer, position, per_micro_inputs, mesh,
        answer(run, f"the layer ILP ({len(program.eqns)} equations) on sub-mesh {submesh}, "
                    f"logical mesh {shape}"))), run)
        for shape, mesh, run in pending}


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


@dataclasses.dataclass(frozen=True)
class StateSplit:
    """Which parameters' optimizer state a stage splits over its unused mesh axes (ZeRO-2,
    `state_split`), and what each parameter's update costs.

    `mode`: "none"; "all"; or "paying": where updating the split and all-gathering the
    updated parameter back to its layout is faster than updating it whole at its layout."""

    mode: str
    state_bytes_per_param_byte: float
    cluster: ClusterSpec
    # (spec, shape, nbytes, mesh shape, mesh links) -> _costs_s: the stage DP asks for the
    # same parameters' costs once per layer range.
    _memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def _costs_s(self, spec: Spec, shape: tuple[int, ...], nbytes: float,
                 mesh: MeshContext) -> tuple[float, float]:
        """(whole update, split update + all-gather) seconds per step."""
        key = (spec, shape, nbytes, mesh.shape, mesh.links)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = self._compute_costs_s(spec, shape, nbytes, mesh)
        return found

    def _compute_costs_s(self, spec: Spec, shape: tuple[int, ...], nbytes: float,
                         mesh: MeshContext) -> tuple[float, float]:
        whole = update_time_s(nbytes / mesh.shards(spec), self.state_bytes_per_param_byte,
                              self.cluster)
        if self.mode == "none":
            return whole, math.inf
        state = state_split(spec, shape, mesh)
        split = (update_time_s(nbytes / mesh.shards(state), self.state_bytes_per_param_byte,
                               self.cluster)
                 + gather_after_update_s(state, spec, nbytes, mesh))
        return whole, split

    def _chooses_split(self, whole: float, split: float) -> bool:
        return self.mode == "all" or (self.mode == "paying" and split < whole)

    def splits(self, spec: Spec, shape: tuple[int, ...], nbytes: float,
               mesh: MeshContext) -> bool:
        return self._chooses_split(*self._costs_s(spec, shape, nbytes, mesh))

    def cost_s(self, spec: Spec, shape: tuple[int, ...], nbytes: float,
               mesh: MeshContext) -> float:
        """Seconds per step of updating a parameter held as `spec` (and gathering it)."""
        whole, split = self._costs_s(spec, shape, nbytes, mesh)
        return split if self._chooses_split(whole, split) else whole


def updates_s(priced: Sequence[_Priced], programs: Sequence[pipeline.StageProgram],
              params: set[int], graph: Graph, split: StateSplit, num_micro_batches: int,
              per_layer: bool = False) -> float:
    """Seconds per micro-batch of the parameter updates of a stage under `split`: each
    parameter once, at the layout of its first reader (where `stage_memory_bytes` holds it
    and the runtime updates it).  With `per_layer`, as the layer ILPs price them
    (`start_price_stage(update=...)`): once per layer reading it, so a tied embedding read
    by the first and the last layer is charged twice."""
    if per_layer:
        held = [(spec, p.mesh, vid) for p, prog in zip(priced, programs)
                for vid, spec in zip(prog.inputs, p.input_specs) if vid in params]
        return sum(split.cost_s(spec, graph.values[vid].shape, graph.values[vid].nbytes,
                                mesh) for spec, mesh, vid in held) / num_micro_batches
    return _once_each(_layer_updates_s(p, prog, params, graph, split)
                      for p, prog in zip(priced, programs)) / num_micro_batches


# Seconds added to a parameter layout that is not cut as finely as it can be, in a lean
# layer solve (`start_price_stage(lean=True)`): larger than any layer's time.
LEAN_PENALTY_S = 1e4


#: The memory-priced layer solves between the time-optimal and the lean ends of a layer's
#: trade-off, as fractions of the sub-mesh's knee price (`knee_price`: the seconds per
#: byte at which its layers' time-optimal and lean solutions cost the same): a stage whose
#: time-optimal layouts do not fit tries them in this order before the lean ones, all its
#: layers at one price (a Lagrangian sweep of the stage's memory constraint: each price
#: gives a stage on its time/memory frontier).  The knee comes from the two solutions the
#: search has anyway, so the prices follow the model and the device, not a fixed scale.
KNEE_FRACTIONS = (0.25, 1.0)
#: The trade-off level of the lean layer solves (after the time-optimal level 0 and the
#: memory-priced levels 1..len(KNEE_FRACTIONS)).
LEAN = len(KNEE_FRACTIONS) + 1


def _level_name(level: int) -> str:
    return "lean" if level == LEAN else f"memory-priced ({KNEE_FRACTIONS[level - 1]:g} x knee)"


def knee_price(pairs: Sequence[tuple[float, float, float, float]]) -> float | None:
    """Seconds per byte at which the lean end of a layer's trade-off pays: the median, over
    (time-optimal s, time-optimal bytes, lean s, lean bytes) pairs of solutions, of the
    time the lean one adds per byte it saves; None where no pair trades time for bytes."""
    rates = sorted((lean_s - fast_s) / (fast_b - lean_b)
                   for fast_s, fast_b, lean_s, lean_b in pairs
                   if lean_s > fast_s and fast_b > lean_b)
    return rates[len(rates) // 2] if rates else None


def _finest_shards(shape: tuple[int, ...], mesh: MeshContext) -> int:
    """The most pieces an even split of a value of `shape` on `mesh` cuts it into (what a
    lean solve's parameters must reach)."""
    return max(mesh.shards(s) for s in enumerate_specs(shape, mesh))


def _lean_penalty(shape: tuple[int, ...], mesh: MeshContext) -> Callable[[Spec], float]:
    """`LEAN_PENALTY_S` seconds on a spec with fewer shards than the finest even split of a
    value of `shape` on `mesh` (`_finest_shards`), 0 on the others."""
    finest = _finest_shards(shape, mesh)
    return lambda spec: LEAN_PENALTY_S if mesh.shards(spec) < finest else 0.0


def _param_cost(update: StateSplit | None, lean: Callable[[Spec], float] | None,
                shape: tuple[int, ...], nbytes: float, mesh: MeshContext,
                num_micro_batches: int, memory_price: float = 0.0
                ) -> Callable[[Spec], float]:
    """A parameter input's extra seconds per spec: its update amortized over the
    micro-batches (`update`), the lean penalty `lean` (`_lean_penalty` of `shape` on
    `mesh`) if given, and `memory_price` (s/byte) times the bytes per device the spec
    keeps of the parameter, its gradient and optimizer state."""
    def cost(spec: Spec) -> float:
        seconds = 0.0 if update is None else (
            update.cost_s(spec, shape, nbytes, mesh) / num_micro_batches)
        if lean is not None:
            seconds += lean(spec)
        if memory_price:
            seconds += _memory_charge_s(memory_price, update, nbytes, mesh.shards(spec))
        return seconds
    return cost


def _held_bytes(p: _Priced, prog: pipeline.StageProgram, params: set[int], graph: Graph,
                update: StateSplit | None) -> float:
    """Bytes per device a layer solution keeps of its parameters, their gradients and
    optimizer state (what a memory price charges)."""
    return sum(_memory_charge_s(1.0, update, graph.values[vid].nbytes, p.mesh.shards(spec))
               for vid, spec in zip(prog.inputs, p.input_specs) if vid in params)


def _memory_charge_s(memory_price: float, update: StateSplit | None, nbytes: float,
                     shards: int) -> float:
    """The memory price (s/byte) of a parameter of `nbytes` cut into `shards` per device:
    its bytes there, its gradient's and its optimizer state's (`update`'s bytes per
    parameter byte; none without)."""
    held_per_byte = 2.0 + (update.state_bytes_per_param_byte if update is not None else 0.0)
    return memory_price * held_per_byte * nbytes / shards


def _priced(graph: Graph, program: pipeline.StageProgram, layer: LayerProgram,
            position: dict[int, int], per_micro_inputs: set[int], mesh: MeshContext,
            res: intra_op.IntraOpResult) -> _Priced:
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
    return _Priced(
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


def neighbour_reshard_s(p: _Priced, program: pipeline.StageProgram, graph: Graph,
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


class _SameProblems:
    """A `submit` that hands each distinct sharding problem to `submit` once: a problem
    equal to one already handed over, number for number (costs, memory usages, liveness,
    edges, usage limit) and with the same solver and time limit, gets that one's future.

    Layer ILPs repeat: on a sub-mesh whose axes split no more of a layer than a smaller
    one's (GPT-39B at 1,024 micro-batches: its layers on (3, 8), (5, 8), (6, 8) and (7, 8)
    pose the problems they pose on (1, 1) or (1, 8)), and neighbour re-solves whose sides
    differ but charge the same seconds for every layout.  GPT-39B on 8x8xV100-16GB at 1,024
    micro-batches: 127 of 289 problems repeat one before them.  Any choice costs the same in
    equal problems, so one answer serves all of them."""

    def __init__(self, submit: Callable[..., Any]):
        self._submit = submit
        self._futures: dict[tuple, Any] = {}
        self._lock = threading.Lock()   # the sub-meshes are priced side by side
        self.shared = 0

    def __call__(self, problem, *, time_limit_s: float, backend: str, **options):
        key = (_problem_digest(problem), float(time_limit_s), backend,
               tuple(sorted(options.items())))
        with self._lock:
            future = self._futures.get(key)
            if future is None:
                future = self._futures[key] = self._submit(
                    problem, time_limit_s=time_limit_s, backend=backend, **options)
            else:
                self.shared += 1
        return future


def _problem_digest(problem) -> bytes:
    """A digest of everything a solver reads from a `ShardingProblem` (not its names)."""
    h = hashlib.blake2b(digest_size=20)
    for arrays in (problem.node_costs, problem.node_usages, problem.edge_costs):
        h.update(len(arrays).to_bytes(8, "little"))
        for a in arrays:
            a = np.ascontiguousarray(a)
            h.update(repr((a.dtype.str, a.shape)).encode())
            h.update(a.tobytes())
    for a in (problem.intervals, problem.edges):
        a = np.ascontiguousarray(a)
        h.update(repr((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    h.update(repr(problem.usage_limit).encode())
    return h.digest()


def _price_side_by_side(range_cost: Callable[[int, int, tuple[int, int]], Any],
                        submeshes: Sequence[tuple[int, int]],
                        asked: Sequence[tuple[int, int, int]]) -> None:
    """Calls `range_cost(i, j, submesh)` for the `asked` triples (`inter_op.asked`: the
    stage DP's), one thread per sub-mesh, each in the DP's order.

    A range's cost waits on its layers' neighbour re-solves (`search`'s `aligned`), one at
    a time along a chain; the chains of different sub-meshes share no state but the solve
    pool, so pricing the sub-meshes side by side keeps the pool's workers busy where the
    DP's own order (every sub-mesh of one range, then the next range) waited on one solve
    at a time.  The DP then reads the memoized costs."""
    per: dict[int, list[tuple[int, int]]] = {}
    for i, j, s in asked:
        per.setdefault(s, []).append((i, j))

    def price(s: int) -> None:
        for i, j in per[s]:
            range_cost(i, j, submeshes[s])

    # Each thread runs in a copy of the caller's context: the fallbacks a layer build
    # reports (`passes.fallbacks.collecting`) reach the caller's collection.
    with concurrent.futures.ThreadPoolExecutor(max(1, len(per))) as threads:
        for f in [threads.submit(contextvars.copy_context().run, price, s) for s in per]:
            f.result()


#: What a stage's layers are aligned to on the side of the next layer (`search`'s
#: `aligned`), besides what the layer before made: the layouts the next layer's own
#: solution reads; none (each layer follows what it receives); every value the next layer
#: reads replicated, a boundary every layer can meet.  Where the layers' own layouts agree,
#: the first leaves them as they are and the others are not tried; where they disagree at
#: every boundary (2 rows of a micro-batch split by some layers and not by others), the
#: first can pay a reshard at every layer and another target gives the faster stage.
AFTER_OWN, AFTER_NONE, AFTER_WHOLE = "own", "none", "whole"
AFTER_TARGETS = (AFTER_OWN, AFTER_NONE, AFTER_WHOLE)


def _same_solutions(a: Sequence[_Priced], b: Sequence[_Priced]) -> bool:
    """Whether two chains of a stage's layer solutions are the same solutions."""
    return all(x is y for x, y in zip(a, b, strict=True))


def _cheapest(options: dict[tuple[int, ...], _Priced]) -> _Priced:
    return min(options.values(), key=lambda p: p.cost_s)


def state_floor_bytes(param_bytes: float, state_bytes_per_param_byte: float,
                      num_devices: int) -> float:
    """Bytes per device that no plan goes below: the parameters, their gradient
    accumulators and the optimizer state, split evenly over all `num_devices`."""
    return param_bytes * (2.0 + state_bytes_per_param_byte) / num_devices


def search(split: pipeline.SplitStep, method: PipelineMethod,
           cluster: ClusterSpec, device_ids: Sequence[int], *, fp: str,
           input_names: Sequence[str], in_shapes: Sequence[tuple[int, ...]],
           out_shapes: Sequence[tuple[int, ...]], batch_size: int | None,
           progress: Callable[[str], None] | None = None,
           state_bytes_per_param_byte: float = 0.0) -> Plan:
    """Finds stages, sub-meshes and per-stage shardings for a split step.

    A stage's memory per device (checked against the budget) is `stage_memory_bytes`:
    its layers' forward+backward peaks, the optimizer state (`state_bytes_per_param_byte`
    x its parameter bytes per device, laid out like the parameters, or split further over
    the stage's data-parallel axes with the method's `shard_optimizer_state`: the plan's
    `StagePlan.state_specs`), and the residuals of the micro-batches 1F1B keeps in flight.

    `progress(message)` is called at each phase boundary (layering, each layer ILP, stage
    DP, each stage ILP); the seconds of each phase are in the plan's `solver["phases_s"]`.
    """
    t0 = time.perf_counter()
    phases: dict[str, float] = {}
    graph = split.forward_graph()
    diff = diff_values(split, graph)
    params = {graph.invars[j] for j in split.diff_inputs}
    n = len(device_ids)
    hosts = cluster.num_hosts if n == cluster.num_devices else 1
    per_host = n // hosts
    layout = method.stage_layout(n, per_host)
    if progress:
        progress("layering")
    t_phase = time.perf_counter()
    lay = layering.run(graph, layout.layer_num, min_layers=layout.min_layers)
    phases["layering"] = time.perf_counter() - t_phase
    if layout.num_stages is not None and layout.num_stages > lay.num_layers:
        raise NoStageLayoutError(f"{type(method).__name__}: {layout.num_stages} stages need "
                                 f"at least as many layers, the forward has "
                                 f"{lay.num_layers}")
    ranges = lay.eqn_ranges()
    layer_programs = pipeline.stage_programs(graph, [a for a, _ in ranges[1:]])
    budget = method.memory_budget_bytes or cluster.memory_bytes
    # Fail now rather than after pricing every stage (minutes on large clusters).
    param_bytes = float(sum(graph.values[v].nbytes for v in params))
    floor = state_floor_bytes(param_bytes, state_bytes_per_param_byte, n)
    if floor > budget:
        raise NoStageLayoutError(
            f"no stage layout fits: the parameters ({format_bytes(param_bytes)}), their "
            f"gradients and the optimizer state ({state_bytes_per_param_byte:.3g} bytes per "
            f"parameter byte) need {format_bytes(floor)} per device even split over all "
            f"{n} devices; the budget is {format_bytes(budget)} per device")
    kw = dict(solver=method.solver, time_limit_s=method.time_limit_s, batch_size=batch_size)
    # The layer ILPs price each parameter's update at its layout: split where that pays
    # (or always, for a fixed layout); a stage may then split every parameter's state when
    # its memory needs it (`stage_options`).
    zero = method.shard_optimizer_state
    modes = (["all"] if zero and layout.fixed_state_split else ["paying", "all"] if zero
             else ["none"])
    splits = {m: StateSplit(m, state_bytes_per_param_byte, cluster) for m in modes}
    layer_kw = dict(kw, time_limit_s=min(method.time_limit_s, LAYER_TIME_LIMIT_S),
                    retry_time_limit_s=min(method.time_limit_s, LAYER_RETRY_TIME_LIMIT_S),
                    update=splits[modes[0]])
    # A layer's variants: rematerialized or not (`always_remat`: every layer is; with
    # `search_remat` the stage search may rematerialize some where memory needs it).
    always_remat = split.remat or layout.remat is True
    search_remat = layout.remat == "auto" and not always_remat
    layer_cache: dict[tuple[str, tuple[int, int], int, bool],
                      dict[tuple[int, ...], _Priced]] = {}
    layer_seen: set[tuple[int, tuple[int, int]]] = set()
    layer_pairs = lay.num_layers * len(
        set(layout.submesh_shapes) if layout.submesh_shapes is not None
        else inter_op.submesh_shapes(hosts, per_host))
    fixed_shape = [layout.logical_shape] if layout.logical_shape is not None else None

    program_keys: dict[int, str] = {}
    # Identical layers share one trace of their forward+backward (that of the first), one
    # per variant (rematerialized or not).
    traced_layers: dict[tuple[str, bool], tuple[pipeline.StageProgram, LayerProgram]] = {}

    started: dict[tuple[str, tuple[int, int], int, bool], Callable[[], dict]] = {}
    pool = SolvePool()
    # waits on answers bounded by the pool's progress; a problem identical to one already
    # handed over shares its answer (`_SameProblems`)
    submit = WatchedSubmit(_SameProblems(pool.submit))
    # A layer's memory-priced and lean ILPs are its time-optimal twin with other parameter
    # costs: one build each.
    builds = intra_op.BuildCache()

    def start_layer(layer: int, submesh: tuple[int, int], level: int = 0, remat: bool = False
                    ) -> tuple[str, tuple[int, int], int, bool]:
        """Builds the layer's ILPs on `submesh` at trade-off `level` (0 time-optimal,
        1.. `KNEE_FRACTIONS`, `LEAN` parameters cut as finely as they go), rematerialized
        with `remat` (or `always_remat`), and hands them to the pool, once per distinct
        layer program, sub-mesh, level and variant; returns the cache key."""
        if layer not in program_keys:
            program_keys[layer] = _program_key(graph, layer_programs[layer], diff)
        pkey = program_keys[layer]
        remat = remat or always_remat
        key = (pkey, submesh, level, remat)
        if not level and remat == always_remat:
            layer_seen.add((layer, submesh))
        if key not in layer_cache and key not in started:
            if progress:
                what = " rematerialized" if remat and not always_remat else ""
                progress(f"layer ILP {len(layer_seen)}/{layer_pairs}: layer {layer} on "
                         f"sub-mesh {submesh}" if not level and not what else
                         f"{_level_name(level)}{what} layer ILP: layer {layer} on sub-mesh "
                         f"{submesh} (the faster stages do not fit)")
            prog, traced = traced_layer(layer, remat)
            started[key] = start_layer_ilps(prog, traced, submesh, level, fixed_shape)
        return key

    def traced_layer(layer: int, remat: bool) -> tuple[pipeline.StageProgram, LayerProgram]:
        """The first layer with layer `layer`'s program, and its forward+backward traced
        (rematerialized with `remat`)."""
        tkey = (program_keys[layer], remat)
        if tkey not in traced_layers:
            prog = layer_programs[layer]
            traced_layers[tkey] = (prog, LayerProgram.build(graph, prog, diff, remat=remat))
        return traced_layers[tkey]

    def start_layer_ilps(prog: pipeline.StageProgram, traced: LayerProgram,
                         submesh: tuple[int, int], level: int,
                         shapes: Sequence[tuple[int, ...]] | None,
                         neighbours: Neighbours | None = None
                         ) -> Callable[[], dict[tuple[int, ...], _Priced]]:
        """`start_price_stage` of one layer program at trade-off `level`."""
        return start_price_stage(
            graph, prog, diff, cluster, submesh, forced_batch_axis=layout.batch_axis,
            shapes=shapes, remat=traced.fn.remat, num_micro_batches=method.num_micro_batches,
            layer=traced, submit=submit, lean=level == LEAN,
            memory_price=(KNEE_FRACTIONS[level - 1] * knee_of(submesh)
                          if 0 < level < LEAN else 0.0),
            builds=builds, neighbours=neighbours, **layer_kw)

    leaner_submeshes: set[tuple[tuple[int, int], int, bool]] = set()

    def layer_options(layer: int, submesh: tuple[int, int], level: int = 0,
                      remat: bool = False) -> dict[tuple[int, ...], _Priced]:
        key = start_layer(layer, submesh, level, remat)
        if (level or remat) and (submesh, level, remat) not in leaner_submeshes:
            # The faster stages do not fit on this sub-mesh: the stage DP will ask for this
            # level's options of most layers here, so the pool solves them side by side
            # rather than one at a time as they are asked for (GPT-39B on 64 V100s: 13 s
            # of waiting for lean answers -> 7 s).
            leaner_submeshes.add((submesh, level, remat))
            for k in range(lay.num_layers):
                start_layer(k, submesh, level, remat)
        if key not in layer_cache:
            # A lean solve that cannot cut every parameter finely carries the penalty:
            # that logical shape has no lean option.
            layer_cache[key] = {shape: p for shape, p in started.pop(key)().items()
                                if not p.penalized}
            if progress and layer_cache[key]:
                best = min(layer_cache[key].values(), key=lambda p: p.cost_s)
                progress(f"layer ILP {len(layer_cache)} solved: layer {layer} on sub-mesh "
                         f"{submesh}, best {best.cost_s * 1e3:.3f} ms/mb on {best.mesh.shape}")
        return layer_cache[key]

    micro = method.num_micro_batches
    # GPipe runs every micro-batch's forward before the first backward: each stage holds
    # all of their residuals (1F1B: as many as stages from it to the last).
    gpipe = method.schedule == "gpipe"
    link = cluster.inter_host if hosts > 1 else cluster.intra_host

    def stage_options(i: int, j: int, submesh: tuple[int, int], level: int = 0
                      ) -> list[_StageEstimate]:
        """Layers i..j on `submesh`, one estimate per logical shape (all layers of a stage
        share its mesh): their solutions at trade-off `level` (`start_layer`)."""
        progs = [layer_programs[k] for k in range(i, j + 1)]
        options = [layer_options(k, submesh, level) for k in range(i, j + 1)]
        out = []
        for shape in options[0]:
            if any(shape not in o for o in options):
                continue
            free = [o[shape] for o in options]
            chained = [aligned(i, j, submesh, level, shape, free, AFTER_OWN)]
            if not _same_solutions(chained[0], free):
                # The look-ahead chain re-solved a layer: its neighbours' own layouts
                # disagree, so also try the other targets (`AFTER_TARGETS`), each chain
                # that differs from those before it once.
                for after in AFTER_TARGETS[1:]:
                    chain = aligned(i, j, submesh, level, shape, free, after)
                    if not any(_same_solutions(seen, chain) for seen in chained):
                        chained.append(chain)
            for priced in chained:
                out += estimates(i, submesh, priced, progs, (always_remat,) * len(priced))
        return out

    def estimates(i: int, submesh: tuple[int, int], priced: list[_Priced],
                  progs: list[pipeline.StageProgram], remat: tuple[bool, ...]
                  ) -> list[_StageEstimate]:
        """The stage of layers i.. with these solutions, one estimate per optimizer-state
        mode.  The layer ILPs priced the updates under the first mode (splitting where it
        pays), once per layer reading a parameter: the stage takes theirs off and prices
        its own, each parameter once, under each mode ("all": every state split, for
        memory)."""
        layers_s = (sum(p.cost_s for p in priced) + internal_reshard_s(priced, progs, graph)
                    - sum(layer_updates_s(k, submesh, p) for k, p in enumerate(priced, start=i)))
        return [_StageEstimate(priced, progs, layers_s + updates_s(priced, progs, params, graph,
                                                                   splits[m], micro),
                               splits[m], remat) for m in modes]

    def rematerialized(i: int, j: int, submesh: tuple[int, int], level: int,
                       options: list[_StageEstimate], in_flight: int, whole: bool
                       ) -> _StageEstimate | None:
        """The fastest stage of layers i..j at trade-off `level` (`options`: its
        `stage_options` there) that fits by rematerializing some of its layers: per logical
        shape and optimizer-state mode, the layers ranked by the residual bytes their
        rematerialization frees per second it adds, the fewest of the first of them that
        make the stage fit (memory falls as more are rematerialized: bisected)."""
        progs = [layer_programs[k] for k in range(i, j + 1)]
        # Per logical shape, the layers' solutions in the stage's fastest option on it.
        plain: dict[tuple[int, ...], _StageEstimate] = {}
        for o in options:
            shape = o.priced[0].mesh.shape
            if shape not in plain or o.cost_s < plain[shape].cost_s:
                plain[shape] = o
        again = [layer_options(k, submesh, level, remat=True) for k in range(i, j + 1)]
        best = None
        for shape, fastest in plain.items():
            if any(shape not in o for o in again):
                continue
            kept = fastest.priced
            # Each layer's rematerialized solution aligned to its own kept one at the
            # layer's edges (its neighbours may keep theirs).
            redone = [align_layer(k, submesh, level, shape, o[shape],
                                  *_own_edges(kept[k - i], progs[k - i], params), remat=True)
                      for k, o in enumerate(again, start=i)]
            freed = [(k, kept[k].residual_bytes - redone[k].residual_bytes,
                      redone[k].cost_s - kept[k].cost_s) for k in range(len(kept))]
            order = [k for k, b, _ in sorted((f for f in freed if f[1] > 0),
                                             key=lambda f: -f[1] / max(f[2], 1e-12))]
            for m in range(len(modes)):
                option = functools.partial(mixed, i, submesh, progs, kept, redone, order, m)
                r = _least(len(order), lambda r, option=option: stage_fits(
                    option(r), in_flight, whole))
                found = option(r) if r is not None else None
                if found is not None and (best is None or found.cost_s < best.cost_s):
                    best = found
        return best

    def mixed(i: int, submesh: tuple[int, int], progs: list[pipeline.StageProgram],
              kept: list[_Priced], redone: list[_Priced], order: list[int], mode: int,
              r: int) -> _StageEstimate:
        """The stage of layers i.. with the first `r` layers of `order` rematerialized
        (`redone`'s solutions) and the rest not (`kept`'s), under optimizer-state mode
        `modes[mode]`."""
        chosen = set(order[:r])
        priced = [redone[k] if k in chosen else kept[k] for k in range(len(kept))]
        return estimates(i, submesh, priced, progs,
                         tuple(k in chosen for k in range(len(kept))))[mode]

    # Each layer's ILP chose the layouts of the values it shares with its neighbours
    # freely; where that leaves resharding, the layer is solved again paying for it
    # (`start_price_stage`'s `neighbours`: the layer before as chosen, the layer after as
    # its own ILP chose, when it is in the stage), and the stage takes whichever of the two
    # costs less with the resharding.  Per (first layer, sub-mesh, level, logical shape):
    # the chain's solutions of layers with a next layer in the stage so far (each depends
    # only on those before it and the next layer's own solution, so a longer range extends
    # a shorter one), and what they make.
    chains: dict[tuple, tuple[list[_Priced], dict[int, tuple[Spec, Spec | None]]]] = {}
    neighbour_solves: dict[tuple, _Priced | None] = {}

    def aligned(i: int, j: int, submesh: tuple[int, int], level: int,
                shape: tuple[int, ...], free: list[_Priced], after: str) -> list[_Priced]:
        """Layers i..j's solutions on `shape`, each aligned where that is cheaper
        (`align_layer`) to what the layer before made and to the layouts `after` names
        for what the next layer reads (`AFTER_TARGETS`)."""
        inner, made = chains.setdefault((i, submesh, level, shape, after), ([], {}))

        def before(k: int) -> dict[int, tuple[Spec, Spec | None]]:
            return {vid: made[vid] for vid in layer_programs[k].inputs if vid in made}

        for k in range(i + len(inner), j):
            p = align_layer(k, submesh, level, shape, free[k - i], before(k),
                            targets(k, submesh, level, shape, after))
            inner.append(p)
            for n, vid in enumerate(layer_programs[k].outputs):
                made[vid] = (p.output_specs[n], p.ct_in_specs[n] if p.ct_in_specs else None)
        last = align_layer(j, submesh, level, shape, free[j - i], before(j), {})
        return inner[:j - i] + [last]

    def reads_after(k: int, submesh: tuple[int, int], level: int, shape: tuple[int, ...]
                    ) -> dict[int, tuple[Spec, Spec | None]]:
        """Layer k's outputs that layer k + 1 reads: the spec its own solution reads each
        in and gives its cotangent in."""
        if k + 1 >= lay.num_layers:
            return {}
        nxt = layer_options(k + 1, submesh, level).get(shape)
        if nxt is None:
            return {}
        prog = layer_programs[k + 1]
        made = set(layer_programs[k].outputs)
        return {vid: (nxt.input_specs[n], nxt.ct_out_specs[n] if nxt.ct_out_specs else None)
                for n, vid in enumerate(prog.inputs) if vid in made}

    def targets(k: int, submesh: tuple[int, int], level: int, shape: tuple[int, ...],
                after: str) -> dict[int, tuple[Spec, Spec | None]]:
        """Layer k's outputs that layer k + 1 reads, with the layouts `after` aligns them
        to (`AFTER_TARGETS`)."""
        if after == AFTER_OWN:
            return reads_after(k, submesh, level, shape)
        if after == AFTER_NONE or k + 1 >= lay.num_layers:
            return {}
        made = set(layer_programs[k].outputs)
        return {vid: (whole, whole if vid in diff else None)
                for vid in layer_programs[k + 1].inputs if vid in made
                for whole in [((),) * graph.values[vid].ndim]}

    def align_layer(k: int, submesh: tuple[int, int], level: int, shape: tuple[int, ...],
                    free: _Priced, before: dict[int, tuple[Spec, Spec | None]],
                    after: dict[int, tuple[Spec, Spec | None]], remat: bool = False
                    ) -> _Priced:
        """`free`, or layer k solved again paying for resharding to `before` and `after`
        (`Neighbours`), whichever costs less with that resharding (the rematerialized
        variant with `remat`)."""
        prog = layer_programs[k]
        sides = Neighbours(before, after)
        if not sides or neighbour_reshard_s(free, prog, graph, sides) <= 0.0:
            return free
        # Identical layers share the first one's trace and solve: its value ids.
        pkey = program_keys[k]
        first, traced = traced_layer(k, remat or always_remat)
        renamed = sides.renamed(dict(zip(prog.inputs, first.inputs)),
                                dict(zip(prog.outputs, first.outputs)))
        key = (pkey, submesh, level, shape, renamed.key(), remat or always_remat)
        if key not in neighbour_solves:
            solved = start_layer_ilps(first, traced, submesh, level, [shape],
                                      renamed)().get(shape)
            neighbour_solves[key] = solved if solved is not None and \
                not solved.penalized else None
        other = neighbour_solves[key]
        if other is None:
            return free
        return min((free, other),
                   key=lambda q: q.cost_s + neighbour_reshard_s(q, prog, graph, sides))

    layer_updates: dict[tuple[int, tuple[int, int], tuple[int, ...], int], float] = {}

    def layer_updates_s(k: int, submesh: tuple[int, int], p: _Priced) -> float:
        """The updates layer k's ILP charged (under the first mode) on this logical mesh
        (`p`: a solution kept alive by the caches above, so its id is its own)."""
        key = (k, submesh, p.mesh.shape, id(p))
        if key not in layer_updates:
            layer_updates[key] = updates_s([p], [layer_programs[k]], params, graph,
                                           splits[modes[0]], micro, per_layer=True)
        return layer_updates[key]

    def stage_fits(o: _StageEstimate, in_flight: int, whole: bool) -> bool:
        return stage_memory_bytes(o.priced, o.programs, params, graph, micro, in_flight,
                                  state_bytes_per_param_byte, o.zero,
                                  whole_step=whole) <= budget

    def fitting(options: list[_StageEstimate], in_flight: int, whole: bool
                ) -> _StageEstimate | None:
        ok = [o for o in options if stage_fits(o, in_flight, whole)]
        return min(ok, key=lambda o: o.cost_s) if ok else None

    # Per layer range and sub-mesh: its fastest time-optimal option's seconds per
    # micro-batch, memory not checked (None: no option), for `StageCostTable`.
    free_costs: dict[tuple[int, int, tuple[int, int]], float | None] = {}

    def fitting_stage(i: int, j: int, submesh: tuple[int, int], in_flight: int
                      ) -> _StageEstimate | None:
        """The fastest option of layers i..j that fits at the first trade-off level where
        one does (time-optimal, then each memory price, then lean); with `search_remat`,
        at each level before it, the fastest that fits by rematerializing some layers
        (`rematerialized`) too, while such an option is faster than the level's fastest
        option memory unchecked."""
        whole = i == 0 and j == lay.num_layers - 1 and submesh[0] * submesh[1] == n
        found: list[_StageEstimate] = []
        for level in range(LEAN + 1):
            if 0 < level < LEAN and knee_of(submesh) is None:
                continue    # no layer trades time for memory here: nothing in between
            options = stage_options(i, j, submesh, level)
            if not level:
                free_costs.setdefault((i, j, submesh),
                                      min((o.cost_s for o in options), default=None))
            if found and min((o.cost_s for o in options), default=math.inf) >= min(
                    o.cost_s for o in found):
                break   # nothing at this level or leaner beats the rematerialized stage
            best = fitting(options, in_flight, whole)
            if best is not None:
                found.append(best)
                break
            if search_remat:
                best = rematerialized(i, j, submesh, level, options, in_flight, whole)
                if best is not None:
                    found.append(best)
        return min(found, key=lambda o: o.cost_s) if found else None

    knees: dict[tuple[int, int], float | None] = {}

    def knee_of(submesh: tuple[int, int]) -> float | None:
        """`knee_price` of the layers' time-optimal and lean solutions on `submesh` (every
        logical shape both have); solves the lean ones first if they are not yet."""
        if submesh not in knees:
            update = splits[modes[0]]
            pairs = []
            for layer in range(lay.num_layers):
                fast, lean = layer_options(layer, submesh), layer_options(layer, submesh, LEAN)
                prog = layer_programs[layer]
                for shape in fast.keys() & lean.keys():
                    f, m = fast[shape], lean[shape]
                    pairs.append((f.cost_s, _held_bytes(f, prog, params, graph, update),
                                  m.cost_s, _held_bytes(m, prog, params, graph, update)))
            knees[submesh] = knee_price(pairs)
        return knees[submesh]

    range_costs: dict[tuple[int, int, tuple[int, int]], float | None] = {}

    def range_cost(i: int, j: int, submesh: tuple[int, int]) -> float | None:
        """Seconds per micro-batch of layers i..j as one stage on `submesh` (the stage DP's
        cost; asked again by the DPs over one sub-mesh shape)."""
        key = (i, j, submesh)
        if key not in range_costs:
            range_costs[key] = _range_cost(i, j, submesh)
        return range_costs[key]

    def _range_cost(i: int, j: int, submesh: tuple[int, int]) -> float | None:
        # The stage's position is not known here: assume as many stages in flight as
        # stages of this size would fill the devices, and its inputs arriving over the
        # slowest link of the cluster.
        size = submesh[0] * submesh[1]
        best = fitting_stage(i, j, submesh, micro if gpipe else max(1, n // size))
        if best is None:
            return None
        recv = sum(transfer_s(graph.values[v].nbytes, size, size, link) * (1 + (v in diff))
                   for v in received_values(i, j))
        return best.cost_s + recv

    activations = {o for e in graph.eqns for o in e.outputs}
    received: dict[tuple[int, int], list[int]] = {}

    def received_values(i: int, j: int) -> list[int]:
        """The activations layers i..j read from the layers before them."""
        if (i, j) not in received:
            prog = pipeline.program_for_range(graph, ranges[i][0], ranges[j][1])
            received[(i, j)] = [v for v in prog.inputs if v in activations]
        return received[(i, j)]

    def least_stage_s(i: int, j: int, submesh: tuple[int, int], cross: bool = False
                      ) -> float | None:
        """Seconds per micro-batch layers i..j take at least as a stage on `submesh`: its
        fastest time-optimal option (None: none) and its received activations and their
        cotangents arriving as fast as they can (`least_transfer_s`); with `cross`, those
        made by layer i - 1 (the stage before's last) from another host."""
        layers_s = free_costs.get((i, j, submesh))
        if layers_s is None:
            return None
        before = range(*ranges[i - 1]) if cross and i > 0 else range(0)
        return layers_s + sum(
            least_transfer_s(submesh, graph.values[v].nbytes, hosts, per_host, cluster,
                             cross=graph.values[v].producer in before)
            * (1 + (v in diff)) for v in received_values(i, j))

    def tied_step_s(submesh: tuple[int, int]) -> float:
        """Seconds per step a pipeline of several stages, its last on `submesh`, spends at
        least moving the parameters that the first and the last layer both read (a tied
        embedding) from the first stage to the last, and their gradients back: each device
        of the receiving stage copies at least its share (`least_transfer_s`; the first
        stage has at most the devices the last leaves)."""
        size = submesh[0] * submesh[1]
        shared = set(layer_programs[0].inputs) & set(layer_programs[-1].inputs) & params
        if lay.num_layers < 2 or size >= n:
            return 0.0
        return sum(least_transfer_s(submesh, graph.values[v].nbytes, hosts, per_host, cluster)
                   + (least_transfer_s(submesh, graph.values[v].nbytes * size / (n - size),
                                       hosts, per_host, cluster) if v in diff else 0.0)
                   for v in sorted(shared))

    def crossing(i: int, j: int, submesh: tuple[int, int]) -> bool:
        """Whether layers i..j on `submesh` can receive from the stage before on the same
        host or on another (`StageCostTable.cross_s`)."""
        return (hosts > 1 and submesh[1] < per_host and i > 0
                and free_costs.get((i, j, submesh)) is not None)

    def fixed_stage_s(i: int, j: int, submesh: tuple[int, int]) -> float:
        """Seconds per micro-batch of `least_stage_s(i, j, submesh)` that no layout and no
        micro-batch count changes: the layers' `_Priced.fixed_floor_s` (the least over the
        logical shapes of each layer's time-optimal solutions; 0 where none)."""
        return sum(min((p.fixed_floor_s for p in layer_options(k, submesh).values()),
                       default=0.0) for k in range(i, j + 1))

    def stage_alternatives(i: int, j: int, submesh: tuple[int, int], in_flight: int
                           ) -> list[_StageEstimate]:
        """Layers i..j's time-optimal options on `submesh` that fit with `in_flight`
        micro-batches in flight, the fastest on each logical mesh."""
        whole = i == 0 and j == lay.num_layers - 1 and submesh[0] * submesh[1] == n
        per_mesh: dict[tuple[int, ...], _StageEstimate] = {}
        for o in stage_options(i, j, submesh):
            shape = o.priced[0].mesh.shape
            if (shape not in per_mesh or o.cost_s < per_mesh[shape].cost_s) \
                    and stage_fits(o, in_flight, whole):
                per_mesh[shape] = o
        return sorted(per_mesh.values(), key=lambda o: o.cost_s)

    assemble = functools.partial(
        _assemble, hosts=hosts, per_host=per_host, device_ids=device_ids, ranges=ranges,
        graph=graph, diff=diff, params=params, micro=micro,
        state_bytes_per_param_byte=state_bytes_per_param_byte, cluster=cluster,
        fitting_stage=fitting_stage, stage_options=stage_options, gpipe=gpipe)
    t_phase = time.perf_counter()
    try:
        # Every layer is priced on every sub-mesh in play: build all the ILPs up front so the
        # pool solves them while the rest are built (and the DP then waits on the answers).
        for submesh in sorted(set(layout.submesh_shapes) if layout.submesh_shapes is not None
                              else inter_op.submesh_shapes(hosts, per_host)):
            for layer in range(lay.num_layers):
                start_layer(layer, submesh)
        phases["layer ILP builds"] = time.perf_counter() - t_phase
        choices: list[list[tuple[tuple[int, int], tuple[int, int]]]] = []
        if layout.equal_layers:
            bounds = inter_op.equal_ranges(lay.num_layers, len(layout.submesh_shapes))
            choices.append(list(zip(bounds, layout.submesh_shapes)))
        elif layout.submesh_shapes is not None:
            choices.append(_best_split(lay.num_layers, list(layout.submesh_shapes), range_cost,
                                       micro))
            phases["layer ILPs + stage split"] = time.perf_counter() - t_phase
        else:
            submeshes = inter_op.submesh_shapes(hosts, per_host)
            t_costs = time.perf_counter()
            _price_side_by_side(range_cost, submeshes, inter_op.asked(
                lay.num_layers, submeshes, num_devices=n, num_stages=layout.num_stages))
            t_costs = time.perf_counter() - t_costs
            result = inter_op.run(lay.num_layers, submeshes,
                                  lambda i, j, s: range_cost(i, j, submeshes[s]), num_devices=n,
                                  num_micro_batches=micro, num_stages=layout.num_stages)
            choices.append([(st.layers, st.submesh) for st in result.stages])
            # The layer ILPs: the stage costs priced ahead, and whatever inter_op's filling
            # of its cost table still asked for, before the DP proper.
            phases["layer ILPs"] = t_costs + result.stats["cost_s"]
            t_phase = time.perf_counter()
            # The DP prices a stage's received activations as if sent by a stage of its own
            # size, without layouts (neither the sender nor the layouts are known there),
            # and leaves out the per-step moves of values several stages read; the assembly
            # prices both from the chosen layouts.  Where stage sizes differ, the DP's
            # choice can assemble slower than a pipeline of equal sub-meshes, whose
            # transfers the DP priced from the right device counts, and where the layouts
            # re-lay out what they send (a relayout per transfer), slower than one stage
            # over every device, which has no transfers: each such pipeline (the DP
            # restricted to one sub-mesh shape; the hand-written 3-D plans are of this
            # kind, and one stage is the whole mesh's) is assembled too and the fastest
            # kept.
            for submesh in submeshes:
                if n % (submesh[0] * submesh[1]):
                    continue
                try:
                    uniform = inter_op.run(lay.num_layers, [submesh],
                                           lambda i, j, s, m=submesh: range_cost(i, j, m),
                                           num_devices=n, num_micro_batches=micro,
                                           num_stages=layout.num_stages)
                except NoStageLayoutError:
                    continue
                choices.append([(st.layers, st.submesh) for st in uniform.stages])
            phases["stage DP"] = (result.stats["seconds"] - result.stats["cost_s"]
                                  + time.perf_counter() - t_phase)
    except BaseException:
        pool.close(cancel=True)
        raise
    pool.close()  # waits for solves still queued (their answers are cached)
    t_phase = time.perf_counter()
    # The uniform pipelines often repeat the DP's choice (one stage over every device,
    # above all): each distinct choice is assembled once, in order.
    assembled = {}
    for c in choices:
        if tuple(c) not in assembled:
            assembled[tuple(c)] = assemble(c)
    chosen = min(assembled, key=lambda c: assembled[c][2])
    # the fastest, its stages' logical meshes then chosen together (`_assemble`)
    stages, per_step_s, step_s, transfers = assemble(list(chosen),
                                                     alternatives=stage_alternatives)
    phases["stage assembly"] = time.perf_counter() - t_phase
    if progress:
        progress(f"stages chosen: {[st.layers for st in stages]}"
                 + (f" (fastest of {len(choices)} assembled)" if len(choices) > 1 else ""))
    # The busiest stage's work over the step (its micro-batches' forward + backward, its
    # own collectives included); the rest of the step is the pipeline's fill and drain
    # bubble and the transfers between stages.
    compute = micro * max(st.predicted_s - st.transfer_s for st in stages)
    recorded = {}
    if _recording.get() and layout.submesh_shapes is None and not layout.equal_layers:
        recorded["stage_costs"] = StageCostTable(
            micro, lay.num_layers, n, tuple(inter_op.submesh_shapes(hosts, per_host)),
            layout.num_stages, {key: least_stage_s(*key) for key in free_costs},
            step_s, {key: fixed_stage_s(*key) for key in free_costs},
            {key: least_stage_s(*key, cross=True) for key in free_costs
             if crossing(*key)},
            {sub: t for sub in inter_op.submesh_shapes(hosts, per_host)
             if (t := tied_step_s(sub))}).to_json()
    return Plan(
        fingerprint=fp, method=method.name, cluster=cluster.name, mesh_shape=(n,),
        mesh_axes=("x",), device_ids=tuple(device_ids), input_names=tuple(input_names),
        in_specs=tuple(((),) * len(s) for s in in_shapes),
        out_specs=tuple(((),) * len(s) for s in out_shapes), value_specs=(),
        predicted=PredictedCost(step_s, compute, step_s - compute,
                                max(st.memory_bytes for st in stages), graph.total_flops() * 3),
        solver={"layers": lay.num_layers, "layering": lay.source,
                "layer_solves": len(layer_cache), "search_s": time.perf_counter() - t0,
                "phases_s": phases, "per_step_transfer_s": per_step_s,
                "transfers": transfers, "stage_candidates": len(choices), **recorded},
        stages=tuple(stages), num_micro_batches=micro, schedule=method.schedule)


def _assemble(choice, *, hosts, per_host, device_ids, ranges, graph, diff, params, micro,
              state_bytes_per_param_byte, cluster, fitting_stage, stage_options, gpipe,
              alternatives=None) -> tuple[list[StagePlan], float, float, list[dict[str, Any]]]:
    """The plan's stages for `choice` ((first, last) layer, sub-mesh shape) per stage, with
    their transfers priced from both stages' layouts (`_with_transfers`): (stages, seconds
    per step of per-step moves, step seconds, the priced transfers).

    Each stage starts as its fastest option that fits (`fitting_stage`), chosen alone;
    with `alternatives(i, j, submesh, in_flight)` (other options of a stage that fit), one
    stage at a time then takes whichever of its alternatives makes the whole step fastest,
    the others kept, until none does (at most REFINE_ROUNDS rounds): what a stage sends and
    receives depends on its neighbours' layouts, which the stage alone does not see."""
    devices = inter_op.assign_devices([s for _, s in choice], hosts, per_host)
    in_flight = [micro if gpipe else len(choice) - k for k in range(len(choice))]
    build = functools.partial(_stage_plan, ranges=ranges, graph=graph, params=params,
                              micro=micro, device_ids=device_ids, whole=len(choice) == 1,
                              state_bytes_per_param_byte=state_bytes_per_param_byte)
    picks = [fitting_stage(*layers, submesh, flight) or min(
        stage_options(*layers, submesh), key=lambda o: o.cost_s)
        for (layers, submesh), flight in zip(choice, in_flight)]
    built = [build(o, layers, devs, flight)
             for o, (layers, _), devs, flight in zip(picks, choice, devices, in_flight)]

    def priced(parts: list[tuple[StagePlan, StageLayouts]]):
        stages, per_step_s, transfers = _with_transfers(
            [st for st, _ in parts], [lay for _, lay in parts], graph, diff, params, cluster,
            per_host)
        times = [st.predicted_s for st in stages]
        return stages, per_step_s, sum(times) + (micro - 1) * max(times) + per_step_s, transfers

    best = priced(built)
    others = [] if alternatives is None else [
        [o for o in alternatives(*layers, submesh, flight) if o is not pick]
        for (layers, submesh), flight, pick in zip(choice, in_flight, picks)]
    for _ in range(REFINE_ROUNDS if any(others) else 0):
        changed = False
        for k, options in enumerate(others):
            for o in options:
                trial = list(built)
                trial[k] = build(o, choice[k][0], devices[k], in_flight[k])
                step = priced(trial)
                if step[2] < best[2] * (1 - REFINE_GAIN):
                    best, built, changed = step, trial, True
        if not changed:
            break
    return best


# `_assemble`'s refinement: rounds over the stages at most, and the relative gain in step
# time a stage's other option must bring to be taken (below it: the first choice stays).
REFINE_ROUNDS = 3
REFINE_GAIN = 1e-9


def _stage_plan(best: _StageEstimate, layers: tuple[int, int], devs: Sequence[int],
                in_flight: int, *, ranges, graph: Graph, params: set[int], micro: int,
                device_ids: Sequence[int], whole: bool, state_bytes_per_param_byte: float
                ) -> tuple[StagePlan, StageLayouts]:
    """Stage `layers` on devices `devs` (indices into `device_ids`) as option `best` (its
    layers' solutions on one logical mesh) with `in_flight` micro-batches' residuals kept:
    its plan (transfers not priced yet) and its layouts (`_with_transfers` reads them).
    The stage inputs take the specs of the layer reading them first."""
    start, stop = ranges[layers[0]][0], ranges[layers[1]][1]
    prog = pipeline.program_for_range(graph, start, stop)
    wanted = set(prog.inputs)
    specs: dict[int, Spec] = {}
    for lp, priced in zip(best.programs, best.priced):
        for vid, spec in zip(lp.inputs, priced.input_specs):
            if vid in wanted:
                specs.setdefault(vid, spec)
    mesh = best.priced[0].mesh
    states = {vid: spec for vid, (spec, _) in state_layouts(
        best.priced, best.programs, params, graph, best.zero).items()}
    layer_plans = tuple(
        LayerPlan(eqn_range=ranges[k], value_specs=p.value_specs,
                  operand_specs=p.operand_specs, num_values=p.num_values,
                  predicted_s=p.cost_s, remat=again)
        for k, p, again in zip(range(layers[0], layers[1] + 1), best.priced,
                                best.remat or (False,) * len(best.priced)))
    stage = StagePlan(
        layers=tuple(layers), eqn_range=(start, stop),
        device_ids=tuple(device_ids[d] for d in devs), mesh_shape=mesh.shape,
        mesh_axes=mesh.axes, input_specs=tuple(sorted(specs.items())),
        predicted_s=best.cost_s,
        memory_bytes=stage_memory_bytes(best.priced, best.programs, params, graph, micro,
                                        in_flight, state_bytes_per_param_byte, best.zero,
                                        whole_step=whole),
        layer_plans=layer_plans, state_specs=tuple(sorted(
            (vid, spec) for vid, spec in states.items()
            if vid in wanted and spec != specs.get(vid))))
    return stage, StageLayouts.of(best.priced, best.programs, states)


@dataclasses.dataclass(frozen=True)
class _StageEstimate:
    """Layers of a stage priced on one logical mesh: their solutions, programs and the
    stage's seconds per micro-batch (layers + resharding between them + amortized update,
    transfers from other stages not included).  `zero`: which parameters' optimizer state
    is split (ZeRO-2), their parameters all-gathered after the update."""

    priced: list[_Priced]
    programs: list[pipeline.StageProgram]
    cost_s: float
    zero: StateSplit | None = None
    # Per layer, whether it is rematerialized (the variant `priced` solved).
    remat: tuple[bool, ...] = ()


def internal_reshard_s(priced: Sequence[_Priced], programs: Sequence[pipeline.StageProgram],
                       graph: Graph) -> float:
    """Seconds per micro-batch of resharding between the layers of one stage: a value one
    layer makes in one layout and a later one reads in another (and its cotangent on the
    way back), and a stage input read by several layers in different layouts."""
    out_spec: dict[int, Spec] = {}
    ct_in_spec: dict[int, Spec] = {}
    first: dict[int, Spec] = {}
    total = 0.0
    for p, prog in zip(priced, programs):
        for vid, spec, ct_spec in zip(prog.inputs, p.input_specs, p.ct_out_specs):
            nbytes = graph.values[vid].nbytes
            if vid in out_spec:
                total += reshard_s(out_spec[vid], spec, nbytes, p.mesh)
                if ct_spec is not None and vid in ct_in_spec:
                    total += reshard_s(ct_spec, ct_in_spec[vid], nbytes, p.mesh)
            elif vid in first:
                total += reshard_s(first[vid], spec, nbytes, p.mesh)
            else:
                first[vid] = spec
        out_spec.update(zip(prog.outputs, p.output_specs))
        ct_in_spec.update((v, c) for v, c in zip(prog.outputs, p.ct_in_specs) if c is not None)
    return total


def transfer_s(nbytes: float, src_devices: int, dst_devices: int, link: Link) -> float:
    """Seconds to move a value of `nbytes` between two sub-meshes over `link`, its layouts
    unknown (the stage DP's estimate): the devices move their shares in parallel, as many
    pairs as the smaller side has devices.  The assembled plan prices each transfer from
    both layouts instead (`_with_transfers`)."""
    return send_recv_s(nbytes / max(1, min(src_devices, dst_devices)), 2, link)


def least_transfer_s(submesh: tuple[int, int], nbytes: float, hosts: int, per_host: int,
                     cluster: ClusterSpec, cross: bool = False) -> float:
    """The fewest seconds a stage on `submesh` (of a `hosts` x `per_host` cluster) can take
    to receive a value of `nbytes` from another stage: each of its devices copying at most
    its own share, 1/size of the value (`transfer_cost.price_transfer`: a sender of as many
    devices copies each device's shard, one of another size whole copies; the re-layouts
    on either side cost >= 0), over the fastest link its sender can be behind (another
    host's, when the stage holds whole hosts: `_stage_link`; with `cross`, the sender is
    known to be on another host)."""
    size = submesh[0] * submesh[1]
    links = ([cluster.inter_host] if hosts > 1 and (submesh[1] == per_host or cross)
             else [cluster.intra_host] + ([cluster.inter_host] if hosts > 1 else []))
    return min(send_recv_s(nbytes / size, 2, link) for link in links)


def _stage_link(a: Sequence[int], b: Sequence[int], cluster: ClusterSpec,
                per_host: int) -> Link:
    hosts = {d // per_host for d in a} | {d // per_host for d in b}
    return cluster.intra_host if len(hosts) == 1 else cluster.inter_host


@dataclasses.dataclass(frozen=True)
class StageLayouts:
    """Where a planned stage holds the values it exchanges with other stages, by F value
    id, on its logical mesh `mesh`: its inputs (the layout of the first layer reading
    each), the cotangents its backward makes for them (`ct_outs`), its outputs as the
    producing layer makes them, the layout that layer's backward wants their cotangents in
    (`ct_ins`), and each parameter's reduced gradient (`states`)."""

    mesh: MeshContext
    inputs: dict[int, Spec]
    ct_outs: dict[int, Spec]
    outputs: dict[int, Spec]
    ct_ins: dict[int, Spec]
    states: dict[int, Spec]

    @staticmethod
    def of(priced: Sequence[_Priced], programs: Sequence[pipeline.StageProgram],
           states: dict[int, Spec]) -> StageLayouts:
        """A stage of these layer solutions (on one logical mesh), its parameters' reduced
        gradients in `states`."""
        inputs: dict[int, Spec] = {}
        ct_outs: dict[int, Spec] = {}
        outputs: dict[int, Spec] = {}
        ct_ins: dict[int, Spec] = {}
        for p, prog in zip(priced, programs):
            for vid, spec in zip(prog.inputs, p.input_specs):
                inputs.setdefault(vid, spec)
            for vid, ct in zip(prog.inputs, p.ct_out_specs):
                if ct is not None:
                    ct_outs.setdefault(vid, ct)
            outputs.update(zip(prog.outputs, p.output_specs))
            ct_ins.update((v, c) for v, c in zip(prog.outputs, p.ct_in_specs) if c is not None)
        return StageLayouts(priced[0].mesh, inputs, ct_outs, outputs, ct_ins, states)

    def at(self, specs: dict[int, Spec], vid: int, ndim: int) -> Layout:
        """`vid`'s layout in `specs` (one of this stage's tables; replicated if absent)."""
        return Layout(specs.get(vid, ((),) * ndim), self.mesh)


def _with_transfers(stages: list[StagePlan], layouts: Sequence[StageLayouts], graph: Graph,
                    diff: set[int], params: set[int], cluster: ClusterSpec, per_host: int
                    ) -> tuple[list[StagePlan], float, list[dict[str, Any]]]:
    """The stages with the seconds per micro-batch of receiving their activations (and
    sending the cotangents back) added (`StagePlan.transfer_s`), the seconds per step of
    moving values several stages read, and the priced transfers (`price_transfers`)."""
    per_micro, per_step, records = price_transfers(
        [pipeline.program_for_range(graph, *st.eqn_range) for st in stages],
        [st.device_ids for st in stages], layouts, graph, diff, params, cluster, per_host)
    return ([dataclasses.replace(st, predicted_s=st.predicted_s + t, transfer_s=t)
             for st, t in zip(stages, per_micro)], per_step, records)


def price_transfers(programs: Sequence[pipeline.StageProgram],
                    devices: Sequence[Sequence[int]], layouts: Sequence[StageLayouts],
                    graph: Graph, diff: set[int], params: set[int], cluster: ClusterSpec,
                    per_host: int) -> tuple[list[float], float, list[dict[str, Any]]]:
    """Per stage (its program, device ids and layouts), the seconds per micro-batch of
    receiving its activations and sending their cotangents back; the seconds per step of
    moving values several stages read (a tied embedding) to them and their gradients back;
    and a record of each transfer priced (`_transfer_record`).  Each is priced from the two
    stages' layouts as the runtime moves it (`passes.transfer_cost`;
    `PipelineRuntime._lay_out_transfers`): an activation leaves its producer in the tiling
    of its first later reader where that reader has as many devices (else as its producing
    layer made it); its cotangent goes back in the tiling of the activation as the
    producing layer made it, and is re-laid out there into the layout that layer's
    backward wants."""
    made_by: dict[int, int] = {}
    reader: dict[int, int] = {}
    sent: dict[int, Layout] = {}        # an activation as it leaves its producer
    ct_relaid: set[int] = set()         # cotangents whose re-layout on arrival is priced
    out, per_step, records = [], 0.0, []

    def priced(what: str, v: int, a: int, b: int, src: Layout, dst: Layout,
               then: Spec | None = None) -> float:
        value = graph.values[v]
        link = _stage_link(devices[a], devices[b], cluster, per_host)
        price = price_transfer(value.shape, value.nbytes, src, dst, link, then)
        records.append(_transfer_record(what, v, value.nbytes, a, b, price))
        return price.total_s

    for k, (prog, here) in enumerate(zip(programs, layouts)):
        seconds = 0.0
        for v in prog.inputs:
            ndim = graph.values[v].ndim
            src = made_by.get(v, reader.get(v))
            if src is None:
                reader[v] = k
                continue
            there = layouts[src]
            if v in made_by:
                made = there.at(there.outputs, v, ndim)
                seconds += priced("activation", v, src, k, sent.get(v, made),
                                  here.at(here.inputs, v, ndim))
                if v not in sent:
                    same = len(devices[src]) == len(devices[k])
                    sent[v] = here.at(here.inputs, v, ndim) if same else made
                if v in diff:
                    then = there.ct_ins.get(v) if v not in ct_relaid else None
                    ct_relaid.add(v)
                    ct = here.at(here.ct_outs if v in here.ct_outs else here.inputs, v, ndim)
                    seconds += priced("cotangent", v, k, src, ct, made, then)
            else:
                per_step += priced("input", v, src, k, there.at(there.inputs, v, ndim),
                                   here.at(here.inputs, v, ndim))
                if v in diff and v in params:
                    per_step += priced("gradient", v, k, src, here.at(here.states, v, ndim),
                                       there.at(there.states, v, ndim))
        made_by.update((o, k) for o in prog.outputs)
        out.append(seconds)
    return out, per_step, records


def _transfer_record(what: str, vid: int, nbytes: int, src: int, dst: int,
                     price: TransferPrice) -> dict[str, Any]:
    """One priced transfer as the plan's `solver["transfers"]` lists it (per micro-batch
    for activations and cotangents, per step for inputs several stages read and their
    gradients); seconds and bytes: `nbytes` of the whole value, of the re-layout per
    sending device, of the copy per receiving device and of the receiver's gather of the
    wire pieces per receiving device (`transfer_cost.TransferPrice`)."""
    return {"what": what, "value": vid, "nbytes": nbytes, "from_stage": src, "to_stage": dst,
            "route": price.route, "relayout_bytes": price.relayout_bytes,
            "relayout_s": price.relayout_s, "copy_bytes": price.copy_bytes,
            "copy_s": price.copy_s, "gather_bytes": price.gather_bytes,
            "gather_s": price.gather_s, "receive_s": price.receive_s, "total_s": price.total_s}


def param_layouts(priced: Sequence[_Priced], programs: Sequence[pipeline.StageProgram],
                  params: set[int]) -> dict[int, tuple[Spec, MeshContext]]:
    """(spec, mesh) of every parameter a stage of these layer solutions reads: the layout
    of the first layer reading it (the stage's input spec)."""
    out: dict[int, tuple[Spec, MeshContext]] = {}
    for p, prog in zip(priced, programs):
        for vid, spec in zip(prog.inputs, p.input_specs):
            if vid in params:
                out.setdefault(vid, (spec, p.mesh))
    return out


def state_layouts(priced: Sequence[_Priced], programs: Sequence[pipeline.StageProgram],
                  params: set[int], graph: Graph, shard: bool | StateSplit | None
                  ) -> dict[int, tuple[Spec, MeshContext]]:
    """(spec, mesh) of each parameter's reduced gradient and optimizer state on the stage:
    its spec cut over the data-parallel axes (`state_split`) where `shard` splits it (True:
    every parameter), else its spec."""
    def cut(vid: int, spec: Spec, mesh: MeshContext) -> bool:
        if isinstance(shard, StateSplit):
            v = graph.values[vid]
            return shard.splits(spec, v.shape, v.nbytes, mesh)
        return bool(shard)

    return {vid: (state_split(spec, graph.values[vid].shape, mesh)
                  if cut(vid, spec, mesh) else spec, mesh)
            for vid, (spec, mesh) in param_layouts(priced, programs, params).items()}


def held_param_bytes(priced: Sequence[_Priced], programs: Sequence[pipeline.StageProgram],
                     params: set[int], graph: Graph,
                     shard_state: bool | StateSplit | None = False) -> float:
    """Parameter bytes per device of a stage made of these layer solutions (a parameter
    read by several layers counts once, at the layout of the first); with `shard_state`,
    at its state layout (the bytes of parameter the device updates and holds state for)."""
    return _once_each(_layer_param_bytes(p, prog, params, graph, shard_state)
                      for p, prog in zip(priced, programs))


def _once_each(layers: Iterable[list[tuple[int, float]]]) -> float:
    """The sum of the layers' (parameter, amount) terms, each parameter counted once: at
    the first layer listing it."""
    seen: set[int] = set()
    total = 0.0
    for terms in layers:
        for vid, amount in terms:
            if vid not in seen:
                seen.add(vid)
                total += amount
    return total


def _layer_param_bytes(p: _Priced, prog: pipeline.StageProgram, params: set[int],
                       graph: Graph, shard: bool | StateSplit | None
                       ) -> list[tuple[int, float]]:
    """(parameter, bytes per device) of each parameter layer solution `p` reads in `prog`,
    in input order: at its input layout, or at its state layout where `shard` splits it (as
    `state_layouts` does).  Memoized on `p` (the same solution serves identical layers:
    the key holds their program)."""
    return _memoized(p, "param bytes", (prog, params, graph, shard), lambda: [
        (vid, graph.values[vid].nbytes / mesh.shards(spec))
        for vid, (spec, mesh) in state_layouts([p], [prog], params, graph, shard).items()])


def _layer_updates_s(p: _Priced, prog: pipeline.StageProgram, params: set[int], graph: Graph,
                     split: StateSplit) -> list[tuple[int, float]]:
    """(parameter, seconds per step of its update under `split`) of each parameter layer
    solution `p` reads in `prog`, at its input layout, in input order; memoized on `p`."""
    return _memoized(p, "updates", (prog, params, graph, split), lambda: [
        (vid, split.cost_s(spec, graph.values[vid].shape, graph.values[vid].nbytes, mesh))
        for vid, (spec, mesh) in param_layouts([p], [prog], params).items()])


def _layer_memory_terms(p: _Priced, prog: pipeline.StageProgram, params: set[int],
                        graph: Graph) -> tuple[float, list[tuple[int, float]],
                                               list[tuple[int, tuple[Spec, float]]]]:
    """`stage_memory_bytes`'s terms of one layer solution that need no other layer: the
    bytes per device of the parameters and gradients it reads and writes (`own`), the
    (parameter, gradient accumulator bytes) it would hold, and (input, (its spec, bytes per
    device)) of every input as this layer reads it; memoized on `p`."""
    def compute():
        own = 0.0
        grads = []
        acc = p.accumulator_bytes or (None,) * len(prog.inputs)
        for vid, spec, ct, a in zip(prog.inputs, p.input_specs, p.ct_out_specs or
                                    (None,) * len(prog.inputs), acc):
            if vid not in params:
                continue
            nbytes = graph.values[vid].nbytes
            own += nbytes / p.mesh.shards(spec)
            if ct is not None:
                g = nbytes / p.mesh.shards(ct)
                own += g
                grads.append((vid, g if a is None else a))
        inputs = [(vid, (spec, graph.values[vid].nbytes / p.mesh.shards(spec)))
                  for vid, spec in zip(prog.inputs, p.input_specs)]
        return own, grads, inputs

    return _memoized(p, "memory terms", (prog, params, graph), compute)


def _memoized(p: _Priced, what: str, owners: tuple, compute: Callable[[], Any]) -> Any:
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


def gather_after_update_s(state: Spec, spec: Spec, nbytes: float, mesh: MeshContext) -> float:
    """Seconds of all-gathering a parameter of `nbytes` (whole) updated at its state layout
    `state` back to its layout `spec`.  The stage's update gathers every such parameter at
    once, so XLA:GPU combines the gathers (`collectives.combined_alpha_share`, by the mesh's
    device kind): each pays the bandwidth of its own bytes and its share of a combined op's
    latency."""
    if state == spec:
        return 0.0
    latency = reshard_s(state, spec, 0.0, mesh)
    share = combined_alpha_share(nbytes / mesh.shards(spec), mesh.cluster.device_kind)
    return reshard_s(state, spec, nbytes, mesh) - (1.0 - share) * latency


def update_time_s(param_bytes: float, state_bytes_per_param_byte: float,
                  cluster: ClusterSpec) -> float:
    """Seconds of the optimizer update over `param_bytes` of parameters on one device:
    memory-bound — read parameters, gradients and state, write parameters and state
    (~3 FLOPs per byte of parameter, AdamW's dozen per float32 element)."""
    nbytes = param_bytes * (3 + 2 * state_bytes_per_param_byte)
    return compute_time_s(3 * param_bytes, nbytes, "float32", cluster)


def stage_memory_bytes(priced: Sequence[_Priced], programs: Sequence[pipeline.StageProgram],
                       params: set[int], graph: Graph, micro: int, in_flight: int,
                       state_bytes_per_param_byte: float,
                       shard_state: bool | StateSplit | None = False,
                       whole_step: bool = False) -> float:
    """Bytes per device of a stage made of these layer solutions at its peak, as the runtime
    holds them (`PipelineCompiled.stage_memory_bytes` measures the same terms):

    * the parameters, each once, at the layout of its first reader;
    * the gradient accumulators, one per parameter at the layout its first reader's
      backward gives it, unreduced over the data-parallel axes as the runtime keeps them
      (`_Priced.accumulator_bytes`; gradients are added in place, as Megatron-LM's
      main_grad);
    * the optimizer state (split over the data-parallel axes with `shard_state`);
    * the residuals of every micro-batch in flight (the schedule's `in_flight`, at most
      `micro`) but the one running, whole; a layer input among them once, at the layout
      the runtime holds it in (its producer's, `_Priced.input_residuals`), not the reading
      layer's: a layer that reads its input in another layout (replicated, say) makes that
      copy when it runs, a transient of that layer (wrn-2b on 8 H100s, one micro-batch:
      a 32 GiB all-gather of the input of its fifth layer);
    * for the micro-batch running, the largest, over the layers, of a layer's transient
      (its forward+backward's predicted peak less the parameters, gradients and residuals
      counted here) plus the residuals of that layer and the layers before it.  Layers run
      one after the other, so their temporaries never coexist (summing the layers' peaks
      counted each layer's parameters-sized temporaries and attention scores once per
      layer); and while layer k runs forward, later layers have no residuals yet, while it
      runs backward theirs are freed (a convolutional net's largest transients are in its
      first, widest layers, where few residuals are held);
    * with `whole_step` (the stage is the whole pipeline, which the runtime runs as one
      program, `StageRunner.fused_step`): the reduced gradients, at their state layout,
      which are that program's outputs and so held through the step."""
    held = held_param_bytes(priced, programs, params, graph, False)
    state = held_param_bytes(priced, programs, params, graph, shard_state)
    grads: dict[int, float] = {}
    residuals = running = 0.0
    # Where the runtime keeps a layer input it saves for the backward: as the earlier layer
    # producing it laid it out, or a stage input as its first reader does (the stage's
    # input layout); once however many layers read it.
    holder: dict[int, tuple[Spec, float]] = {}
    kept: set[int] = set()
    for p, prog in zip(priced, programs):
        own, layer_grads, inputs_held = _layer_memory_terms(p, prog, params, graph)
        for vid, entry in inputs_held:
            holder.setdefault(vid, entry)
        for vid, g in layer_grads:
            grads.setdefault(vid, g)
        residuals += p.residual_bytes
        transient = p.memory_bytes - own - p.residual_bytes
        for k, nbytes in p.input_residuals:
            vid = prog.inputs[k]
            spec, held_bytes = holder[vid]
            residuals += (held_bytes if vid not in kept else 0.0) - nbytes
            kept.add(vid)
            if p.input_specs[k] != spec:
                transient += nbytes  # the copy in this layer's layout, made when it runs
        running = max(running, residuals + transient)
        for vid, spec in zip(prog.outputs, p.output_specs):
            holder[vid] = (spec, graph.values[vid].nbytes / p.mesh.shards(spec))
    return (held + sum(grads.values()) + (state_bytes_per_param_byte + whole_step) * state
            + (min(in_flight, micro) - 1) * residuals + running)


def _program_key(graph: Graph, prog: pipeline.StageProgram, diff: set[int]) -> str:
    """Identity of a layer for caching: its equations' text with value ids renumbered, the
    renumbered input at each input position, and which inputs carry gradients.

    A solution is stored by input position (`prog.inputs`) and applied to every layer with
    the same key, so the key holds which value each position is.  Inputs are listed in the
    order the equations first read them (`pipeline.program_for_range`), so layers computing
    the same equations match whatever the ids of their inputs (parameters are numbered in
    name order, Block_10 before Block_7)."""
    ren: dict[int, int] = {}

    def name(v):
        return f"v{ren.setdefault(v, len(ren))}" if isinstance(v, int) else repr(v.value)

    lines = []
    for i in prog.eqns:
        e = graph.eqns[i]
        ins = [name(op) if isinstance(op, int) else repr(op.value) for op in e.inputs]
        outs = [f"{name(o)}:{graph.values[o].shape}" for o in e.outputs]
        lines.append(f"{outs}={e.name}{sorted(e.params.items())!r}{ins}")
    lines.append(str([name(o) for o in prog.outputs]))
    lines.append(str([name(v) for v in prog.inputs]))
    lines.append(str([v in diff for v in prog.inputs]))
    return "\n".join(lines)


def _own_edges(p: _Priced, prog: pipeline.StageProgram, params: set[int]
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


def _least(count: int, ok: Callable[[int], bool]) -> int | None:
    """The least r in 1..`count` with `ok(r)`, `ok` taken as monotone (false, then true:
    bisected); None when `ok(count)` is false."""
    if count < 1 or not ok(count):
        return None
    lo, hi = 1, count
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def _best_split(num_layers: int, shapes: list[tuple[int, int]],
                range_cost: Callable[[int, int, tuple[int, int]], float | None],
                micro: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Contiguous layer ranges for fixed, ordered sub-meshes minimizing
    Σ t + (B − 1)·max t (exhaustive: the number of stages is small); a range that does
    not fit its sub-mesh's memory costs infinity (the cheapest split is kept if none
    fits)."""
    k = len(shapes)
    if k > num_layers:
        raise NoStageLayoutError(f"{k} sub-meshes given but the forward has only {num_layers} "
                                 f"layers")
    best, best_cost = None, math.inf
    for cuts in itertools.combinations(range(1, num_layers), k - 1):
        edges = (0, *cuts, num_layers)
        costs = [range_cost(edges[s], edges[s + 1] - 1, shapes[s]) for s in range(k)]
        times = [math.inf if c is None else c for c in costs]
        cost = sum(times) + (micro - 1) * max(times)
        if best is None or cost < best_cost:
            best_cost = cost
            best = [((edges[s], edges[s + 1] - 1), shapes[s]) for s in range(k)]
    return best

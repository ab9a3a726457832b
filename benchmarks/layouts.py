"""Hand-written strategies and autopar's plans priced with one step model (issue 6).

Every strategy is a *layout*: `pp` pipeline stages with equal layer counts, each on `dp x tp`
devices as a (dp, tp) logical mesh, `B` micro-batches, and a rule fixing the parameters'
layout.  Each layer's forward+backward at micro-batch size is priced by the intra-op pass
(`autopar.pipeline_search.price_stage`, autopar's cost model) with the batch split over
dp and the parameters forced by the rule; only the intermediates are left to the search.
autopar's own plans (`autopar.plan`) are re-priced through the same function with the
parameters free, on the stages and logical meshes the plan chose.

Step model (the same for every strategy):

    step = Σ_s t_s + (B − 1)·max_s t_s + max_s u_s

t_s: a stage's seconds per micro-batch, its parameter-gradient reduction counted 1/B (the
gradients accumulate over micro-batches and are reduced once per step, as in Megatron-LM,
DeepSpeed and Alpa; the ILP's `comm_scale`); u_s: the optimizer update (memory-bound
roofline over the state the device holds), plus for ZeRO-2 the all-gather of the updated parameters.

Memory per device of stage s (1F1B keeps pp − s micro-batches of activations in flight) is
the planner's (`pipeline_search.stage_memory_bytes`):

    parameters + gradient accumulators + (in-flight − 1) · residuals
    + max over layers k (residuals of layers ≤ k + layer k's transient) + optimizer state

(gradients are added in place into the accumulators, as Megatron-LM's main_grad does)
with residuals the bytes per device the forward keeps for the backward (at the layouts the
search chose, `LayerCost.residual_bytes`; a saved layer input once, at its producer's
layout), and the optimizer state
(`state_bytes_per_param_byte` x parameter bytes) split like the parameters, and for ZeRO-2/3
also over dp.  A plan whose memory exceeds the device's is out of memory (OOM).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence

from autopar import pipeline
from autopar.cost_model import ClusterSpec
from autopar.passes.inter_op import equal_ranges
from autopar.passes.sharding_spec import MeshContext, Spec, replicated, state_split
from autopar.pipeline_search import (
    LayerCost,
    gather_after_update_s,
    price_stage,
    stage_memory_bytes,
    state_layouts,
)
from autopar.pipeline_search.layer_cost import LAYER_RETRY_TIME_LIMIT_S, LAYER_TIME_LIMIT_S
from autopar.pipeline_search.state import update_time_s
from autopar.pipeline_search.transfers import StageLayouts, price_transfers
from benchmarks.baselines import megatron_dim
from benchmarks.workload import Overrides, Workload

# ----------------------------------------------------------------------------- param rules


def _largest_dim(shape: Sequence[int], n: int) -> int | None:
    dims = [d for d in range(len(shape)) if shape[d] % n == 0]
    return max(dims, key=lambda i: (shape[i], -i)) if dims else None


def _split(shape: Sequence[int], dim: int | None, axes: tuple[str, ...]) -> Spec:
    return tuple(axes if i == dim else () for i in range(len(shape)))


def tensor_parallel_dim(name: str, shape: Sequence[int]) -> int | None:
    """The dim a hand-written tensor-parallel plan splits: Megatron's (attention heads,
    column/row-parallel MLP pairs, vocabulary), expert weights [E, ...] on the experts dim
    (GShard's expert parallelism), convolution kernels [kh, kw, in, out] on the output
    channels."""
    keys = re.findall(r"\['([^']+)'\]", name)
    if keys and keys[-1] in ("wi", "wo") and len(shape) == 3:
        return 0
    if keys and keys[-1] == "kernel" and len(shape) == 4:
        return 3
    return megatron_dim(name, shape)


def param_rule(kind: str) -> Callable[[str, Sequence[int], MeshContext], Spec | None]:
    """Layout of a parameter under a hand-written strategy (mesh axes: x = dp, y = tp).

    * "replicated" (data parallel, ZeRO-2): every device holds the whole parameter;
    * "zero3": split on its largest evenly divisible dim over dp;
    * "tensor": split over tp by `tensor_parallel_dim`, else replicated;
    * "free": left to the search (None), the batch still split over dp (Alpa's
      `force_batch_dim_to_mesh_dim`; "auto" leaves the batch free too).
    """
    def replicate(name, shape, mesh):
        return replicated(len(shape))

    def free(name, shape, mesh):
        return None

    def zero3(name, shape, mesh):
        n = mesh.shape[0]
        return _split(shape, _largest_dim(shape, n), ("x",)) if n > 1 else replicated(len(shape))

    def tensor(name, shape, mesh):
        if len(mesh.shape) < 2 or mesh.shape[1] == 1:
            return replicated(len(shape))
        d = tensor_parallel_dim(name, shape)
        if d is None or shape[d] % mesh.shape[1]:
            return replicated(len(shape))
        return _split(shape, d, ("y",))

    rules = {"replicated": replicate, "zero3": zero3, "tensor": tensor, "free": free}
    if kind not in rules:
        raise ValueError(f"unknown parameter rule {kind!r}; known: {sorted(rules)}")
    return rules[kind]


# ----------------------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class Layout:
    """A hand-written strategy: `pp` equal stages on (dp, tp) meshes, `micro` micro-batches,
    parameters laid out by `params` ("replicated", "zero3", "tensor", or "auto" = searched),
    optimizer state also split over dp when `zero_state`."""

    strategy: str
    dp: int
    tp: int
    pp: int
    micro: int
    params: str
    zero_state: bool = False
    zero_gather: bool = False

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp


@dataclasses.dataclass(frozen=True)
class StageCost:
    layers: tuple[int, int]
    devices: int
    mesh: tuple[int, ...]
    per_micro_s: float
    update_s: float
    memory_bytes: float


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """A strategy's predicted step on one cluster (seconds, bytes per device)."""

    layout: Layout
    step_s: float
    memory_bytes: float
    oom: bool
    stages: tuple[StageCost, ...]

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self.layout), "step_s": self.step_s,
                "memory_bytes": self.memory_bytes, "oom": self.oom,
                "stages": [dataclasses.asdict(s) for s in self.stages]}


class Pricer:
    """Prices layers and layouts for one model (the zoo's, its config's `overrides`
    replaced) on one cluster, caching layer solves by (micro-batches, layer program,
    sub-mesh, logical mesh, parameter rule)."""

    def __init__(self, model: str, global_batch: int, cluster: ClusterSpec,
                 progress: Callable[[str], None] | None = None, overrides: Overrides = ()):
        self.model = model
        self.overrides = tuple(overrides)
        self.global_batch = global_batch
        self.cluster = cluster
        self.progress = progress
        self._cache: dict[tuple, LayerCost] = {}
        self.solves = 0

    def workload(self, micro: int) -> Workload:
        return Workload.build(self.model, self.global_batch, micro, self.overrides)

    def submesh(self, n: int) -> tuple[int, int]:
        per_host = self.cluster.devices_per_host
        if n <= per_host:
            return (1, n)
        if n % per_host:
            raise ValueError(f"{n} devices do not fill whole hosts of {per_host}")
        return (n // per_host, per_host)

    def layer(self, w: Workload, layer: int, mesh_shape: tuple[int, ...], rule: str) -> LayerCost:
        n = math.prod(mesh_shape)
        submesh = self.submesh(n)
        key = (w.num_micro_batches, w.layer_keys[layer], submesh, mesh_shape, rule)
        if key not in self._cache:
            self.solves += 1
            if self.progress:
                self.progress(f"{self.model} B={w.num_micro_batches} layer {layer} mesh "
                              f"{mesh_shape} params {rule}")
            input_rule = None if rule == "auto" else self._input_rule(w, param_rule(rule))
            priced = price_stage(w.graph, w.layers[layer], w.diff, self.cluster, submesh,
                                 solver="auto", time_limit_s=LAYER_TIME_LIMIT_S,
                                 retry_time_limit_s=LAYER_RETRY_TIME_LIMIT_S,
                                 batch_size=w.micro_batch, shapes=[mesh_shape],
                                 input_rule=input_rule, remat=w.split.remat,
                                 num_micro_batches=w.num_micro_batches)
            self._cache[key] = priced[mesh_shape]
        return self._cache[key]

    @staticmethod
    def _input_rule(w: Workload, rule) -> Callable[[int, MeshContext], Spec | None]:
        def forced(vid: int, mesh: MeshContext) -> Spec | None:
            shape = w.graph.values[vid].shape
            if vid in w.batch_ids:
                if shape and shape[0] % mesh.shape[0] == 0 and mesh.shape[0] > 1:
                    return (("x",),) + replicated(len(shape) - 1)
                return replicated(len(shape))
            if vid in w.param_ids:
                return rule(w.names.get(vid, ""), shape, mesh)
            return None
        return forced

    # -- the step model --------------------------------------------------------------------

    def evaluate(self, layout: Layout, stages: Sequence[tuple[tuple[int, int], tuple[int, ...]]]
                 | None = None, held: Sequence[HeldState] | None = None,
                 rules: Sequence[str] | None = None) -> Evaluation:
        """Predicted step of `layout` (uniform stages) or of explicit `stages` ((first, last)
        layer, logical mesh shape) with the layout's micro-batches and rule (`rules`, one per
        stage, where the stages differ); `held`, one per stage, prices each stage's update as
        a plan holds its parameters and state."""
        w = self.workload(layout.micro)
        if stages is None:
            if layout.pp > len(w.layers):
                raise ValueError(f"{self.model}: {layout.pp} stages but only "
                                 f"{len(w.layers)} layers")
            stages = [(layers, (layout.dp, layout.tp))
                      for layers in equal_ranges(len(w.layers), layout.pp)]
        costs, layouts = [], []
        for s, (layers, mesh_shape) in enumerate(stages):
            stage_layout = layout if rules is None else dataclasses.replace(
                layout, params=rules[s])
            costs.append(self._stage(w, stage_layout, layers, tuple(mesh_shape),
                                     in_flight=len(stages) - s,
                                     held=held[s] if held is not None else None))
            layouts.append(self._stage_layouts(w, stage_layout, layers, tuple(mesh_shape),
                                               held[s] if held is not None else None))
        moves, per_step = self._transfers(w, stages, layouts)
        costs = [dataclasses.replace(c, per_micro_s=c.per_micro_s + t)
                 for c, t in zip(costs, moves)]
        b = layout.micro
        per = [c.per_micro_s for c in costs]
        step = sum(per) + (b - 1) * max(per) + max(c.update_s for c in costs) + per_step
        memory = max(c.memory_bytes for c in costs)
        return Evaluation(layout, step, memory, memory > self.cluster.memory_bytes, tuple(costs))

    def _transfers(self, w: Workload, stages: Sequence[tuple[tuple[int, int], tuple[int, ...]]],
                   layouts: Sequence[StageLayouts]) -> tuple[list[float], float]:
        """Seconds per micro-batch each stage spends receiving activations (and sending
        their cotangents back), and seconds per step of moving values several stages read
        (a tied embedding), priced as the planner prices them (`pipeline_search.
        price_transfers`: from both stages' layouts, over the link between the stages'
        devices, numbered in stage order)."""
        first, devices = [], 0
        for _, mesh_shape in stages:
            first.append(devices)
            devices += math.prod(mesh_shape)
        programs = [pipeline.program_for_range(w.graph, w.layers[layers[0]].eqns[0],
                                               w.layers[layers[1]].eqns[-1] + 1)
                    for layers, _ in stages]
        ids = [range(f, f + math.prod(m)) for f, (_, m) in zip(first, stages)]
        moves, per_step, _ = price_transfers(programs, ids, layouts, w.graph, set(w.diff),
                                             set(w.param_ids), self.cluster,
                                             self.cluster.devices_per_host)
        return moves, per_step

    def _stage_layouts(self, w: Workload, layout: Layout, layers: tuple[int, int],
                       mesh_shape: tuple[int, ...], held: HeldState | None) -> StageLayouts:
        """Where the stage holds the values it exchanges with other stages: its layers'
        solutions, each parameter's reduced gradient at the plan's state layout (`held`)
        or at the layout's (cut over dp for ZeRO-2, as `_stage` prices its update)."""
        priced = [self.layer(w, k, mesh_shape, layout.params)
                  for k in range(layers[0], layers[1] + 1)]
        programs = [w.layers[k] for k in range(layers[0], layers[1] + 1)]
        split = layout.zero_state and layout.params != "zero3" and mesh_shape[0] > 1
        states = {v: spec for v, (spec, _) in state_layouts(
            priced, programs, set(w.param_ids), w.graph, split).items()}
        if held is not None:
            states = {v: held[1].get(v, spec) for v, spec in held[0].items()}
        return StageLayouts.of(priced, programs, states)

    def _stage(self, w: Workload, layout: Layout, layers: tuple[int, int],
               mesh_shape: tuple[int, ...], in_flight: int,
               held: HeldState | None = None) -> StageCost:
        mesh = None
        per_micro = 0.0
        priced, programs = [], []
        param_spec: dict[int, Spec] = {}
        for layer in range(layers[0], layers[1] + 1):
            p = self.layer(w, layer, mesh_shape, layout.params)
            mesh = p.mesh
            per_micro += p.cost_s
            priced.append(p)
            programs.append(w.layers[layer])
            for vid, spec in zip(w.layers[layer].inputs, p.input_specs):
                if vid in w.param_ids:
                    param_spec.setdefault(vid, spec)
        params = sum(w.value_bytes(v) / mesh.shards(spec) for v, spec in param_spec.items())
        dp = mesh_shape[0] if layout.zero_state and layout.params != "zero3" else 1
        state = w.state_bytes_per_param_byte * params / dp
        # The planner's count (parameters, gradients, in-flight residuals, one layer's
        # transient), with this layout's optimizer state; a stage that is the whole
        # pipeline runs as one program whose outputs, the reduced gradients (at the state
        # layout), are held through the step.
        whole = tuple(layers) == (0, len(w.layers) - 1)
        memory = stage_memory_bytes(priced, programs, set(w.param_ids), w.graph,
                                    layout.micro, in_flight, 0.0) + state + whole * params / dp
        if held is not None:
            update = self._held_update_s(w, held, mesh)
        else:
            update = update_time_s(params / dp, w.state_bytes_per_param_byte, self.cluster)
            if layout.zero_gather and dp > 1:   # each parameter gathered back, as the planner
                update += sum(gather_after_update_s(
                    state_split(spec, w.graph.values[v].shape, mesh), spec, w.value_bytes(v),
                    mesh) for v, spec in param_spec.items())
        return StageCost(layers, math.prod(mesh_shape), mesh_shape, per_micro, update,
                         memory)

    def _held_update_s(self, w: Workload, held: HeldState, mesh: MeshContext) -> float:
        """Seconds per step of a plan stage's update: each parameter the stage reads updated
        at its state layout (`StagePlan.state_specs`, else its input spec) and gathered back
        to its input spec where they differ."""
        specs, states = held
        state_bytes = 0.0
        gathers = 0.0
        for vid, spec in specs.items():
            if vid not in w.param_ids:
                continue
            state = states.get(vid, spec)
            state_bytes += w.value_bytes(vid) / mesh.shards(state)
            gathers += gather_after_update_s(state, spec, w.value_bytes(vid), mesh)
        return update_time_s(state_bytes, w.state_bytes_per_param_byte, self.cluster) + gathers


# (value id -> input spec, value id -> state spec) of one plan stage (`StagePlan.input_specs`,
# `StagePlan.state_specs`).
HeldState = tuple[dict[int, Spec], dict[int, Spec]]


# ----------------------------------------------------------------------------- strategies


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_candidates(global_batch: int, dp: int, pp: int, max_micro: int = 1024) -> list[int]:
    """Micro-batch counts worth trying: powers of two from pp (a pipeline needs at least
    one micro-batch per stage) while the micro-batch still splits over dp."""
    out, b = [], 1
    while b <= min(max_micro, global_batch):
        if b >= pp and global_batch % b == 0 and (global_batch // b) % dp == 0:
            out.append(b)
        b *= 2
    return out


def grid_3d(num_devices: int, devices_per_host: int, num_layers: int, global_batch: int,
            max_micro: int = 1024) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) of the manual 3-D grid: tp within a host (a power of two), pp at most
    the number of layers and dividing the devices, dp the rest."""
    out = []
    for pp in divisors(num_devices):
        if pp > num_layers:
            continue
        for tp in divisors(num_devices // pp):
            if tp > devices_per_host or tp & (tp - 1):
                continue
            dp = num_devices // pp // tp
            if micro_candidates(global_batch, dp, pp, max_micro):
                out.append((dp, tp, pp))
    return out


def best_fitting(pricer: Pricer, layouts: Sequence[Layout]) -> tuple[Evaluation | None,
                                                                    list[Evaluation]]:
    """The fastest of `layouts` that fits memory (None if none fits), and every evaluation.
    Layouts of one (strategy, dp, tp, pp, state split) are tried from the most micro-batches (least
    activation memory, smallest pipeline bubble) down, stopping at the first that does
    not fit or is slower than the one before."""
    evals: list[Evaluation] = []
    groups: dict[tuple, list[Layout]] = {}
    for lay in layouts:
        groups.setdefault((lay.strategy, lay.dp, lay.tp, lay.pp, lay.zero_state),
                          []).append(lay)
    for group in groups.values():
        best_here = None
        for lay in sorted(group, key=lambda x: -x.micro):
            ev = pricer.evaluate(lay)
            evals.append(ev)
            if ev.oom or (best_here is not None and ev.step_s >= best_here.step_s):
                break
            best_here = ev
    fitting = [e for e in evals if not e.oom]
    return (min(fitting, key=lambda e: e.step_s) if fitting else None), evals

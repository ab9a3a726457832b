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

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from autopar import pipeline
from autopar.cost_model import ClusterSpec
from autopar.cost_model.units import format_bytes
from autopar.layer import LayerProgram
from autopar.methods import PipelineMethod
from autopar.passes import inter_op, intra_op, layering
from autopar.passes.inter_op import NoStageLayoutError
from autopar.passes.sharding_spec import (
    Spec,
)
from autopar.plan import Plan, PredictedCost
from autopar.planner import (
    WatchedSubmit,
)
from autopar.solve_pool import SolvePool

from .assemble import _assemble, _StageEstimate
from .layer_cost import (
    LAYER_RETRY_TIME_LIMIT_S,
    LAYER_TIME_LIMIT_S,
    LayerCost,
    Neighbours,
    _held_bytes,
    _own_edges,
    diff_values,
    neighbour_reshard_s,
    start_price_stage,
)
from .reuse import _price_side_by_side, _program_key, _SameProblems
from .stage_memory import internal_reshard_s, stage_memory_bytes, updates_s
from .state import KNEE_FRACTIONS, LEAN, StateSplit, _level_name, knee_price, state_floor_bytes
from .transfers import least_transfer_s, transfer_s


@dataclasses.dataclass(frozen=True)
class StageCostTable:
    """What one pipeline search's stage DP priced (`recording`), for `num_micro_batches`
    micro-batches of the step: per layer range and sub-mesh it asked, the seconds per
    micro-batch of the range's fastest time-optimal layouts on it (memory not checked) with
    its activations received as fast as they can be (None: no such layout), and the
    plan's predicted step seconds.  Every stage a plan can hold takes at least that long.

    `fixed_s`: per layer range and sub-mesh, seconds per micro-batch of that least time
    that no layout goes below and no micro-batch count changes (its layers'
    `LayerCost.fixed_floor_s`; absent: 0), which a bound for more micro-batches keeps
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


#: What a stage's layers are aligned to on the side of the next layer (`search`'s
#: `aligned`), besides what the layer before made: the layouts the next layer's own
#: solution reads; none (each layer follows what it receives); every value the next layer
#: reads replicated, a boundary every layer can meet.  Where the layers' own layouts agree,
#: the first leaves them as they are and the others are not tried; where they disagree at
#: every boundary (2 rows of a micro-batch split by some layers and not by others), the
#: first can pay a reshard at every layer and another target gives the faster stage.
AFTER_OWN, AFTER_NONE, AFTER_WHOLE = "own", "none", "whole"


AFTER_TARGETS = (AFTER_OWN, AFTER_NONE, AFTER_WHOLE)


def _same_solutions(a: Sequence[LayerCost], b: Sequence[LayerCost]) -> bool:
    """Whether two chains of a stage's layer solutions are the same solutions."""
    return all(x is y for x, y in zip(a, b, strict=True))


def _cheapest(options: dict[tuple[int, ...], LayerCost]) -> LayerCost:
    return min(options.values(), key=lambda p: p.cost_s)


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
                      dict[tuple[int, ...], LayerCost]] = {}
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
                         ) -> Callable[[], dict[tuple[int, ...], LayerCost]]:
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
                      remat: bool = False) -> dict[tuple[int, ...], LayerCost]:
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

    def estimates(i: int, submesh: tuple[int, int], priced: list[LayerCost],
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
              kept: list[LayerCost], redone: list[LayerCost], order: list[int], mode: int,
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
    chains: dict[tuple, tuple[list[LayerCost], dict[int, tuple[Spec, Spec | None]]]] = {}
    neighbour_solves: dict[tuple, LayerCost | None] = {}

    def aligned(i: int, j: int, submesh: tuple[int, int], level: int,
                shape: tuple[int, ...], free: list[LayerCost], after: str) -> list[LayerCost]:
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
                    free: LayerCost, before: dict[int, tuple[Spec, Spec | None]],
                    after: dict[int, tuple[Spec, Spec | None]], remat: bool = False
                    ) -> LayerCost:
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

    def layer_updates_s(k: int, submesh: tuple[int, int], p: LayerCost) -> float:
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
        micro-batch count changes: the layers' `LayerCost.fixed_floor_s` (the least over the
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

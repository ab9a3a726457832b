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
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from autopar import pipeline
from autopar.cost_model import ClusterSpec
from autopar.methods import PipelineMethod
from autopar.passes import inter_op
from autopar.passes.inter_op import NoStageLayoutError
from autopar.plan import Plan, PredictedCost

from .assemble import REFINE_GAIN, _assemble
from .context import SearchContext, prepare
from .layer_solutions import LayerSolutions
from .reuse import _price_side_by_side
from .stage_costs import StageCosts, StageCostTable

__all__ = ["SearchReport", "StageChoices", "recording", "search"]

#: One pipeline: per stage, its (first, last) layer and its sub-mesh shape.
Choice = tuple[tuple[tuple[int, int], tuple[int, int]], ...]


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


@dataclasses.dataclass(frozen=True)
class StageChoices:
    """The third phase's result: the pipelines worth assembling, in order (the stage DP's
    or the method's own first), and the seconds of its parts (`SearchReport.phases_s`)."""

    candidates: tuple[Choice, ...]
    phases_s: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class SearchReport:
    """What one pipeline search did, as the plan records it (`Plan.solver`, `to_json`).

    Attributes:
      layers: layers the forward was cut into; `layering`: "auto" or "user" (markers).
      layer_solves: distinct layer ILP solves asked for.
      search_s: seconds of the whole search; `phases_s`: seconds per phase.
      per_step_transfer_s: seconds per step of moves made once per step (tied parameters
        and their gradients), in the predicted step.
      transfers: the priced transfers between stages (`transfers._with_transfers`).
      stage_candidates: pipelines considered for assembly (the DP's and the uniform ones).
      stage_costs: what the stage DP priced, under `recording` (else None).
      layered_step_s: where the assembly solved a stage's layers as one program
        (`StageCosts.joint_alternatives`), the step seconds of the plan before it did:
        the plan of layer solutions, which `stage_costs` bound; else None.
    """

    layers: int
    layering: str
    layer_solves: int
    search_s: float
    phases_s: Mapping[str, float]
    per_step_transfer_s: float
    transfers: Sequence[Mapping[str, Any]]
    stage_candidates: int
    stage_costs: StageCostTable | None = None
    layered_step_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"layers": self.layers, "layering": self.layering,
               "layer_solves": self.layer_solves, "search_s": self.search_s,
               "phases_s": dict(self.phases_s), "per_step_transfer_s": self.per_step_transfer_s,
               "transfers": list(self.transfers), "stage_candidates": self.stage_candidates}
        if self.stage_costs is not None:
            out["stage_costs"] = self.stage_costs.to_json()
        if self.layered_step_s is not None:
            out["layered_step_s"] = self.layered_step_s
        return out


def layered_step_s(plan: Plan) -> float:
    """Predicted step seconds of `plan`'s layer solutions, the stages a `StageCostTable`
    bounds: the step before the assembly solved a stage's layers as one program
    (`SearchReport.layered_step_s`, which that only lowers), else the plan's own."""
    return float(plan.solver.get("layered_step_s", plan.predicted.step_s))


def search(split: pipeline.SplitStep, method: PipelineMethod,
           cluster: ClusterSpec, device_ids: Sequence[int], *, fp: str,
           input_names: Sequence[str], in_shapes: Sequence[tuple[int, ...]],
           out_shapes: Sequence[tuple[int, ...]], batch_size: int | None,
           progress: Callable[[str], None] | None = None,
           state_bytes_per_param_byte: float = 0.0) -> Plan:
    """Finds stages, sub-meshes and per-stage shardings for a split step, in four phases:
    layering (`context.prepare`), the layers' ILPs (`LayerSolutions`, solved side by side
    while the stage DP asks for them), the stage DP over their costs (`StageCosts`,
    `_choose_stages`), and the plan's assembly (`assemble._assemble`).

    A stage's memory per device (checked against the budget) is `stage_memory_bytes`:
    its layers' forward+backward peaks, the optimizer state (`state_bytes_per_param_byte`
    x its parameter bytes per device, laid out like the parameters, or split further over
    the stage's data-parallel axes with the method's `shard_optimizer_state`: the plan's
    `StagePlan.state_specs`), and the residuals of the micro-batches 1F1B keeps in flight.

    `progress(message)` is called at each phase boundary (layering, each layer ILP, stage
    DP, each stage ILP); the seconds of each phase are in the plan's `solver["phases_s"]`
    (`SearchReport`).
    """
    t0 = time.perf_counter()
    if progress:
        progress("layering")
    ctx = prepare(split, method, cluster, device_ids, batch_size=batch_size,
                  state_bytes_per_param_byte=state_bytes_per_param_byte)
    phases = {"layering": time.perf_counter() - t0}
    layers = LayerSolutions(ctx, progress)
    costs = StageCosts(ctx, layers)
    try:
        t_phase = time.perf_counter()
        layers.start_all()
        phases["layer ILP builds"] = time.perf_counter() - t_phase
        choices = _choose_stages(ctx, costs)
        phases.update(choices.phases_s)
        t_phase = time.perf_counter()
        # (the assembly may solve a stage's layers as one program: the pool stays open)
        stages, per_step_s, step_s, transfers, layered_s = _assemble_fastest(
            ctx, costs, choices.candidates)
        phases["stage assembly"] = time.perf_counter() - t_phase
    except BaseException:
        layers.close(cancel=True)
        raise
    layers.close()  # waits for solves still queued (their answers are cached)
    if progress:
        progress(f"stages chosen: {[st.layers for st in stages]}"
                 + (f" (fastest of {len(choices.candidates)} assembled)"
                    if len(choices.candidates) > 1 else ""))
    # The busiest stage's work over the step (its micro-batches' forward + backward, its
    # own collectives included); the rest of the step is the pipeline's fill and drain
    # bubble and the transfers between stages.
    micro, n = ctx.micro, ctx.num_devices
    compute = micro * max(st.predicted_s - st.transfer_s for st in stages)
    layout = ctx.layout
    recorded = (costs.table(layered_s) if _recording.get() and layout.submesh_shapes is None
                and not layout.equal_layers else None)
    report = SearchReport(
        layers=ctx.num_layers, layering=ctx.layering.source, layer_solves=layers.solves,
        search_s=time.perf_counter() - t0, phases_s=phases, per_step_transfer_s=per_step_s,
        transfers=transfers, stage_candidates=len(choices.candidates), stage_costs=recorded,
        layered_step_s=layered_s if layered_s != step_s else None)
    return Plan(
        fingerprint=fp, method=method.name, cluster=cluster.name, mesh_shape=(n,),
        mesh_axes=("x",), device_ids=tuple(device_ids), input_names=tuple(input_names),
        in_specs=tuple(((),) * len(s) for s in in_shapes),
        out_specs=tuple(((),) * len(s) for s in out_shapes), value_specs=(),
        predicted=PredictedCost(step_s, compute, step_s - compute,
                                max(st.memory_bytes for st in stages),
                                ctx.graph.total_flops() * 3),
        solver=report.to_json(), stages=tuple(stages), num_micro_batches=micro,
        schedule=method.schedule)


def _choose_stages(ctx: SearchContext, costs: StageCosts) -> StageChoices:
    """The pipelines to assemble: the method's fixed stages, the best split over its fixed
    sub-meshes, or the stage DP's choice (passes.inter_op over `costs.range_cost`) and the
    DP's choice on each single sub-mesh shape that divides the devices."""
    layout, n, micro, num_layers = ctx.layout, ctx.num_devices, ctx.micro, ctx.num_layers
    t_phase = time.perf_counter()
    if layout.equal_layers:
        bounds = inter_op.equal_ranges(num_layers, len(layout.submesh_shapes))
        return StageChoices((tuple(zip(bounds, layout.submesh_shapes)),), {})
    if layout.submesh_shapes is not None:
        split = _best_split(num_layers, list(layout.submesh_shapes), costs.range_cost, micro)
        return StageChoices((tuple(split),),
                            {"layer ILPs + stage split": time.perf_counter() - t_phase})
    submeshes = ctx.submeshes
    t_costs = time.perf_counter()
    _price_side_by_side(costs.range_cost, submeshes, inter_op.asked(
        num_layers, submeshes, num_devices=n, num_stages=layout.num_stages))
    t_costs = time.perf_counter() - t_costs
    result = inter_op.run(num_layers, submeshes,
                          lambda i, j, s: costs.range_cost(i, j, submeshes[s]), num_devices=n,
                          num_micro_batches=micro, num_stages=layout.num_stages)
    candidates = [tuple((st.layers, st.submesh) for st in result.stages)]
    t_phase = time.perf_counter()
    # The DP prices a stage's received activations as if sent by a stage of its own size,
    # without layouts (neither the sender nor the layouts are known there), and leaves out
    # the per-step moves of values several stages read; the assembly prices both from the
    # chosen layouts.  Where stage sizes differ, the DP's choice can assemble slower than a
    # pipeline of equal sub-meshes, whose transfers the DP priced from the right device
    # counts, and where the layouts re-lay out what they send (a relayout per transfer),
    # slower than one stage over every device, which has no transfers: each such pipeline
    # (the DP restricted to one sub-mesh shape; the hand-written 3-D plans are of this
    # kind, and one stage is the whole mesh's) is assembled too and the fastest kept.
    for submesh in submeshes:
        if n % (submesh[0] * submesh[1]):
            continue
        try:
            uniform = inter_op.run(num_layers, [submesh],
                                   lambda i, j, s, m=submesh: costs.range_cost(i, j, m),
                                   num_devices=n, num_micro_batches=micro,
                                   num_stages=layout.num_stages)
        except NoStageLayoutError:
            continue
        candidates.append(tuple((st.layers, st.submesh) for st in uniform.stages))
    # The layer ILPs: the stage costs priced ahead, and whatever inter_op's filling of its
    # cost table still asked for, before the DP proper.
    return StageChoices(tuple(candidates), {
        "layer ILPs": t_costs + result.stats["cost_s"],
        "stage DP": (result.stats["seconds"] - result.stats["cost_s"]
                     + time.perf_counter() - t_phase)})


def _assemble_fastest(ctx: SearchContext, costs: StageCosts, candidates: Sequence[Choice]):
    """`_assemble` of each distinct candidate once, in order (the uniform pipelines often
    repeat the DP's choice: one stage over every device, above all), then of the fastest
    again with its stages' logical meshes chosen together (`_assemble`'s `refine`).

    Refinement also solves a stage's layers as one program where the stage is small enough
    (`StageCosts.joinable`), which can take a stage far below its layer solutions (where
    what one layer hands the next is reduced on the critical path: generated tied_embed-10,
    one stage 7.27 ms a step as layer solutions, 3.83 ms as one program); so every other
    candidate with such a stage is refined too, and the fastest refined plan kept."""
    assembled = {}
    for c in candidates:
        if c not in assembled:
            assembled[c] = _assemble(c, ctx, costs)
    chosen = min(assembled, key=lambda c: assembled[c][2])
    best = _assemble(chosen, ctx, costs, refine=True)
    for c in assembled:
        if c != chosen and any(costs.joinable(*layers) for layers, _ in c):
            refined = _assemble(c, ctx, costs, refine=True)
            if refined[2] < best[2] * (1 - REFINE_GAIN):
                best = refined
    return best


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

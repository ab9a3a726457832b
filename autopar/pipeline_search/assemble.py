"""The plan from the stage DP's choice: one `StagePlan` per stage with its layer solutions,
memory and transfers, and the refinement that swaps a stage for another of its options
where the priced step gets faster (`_assemble`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from autopar import pipeline
from autopar.graph import Graph
from autopar.passes import inter_op
from autopar.passes.sharding_spec import (
    Spec,
)
from autopar.plan import LayerPlan, StagePlan

from .context import SearchContext
from .stage_costs import StageCosts, StageEstimate
from .stage_memory import stage_memory_bytes, state_layouts
from .transfers import StageLayouts, _with_transfers


def _assemble(choice: Sequence[tuple[tuple[int, int], tuple[int, int]]], ctx: SearchContext,
              costs: StageCosts, refine: bool = False
              ) -> tuple[list[StagePlan], float, float, list[dict[str, Any]], float]:
    """The plan's stages for `choice` ((first, last) layer, sub-mesh shape) per stage, with
    their transfers priced from both stages' layouts (`_with_transfers`): (stages, seconds
    per step of per-step moves, step seconds, the priced transfers, the step seconds of
    the plan of layer solutions: before any stage was solved as one program).

    Each stage starts as its fastest option that fits (`StageCosts.fitting`), chosen alone;
    with `refine`, one stage at a time then takes whichever of its other options that fit
    (`StageCosts.alternatives`) makes the whole step fastest, the others kept, until none
    does (at most REFINE_ROUNDS rounds): what a stage sends and receives depends on its
    neighbours' layouts, which the stage alone does not see.  Then the same again with each
    stage's layers also solved as one program on the logical mesh they took
    (`StageCosts.joint_alternatives`: one ILP over the stage's equations, where each
    layer's own ILP saw only its part)."""
    graph, micro = ctx.graph, ctx.micro
    devices = inter_op.assign_devices([s for _, s in choice], ctx.hosts, ctx.per_host)
    in_flight = [micro if ctx.gpipe else len(choice) - k for k in range(len(choice))]
    build = functools.partial(_stage_plan, ranges=ctx.ranges, graph=graph, params=ctx.params,
                              micro=micro, device_ids=ctx.device_ids, whole=len(choice) == 1,
                              state_bytes_per_param_byte=ctx.state_bytes_per_param_byte)
    picks = [costs.fitting(*layers, submesh, flight) or min(
        costs.options(*layers, submesh), key=lambda o: o.cost_s)
        for (layers, submesh), flight in zip(choice, in_flight)]
    built = [build(o, layers, devs, flight)
             for o, (layers, _), devs, flight in zip(picks, choice, devices, in_flight)]

    def priced(parts: list[tuple[StagePlan, StageLayouts]]):
        stages, per_step_s, transfers = _with_transfers(
            [st for st, _ in parts], [lay for _, lay in parts], graph, ctx.diff, ctx.params,
            ctx.cluster, ctx.per_host)
        times = [st.predicted_s for st in stages]
        return stages, per_step_s, sum(times) + (micro - 1) * max(times) + per_step_s, transfers

    def improved(best, built, kept, others):
        for _ in range(REFINE_ROUNDS if any(others) else 0):
            changed = False
            for k, options in enumerate(others):
                for o in options:
                    trial = list(built)
                    trial[k] = build(o, choice[k][0], devices[k], in_flight[k])
                    step = priced(trial)
                    if step[2] < best[2] * (1 - REFINE_GAIN):
                        best, built, changed = step, trial, True
                        kept = [*kept[:k], o, *kept[k + 1:]]
            if not changed:
                break
        return best, built, kept

    best = priced(built)
    if not refine:
        return (*best, best[2])
    others = [[o for o in costs.alternatives(*layers, submesh, flight) if o is not pick]
              for (layers, submesh), flight, pick in zip(choice, in_flight, picks)]
    best, built, kept = improved(best, built, picks, others)
    layered_s = best[2]
    # Each stage as one program on the logical mesh its layer solutions took (solved side
    # by side).
    shapes = [o.priced[0].mesh.shape for o in kept]
    for (layers, submesh), shape in zip(choice, shapes):
        if costs.joinable(*layers):
            costs.layers.start_joint(*layers, submesh, shape)
    joint = [costs.joint_alternatives(*layers, submesh, flight, shape)
             for (layers, submesh), flight, shape in zip(choice, in_flight, shapes)]
    if any(joint):
        best, _, _ = improved(best, built, kept, [a + j for a, j in zip(others, joint)])
    return (*best, layered_s)


# `_assemble`'s refinement: rounds over the stages at most, and the relative gain in step
# time a stage's other option must bring to be taken (below it: the first choice stays).
REFINE_ROUNDS = 3


REFINE_GAIN = 1e-9


def _stage_plan(best: StageEstimate, layers: tuple[int, int], devs: Sequence[int],
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
    # One solution per layer, or one for the stage's layers solved as one program.
    bounds = (ranges[layers[0]:layers[1] + 1]
              if len(best.priced) == layers[1] - layers[0] + 1 else [(start, stop)])
    layer_plans = tuple(
        LayerPlan(eqn_range=rng, value_specs=p.value_specs,
                  operand_specs=p.operand_specs, num_values=p.num_values,
                  predicted_s=p.cost_s, remat=again)
        for rng, p, again in zip(bounds, best.priced, best.remat or (False,) * len(best.priced),
                                 strict=True))
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

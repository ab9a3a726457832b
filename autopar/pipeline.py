"""Splitting a traced step for pipeline execution.

The step, traced at micro-batch size, has one `autopar_compute_grad` equation.  From it we
build the **forward program** F: the equations that depend on the batch before the marker,
followed by the marker's forward jaxpr (the loss function).  F's inputs are the step's batch
inputs and every other value it reads (parameters, RNG keys, batch statistics, ...); its
outputs are the loss and the aux leaves.  F is cut into layers and stages.

Everything else — equations before the marker that do not touch the batch, and everything
after it (apply-grad) — is the **outer program**; the runtime runs it once per step, split
by which stage holds each value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jcore

from autopar.graph import Graph
from autopar.interpret import eval_jaxpr, read, run_eqns
from autopar.passes import primitives

from .markers import compute_grad_p, pipeline_boundary_p
from .microbatch import MicroBatchError, batch_derived, compute_grad_eqns


class PipelineError(ValueError):
    """The step cannot run as a pipeline as written."""


@dataclasses.dataclass(frozen=True, eq=False)
class SplitStep:
    """A step split around its compute-grad equation.

    Attributes:
      step: the step's jaxpr at micro-batch size.
      marker: index of the compute-grad equation in `step.jaxpr.eqns`.
      forward: F as a ClosedJaxpr: inputs `forward_inputs`, outputs (loss, *aux leaves).
      forward_inputs: for each F input, the step variable it reads (a step input or a
        value the outer program computes before the marker).
      diff_inputs: F input index of every differentiated leaf, in the marker's order.
      forward_eqns: indices of the step equations folded into F (batch-derived, before
        the marker) — the outer program skips them.
      num_aux: number of aux leaves among the marker's outputs.
    """

    step: jcore.ClosedJaxpr
    marker: int
    forward: jcore.ClosedJaxpr
    forward_inputs: tuple[Any, ...]
    diff_inputs: tuple[int, ...]
    forward_eqns: frozenset[int]
    num_aux: int

    @property
    def marker_eqn(self):
        return self.step.jaxpr.eqns[self.marker]

    @property
    def remat(self) -> bool:
        """Whether the loss function rematerializes (`jax.checkpoint` / `nn.remat`) anywhere:
        the pipeline then rematerializes every stage."""
        return _has_remat(self.forward.jaxpr)

    def forward_graph(self) -> Graph:
        """F flattened, with pipeline boundary markers kept in place."""
        return Graph.from_jaxpr(self.forward, keep=frozenset({pipeline_boundary_p.name}))


def _has_remat(jaxpr: jcore.Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if primitives.info(eqn.primitive.name).remat:
            return True
        for sub in jcore.jaxprs_in_params(eqn.params):
            if _has_remat(sub):
                return True
    return False


def split(step: jcore.ClosedJaxpr, batch_positions: set[int]) -> SplitStep:
    """Finds the compute-grad equation and builds the forward program F."""
    jaxpr = step.jaxpr
    markers = compute_grad_eqns(jaxpr)
    if not markers:
        raise PipelineError(
            "PipeshardParallel needs the step to compute its gradients with autopar.grad or "
            "autopar.value_and_grad (e.g. `loss, grads = autopar.value_and_grad(loss_fn)"
            "(params, batch)`): that marks the forward+backward part to pipeline")
    if len(markers) > 1:
        raise PipelineError(f"PipeshardParallel supports one autopar.grad call per step; this "
                            f"step has {len(markers)}")
    k = markers[0]
    eqn = jaxpr.eqns[k]
    derived = batch_derived(jaxpr, batch_positions)
    pre = [i for i in range(k) if any(v in derived for v in jaxpr.eqns[i].outvars)]
    num_consts = eqn.params["num_consts"]
    diff_leaves = eqn.params["diff_leaves"]
    diff_vars = [eqn.invars[num_consts + i] for i in diff_leaves]
    for v in diff_vars:
        if not isinstance(v, jcore.Literal) and v in derived:
            raise MicroBatchError("autopar.grad differentiates with respect to a value computed "
                                  "from the batch; pipelines need gradients of parameters")

    # F's inputs: batch inputs first, then the other values F reads, in first-use order.
    inputs: list[Any] = [v for i, v in enumerate(jaxpr.invars) if i in batch_positions]
    produced = {v for i in pre for v in jaxpr.eqns[i].outvars}

    def need(v: Any) -> None:
        if not isinstance(v, jcore.Literal) and v not in produced and v not in inputs:
            inputs.append(v)

    for i in pre:
        for v in jaxpr.eqns[i].invars:
            need(v)
    for v in eqn.invars:
        need(v)
    forward_index = {v: n for n, v in enumerate(inputs)}
    diff_inputs = tuple(forward_index[v] for v in diff_vars)
    fwd = eqn.params["fwd_jaxpr"]
    consts = dict(zip(jaxpr.constvars, step.consts))

    def forward(*xs):
        env = dict(consts)
        env.update(zip(inputs, xs))
        run_eqns(((i, jaxpr.eqns[i]) for i in pre), env, keyed=True)
        return eval_jaxpr(fwd, [read(env, v) for v in eqn.invars])

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in inputs]
    forward_jaxpr = jax.make_jaxpr(forward)(*avals)
    num_aux = len(forward_jaxpr.jaxpr.outvars) - 1
    return SplitStep(step, k, forward_jaxpr, tuple(inputs), diff_inputs, frozenset(pre),
                     num_aux)


@dataclasses.dataclass(frozen=True)
class StageProgram:
    """One pipeline stage of F: the equations `eqns` of `graph` (F flattened).

    Attributes:
      eqns: equation indices, in order.
      inputs: value ids the stage reads but does not compute (F inputs or earlier stages'
        outputs), in the order its equations first read them: two ranges computing the
        same equations list their inputs alike whatever their ids (F's parameters are
        numbered in name order, Block_10 before Block_7), so a layer solution stored by
        input position (`pipeline_search.LayerCost`) and the forward+backward program
        traced from these inputs (`layer.LayerProgram`) serve every identical layer.
      outputs: value ids the stage computes that later stages or F's outputs read, sorted
        (the order they are computed in).
    """

    eqns: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


def program_for_range(graph: Graph, start: int, stop: int) -> StageProgram:
    """The stage running F's equations [start, stop)."""
    inside = {o for i in range(start, stop) for o in graph.eqns[i].outputs}
    final = {op for op in graph.outvars if isinstance(op, int)}
    reads = [op for i in range(start, stop) for op in graph.eqns[i].inputs
             if isinstance(op, int) and op not in inside
             and graph.values[op].const_index is None]
    outs = {o for o in inside if o in final or any(c >= stop for c in graph.consumers[o])}
    return StageProgram(tuple(range(start, stop)), tuple(dict.fromkeys(reads)),
                        tuple(sorted(outs)))


def stage_programs(graph: Graph, cuts: Sequence[int]) -> list[StageProgram]:
    """Cuts F's equations at `cuts` (equation indices where a stage starts, after 0)."""
    bounds = [0, *cuts, len(graph.eqns)]
    return [program_for_range(graph, a, b) for a, b in zip(bounds, bounds[1:])]


__all__ = ["PipelineError", "SplitStep", "StageProgram", "compute_grad_p", "program_for_range",
           "split", "stage_programs"]

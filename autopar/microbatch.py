"""Gradient accumulation over micro-batches, as a rewrite of the traced step.

The step's `autopar_compute_grad` equation runs once per micro-batch on the slices of its
batch-derived operands; loss, aux outputs and gradients are averaged (the mean of equal-size
micro-batch means is the full-batch mean, except for batch statistics such as BatchNorm's,
which become per-micro-batch).  The rest of the step (apply-grad) runs once.

Micro-batch m takes the rows m, m + N, m + 2N, ... of every batch-derived operand (a
strided split): under a batch-split layout every device then holds its share of every
micro-batch, and no data moves to form them.

The gradients' means are computed under the name scope `GRAD_MEAN_SCOPE`, which marks them
in the flattened program (`gradient_means`).  The single-mesh step (`ReducedOnce`, used by
`autopar.emit`) keeps every micro-batch's gradient contractions unreduced — per-device
partial sums, through the sum and the mean (`autopar.grad_accum`) — and reduces each
gradient once per step, where the optimizer first reads it; the planner prices those
contractions' reductions 1/N per micro-batch (`reduced_once`), once per step in all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
from jax.sharding import Mesh

from autopar.graph import Graph, is_float
from autopar.interpret import bind, read, run_eqns

from .constraints import Constraints
from .grad_accum import Deferral, DeferredBackward, GradSum, gradient_contractions, skip_sums
from .markers import compute_grad_p
from .plan import Plan

#: Name scope of the micro-batch step's gradient means (`rewrite`, `gradient_means`).
GRAD_MEAN_SCOPE = "autopar_micro_batch_grad_mean"


class MicroBatchError(ValueError):
    """The step cannot be split into micro-batches as asked."""


def micro_slice(x: jax.Array, num: int, index: int | jax.Array) -> jax.Array:
    """Rows index, index + num, ... of `x` (the strided micro-batch split); `index` may be
    traced (a loop over the micro-batches)."""
    b = x.shape[0]
    rows = x.reshape((b // num, num) + x.shape[1:])
    if isinstance(index, int):
        return jax.lax.index_in_dim(rows, index, axis=1, keepdims=False)
    return jax.lax.dynamic_index_in_dim(rows, index, axis=1, keepdims=False)


def check_divisible(batch_leaves: Sequence[tuple[str, tuple[int, ...]]], num: int) -> None:
    """Every batch leaf's dim 0 must divide into `num` micro-batches."""
    for name, shape in batch_leaves:
        if not shape:
            raise MicroBatchError(f"batch argument {name} is a scalar: it has no batch dim to "
                                  f"split into num_micro_batches={num}")
        if shape[0] % num:
            raise MicroBatchError(f"batch dim {shape[0]} of argument {name} is not divisible by "
                                  f"num_micro_batches={num}")


def compute_grad_eqns(jaxpr: jcore.Jaxpr) -> list[int]:
    return [i for i, e in enumerate(jaxpr.eqns) if e.primitive is compute_grad_p]


def batch_derived(jaxpr: jcore.Jaxpr, batch_positions: set[int]) -> set[Any]:
    """Variables of `jaxpr` computed from the batch inputs."""
    derived = {v for i, v in enumerate(jaxpr.invars) if i in batch_positions}
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, jcore.Literal) and v in derived for v in eqn.invars):
            derived.update(eqn.outvars)
    return derived


def micro_avals(avals: Sequence[jax.ShapeDtypeStruct], batch_positions: set[int],
                num: int) -> list[jax.ShapeDtypeStruct]:
    """The inputs' avals with the batch leaves cut to one micro-batch."""
    return [jax.ShapeDtypeStruct((a.shape[0] // num,) + tuple(a.shape[1:]), a.dtype)
            if i in batch_positions else a for i, a in enumerate(avals)]


def rewrite(micro: jcore.ClosedJaxpr, full_avals: Sequence[jax.ShapeDtypeStruct],
            batch_positions: set[int], num: int) -> jcore.ClosedJaxpr:
    """The step over the full batch, from its trace `micro` at micro-batch size.

    Every equation that depends on the batch runs once per micro-batch (the compute-grad
    equation included); the compute-grad outputs are averaged, and so is any other
    batch-dependent float output (integer ones: the last micro-batch's).  Everything else
    (apply-grad) runs once.
    """
    jaxpr = micro.jaxpr
    if not compute_grad_eqns(jaxpr):
        raise MicroBatchError(
            f"num_micro_batches={num} needs the step to compute its gradients with "
            f"autopar.grad or autopar.value_and_grad (not jax.grad): that marks the part "
            f"of the step to run per micro-batch")
    batch_vars = {v for i, v in enumerate(jaxpr.invars) if i in batch_positions}

    def per_micro(x: Any, m: int) -> Any:
        return x.parts[m] if isinstance(x, _PerMicro) else x

    def override(key: int, eqn: Any, ins: list) -> list | None:
        if eqn.primitive is compute_grad_p:
            results = [bind(eqn, [per_micro(x, m) for x in ins]) for m in range(num)]
            # ((value, aux), grads) flattened: the last outputs are the gradients.
            first_grad = len(eqn.outvars) - len(eqn.params["diff_leaves"])
            means = [_mean([r[k] for r in results]) for k in range(first_grad)]
            with jax.named_scope(GRAD_MEAN_SCOPE):
                means += [_mean([r[k] for r in results])
                          for k in range(first_grad, len(eqn.outvars))]
            return means
        if not any(isinstance(x, _PerMicro) for x in ins):
            return None
        results = [bind(eqn, [per_micro(x, m) for x in ins]) for m in range(num)]
        return [_PerMicro([r[k] for r in results]) for k in range(len(eqn.outvars))]

    def run(*args):
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, micro.consts))
        for v, x in zip(jaxpr.invars, args):
            env[v] = (_PerMicro([micro_slice(x, num, m) for m in range(num)])
                      if v in batch_vars else x)
        run_eqns(jaxpr.eqns, env, override=override)
        outs = [read(env, v) for v in jaxpr.outvars]
        return [_mean(x.parts) if isinstance(x, _PerMicro) else x for x in outs]

    return jax.make_jaxpr(run)(*full_avals)


class _PerMicro:
    """A batch-dependent value: one array per micro-batch."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[Any]):
        self.parts = parts


def _mean(xs: list[Any]) -> Any:
    if not is_float(jnp.result_type(xs[0])):
        return xs[-1]
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total / len(xs)


def gradient_means(graph: Graph) -> list[int]:
    """Value ids of `graph` (a step rewritten by `rewrite`) that are gradients averaged over
    the micro-batches (the divisions `rewrite` makes under `GRAD_MEAN_SCOPE`)."""
    return [e.outputs[0] for e in graph.eqns if e.name == "div"
            and GRAD_MEAN_SCOPE in str(getattr(e.source_info, "name_stack", "")).split("/")]


def reduced_once(graph: Graph) -> set[int]:
    """Equations of `graph` computing a micro-batch's gradient contribution as a sum that
    `ReducedOnce` keeps unreduced (when the plan splits the summed dim) and reduces once per
    step: the contractions the planner prices 1/N per micro-batch."""
    return gradient_contractions(graph, gradient_means(graph), through_scaling=True)


@dataclasses.dataclass(frozen=True, eq=False)
class ReducedOnce:
    """A micro-batched single-mesh program (`rewrite`) that reduces each gradient once per
    step: the deferral (`grad_accum.Deferral`) of its micro-batches' gradient contractions
    under the plan's layouts, walked back from the gradient means."""

    graph: Graph
    deferral: Deferral
    mesh: Mesh

    @staticmethod
    def find(graph: Graph, plan: Plan, mesh: Mesh) -> ReducedOnce | None:
        """The deferral of `graph` under a single-mesh `plan` on `mesh`; None when the
        program has no micro-batch gradients, or none whose sum the plan splits."""
        means = gradient_means(graph)
        if not means:
            return None
        specs = {**dict(zip(graph.invars, plan.in_specs)), **dict(plan.value_specs)}
        deferral = Deferral.find(graph, range(len(graph.eqns)), means, specs,
                                 {(e, k): s for e, k, s in plan.operand_specs},
                                 through_scaling=True)
        return ReducedOnce(graph, deferral, mesh) if deferral else None

    def evaluate(self, args: Sequence[Any], hooks: Constraints) -> list[Any]:
        """`graph.evaluate(args, hooks.on_value, hooks.on_operand)` with the deferral: the
        partial sums pass the linear equations part by part, and an equation the deferral
        does not cover (the optimizer) reads a gradient reduced once into its planned
        layout, then pinned as `hooks` pins that operand."""
        graph, d = self.graph, self.deferral
        deferred = DeferredBackward(graph, d, self.mesh, reduce_once=True)

        def on_operand(key: int, k: int, x: Any) -> Any:
            return x if isinstance(x, GradSum) else hooks.on_operand(key, k, x)

        def override(key: int, eqn: Any, ins: list) -> list | None:
            if key in d.contractions or key in d.linear:
                return deferred(key, eqn, ins)
            if not any(isinstance(x, GradSum) for x in ins):
                return None
            return bind(eqn, [hooks.on_operand(key, k, deferred.value(x, v))
                              if isinstance(x, GradSum) else x
                              for k, (x, v) in enumerate(zip(ins, eqn.inputs))])

        env = dict(zip(graph.invars, args))
        graph.run_eqns(range(len(graph.eqns)), env, skip_sums(hooks.on_value), on_operand,
                       override)
        return [deferred.value(graph.read(op, env), op) for op in graph.outvars]

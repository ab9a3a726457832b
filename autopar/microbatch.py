"""Gradient accumulation over micro-batches, as a rewrite of the traced step.

The step's `autopar_compute_grad` equation runs once per micro-batch on the slices of its
batch-derived operands; loss, aux outputs and gradients are averaged (the mean of equal-size
micro-batch means is the full-batch mean, except for batch statistics such as BatchNorm's,
which become per-micro-batch).  The rest of the step (apply-grad) runs once.

Micro-batch m takes the rows m, m + N, m + 2N, ... of every batch-derived operand (a
strided split): under a batch-split layout every device then holds its share of every
micro-batch, and no data moves to form them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp

from autopar.graph import is_float

from .markers import compute_grad_p


class MicroBatchError(ValueError):
    """The step cannot be split into micro-batches as asked."""


def micro_slice(x: jax.Array, num: int, index: int) -> jax.Array:
    """Rows index, index + num, ... of `x` (the strided micro-batch split)."""
    b = x.shape[0]
    return jax.lax.index_in_dim(x.reshape((b // num, num) + x.shape[1:]), index, axis=1,
                                keepdims=False)


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

    def run(*args):
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, micro.consts))
        per_mb: list[dict[Any, Any]] = [{} for _ in range(num)]
        for v, x in zip(jaxpr.invars, args):
            if v in batch_vars:
                for m in range(num):
                    per_mb[m][v] = micro_slice(x, num, m)
            else:
                env[v] = x

        def read(v, m=None):
            if isinstance(v, jcore.Literal):
                return v.val
            if m is not None and v in per_mb[m]:
                return per_mb[m][v]
            return env[v]

        for eqn in jaxpr.eqns:
            derived = any(not isinstance(v, jcore.Literal) and v in per_mb[0]
                          for v in eqn.invars)
            if eqn.primitive is compute_grad_p:
                results = [_bind(eqn, [read(v, m) for v in eqn.invars]) for m in range(num)]
                for k, v in enumerate(eqn.outvars):
                    env[v] = _mean([r[k] for r in results])
            elif derived:
                for m in range(num):
                    for v, x in zip(eqn.outvars, _bind(eqn, [read(u, m) for u in eqn.invars])):
                        per_mb[m][v] = x
            else:
                for v, x in zip(eqn.outvars, _bind(eqn, [read(u) for u in eqn.invars])):
                    env[v] = x
        outs = []
        for v in jaxpr.outvars:
            if not isinstance(v, jcore.Literal) and v in per_mb[0]:
                outs.append(_mean([per_mb[m][v] for m in range(num)]))
            else:
                outs.append(read(v))
        return outs

    return jax.make_jaxpr(run)(*full_avals)


def _bind(eqn: Any, ins: list[Any]) -> list[Any]:
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _mean(xs: list[Any]) -> Any:
    if not is_float(jnp.result_type(xs[0])):
        return xs[-1]
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total / len(xs)

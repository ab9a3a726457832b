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
from autopar.interpret import bind, read, run_eqns

from .markers import compute_grad_p


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
            return [_mean([r[k] for r in results]) for k in range(len(eqn.outvars))]
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

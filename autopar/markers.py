"""Markers that user code leaves in the traced program.

`autopar.grad` / `autopar.value_and_grad` behave exactly like jax's.  While `parallelize`
traces a step they also record the forward+backward part as one `autopar_compute_grad`
equation that carries both the forward jaxpr (the loss function, for pipeline stages) and
the value-and-grad jaxpr (what the equation computes).  Its operands are the values the
loss function closes over (e.g. the batch) followed by its flattened arguments.

`autopar.mark_pipeline_boundary()` leaves an `autopar_pipeline_boundary` equation (no
operands, no results) in the forward jaxpr: a manual layer cut for the pipeline passes.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
from jax.interpreters import mlir

_recording: contextvars.ContextVar[bool] = contextvars.ContextVar("autopar_recording",
                                                                   default=False)
_in_forward: contextvars.ContextVar[bool] = contextvars.ContextVar("autopar_in_forward",
                                                                   default=False)


@contextlib.contextmanager
def _enabled(flag: contextvars.ContextVar[bool]):
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


def recording():
    """Within this context, autopar.grad / value_and_grad record compute-grad markers."""
    return _enabled(_recording)


# ---- compute-grad marker ------------------------------------------------------------------

compute_grad_p = jcore.Primitive("autopar_compute_grad")
compute_grad_p.multiple_results = True


def _run_grad(*args, grad_jaxpr, **_):
    return jcore.jaxpr_as_fun(grad_jaxpr)(*args)


compute_grad_p.def_impl(_run_grad)
compute_grad_p.def_abstract_eval(lambda *args, grad_jaxpr, **_: grad_jaxpr.out_avals)
mlir.register_lowering(compute_grad_p, mlir.lower_fun(_run_grad, multiple_results=True))


def _marked(fun: Callable, argnums: int | Sequence[int], has_aux: bool,
            with_value: bool, kwargs: dict) -> Callable:
    def wrapped(*args):
        flat, in_tree = jax.tree_util.tree_flatten(args)

        def flat_loss(*flat_args):
            return fun(*jax.tree_util.tree_unflatten(in_tree, list(flat_args)))

        with _enabled(_in_forward):
            fwd, fwd_shape = jax.make_jaxpr(flat_loss, return_shape=True)(*flat)
        fwd_tree = jax.tree_util.tree_structure(fwd_shape)
        consts = list(fwd.consts)
        num_consts = len(consts)
        leaf_ranges = _leaf_ranges(args)
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        diff_leaves = tuple(i for a in nums for i in range(*leaf_ranges[a]))

        def grad_fun(*consts_and_flat):
            c, f = consts_and_flat[:num_consts], consts_and_flat[num_consts:]
            closed = jcore.ClosedJaxpr(fwd.jaxpr, list(c))
            def loss_and_aux(*diff):
                out = jax.tree_util.tree_unflatten(
                    fwd_tree, _call_with(closed, f, diff_leaves, diff))
                return out if has_aux else (out, ())

            diff_args = [f[i] for i in diff_leaves]
            return jax.value_and_grad(loss_and_aux, argnums=tuple(range(len(diff_args))),
                                      has_aux=True, **kwargs)(*diff_args)

        grad_jaxpr, out_shape = jax.make_jaxpr(grad_fun, return_shape=True)(*consts, *flat)
        open_fwd = jcore.ClosedJaxpr(
            _with_consts_as_inputs(fwd.jaxpr), ())
        outs = compute_grad_p.bind(*consts, *flat, grad_jaxpr=grad_jaxpr, fwd_jaxpr=open_fwd,
                                   num_consts=num_consts, diff_leaves=diff_leaves,
                                   has_aux=has_aux)
        (value, aux), grads = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(out_shape), outs)
        grads = _regroup_grads(args, nums, leaf_ranges, grads)
        grads = grads[0] if isinstance(argnums, int) else grads
        if with_value:
            return ((value, aux), grads) if has_aux else (value, grads)
        return (grads, aux) if has_aux else grads

    return wrapped


def _leaf_ranges(args: tuple) -> list[tuple[int, int]]:
    out, start = [], 0
    for a in args:
        n = len(jax.tree_util.tree_leaves(a))
        out.append((start, start + n))
        start += n
    return out


def _call_with(closed: jcore.ClosedJaxpr, flat: Sequence[Any], diff_leaves: Sequence[int],
               diff: Sequence[Any]) -> Any:
    args = list(flat)
    for i, d in zip(diff_leaves, diff):
        args[i] = d
    return jcore.jaxpr_as_fun(closed)(*args)


def _regroup_grads(args: tuple, nums: Sequence[int], leaf_ranges, grads) -> tuple:
    out, k = [], 0
    for a in nums:
        n = leaf_ranges[a][1] - leaf_ranges[a][0]
        tree = jax.tree_util.tree_structure(args[a])
        out.append(jax.tree_util.tree_unflatten(tree, list(grads[k:k + n])))
        k += n
    return tuple(out)


def _with_consts_as_inputs(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
    """The same jaxpr with its constvars turned into leading invars."""
    return jaxpr.replace(constvars=[], invars=list(jaxpr.constvars) + list(jaxpr.invars))


# ---- pipeline boundary --------------------------------------------------------------------

pipeline_boundary_p = jcore.Primitive("autopar_pipeline_boundary")
pipeline_boundary_p.multiple_results = True
pipeline_boundary_p.def_impl(lambda: [])
pipeline_boundary_p.def_abstract_eval(lambda: [])
mlir.register_lowering(pipeline_boundary_p, lambda ctx: [])


def mark_pipeline_boundary() -> None:
    """Cuts the pipeline layers here (inside the loss function of `autopar.grad`).

    Has no effect outside a `parallelize` trace.
    """
    if _in_forward.get():
        pipeline_boundary_p.bind()


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
         **kwargs) -> Callable:
    """Same as `jax.grad`; inside `parallelize` it also marks the forward+backward part."""
    if not _recording.get():
        return jax.grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)
    return _marked(fun, argnums, has_aux, False, kwargs)


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
                   **kwargs) -> Callable:
    """Same as `jax.value_and_grad`; inside `parallelize` it also marks forward+backward."""
    if not _recording.get():
        return jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)
    return _marked(fun, argnums, has_aux, True, kwargs)

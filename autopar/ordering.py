"""Pins the order of a program's work with data dependencies that XLA must keep.

XLA takes every `optimization_barrier` out before it schedules (its
OptimizationBarrierExpander replaces the barrier by its operand), so a barrier keeps
values from being merged but orders nothing.  XLA:CPU's memory scheduler then walks the
program depth-first from its outputs.  In a stage's backward the first output it visits
is the first layer's weight gradient, and that needs the whole chain of input cotangents.
So it computes the chain first and every layer's weight and bias gradients after it,
holding each layer's rematerialized activations and cotangents until the end of the
program.  GPT-350M, one device, micro-batch 8: the backward's temporaries took 18.4 GiB
that way, and 6.2 GiB with each layer's gradients computed before the next layer's
backward starts, which is the order the planner prices (one layer's backward live at a
time).

The stage runner ties three orders this way: a layer's recomputation after its output
cotangents arrive (XLA:CPU otherwise started every layer's recomputation early: moe-380m,
eight blocks' attention probabilities live at once), a layer's input cotangents after its
gradients are added to the accumulators, and in the one-program step the weights after the
micro-batch (else XLA hoists their all-gathers and casts out of the loop).

`after` makes values depend on others, and changes no number: each device adds to its
own block of the target an exact `+0.0` derived from one element of its own block of
each source.  It is a `jax.shard_map` over the whole mesh, so it moves no data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from autopar.passes import fallbacks
from autopar.passes.sharding_spec import Spec

from .constraints import to_pspec


def _local_ok(x: Any, spec: Spec | None, mesh: Mesh) -> bool:
    """Whether `x` laid out as `spec` has equal, non-empty blocks on every device."""
    if spec is None or len(spec) != x.ndim or x.size == 0:
        return False
    return all(n % math.prod(mesh.shape[a] for a in axes) == 0
               for n, axes in zip(x.shape, spec))


def _zero_from(x: Any) -> Any:
    """An exact float32 `+0.0` that XLA cannot compute before `x` (NaN and infinities
    give `+0.0` too, so no non-finite value spreads).

    It is a reduction (of `x`'s first two elements), which XLA keeps as a fusion of its
    own with a scalar result.  An element read (`x[0]`) would be fused into every consumer
    of the tied values instead, and each of those would then keep `x`'s whole buffer, and
    the operands of `x`'s own fused producers, live until it runs: wrn-250m on one
    device held five blocks' cotangents through the next group's backward that way
    (37.8 GiB of temporaries where the planner counts 30)."""
    z = jnp.sum(jnp.abs(x.reshape(-1)[:2].astype(jnp.float32))) * 0.0
    return jnp.where(z == 0.0, z, 0.0)


def after(targets: Sequence[tuple[Any, Spec | None]], sources: Sequence[tuple[Any, Spec | None]],
          mesh: Mesh) -> list[Any]:
    """The arrays of `targets` ((array, its layout) pairs), unchanged in value, made to
    depend on every array of `sources` (same pairs).  Float and integer targets are tied
    (an integer one, e.g. the token ids a first layer recomputes from, gets an exact
    integer 0); a boolean target, or a target or source whose layout is unknown or does
    not split it evenly over `mesh`, is left out (returned as it is); one left out for a
    layout that does not split it evenly is reported as a fallback (`_report_uneven`)."""
    kinds = [i for i, (x, _) in enumerate(targets)
             if jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)]
    tied = [i for i in kinds if _local_ok(targets[i][0], targets[i][1], mesh)]
    srcs = [(x, spec) for x, spec in sources if _local_ok(x, spec, mesh)]
    _report_uneven([targets[i] for i in kinds], sources, mesh, bool(tied), bool(srcs))
    out = [x for x, _ in targets]
    if not tied or not srcs:
        return out

    def local(*xs):
        ts, ss = xs[:len(tied)], xs[len(tied):]
        dep = sum(_zero_from(s) for s in ss)
        return tuple(t - dep.astype(t.dtype) for t in ts)

    t_specs = tuple(to_pspec(targets[i][1]) for i in tied)
    s_specs = tuple(to_pspec(spec) for _, spec in srcs)
    done = jax.shard_map(local, mesh=mesh, in_specs=t_specs + s_specs, out_specs=t_specs,
                         check_vma=False)(*[targets[i][0] for i in tied],
                                          *[x for x, _ in srcs])
    for i, x in zip(tied, done):
        out[i] = x
    return out


def _uneven(x: Any, spec: Spec | None, mesh: Mesh) -> bool:
    """Whether `spec` is a layout of `x` (a non-empty array) that does not split it evenly
    over `mesh` (so `after` cannot tie it block by block)."""
    return (spec is not None and len(spec) == x.ndim and x.size > 0
            and not _local_ok(x, spec, mesh))


def _report_uneven(targets: Sequence[tuple[Any, Spec | None]],
                   sources: Sequence[tuple[Any, Spec | None]], mesh: Mesh, any_tied: bool,
                   any_source: bool) -> None:
    """Reports a fallback when an order `after` was asked for is dropped because a layout
    does not split its array evenly: a tieable target (float or integer) left untied while
    a source remains, or every source left out, one for that reason, while a target would
    be tied.  The planner prices memory with these orders kept (one layer's backward live
    at a time); its layouts always split evenly, so this is a layout from elsewhere.  A
    target or source whose layout is unknown, and a boolean target, are left out silently:
    ordinary steps have them (a ReLU's boolean mask; scalar and one-element index
    residuals no layer lays out in the zoo's MLP and GPT): reporting them would flag
    every model."""
    def show(pairs: Sequence[tuple[Any, Spec | None]]) -> str:
        return ", ".join(f"{tuple(x.shape)} as {tuple(spec)}" for x, spec in pairs)

    mesh_s = " x ".join(f"{a}={n}" for a, n in mesh.shape.items())
    odd_targets = [(x, spec) for x, spec in targets if _uneven(x, spec, mesh)]
    if odd_targets and any_source:
        fallbacks.report("ordering", f"{show(odd_targets)} left out of the order that makes "
                         f"them wait for {len(sources)} value(s): the layout does not split "
                         f"them evenly over the mesh ({mesh_s}); XLA may compute them "
                         "earlier and hold them longer than the plan's memory counts")
    odd_sources = [(x, spec) for x, spec in sources if _uneven(x, spec, mesh)]
    if odd_sources and not any_source and any_tied:
        fallbacks.report("ordering", f"no value waits for {show(odd_sources)}: the layout "
                         f"does not split them evenly over the mesh ({mesh_s}), and no other "
                         "source is left; XLA may compute the waiting values earlier and "
                         "hold them longer than the plan's memory counts")

"""Inlines the `jit` calls of a traced step that asked for it (`jax.jit(f, inline=True)`).

jax < 0.11 inlined such calls while tracing; jax 0.11 keeps them as `jit` equations
(`inline=Inline.JAX_LATE`) and inlines them when lowering.  autopar places, splits and
prices a step equation by equation, so a kept call is one indivisible equation: optax's
Adam and AdamW compute every parameter's bias-corrected moments in one such call
(`optax.tree_utils.tree_bias_correction`), which ties the whole update to one pipeline
stage (and, across processes, every stage's moments to one process).  `run` restores the
jaxpr jax < 0.11 traced: the same equations, with their source lines.
"""

from __future__ import annotations

from typing import Any

import jax.extend.core as jcore

from autopar.passes import primitives

_REQUESTED = frozenset({"jax_early", "jax_late"})   # jax 0.11's `Inline` values for True


def requested(eqn: Any) -> bool:
    """Whether `eqn` is a `jit` call its author asked to be inlined."""
    if not primitives.info(eqn.primitive.name).jit_call:
        return False
    flag = eqn.params.get("inline")
    return flag is True or getattr(flag, "value", None) in _REQUESTED


def run(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """`closed` with every requested call (`requested`) at its top level replaced by the
    call's equations, recursively; `closed` itself when it has none.  Equations outside
    the calls keep their variables; those from inside get fresh ones (a call traced once
    may be made twice), and the calls' constants become constants of the result."""
    if not any(requested(e) for e in closed.jaxpr.eqns):
        return closed
    constvars, consts = list(closed.jaxpr.constvars), list(closed.consts)
    eqns: list[Any] = []

    def splice(jaxpr: Any, env: dict[Any, Any], fresh: bool) -> None:
        def read(v: Any) -> Any:
            return v if isinstance(v, jcore.Literal) else env.get(v, v)

        for e in jaxpr.eqns:
            ins = [read(v) for v in e.invars]
            if requested(e):
                sub = e.params["jaxpr"]
                inner = dict(zip(sub.jaxpr.invars, ins))
                for cv, c in zip(sub.jaxpr.constvars, sub.consts):
                    inner[cv] = jcore.Var(cv.aval)
                    constvars.append(inner[cv])
                    consts.append(c)
                splice(sub.jaxpr, inner, fresh=True)
                for out, v in zip(e.outvars, sub.jaxpr.outvars):
                    if not isinstance(out, jcore.DropVar):
                        env[out] = v if isinstance(v, jcore.Literal) else inner[v]
                continue
            outs = list(e.outvars)
            if fresh:
                for k, out in enumerate(outs):
                    if not isinstance(out, jcore.DropVar):
                        outs[k] = env[out] = jcore.Var(out.aval)
            eqns.append(e.replace(invars=ins, outvars=outs))

    top: dict[Any, Any] = {}
    splice(closed.jaxpr, top, fresh=False)
    outvars = [v if isinstance(v, jcore.Literal) else top.get(v, v)
               for v in closed.jaxpr.outvars]
    jaxpr = closed.jaxpr.replace(constvars=constvars, eqns=eqns, outvars=outvars)
    return jcore.ClosedJaxpr(jaxpr, consts)

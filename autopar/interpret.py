"""The one jaxpr evaluator (the shape of `jax.core.eval_jaxpr`), with hooks.

Every part of autopar that re-runs a traced program goes through `run_eqns`: the emitter
(sharding constraints on values and operands), the pipeline runtime (stage programs,
apply-grad segments), the pipeline split (the forward program F) and micro-batching (one
equation run once per micro-batch).  It works on `jax.extend.core` equations and on
`autopar.graph.Eqn`s alike: both carry `primitive`, `params`, `ctx`, `invars` and `outvars`;
literals are `jax.extend.core.Literal` or `autopar.graph.Lit` (both have `.val`).

Hooks, all optional:
  on_operand(key, k, x) -> x   replaces operand k of equation `key` before binding;
  override(key, eqn, ins) -> outs | None   computes an equation itself (None: bind it);
  on_value(var, x) -> x        replaces each output before it is stored.
`key` is the equation's index in the sequence given (or the one given with it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping, Sequence
from typing import Any

import jax.extend.core as jcore

from autopar.passes.ir import Lit

OperandHook = Callable[[int, int, Any], Any]
ValueHook = Callable[[Any, Any], Any]
OverrideHook = Callable[[int, Any, list], "Sequence[Any] | None"]


def bind(eqn: Any, ins: Sequence[Any]) -> list[Any]:
    """Runs one equation on `ins` (arrays or tracers); always returns a list of outputs."""
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def read(env: MutableMapping[Any, Any], var: Any) -> Any:
    """The value of an operand: a literal's value, else `env[var]`."""
    if isinstance(var, jcore.Literal | Lit):
        return var.val
    return env[var]


def run_eqns(eqns: Iterable[Any] | Iterable[tuple[int, Any]], env: MutableMapping[Any, Any],
             *, on_operand: OperandHook | None = None, on_value: ValueHook | None = None,
             override: OverrideHook | None = None, keyed: bool = False,
             ) -> MutableMapping[Any, Any]:
    """Runs `eqns` in order, reading operands from and writing outputs to `env`.

    With `keyed`, `eqns` yields (key, equation) pairs and hooks see that key; otherwise
    the key is the position in `eqns`.  Returns `env`."""
    items = eqns if keyed else enumerate(eqns)
    for key, eqn in items:
        ins = [read(env, v) for v in eqn.invars]
        if on_operand is not None:
            ins = [on_operand(key, k, x) for k, x in enumerate(ins)]
        outs = override(key, eqn, ins) if override is not None else None
        if outs is None:
            outs = bind(eqn, ins)
        for var, x in zip(eqn.outvars, outs):
            env[var] = on_value(var, x) if on_value is not None else x
    return env


def eval_jaxpr(closed: jcore.ClosedJaxpr, args: Sequence[Any], **hooks: Any) -> list[Any]:
    """`closed` applied to `args` through `run_eqns` (same hooks)."""
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, args))
    run_eqns(jaxpr.eqns, env, **hooks)
    return [read(env, v) for v in jaxpr.outvars]

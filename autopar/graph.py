"""A traced training step as the planner's `ir.Graph` (`autopar.passes.ir`, JAX-free):
built from a jaxpr, and run.

`Graph.from_jaxpr` inlines nested calls whose inlining keeps the values the same
(`jit`, `closed_call`, `custom_jvp_call`, `custom_vjp_call`, `remat2`): the step has already
been differentiated when it is traced, so the custom rules are no longer needed, and
rematerialization changes memory, not values.  Control flow (`scan`, `while`, `cond`) stays
one opaque equation whose body is left untouched.

The data types (`Value`, `Eqn`, `Lit`, `Operand`) and the dtype helpers live in
`autopar.passes.ir` and are re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np

from autopar.passes import ir, primitives
from autopar.passes.ir import Eqn, Lit, Operand, Value, is_float, is_numeric, itemsize

from .interpret import run_eqns

__all__ = ["Eqn", "Graph", "Lit", "Operand", "Value", "equation_flops", "is_float",
           "is_numeric", "itemsize"]


def _aval_shape_dtype(aval: Any) -> tuple[tuple[int, ...], Any]:
    shape = tuple(int(d) for d in getattr(aval, "shape", ()))
    return shape, getattr(aval, "dtype", np.dtype("float32"))


# ---- FLOPs --------------------------------------------------------------------------------


def _sub_jaxpr_flops(jaxpr: Any) -> float:
    inner = jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr
    total = 0.0
    for eqn in inner.eqns:
        total += equation_flops(eqn.primitive.name, eqn.params,
                                [_aval_shape_dtype(v.aval)[0] for v in eqn.invars],
                                [_aval_shape_dtype(v.aval)[0] for v in eqn.outvars])
    return total


def equation_flops(name: str, params: dict, ins: Sequence[tuple[int, ...]],
                   outs: Sequence[tuple[int, ...]]) -> float:
    """FLOPs of one equation (whole, unsharded); control flow counts its bodies."""
    if name == "scan":
        return params["length"] * _sub_jaxpr_flops(params["jaxpr"])
    if name == "while":
        return _sub_jaxpr_flops(params["body_jaxpr"]) + _sub_jaxpr_flops(params["cond_jaxpr"])
    if name == "cond":
        return max(_sub_jaxpr_flops(b) for b in params["branches"])
    rule = primitives.info(name).flops
    return rule(params, ins, outs) if rule else 0.0


# ---- the graph ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Graph(ir.Graph):
    """`ir.Graph` built from a jaxpr and run: `from_jaxpr` flattens a traced step,
    `evaluate` / `run_eqns` execute (or trace) its equations."""

    @staticmethod
    def from_jaxpr(closed: jcore.ClosedJaxpr, inline: bool = True,
                   keep: frozenset[str] = frozenset()) -> Graph:
        """Flattens `closed`, inlining value-preserving calls when `inline` is set, except
        the primitives named in `keep`."""
        builder = _Builder(inline, keep)
        consts = []
        env: dict[Any, Operand] = {}
        for var, const in zip(closed.jaxpr.constvars, closed.consts):
            env[var] = builder.new_value(var.aval, const_index=len(consts))
            consts.append(const)
        invars = []
        for i, var in enumerate(closed.jaxpr.invars):
            env[var] = builder.new_value(var.aval, input_index=i)
            invars.append(env[var])
        builder.consts = consts
        builder.emit_jaxpr(closed.jaxpr, env)
        outvars = tuple(builder.read(env, v) for v in closed.jaxpr.outvars)
        consumers: list[list[int]] = [[] for _ in builder.values]
        for eqn in builder.eqns:
            for op in eqn.inputs:
                if isinstance(op, int) and (not consumers[op] or consumers[op][-1] != eqn.index):
                    consumers[op].append(eqn.index)
        return Graph(
            values=tuple(builder.values),
            eqns=tuple(builder.eqns),
            invars=tuple(invars),
            outvars=outvars,
            consts=tuple(builder.consts),
            consumers=tuple(tuple(c) for c in consumers),
            barriers=dict(builder.barriers),
        )

    def evaluate(self, args: Sequence[Any],
                 on_value: Callable[[int, Any], Any] | None = None,
                 on_operand: Callable[[int, int, Any], Any] | None = None) -> list[Any]:
        """Runs the program on `args` (traceable), calling `on_value(id, x)` on every
        equation output and `on_operand(eqn index, operand position, x)` on every operand;
        their return values replace `x` (used to insert sharding constraints).
        """
        if len(args) != len(self.invars):
            raise ValueError(f"graph takes {len(self.invars)} inputs, got {len(args)}")
        env = dict(zip(self.invars, args))
        self.run_eqns(range(len(self.eqns)), env, on_value, on_operand)
        return [self.read(op, env) for op in self.outvars]

    def run_eqns(self, indices: Sequence[int], env: dict[int, Any],
                 on_value: Callable[[int, Any], Any] | None = None,
                 on_operand: Callable[[int, int, Any], Any] | None = None,
                 override: Callable[[int, Eqn, list], Sequence[Any] | None] | None = None,
                 ) -> dict[int, Any]:
        """Runs the equations `indices` (in order) reading and writing `env` (value id →
        array) through `autopar.interpret.run_eqns` (hooks keyed by equation index);
        constants are looked up as needed.  Returns `env`."""
        indices = list(indices)
        for i in indices:
            for op in self.eqns[i].inputs:
                if isinstance(op, int) and op not in env:
                    const = self.values[op].const_index
                    if const is not None:
                        env[op] = self.consts[const]
        run_eqns(self._with_barriers(indices, env), env, on_operand=on_operand,
                 on_value=on_value, override=override, keyed=True)
        return env

    def _with_barriers(self, indices: Sequence[int], env: dict[int, Any]):
        """(index, equation) pairs; before yielding an equation that starts an inlined
        rematerialized backward, passes its operands in `env` through one
        `optimization_barrier` (JAX's own lowering of `remat2`, see `barriers`)."""
        for i in indices:
            tied = [v for v in self.barriers.get(i, ()) if v in env]
            if tied:
                env.update(zip(tied, jax.lax.optimization_barrier([env[v] for v in tied])))
            yield i, self.eqns[i]


class _Builder:
    """Accumulates values and equations while flattening nested jaxprs."""

    def __init__(self, inline: bool, keep: frozenset[str] = frozenset()):
        self.inline = inline
        self.keep = keep
        self.values: list[Value] = []
        self.eqns: list[Eqn] = []
        self.consts: list[Any] = []
        self.barriers: dict[int, tuple[int, ...]] = {}

    def new_value(self, aval: Any, producer: int | None = None, input_index: int | None = None,
                  const_index: int | None = None) -> int:
        shape, dtype = _aval_shape_dtype(aval)
        vid = len(self.values)
        self.values.append(Value(vid, shape, dtype, producer, input_index, const_index))
        return vid

    @staticmethod
    def read(env: dict, var: Any) -> Operand:
        if isinstance(var, jcore.Literal):
            shape, dtype = _aval_shape_dtype(var.aval)
            return Lit(var.val, shape, dtype)
        return env[var]

    def emit_jaxpr(self, jaxpr: jcore.Jaxpr, env: dict) -> None:
        for eqn in jaxpr.eqns:
            ins = [self.read(env, v) for v in eqn.invars]
            param = primitives.info(eqn.primitive.name).body_param
            if (self.inline and param is not None and param in eqn.params
                    and eqn.primitive.name not in self.keep):
                self.inline_call(eqn, eqn.params[param], ins, env)
                continue
            index = len(self.eqns)
            outs = []
            for v in eqn.outvars:
                vid = self.new_value(v.aval, producer=index)
                outs.append(vid)
                if not isinstance(v, jcore.DropVar):
                    env[v] = vid
            in_shapes = [self.shape_of(op) for op in ins]
            out_shapes = [self.values[o].shape for o in outs]
            flops = equation_flops(eqn.primitive.name, eqn.params, in_shapes, out_shapes)
            nbytes = sum(self.nbytes_of(op) for op in ins) + sum(self.values[o].nbytes
                                                               for o in outs)
            self.eqns.append(Eqn(index, eqn.primitive, dict(eqn.params), tuple(ins), tuple(outs),
                                 eqn.source_info, eqn.ctx, flops, float(nbytes)))

    def inline_call(self, eqn: Any, sub: Any, ins: list[Operand], env: dict) -> None:
        if isinstance(sub, jcore.ClosedJaxpr):
            inner, consts = sub.jaxpr, sub.consts
        else:
            inner, consts = sub, ()
        inner_env: dict[Any, Operand] = {}
        for var, const in zip(inner.constvars, consts):
            inner_env[var] = self.new_value(var.aval, const_index=len(self.consts))
            self.consts.append(const)
        cse = eqn.params.get("prevent_cse", False)
        if (primitives.info(eqn.primitive.name).remat and eqn.params.get("differentiated", False)
                and cse):
            flags = (cse,) * len(ins) if isinstance(cse, bool) else cse
            tied = tuple(op for op, f in zip(ins, flags) if f and isinstance(op, int)
                         and self.values[op].const_index is None)
            if tied:
                at = len(self.eqns)
                self.barriers[at] = self.barriers.get(at, ()) + tied
        # Calls may take extra leading operands (e.g. custom_vjp's residual functions);
        # the body's inputs are the trailing ones.
        for var, op in zip(inner.invars, ins[len(ins) - len(inner.invars):]):
            inner_env[var] = op
        self.emit_jaxpr(inner, inner_env)
        for outer, inner_out in zip(eqn.outvars, inner.outvars):
            if not isinstance(outer, jcore.DropVar):
                env[outer] = self.read(inner_env, inner_out)

    def shape_of(self, op: Operand) -> tuple[int, ...]:
        return op.shape if isinstance(op, Lit) else self.values[op].shape

    def nbytes_of(self, op: Operand) -> int:
        if isinstance(op, Lit):
            return math.prod(op.shape) * itemsize(op.dtype)
        return self.values[op].nbytes

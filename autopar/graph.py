"""A read-only, flattened view of a traced training step.

`Graph.from_jaxpr` inlines nested calls whose inlining keeps the values the same
(`jit`, `closed_call`, `custom_jvp_call`, `custom_vjp_call`, `remat2`): the step has already
been differentiated when it is traced, so the custom rules are no longer needed, and
rematerialization changes memory, not values.  Control flow (`scan`, `while`, `cond`) stays
one opaque equation whose body is left untouched.

Values are numbered; an equation's operands are value ids or `Lit` constants.  Time is the
equation index: a value is live from its producing equation (inputs: time 0) to its last use
(outputs: the end of the step).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np
from jax._src import source_info_util

from autopar.passes import primitives

from .interpret import Lit, run_eqns

Operand = int | Lit


@dataclasses.dataclass(frozen=True)
class Value:
    """A value of the program: an input, a constant, or an equation output.

    `producer` is the index of the producing equation, or None for inputs and constants.
    """

    id: int
    shape: tuple[int, ...]
    dtype: Any
    producer: int | None
    input_index: int | None = None
    const_index: int | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @functools.cached_property
    def size(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of the whole (unsharded) value (cached: the stage search asks it millions
        of times)."""
        return self.size * itemsize(self.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class Eqn:
    """One equation of the flattened program.

    `flops` counts floating-point operations of the whole equation (unsharded);
    `bytes_accessed` counts bytes read and written.
    """

    index: int
    primitive: jcore.Primitive
    params: dict
    inputs: tuple[Operand, ...]
    outputs: tuple[int, ...]
    source_info: Any
    ctx: Any
    flops: float
    bytes_accessed: float

    @property
    def name(self) -> str:
        return self.primitive.name

    @property
    def invars(self) -> tuple[Operand, ...]:
        """`inputs`, under the name `autopar.interpret` reads."""
        return self.inputs

    @property
    def outvars(self) -> tuple[int, ...]:
        return self.outputs

    def where(self) -> str:
        """The user's source line that produced this equation ("file:line (fn)")."""
        try:
            return source_info_util.summarize(self.source_info)
        except Exception:  # source info is best-effort; never fail an error message on it
            return "<unknown source>"


def itemsize(dtype: Any) -> int:
    """Bytes per element; PRNG key arrays count their underlying uint32 words."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            return 8
        return 4


def is_numeric(dtype: Any) -> bool:
    """A NumPy dtype (arrays of it can be sharded); False for extended dtypes such as
    PRNG key arrays."""
    try:
        np.dtype(dtype)
        return True
    except TypeError:
        return False


def is_float(dtype: Any) -> bool:
    """Floating or complex: values of this dtype carry gradients and are averaged over
    micro-batches (integer ones are not)."""
    try:
        return bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact))
    except TypeError:
        return False


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
class Graph:
    """The flattened program.

    Attributes:
      values: every value, indexed by id.
      eqns: equations in program order.
      invars: value ids of the program inputs (flattened arguments).
      outvars: operands of the program outputs (a value id or a literal).
      consts: constant arrays captured by the trace, by `Value.const_index`.
      consumers: for each value id, the indices of the equations that read it.
      barriers: equation index → value ids that pass through an optimization barrier
        before it runs: the operands of an inlined rematerialized backward (`remat2` with
        `prevent_cse`), which JAX's lowering ties together so that XLA neither merges the
        recomputation with the forward (CSE) nor starts it before the cotangent arrives.
        Invisible to the planner (identity, no buffer); applied by `run_eqns`.
    """

    values: tuple[Value, ...]
    eqns: tuple[Eqn, ...]
    invars: tuple[int, ...]
    outvars: tuple[Operand, ...]
    consts: tuple[Any, ...]
    consumers: tuple[tuple[int, ...], ...]
    barriers: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

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

    @property
    def num_steps(self) -> int:
        """Number of time steps (equations); outputs stay live until this time."""
        return len(self.eqns)

    def liveness(self) -> np.ndarray:
        """int64 [num_values, 2]: the half-open interval [start, end) each value is live.

        Inputs and constants start at 0; an equation output starts at its equation's index;
        a value ends after its last use, or at `num_steps + 1` if it is a program output.
        """
        out = np.zeros((len(self.values), 2), dtype=np.int64)
        outputs = {op for op in self.outvars if isinstance(op, int)}
        for v in self.values:
            start = 0 if v.producer is None else v.producer
            uses = self.consumers[v.id]
            end = (uses[-1] + 1) if uses else start + 1
            if v.id in outputs:
                end = self.num_steps + 1
            out[v.id] = (start, end)
        return out

    def total_flops(self) -> float:
        return float(sum(e.flops for e in self.eqns))

    def text(self) -> str:
        """A canonical text form of the program (for fingerprints)."""
        lines = [f"in {[(self.values[i].shape, str(self.values[i].dtype)) for i in self.invars]}"]
        for e in self.eqns:
            params = {k: v for k, v in sorted(e.params.items())}
            ins = [f"v{op}" if isinstance(op, int) else f"lit({op.value!r})" for op in e.inputs]
            outs = [f"v{o}:{self.values[o].shape}{self.values[o].dtype}" for o in e.outputs]
            lines.append(f"{outs} = {e.name}{params} {ins}")
        outs = [op if isinstance(op, int) else repr(op.value) for op in self.outvars]
        lines.append(f"out {outs}")
        return "\n".join(lines)

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

    def producers_back(self, starts: Iterable[Operand], follow: Callable[[int], bool]
                       ) -> Iterator[int]:
        """Indices of the equations producing `starts` and, walking back through every
        equation `follow(index)` accepts, its operands' producers: each once, nearest
        first along each path (literals, inputs and constants end a path)."""
        stack = [op for op in starts if isinstance(op, int)]
        seen: set[int] = set()
        while stack:
            vid = stack.pop()
            if vid in seen:
                continue
            seen.add(vid)
            k = self.values[vid].producer
            if k is None:
                continue
            yield k
            if follow(k):
                stack.extend(op for op in self.eqns[k].inputs if isinstance(op, int))

    def computed_from(self, starts: Iterable[int], keep: Callable[[int], bool] = lambda v: True
                      ) -> set[int]:
        """`starts` and every value computed from one of them: each output that `keep`
        accepts of an equation reading a value of the set (a rejected output ends its
        paths)."""
        out = set(starts)
        for e in self.eqns:
            if any(isinstance(op, int) and op in out for op in e.inputs):
                out.update(o for o in e.outputs if keep(o))
        return out

    def read(self, op: Operand, env: dict[int, Any]) -> Any:
        """The value of an operand: a literal, a constant, or `env[id]`."""
        if isinstance(op, Lit):
            return op.value
        if op in env:
            return env[op]
        const = self.values[op].const_index
        if const is None:
            raise KeyError(f"value {op} is not computed yet")
        return self.consts[const]


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

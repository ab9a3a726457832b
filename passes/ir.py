"""The planner's view of a traced training step, as data: values, equations, the flattened
program (`Graph`) and the queries every pass asks of it (liveness, producers, consumers).

No JAX here: `autopar.graph` builds a `Graph` from a jaxpr and adds what runs it; the
passes, the memory model and the solver read only these types.  An equation's primitive,
parameters and source information are JAX objects it carries without looking inside
(`Eqn.where` imports JAX to format a source line; `itemsize`/`is_float` to read an
extended or ml_dtypes dtype).

Values are numbered; an equation's operands are value ids or `Lit` constants.  Time is the
equation index: a value is live from its producing equation (inputs: time 0) to its last use
(outputs: the end of the step).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Lit:
    """A literal operand of a flattened program (a Python or NumPy scalar baked in)."""

    value: Any
    shape: tuple[int, ...]
    dtype: Any

    @property
    def val(self) -> Any:
        return self.value


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
    primitive: Any
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
            from jax._src import source_info_util  # only where an error message is written
            return source_info_util.summarize(self.source_info)
        except Exception:  # source info is best-effort; never fail an error message on it
            return "<unknown source>"


def itemsize(dtype: Any) -> int:
    """Bytes per element; PRNG key arrays count their underlying uint32 words."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        import jax  # extended dtypes (PRNG keys) exist only where JAX made them
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
    import jax  # knows the ml_dtypes floats (bfloat16, float8) as inexact
    try:
        return bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact))
    except TypeError:
        return False


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
        reprs: dict[tuple, str] = {}

        def lit(value: Any) -> str:
            # A program repeats few literals (1.0, 0, eps), and an array's repr is slow.
            if not isinstance(value, np.ndarray):
                return repr(value)
            key = (type(value), value.dtype.str, value.shape,
                   getattr(value, "weak_type", None), value.tobytes())
            if key not in reprs:
                reprs[key] = repr(value)
            return reprs[key]

        for e in self.eqns:
            params = {k: v for k, v in sorted(e.params.items())}
            ins = [f"v{op}" if isinstance(op, int) else f"lit({lit(op.value)})"
                   for op in e.inputs]
            outs = [f"v{o}:{self.values[o].shape}{self.values[o].dtype}" for o in e.outputs]
            lines.append(f"{outs} = {e.name}{params} {ins}")
        outs = [op if isinstance(op, int) else repr(op.value) for op in self.outvars]
        lines.append(f"out {outs}")
        return "\n".join(lines)

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

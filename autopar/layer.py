"""A range of the forward program F as a differentiable function, and its forward+backward
program — the unit the pipeline planner prices and the runtime runs.

`StageFunction` is F's equations [start, stop) as a function of (differentiable inputs,
other inputs) → (float outputs, integer outputs).  `LayerProgram` traces its forward and
backward together (`jax.vjp`, rematerialized when the step uses remat) into one flat
`Graph` — the program the intra-op pass solves — and cuts that graph in two: the forward
part (up to the last primal output) and the backward part, with the residuals the second
reads from the first.  The planner and the runtime build it with the same function, so the
value ids of a plan's layer solution name the same values at run time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from autopar.graph import Graph, Lit, is_float

from .pipeline import StageProgram

Hook = Callable[..., Any]


def differentiable_values(graph: Graph, diff_inputs: Sequence[int]) -> set[int]:
    """Value ids of F that carry gradients: the differentiated inputs and every float value
    computed from one of them (a causal mask built from `iota`, or a value computed from
    the batch alone, gets no cotangent)."""
    return graph.computed_from(diff_inputs, lambda v: is_float(graph.values[v].dtype))


@dataclasses.dataclass(frozen=True, eq=False)
class StageFunction:
    """A range of F as a function: (differentiable inputs, other inputs) → (float outputs,
    integer outputs), with the value ids of each list."""

    graph: Graph
    program: StageProgram
    diff_ids: tuple[int, ...]
    nondiff_ids: tuple[int, ...]
    float_outs: tuple[int, ...]
    int_outs: tuple[int, ...]
    remat: bool = False

    @staticmethod
    def build(graph: Graph, program: StageProgram, diff_values: set[int],
              remat: bool = False) -> StageFunction:
        """`remat`: the forward keeps only the inputs and the backward recomputes the range
        (`jax.checkpoint`) — the step's own `jax.checkpoint`/`nn.remat` boundaries are gone
        once F is flattened, so pipelines rematerialize per layer instead."""
        values = graph.values
        diff = tuple(v for v in program.inputs if v in diff_values and is_float(values[v].dtype))
        return StageFunction(
            graph, program, diff, tuple(v for v in program.inputs if v not in diff),
            tuple(v for v in program.outputs if is_float(values[v].dtype)),
            tuple(v for v in program.outputs if not is_float(values[v].dtype)), remat)

    def __call__(self, diff: Sequence[Any], nondiff: Sequence[Any]):
        env = dict(zip(self.diff_ids, diff))
        env.update(zip(self.nondiff_ids, nondiff))
        self.graph.run_eqns(self.program.eqns, env)
        return [env[o] for o in self.float_outs], [env[o] for o in self.int_outs]

    def forward(self, diff: Sequence[Any], nondiff: Sequence[Any]):
        """(float outputs, vjp function holding the residuals, integer outputs)."""
        fun = lambda *d: self(d, nondiff)
        return jax.vjp(jax.checkpoint(fun) if self.remat else fun, *diff, has_aux=True)

    def forward_backward(self, diff: Sequence[Any], nondiff: Sequence[Any],
                         cts: Sequence[Any]):
        """One micro-batch's forward and backward (what the planner prices)."""
        outs, vjp_fn, ints = self.forward(diff, nondiff)
        return outs, ints, vjp_fn(list(cts))


@dataclasses.dataclass(frozen=True, eq=False)
class LayerProgram:
    """A range of F's forward+backward as one graph, cut into a forward and a backward part.

    Attributes:
      fn: the range as a function (F value ids of its inputs and outputs).
      fb: the forward+backward graph; inputs (diff..., nondiff..., output cotangents...),
        outputs (float outputs..., integer outputs..., input cotangents (one per diff)...).
      forward_eqns / backward_eqns: `fb` equation indices of each part.
      residuals: `fb` value ids the backward part reads from the forward part's inputs or
        results (what one micro-batch in flight keeps).
    """

    fn: StageFunction
    fb: Graph
    forward_eqns: tuple[int, ...]
    backward_eqns: tuple[int, ...]
    residuals: tuple[int, ...]

    @staticmethod
    def build(graph: Graph, program: StageProgram, diff_values: set[int],
              remat: bool = False) -> LayerProgram:
        fn = StageFunction.build(graph, program, diff_values, remat=remat)
        vals = graph.values
        avals = lambda ids: [jax.ShapeDtypeStruct(vals[v].shape, vals[v].dtype) for v in ids]
        closed = jax.make_jaxpr(fn.forward_backward)(avals(fn.diff_ids), avals(fn.nondiff_ids),
                                                     avals(fn.float_outs))
        fb = Graph.from_jaxpr(closed)
        num_outs = len(fn.float_outs) + len(fn.int_outs)
        producers = [fb.values[op].producer for op in fb.outvars[:num_outs]
                     if isinstance(op, int) and fb.values[op].producer is not None]
        start = max(producers) + 1 if producers else 0
        forward = tuple(range(start))
        backward = tuple(range(start, len(fb.eqns)))
        ct_inputs = set(fb.invars[len(fn.diff_ids) + len(fn.nondiff_ids):])
        available = set(fb.invars) - ct_inputs
        available.update(o for i in forward for o in fb.eqns[i].outputs)
        read_later = [op for i in backward for op in fb.eqns[i].inputs]
        read_later += list(fb.outvars[num_outs:])
        residuals: list[int] = []
        for op in read_later:
            if isinstance(op, int) and op in available and op not in residuals:
                residuals.append(op)
        return LayerProgram(fn, fb, forward, backward, tuple(residuals))

    @property
    def num_outs(self) -> int:
        return len(self.fn.float_outs) + len(self.fn.int_outs)

    def run_forward(self, diff: Sequence[Any], nondiff: Sequence[Any], *,
                    on_value: Hook | None = None, on_operand: Hook | None = None
                    ) -> tuple[list[Any], list[Any], list[Any]]:
        """(float outputs, integer outputs, residuals) of one micro-batch."""
        fb = self.fb
        env = dict(zip(fb.invars, list(diff) + list(nondiff)))
        if on_value is not None:
            env = {v: on_value(v, x) for v, x in env.items()}
        fb.run_eqns(self.forward_eqns, env, on_value, on_operand)
        outs = [fb.read(op, env) for op in fb.outvars[:self.num_outs]]
        k = len(self.fn.float_outs)
        return outs[:k], outs[k:], [fb.read(v, env) for v in self.residuals]

    def run_backward(self, residuals: Sequence[Any], cts: Sequence[Any], *,
                     on_value: Hook | None = None, on_operand: Hook | None = None,
                     override: Hook | None = None) -> list[Any]:
        """The cotangents of the diff inputs, from the residuals and the float outputs'
        cotangents (one per `fn.float_outs`)."""
        fb = self.fb
        env = dict(zip(self.residuals, residuals))
        ct_vars = fb.invars[len(self.fn.diff_ids) + len(self.fn.nondiff_ids):]
        env.update(zip(ct_vars, cts if on_value is None else
                       [on_value(v, x) for v, x in zip(ct_vars, cts)]))
        fb.run_eqns(self.backward_eqns, env, on_value, on_operand, override)
        out = []
        for op, vid in zip(fb.outvars[self.num_outs:], self.fn.diff_ids):
            if isinstance(op, Lit):   # a symbolic zero, instantiated as a literal
                value = self.fn.graph.values[vid]
                out.append(jnp.full(value.shape, op.value, value.dtype))
            else:
                out.append(fb.read(op, env))
        return out

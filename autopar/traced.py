"""`Traced`: a parallelized step traced and planned for one set of argument shapes (what
`step.trace(*args)` returns), and the argument bookkeeping the step and the micro-batch
search share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import jax

from autopar.graph import Graph

from .passes import fallbacks
from .plan import Plan

if TYPE_CHECKING:
    from . import pipeline, planner
    from .api import ParallelizedFunction
    from .step_trace import StepTrace


@dataclasses.dataclass(eq=False)
class Traced:
    """A parallelized step traced and planned for one set of argument shapes — what
    `step.trace(*args)` returns (the shape of `jax.jit(f).trace(*args)`).

    Attributes:
      program: the traced step (graph, input names and roles, ties new state → state) that
        the plan was made for; with micro-batches on one mesh, every micro-batch unrolled.
      plan: the plan, searched or loaded.
      split: for pipeline plans, the step traced at micro-batch size and split around its
        compute-grad equation (`split.forward_graph()` is the program the stages cut);
        None for single-mesh plans.
      out_tree: the step's output treedef.
      in_tree: the treedef of the dynamic (non-static) arguments.
      args_info: `jax.ShapeDtypeStruct` of every flattened dynamic argument.
    """

    program: planner.Program
    plan: Plan
    split: pipeline.SplitStep | None
    out_tree: Any
    in_tree: Any
    args_info: tuple[jax.ShapeDtypeStruct, ...]
    _trace: StepTrace = dataclasses.field(repr=False)
    _positions: list[int] = dataclasses.field(repr=False)
    _trace_static: tuple = dataclasses.field(repr=False)
    _step: ParallelizedFunction = dataclasses.field(repr=False)
    _executable: Any = dataclasses.field(default=None, repr=False)
    _layouts: dict[str, list] = dataclasses.field(default_factory=dict, repr=False)
    _built_fallbacks: list = dataclasses.field(default_factory=list, repr=False)

    @property
    def graph(self) -> Graph:
        """The flattened step (`program.graph`)."""
        return self.program.graph

    @property
    def executable(self):
        """What runs the plan on this process's devices (`executable.Executable`), built on
        first use: a single mesh's jitted program or the `PipelineRuntime`."""
        if self._executable is None:
            with fallbacks.collecting() as found:
                self._executable = self._step._build(self)
            self._built_fallbacks.extend(found)
        return self._executable

    @property
    def fallbacks(self) -> tuple[fallbacks.Fallback, ...]:
        """Every fallback of this step (`autopar.FallbackWarning`): the search's
        (`plan.solver["fallbacks"]`) and the runtime's while building the executable and
        lowering it through `lower()`; empty when the programs are the plan."""
        planned = tuple(fallbacks.Fallback(**f) for f in self.plan.solver.get("fallbacks", []))
        return planned + tuple(self._built_fallbacks)

    def lower(self):
        """JAX's `Lowered` program (`.compile()` gives the compiled executable with
        `as_text()`, `memory_analysis()`, `cost_analysis()`); for pipeline plans, an object
        whose `.compile()` gives every compiled program of the step."""
        executable = self.executable
        with fallbacks.collecting() as found:
            lowered = executable.lower(*self.args_info)
        self._built_fallbacks.extend(f for f in found if f not in self._built_fallbacks)
        return lowered

    def input_shardings(self) -> tuple:
        """The `jax.sharding.Sharding` the program expects for every leaf of every dynamic
        argument (static arguments excluded): a tuple with one pytree per argument, in
        argument order.  Arguments laid out so (`autopar.place`, or a checkpoint restored
        into them) reach the program without a reshard."""
        return tuple(jax.tree_util.tree_unflatten(self.in_tree, self._shardings("in")))

    def output_shardings(self) -> Any:
        """The `jax.sharding.Sharding` of every leaf the step returns (a pytree like the
        output) when its arguments are laid out as `input_shardings()`."""
        return jax.tree_util.tree_unflatten(self.out_tree, self._shardings("out"))

    def _shardings(self, side: Literal["in", "out"]) -> list[jax.sharding.Sharding]:
        """Flattened input ("in") or output ("out") shardings, computed once."""
        if side not in self._layouts:
            executable = self.executable
            self._layouts[side] = (executable.input_shardings() if side == "in"
                                   else executable.output_shardings())
        return self._layouts[side]

    def donated_leaves(self) -> list[int]:
        """Flattened input positions the step donates (see `parallelize(donate_argnums=)`)."""
        donated = set(self._step._donated_args(self))
        return [k for k, p in enumerate(leaf_positions(self.in_tree, self._positions))
                if p in donated]

    def fast_call(self) -> Callable:
        """`step(*args)` for these argument shapes as one `jax.jit` (its C++ dispatch is the
        whole per-call cost); tracing other shapes raises `OtherShapes`."""
        step = self._step
        expected = [(tuple(a.shape), jax.numpy.dtype(a.dtype)) for a in self.args_info]
        static = {p: a for p, a in self._trace_static}
        flat = self.executable

        def body(*args):
            dynamic, static_now, _ = step._split(args)
            leaves, tree = jax.tree_util.tree_flatten(dynamic)
            got = [(tuple(jax.numpy.shape(x)), jax.numpy.result_type(x)) for x in leaves]
            if tree != self.in_tree or got != expected or dict(static_now) != static:
                raise OtherShapes()
            return jax.tree_util.tree_unflatten(self.out_tree, flat(*leaves))

        shardings = jax.tree_util.tree_unflatten(self.in_tree, self._shardings("in"))
        in_shardings = [None] * (len(self._positions) + len(static))
        for pos, sh in zip(self._positions, shardings):
            in_shardings[pos] = sh
        in_shardings = [sh for p, sh in enumerate(in_shardings) if p not in static]
        return jax.jit(body, static_argnums=tuple(sorted(static)),
                       donate_argnums=step._donated_args(self),
                       in_shardings=tuple(in_shardings))


class OtherShapes(Exception):
    """Raised while the fast path traces arguments another plan is for."""


def leaf_positions(in_tree, positions: list[int]) -> list[int]:
    """The original argument position of every flattened leaf."""
    marked = jax.tree_util.tree_unflatten(in_tree, list(range(in_tree.num_leaves)))
    out = [0] * in_tree.num_leaves
    for pos, sub in zip(positions, marked):
        for leaf in jax.tree_util.tree_leaves(sub):
            out[leaf] = pos
    return out

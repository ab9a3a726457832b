"""Gradient accumulation without a reduction per micro-batch.

When a stage's plan computes a parameter gradient with a contraction over a split dimension
(the batch, split for data parallelism: `dW = xᵀ·dy` with x and dy split on rows over mesh
axis x), XLA would all-reduce the result over x in every micro-batch's backward.  Instead
the runtime evaluates that contraction shard-locally over x (`jax.shard_map` over x only,
the other mesh axes left to the partitioner) and keeps the per-device partial sums stacked
on a new leading dimension split over x: `[|x|, *shape]`, no communication.  The linear
equations between the contraction and the gradient output (layout changes, sums of
contributions) are applied to every partial sum.  The stage's backward adds these into
donated accumulators; once per step, `finalize` sums the stack into the parameter's layout:
one all-reduce (or reduce-scatter) per gradient per step, where the planner priced it.

A gradient on its way through the backward is a `GradSum`: a dict from the tuple of mesh
axes its parts are not reduced over (`()`: an ordinary, reduced array) to the array.
Equations the deferral does not cover read the sum of the parts (the reduction happens
there, as XLA would have done it) — correct, only not deferred.

A single-mesh step with micro-batches (`autopar.microbatch`) uses the same machinery on its
unrolled program: every micro-batch's gradient contractions are deferred, their partial
sums go through the micro-batch sum and mean (`through_scaling`: the division by the count)
and are reduced once, where the optimizer first reads the mean (`DeferredBackward` with
`reduce_once`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.graph import Graph, Lit
from autopar.interpret import bind
from autopar.passes import primitives
from autopar.passes.sharding_spec import Spec

from .constraints import to_pspec
from .passes import fallbacks


@dataclasses.dataclass(frozen=True)
class GradSum:
    """A value as a sum of parts: `parts[()]` is an ordinary array; `parts[axes]` holds
    partial sums stacked on dim 0 (split over `axes`), still to be summed over that dim."""

    parts: Mapping[tuple[str, ...], Any]

    def total(self) -> Any:
        """The value itself (sums the stacks: a reduction over their axes)."""
        out = None
        for axes, x in self.parts.items():
            x = x.sum(axis=0) if axes else x
            out = x if out is None else out + x
        return out

    def __add__(self, other: GradSum) -> GradSum:
        parts = dict(self.parts)
        for k, x in other.parts.items():
            parts[k] = parts[k] + x if k in parts else x
        return GradSum(parts)


def _strip(spec: Spec, axes: Sequence[str]) -> Spec:
    return tuple(tuple(a for a in dim if a not in axes) for dim in spec)


def unreduced_spec(spec: Spec, axes: Sequence[str]) -> Spec:
    """How each device's partial sum of a gradient laid out as `spec` and kept unreduced
    over `axes` is cut (`spec` without `axes`): the accumulator holds one such partial sum
    per device, `nbytes / shards(unreduced_spec(spec, axes))` bytes."""
    return _strip(spec, axes)


def stacked_spec(spec: Spec, axes: tuple[str, ...]) -> Spec:
    """The layout of partial sums over `axes` of a value laid out as `spec`."""
    return (tuple(axes),) + _strip(spec, axes)


def _axes_on(spec: Spec | None, dims: Sequence[int]) -> list[str]:
    if spec is None:
        return []
    return [a for d in dims for a in spec[d]]


def _dot_axes(eqn: Any, read_specs: Sequence[Spec | None]) -> list[str]:
    (lc, rc), _ = eqn.params["dimension_numbers"]
    rhs = set(_axes_on(read_specs[1], rc))
    return [a for a in _axes_on(read_specs[0], lc) if a in rhs]


def _reduce_sum_axes(eqn: Any, read_specs: Sequence[Spec | None]) -> list[str]:
    return _axes_on(read_specs[0], eqn.params["axes"])


def _conv_axes(eqn: Any, read_specs: Sequence[Spec | None]) -> list[str]:
    """A convolution sums over the lhs feature dim against the rhs input-feature dim (a
    kernel's gradient is such a convolution with the batch as that feature dim).  Batch
    groups group the lhs batch dim and the output features, not the summed dim (grouped
    features: not deferred, `defers`)."""
    dn = eqn.params["dimension_numbers"]
    rhs = set(_axes_on(read_specs[1], [dn.rhs_spec[1]]))
    return [a for a in _axes_on(read_specs[0], [dn.lhs_spec[1]]) if a in rhs]


#: Contractions whose result is a sum over a dimension: name → the mesh axes that dimension
#: is split over in the operands' read layouts (a shard-local evaluation gives partial
#: sums).  The one rule set for deferring gradient reductions: the runtime defers exactly
#: these, and the planner (`pipeline_search`) prices exactly these once per step.
CONTRACTIONS = {"dot_general": _dot_axes, "conv_general_dilated": _conv_axes,
                "reduce_sum": _reduce_sum_axes}


def defers(eqn: Any) -> bool:
    """Whether the runtime can keep the sum `eqn` computes unreduced (when its operands'
    layouts split the summed dim): a rule of `CONTRACTIONS` without grouped features
    (`feature_group_count` > 1 pairs each lhs feature block with its own group: a split of
    that dim is not a plain partial sum).  The runtime (`Deferral.find`) and the planner
    (`pipeline_search`) both ask this."""
    return eqn.name in CONTRACTIONS and not (eqn.name == "conv_general_dilated"
                                             and eqn.params["feature_group_count"] != 1)


def passes_sums(name: str) -> bool:
    """Whether an equation maps a sum of parts to the sum of its images (a deferred
    gradient goes through it unreduced)."""
    facts = primitives.info(name)
    return facts.linear or facts.linear_sum


def scales(eqn: Any) -> bool:
    """Whether `eqn` multiplies or divides one value by a literal constant (`g * c`,
    `c * g`, `g / c`): linear in that value, so a sum of parts passes it part by part."""
    ins = eqn.inputs
    if len(ins) != 2 or isinstance(ins[0], Lit) == isinstance(ins[1], Lit):
        return False
    return eqn.name == "mul" or (eqn.name == "div" and isinstance(ins[1], Lit))


def _passes(eqn: Any, through_scaling: bool) -> bool:
    return passes_sums(eqn.name) or (through_scaling and scales(eqn))


def gradient_contractions(graph: Graph, grads: Sequence[int], *,
                          through_scaling: bool = False) -> set[int]:
    """Indices of the equations of `graph` whose sums `Deferral.find` may keep unreduced on
    their way to the gradients `grads` (whatever the layouts): the contractions it would
    reach walking back through linear equations (and, with `through_scaling`, through
    scalings by a constant).  What a planner prices as reduced once per step."""
    follow = lambda k: _passes(graph.eqns[k], through_scaling)
    return {k for k in graph.producers_back(grads, follow) if defers(graph.eqns[k])}


@dataclasses.dataclass(frozen=True, eq=False)
class Deferral:
    """Which equations of a layer's backward keep their gradient sums unreduced.

    Attributes:
      contractions: equation index → (mesh axes kept unreduced, read spec of each operand).
      linear: equations between a deferred contraction and a gradient output.
      specs: value id → planned spec (for the layouts of stacked parts).
    """

    contractions: Mapping[int, tuple[tuple[str, ...], tuple[Spec, ...]]]
    linear: frozenset[int]
    specs: Mapping[int, Spec]

    @staticmethod
    def find(fb: Graph, eqns: Sequence[int], grad_outs: Sequence[int],
             value_specs: Mapping[int, Spec], operand_specs: Mapping[tuple[int, int], Spec],
             *, through_scaling: bool = False) -> Deferral:
        """Walks back from the parameter gradients `grad_outs` (value ids of `fb`) through
        linear equations of `eqns` (with `through_scaling`, also through scalings by a
        constant: `scales`) to the contractions that produce them."""
        inside = set(eqns)
        is_linear = lambda k: k in inside and _passes(fb.eqns[k], through_scaling)
        contractions: dict[int, tuple[tuple[str, ...], tuple[Spec, ...]]] = {}
        linear: set[int] = set()
        for k in fb.producers_back(grad_outs, is_linear):
            eqn = fb.eqns[k]
            if is_linear(k):
                linear.add(k)
            elif k in inside and defers(eqn):
                reads = tuple(operand_specs.get((k, j), value_specs.get(op))
                              if isinstance(op, int) else None
                              for j, op in enumerate(eqn.inputs))
                if any(r is None for r in reads):
                    continue
                axes = CONTRACTIONS[eqn.name](eqn, reads)
                if axes:
                    contractions[k] = (tuple(axes), reads)
        return Deferral(contractions, frozenset(linear), value_specs)

    def __bool__(self) -> bool:
        return bool(self.contractions)

    def unreduced_axes(self, fb: Graph, grad: int) -> tuple[str, ...]:
        """The mesh axes the gradient `grad` (a value of `fb`) stays unreduced over: those
        of the deferred contractions it is a linear image of."""
        axes: list[str] = []
        for k in fb.producers_back([grad], lambda k: k in self.linear):
            if k in self.contractions:
                axes += [a for a in self.contractions[k][0] if a not in axes]
        return tuple(axes)


class DeferredBackward:
    """`override` hook for `LayerProgram.run_backward` on `mesh` implementing a Deferral.

    With `reduce_once`, a sum read by an equation the deferral does not cover (or by the
    caller, `value`) is reduced by `reduce_to` into its planned layout (one all-reduce or
    reduce-scatter), once per value however many equations read it: the hook then serves
    one trace only."""

    def __init__(self, fb: Graph, deferral: Deferral, mesh: Mesh, *, reduce_once: bool = False):
        self.fb, self.deferral, self.mesh = fb, deferral, mesh
        self._reduced: dict[int, Any] | None = {} if reduce_once else None

    def _constrain(self, x: Any, spec: Spec) -> Any:
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, to_pspec(spec)))

    def value(self, x: Any, vid: Any) -> Any:
        """An operand as an ordinary array (summing a GradSum in the operand's layout)."""
        if not isinstance(x, GradSum):
            return x
        spec = self.deferral.specs.get(vid) if isinstance(vid, int) else None
        if spec is None:
            return x.total()
        if self._reduced is None:
            return self._constrain(x.total(), spec)
        if vid not in self._reduced:
            # The parts are laid out as the value's plan (`stacked_spec`): kept so.
            self._reduced[vid] = reduce_to(x.parts, spec, self.mesh, have=spec)
        return self._reduced[vid]

    def __call__(self, key: int, eqn: Any, ins: list) -> list | None:
        d = self.deferral
        if key in d.contractions:
            return [self._contract(key, eqn, [self.value(x, v)
                                              for x, v in zip(ins, eqn.inputs)])]
        if not any(isinstance(x, GradSum) for x in ins):
            return None
        if key in d.linear and (scales(eqn) or not any(isinstance(v, Lit)
                                                       for v in eqn.inputs)):
            out_spec = d.specs.get(eqn.outputs[0])
            if primitives.info(eqn.name).linear_sum:
                total = GradSum({})
                for x in ins:
                    total = total + (x if isinstance(x, GradSum) else GradSum({(): x}))
                return [total]
            # One operand is the sum (a scaling's other operand is its literal).
            at = next(j for j, v in enumerate(eqn.inputs) if not isinstance(v, Lit))
            x = ins[at]
            with_part = lambda p: ins[:at] + [p] + ins[at + 1:]
            parts = {}
            for axes, part in x.parts.items():
                if axes:
                    y = jax.vmap(lambda p: bind(eqn, with_part(p))[0])(part)
                    if out_spec is not None:
                        y = self._constrain(y, stacked_spec(out_spec, axes))
                else:
                    y = bind(eqn, with_part(part))[0]
                parts[axes] = y
            return [GradSum(parts)]
        return bind(eqn, [self.value(x, v) for x, v in zip(ins, eqn.inputs)])

    def _contract(self, key: int, eqn: Any, ins: list) -> GradSum:
        axes, reads = self.deferral.contractions[key]
        manual = set(axes)

        def manual_only(spec: Spec) -> PartitionSpec:
            return to_pspec(tuple(tuple(a for a in dim if a in manual) for dim in spec))

        def local(*ops):
            return bind(eqn, list(ops))[0][None]

        ins = [self._constrain(x, spec) for x, spec in zip(ins, reads)]
        stacked = jax.shard_map(local, mesh=self.mesh, in_specs=tuple(map(manual_only, reads)),
                                out_specs=to_pspec(((axes),)), axis_names=manual)(*ins)
        out_spec = self.deferral.specs.get(eqn.outputs[0])
        if out_spec is not None:
            stacked = self._constrain(stacked, stacked_spec(out_spec, axes))
        return GradSum({axes: stacked})


def reduce_to(parts: Mapping[tuple[str, ...], Any], spec: Spec, mesh: Mesh,
              have: Spec | None = None) -> Any:
    """The sum of a gradient's `parts` laid out as `spec` on `mesh` (the step's one
    reduction).  A stack of partial sums over axes A is reduce-scattered onto the dims of
    `spec` that A's axes split (ZeRO's gradient layout) and all-reduced over the axes of A
    that `spec` leaves whole, in one `jax.shard_map`.  `have`: the layout the parts are
    accumulated in beyond their stack axis (`stacked_spec`'s), kept through the reduction
    so that no axis outside A is gathered first.  Without it the shard_map is manual over
    A only — when every dim of `spec` that an axis of A splits is split by axes of A only;
    otherwise the stack is summed and laid out by the partitioner (which, on CPU,
    all-reduces and slices)."""
    out = None
    for axes, x in parts.items():
        y = _scatter(x, axes, spec, mesh, have) if axes else x
        out = y if out is None else out + y
    return jax.lax.with_sharding_constraint(out, NamedSharding(mesh, to_pspec(spec)))


def _scatter(stack: Any, axes: tuple[str, ...], spec: Spec, mesh: Mesh,
             have: Spec | None = None) -> Any:
    manual = set(axes)
    dims = [d for d, on in enumerate(spec) if manual & set(on)]
    cut = {d: tuple(a for a in spec[d] if a in manual) for d in dims}
    whole = tuple(a for a in axes if not any(a in on for on in spec))

    def local(x):
        x = x[0]
        for d in dims:
            x = jax.lax.psum_scatter(x, cut[d], scatter_dimension=d, tiled=True)
        return jax.lax.psum(x, whole) if whole else x

    shape = stack.shape[1:]
    kept = _strip(have, axes) if have is not None else None
    if kept is not None and all(
            shape[d] % math.prod(mesh.shape[a] for a in kept[d] + cut.get(d, ())) == 0
            for d in range(len(shape))):
        # Manual over every axis: each device reduce-scatters its own block of the layout
        # the parts are kept in (the other axes' splits stay where they are).
        out_spec = tuple(kept[d] + cut.get(d, ()) for d in range(len(shape)))
        return jax.shard_map(local, mesh=mesh, in_specs=to_pspec((axes,) + kept),
                             out_specs=to_pspec(out_spec))(stack)
    if any(not set(spec[d]) <= manual for d in dims):
        fallbacks.report("gradient reduction", f"partial sums {tuple(stack.shape)} over "
                         f"{list(axes)} summed and laid out as {spec} by XLA's partitioner "
                         "(not one reduce-scatter: the layout mixes those axes with others)")
        return stack.sum(axis=0)
    # Manual over A only (every dim it scatters onto is split by axes of A alone).
    out_spec = tuple(cut.get(d, ()) for d in range(len(spec)))
    return jax.shard_map(local, mesh=mesh, in_specs=to_pspec((axes,)),
                         out_specs=to_pspec(out_spec), axis_names=manual)(stack)


def skip_sums(hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """A value hook that leaves `GradSum`s alone (their parts carry their own layouts)."""
    def on_value(vid: Any, x: Any) -> Any:
        return x if isinstance(x, GradSum) else hook(vid, x)
    return on_value


def as_grad_sum(x: Any) -> GradSum:
    return x if isinstance(x, GradSum) else GradSum({(): x})


def zeros_like_parts(parts: Mapping[tuple[str, ...], jax.ShapeDtypeStruct]) -> dict:
    return {axes: jnp.zeros(p.shape, p.dtype) for axes, p in parts.items()}

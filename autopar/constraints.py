"""A plan's layouts as JAX objects: a `Spec` as a `PartitionSpec`, the plan's `Mesh`, and
the `with_sharding_constraint` hooks (`Constraints`) that pin a re-evaluated jaxpr to an
intra-op solution.  Every emitted program builds on these: the single-mesh step
(`autopar.emit`), the micro-batched one (`autopar.microbatch`) and the pipeline's stages
(`autopar.stage_runner`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from autopar.graph import Graph, is_numeric
from autopar.passes.sharding_spec import (
    Spec,
    full_rematerialization,
    gather_first,
    is_slice,
)

from .plan import Plan


def to_pspec(spec: Spec) -> PartitionSpec:
    return PartitionSpec(*[(axes[0] if len(axes) == 1 else tuple(axes)) if axes else None
                           for axes in spec])


def build_mesh(plan: Plan, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The plan's mesh, with Auto axes (Explicit axes reject tensor-parallel dots)."""
    by_id = {d.id: d for d in (devices if devices is not None else jax.devices())}
    grid = np.array([by_id[i] for i in plan.device_ids], dtype=object).reshape(plan.mesh_shape)
    return Mesh(grid, plan.mesh_axes, axis_types=(AxisType.Auto,) * len(plan.mesh_axes))


@dataclasses.dataclass(frozen=True, eq=False)
class Constraints:
    """The `with_sharding_constraint`s that pin a program to its intra-op solution: one per
    decided value (`on_value`) and one per operand that a matmul, convolution, gather or
    scatter reads in another layout (`on_operand`) — hooks for `autopar.interpret`."""

    values: dict[int, NamedSharding]
    # (equation, operand) → the layouts the operand is constrained to, in order: the last
    # is the one the equation reads; a reshard that XLA would do by replicating the whole
    # value goes through the gathered layout first.
    operands: dict[tuple[int, int], tuple[NamedSharding, ...]]

    @staticmethod
    def build(graph: Graph, mesh: Mesh, value_specs: Iterable[tuple[int, Spec]],
              operand_specs: Iterable[tuple[int, int, Spec]],
              input_specs: Iterable[tuple[int, Spec]] = (),
              raw_inputs: Iterable[tuple[int, Spec]] = ()) -> Constraints:
        """`input_specs`: (value, spec) of the program's inputs, the sources of reshards
        that `value_specs` does not name.  `raw_inputs`: (input value, the layout it
        arrives in) of inputs that stay alive anyway (a stage's parameters): each reader
        takes its own layout straight from the arriving value when that is a local slice
        of it — pinning the value first would make XLA gather it back for a reader that
        wants more of it (a replicated weight pinned split, then read whole: an all-gather
        of the weight)."""
        value_specs = dict(value_specs)
        numeric = {vid for vid in value_specs if is_numeric(graph.values[vid].dtype)}
        raw = {vid: spec for vid, spec in raw_inputs if vid in numeric}
        # A raw input is not pinned at all: it arrives committed to its layout, and a
        # constraint to that layout (replicated) in front of the readers' slices made XLA
        # all-gather the sliced weight back once per step (measured: 3 MiB on the
        # runtime_overhead MLP's one-stage step).
        values = {vid: NamedSharding(mesh, to_pspec(value_specs[vid]))
                  for vid in numeric if vid not in raw}
        own = dict(input_specs)
        own.update(value_specs)

        def chain(src: Spec | None, dst: Spec) -> tuple[NamedSharding, ...]:
            # Operands that a matmul/conv/gather/scatter reads in another layout are pinned
            # too: XLA then reshards exactly as the plan priced (and on CPU, jax 0.10.2,
            # leaving the choice to the partitioner gave wrong attention logits for one
            # such reshard).  A move of a split between dims with several mesh axes
            # involved goes through the gathered layout first: XLA's partitioner would
            # replicate the whole value instead ("involuntary full rematerialization").
            steps = (gather_first(src, dst),) if (
                src is not None and full_rematerialization(src, dst)) else ()
            return tuple(NamedSharding(mesh, to_pspec(s)) for s in steps + (dst,))

        operands: dict[tuple[int, int], tuple[NamedSharding, ...]] = {}
        for e, k, spec in operand_specs:
            op = graph.eqns[e].inputs[k]
            src = own.get(op) if isinstance(op, int) else None
            if src is None or op not in raw:
                operands[(e, k)] = chain(src, spec)
            elif is_slice(raw[op], spec):
                operands[(e, k)] = chain(None, spec)
            else:   # not a slice of what arrives: first the value's own layout, as planned
                operands[(e, k)] = chain(None, src) + chain(src, spec)
        for e, eqn in enumerate(graph.eqns if raw else ()):   # raw inputs' other readers
            for k, op in enumerate(eqn.inputs):
                if isinstance(op, int) and op in raw and (e, k) not in operands:
                    operands[(e, k)] = chain(None, value_specs[op])
        return Constraints(values, operands)

    def on_value(self, vid: int, x: Any) -> Any:
        sharding = self.values.get(vid)
        if sharding is None:
            return x
        return jax.lax.with_sharding_constraint(x, sharding)

    def on_operand(self, eqn: int, k: int, x: Any) -> Any:
        for sharding in self.operands.get((eqn, k), ()):
            x = jax.lax.with_sharding_constraint(x, sharding)
        return x

"""A fixed 2-D logical mesh seen as one axis: the 1-D mesh of the same devices, same order.

On a 2-D mesh the intra-op ILP picks, per value, a split over ``x``, over ``y``, or over both.
Its strategies split an operation over one axis at a time, so a plan whose values are split
over all devices at once (channel or expert parallelism over the whole mesh) is reached only
through re-layouts between axes; and where such a plan moves a split from one dim to another,
XLA's partitioner runs the move over two mesh axes as an all-gather, not the all-to-all it
runs on one axis (a convolution stack on 2x2: 2 MiB gathered where (4,) moves 0.5 MiB,
`benchmarks/results/intra_op_reference.md`).  The 1-D mesh ``(n,)`` over the same devices in
the same (row-major) order is the same machine: a value split over its one axis is split
over ``(x, y)`` of the 2-D mesh, every device holding the same piece, every collective the
same group.  So when the user fixes a 2-D mesh, the planner also solves ``(n,)`` and keeps the
cheaper plan (`planner.search`; the plan's ``mesh_shape`` then reads ``(n,)`` and
``solver["flat_view"]`` says so), unless a batch axis is set: that names one of the two axes.
"""

from __future__ import annotations

from collections.abc import Mapping

from autopar.passes.sharding_spec import MeshContext, Spec


def flat_shape(shape: tuple[int, ...]) -> tuple[int] | None:
    """``(n,)`` for a 2-D mesh with two split axes, None otherwise (nothing to flatten)."""
    if len(shape) == 2 and min(shape) > 1:
        return (shape[0] * shape[1],)
    return None


def lift_spec(spec: Spec, mesh: MeshContext) -> Spec:
    """A spec of the 1-D mesh (dims split over ``("x",)`` or not at all) on the 2-D `mesh`:
    the same pieces on the same devices."""
    return tuple(tuple(mesh.axes) if dim else () for dim in spec)


def lifts_to(flat: Mapping[int, Spec], native: Mapping[int, Spec], mesh: MeshContext) -> bool:
    """Whether the 1-D forced specs `flat` are the 2-D `native` ones on the same devices:
    then both plans start from the same input contract and their costs compare."""
    return flat.keys() == native.keys() and all(
        lift_spec(spec, mesh) == native[v] for v, spec in flat.items())

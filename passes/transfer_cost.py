"""What moving a value between two pipeline stages costs, from both stages' layouts.

The runtime (`autopar.transfer.local_move` / `_route`, `move`, and `StageRunner.send`) moves
a value from the sender's sub-mesh to the receiver's in one of three ways, chosen by the two
layouts:

| route         | device counts, tilings | sender             | each receiver device | receiver  |
| ------------- | ---------------------- | ------------------ | -------------------- | --------- |
| copy          | equal, the same        | nothing            | its own wire piece   | gathers*  |
| relayout+copy | equal, different       | re-lays it out in  | its own wire piece   | gathers*  |
|               |                        | the receiver's     |                      |           |
|               |                        | tiling: collective |                      |           |
| whole copies  | different              | all-gathers it     | the whole value      | cuts it   |
|               |                        | (replicated)       |                      | (a slice) |

(*) only where the receiver holds copies ("+gather" routes, below).

Between equal device counts the value crosses in its *wire* layout (`wire_spec`): the
receiver's layout cut further over the receiver's mesh axes that layout leaves unused, so
that no two receiving devices are sent the same bytes.  Where the receiver holds copies (a
replicated reader, or one split over some axes only), the sender slices its copy into the
wire pieces (local), each receiving device gets its piece, and the receiver all-gathers
them over those axes (the "+gather" routes; Alpa's cross-mesh resharding with a local
all-gather): the slow link between the sub-meshes carries each byte once, and the copies
are made over the receiver's own (faster) links.  Where the receiver's layout has no
copies the wire is that layout and nothing is gathered.

The collectives are priced with `sharding_spec.reshard_steps` (the ones the intra-op pass
prices resharding with), the copy as one point-to-point transfer per receiving device over
the link between the two sub-meshes, all of them in parallel.

Units: seconds and bytes; bytes of a collective are S as `cost_model.hlo_audit` counts
them (per device), bytes of the copy are what one receiving device receives.  JAX-free.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from autopar.cost_model import Link
from autopar.cost_model.collectives import send_recv_s

from .sharding_spec import (
    MeshContext,
    ReshardStep,
    Spec,
    enumerate_specs,
    replicated,
    reshard_steps,
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A value laid out on one sub-mesh: `spec` over the logical mesh `mesh` (its shape,
    axis names and links)."""

    spec: Spec
    mesh: MeshContext

    @property
    def devices(self) -> int:
        return self.mesh.num_devices


@dataclasses.dataclass(frozen=True)
class TransferPrice:
    """One transfer's cost, by phase.

    Attributes:
      route: "copy", "relayout+copy" (either with "+gather": the receiver gathers the
        wire pieces) or "whole copies" (module table).
      relayout: the collectives on the sender's devices before the copy.
      relayout_s: their seconds.
      copy_bytes: bytes each receiving device receives (its wire piece, or the whole value).
      copy_s: seconds of the copy (the receiving devices' copies run in parallel).
      gather: the receiver's all-gather of the wire pieces into its layout (a program of
        its own after the copy; none where the wire is that layout, and none for a cut:
        slicing a held copy is local).
      gather_s: its seconds.
      receive: the collectives on the receiver's devices re-laying the value out once it
        has arrived (`price_transfer`'s `then`).
      receive_s: their seconds.
    """

    route: str
    relayout: tuple[ReshardStep, ...]
    relayout_s: float
    copy_bytes: float
    copy_s: float
    receive: tuple[ReshardStep, ...] = ()
    receive_s: float = 0.0
    gather: tuple[ReshardStep, ...] = ()
    gather_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.relayout_s + self.copy_s + self.gather_s + self.receive_s

    @property
    def relayout_bytes(self) -> float:
        """Bytes per device of the sender's collectives (S of each, summed)."""
        return sum((step.nbytes for step in self.relayout), 0.0)

    @property
    def gather_bytes(self) -> float:
        """Bytes per device of the receiver's gather of the wire pieces (S, summed)."""
        return sum((step.nbytes for step in self.gather), 0.0)


def wire_spec(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int],
              axes: Sequence[str]) -> Spec:
    """The layout a value of `shape` laid out as `spec` on a mesh (`mesh_shape`, `axes`)
    crosses from another sub-mesh in: `spec` with each mesh axis it leaves unused (of more
    than one device) added after the axes of the first dim it still divides evenly, so
    that it is a local slice of `spec` and `spec` is its all-gather over the added axes.
    `spec` itself when it uses every axis (or none can be added): then no two devices hold
    the same piece.  JAX-free; the runtime (`autopar.transfer`) asks it too."""
    size = dict(zip(axes, mesh_shape))
    used = {a for dim in spec for a in dim}
    dims = [tuple(d) for d in spec]
    for axis in axes:
        if axis in used or size[axis] == 1:
            continue
        for d, n in enumerate(shape):
            if n % (math.prod(size[a] for a in dims[d]) * size[axis]) == 0:
                dims[d] += (axis,)
                break
    return tuple(dims)


def wire(shape: Sequence[int], dst: Layout) -> Layout:
    """`dst`'s wire layout (`wire_spec`) on its mesh."""
    return Layout(wire_spec(shape, dst.spec, dst.mesh.shape, dst.mesh.axes), dst.mesh)


def route(src: Layout, dst: Layout, shape: Sequence[int]) -> str:
    """The runtime's route from `src` to `dst` for a value of `shape` (module table; "+gather"
    where the receiver gathers the wire pieces into `dst`)."""
    if src.devices != dst.devices:
        return "whole copies"
    name = ("copy" if _tiling(src.spec, src.mesh.shape, src.mesh.axes) ==
            _tiling(dst.spec, dst.mesh.shape, dst.mesh.axes) else "relayout+copy")
    return name + ("+gather" if wire(shape, dst).spec != dst.spec else "")


def price_transfer(shape: Sequence[int], nbytes: float, src: Layout, dst: Layout, link: Link,
                   then: Spec | None = None) -> TransferPrice:
    """Seconds (and bytes) of moving a value of `shape` and `nbytes` (whole) laid out as
    `src` on the sender's sub-mesh to `dst` on the receiver's, the two sub-meshes joined by
    `link` (module docstring).  `then`: a layout the receiver re-lays the value into once
    it has arrived in `dst` (priced on the receiver; None: it stays in `dst`)."""
    name = route(src, dst, shape)
    if name == "whole copies":
        relayout = reshard_steps(src.spec, replicated(len(shape)), nbytes, src.mesh)
        copy_bytes = float(nbytes)
        gather = ()                     # each device cuts its piece of its whole copy
    else:
        # The sender's program returns the value in the receiver's tiling
        # (`StageRunner.send`), the move slices that into the wire's (local) and copies each
        # device its wire piece, and the receiver gathers the pieces into `dst`.
        on_wire = wire(shape, dst)
        sent = src.spec if name.startswith("copy") else _same_tiling_on(shape, dst, src.mesh)
        relayout = reshard_steps(src.spec, sent, nbytes, src.mesh)
        if on_wire.spec != dst.spec:
            relayout += reshard_steps(sent, _same_tiling_on(shape, on_wire, src.mesh), nbytes,
                                      src.mesh)
        copy_bytes = nbytes / dst.mesh.shards(on_wire.spec)
        gather = reshard_steps(on_wire.spec, dst.spec, nbytes, dst.mesh)
    receive = () if then is None else reshard_steps(dst.spec, then, nbytes, dst.mesh)
    return TransferPrice(
        route=name, relayout=relayout,
        relayout_s=sum((s.seconds(src.mesh) for s in relayout), 0.0),
        copy_bytes=copy_bytes, copy_s=send_recv_s(copy_bytes, 2, link),
        receive=receive, receive_s=sum((s.seconds(dst.mesh) for s in receive), 0.0),
        gather=gather, gather_s=sum((s.seconds(dst.mesh) for s in gather), 0.0))


def _same_tiling_on(shape: Sequence[int], dst: Layout, mesh: MeshContext) -> Spec:
    """A spec over `mesh` (as many devices as `dst`'s) that cuts a value of `shape` as `dst`
    does, device k holding device k's piece: `dst.spec` itself on a mesh of its shape;
    else one found among `mesh`'s even specs; else replicated (the sender then gathers the
    value whole and slices its pieces: an upper bound on what XLA does)."""
    if mesh.shape == dst.mesh.shape and mesh.axes == dst.mesh.axes:
        return dst.spec
    want = _tiling(dst.spec, dst.mesh.shape, dst.mesh.axes)
    for spec in enumerate_specs(shape, mesh):
        if _tiling(spec, mesh.shape, mesh.axes) == want:
            return spec
    return replicated(len(shape))


@functools.lru_cache(maxsize=4096)
def _tiling(spec: Spec, mesh_shape: tuple[int, ...], axes: tuple[str, ...]
            ) -> tuple[tuple[int, ...], ...]:
    """Per device (row-major over the mesh axes, the order of `Mesh.devices.flat`), the index
    of its block in each dim of a value laid out as `spec`."""
    size = dict(zip(axes, mesh_shape))
    out = []
    for flat in range(math.prod(mesh_shape)):
        coord = dict(zip(axes, _unravel(flat, mesh_shape)))
        blocks = []
        for dim_axes in spec:
            index = 0
            for a in dim_axes:
                index = index * size[a] + coord[a]
            blocks.append(index)
        out.append(tuple(blocks))
    return tuple(out)


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for n in reversed(shape):
        coords.append(flat % n)
        flat //= n
    return tuple(reversed(coords))
